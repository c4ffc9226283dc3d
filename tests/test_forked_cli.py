"""tests/forked_cli.py: a run forked from the pre-imported server behaves as
`python SCRIPT ARGV` in a fresh interpreter would, for what the tests look at."""

import os
import signal
import textwrap

import pytest

import forked_cli

pytestmark = pytest.mark.distributed

SCRIPT = textwrap.dedent("""
    import atexit, os, sys, threading, time, warnings
    mode = sys.argv[1]
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "var", os.environ.get("FORKED_VAR"),
          "session_of_its_own", os.getsid(0) == os.getpid(),
          "group_of_its_own", os.getpgid(0) == os.getpid(), "main", __name__)
    atexit.register(lambda: print("atexit ran", flush=True))
    warnings.warn("hidden by PYTHONWARNINGS")
    if mode == "thread":  # a non-daemon thread is joined before exit, as at shutdown
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
    if mode == "raise":
        raise ValueError("boom")
    if mode == "wait":
        print("waiting", flush=True)
        time.sleep(60)
    sys.exit(3 if mode == "exit3" else 0)
""")


def _run(tmp_path, mode, **kwargs):
    (tmp_path / "script.py").write_text(SCRIPT)
    env = dict(os.environ, FORKED_VAR="seen", PYTHONWARNINGS="ignore")
    return forked_cli.start(["script.py", mode], env, cwd=tmp_path, **kwargs)


def test_a_forked_run_is_the_script_as_a_fresh_interpreter_runs_it(tmp_path):
    out, err = (process := _run(tmp_path, "exit3")).communicate(timeout=60)
    assert process.returncode == 3
    assert (f"argv ['exit3'] cwd {tmp_path} var seen session_of_its_own False "
            "group_of_its_own True main __main__") in out
    assert "atexit ran" in out and err == ""  # the warning filtered, as PYTHONWARNINGS says

    out, _ = (process := _run(tmp_path, "thread")).communicate(timeout=60)
    assert process.returncode == 0 and out.index("thread done") < out.index("atexit ran")

    out, err = (process := _run(tmp_path, "raise")).communicate(timeout=60)
    assert process.returncode == 1
    assert err.rstrip().endswith("ValueError: boom") and "Traceback" in err


def test_signals_reach_the_run_by_its_pid(tmp_path):
    process = _run(tmp_path, "wait", new_session=True)
    assert "session_of_its_own True" in process.stdout.readline()
    assert process.stdout.readline() == "waiting\n"
    assert process.poll() is None
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(timeout=60) == -signal.SIGTERM
