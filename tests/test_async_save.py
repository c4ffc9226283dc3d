"""--async-save (megatron/trainer/async_save.py) keeps every guarantee of a synchronous save,
seen through real processes with the fault injected into the background write
(tests/fault_hooks.py): a run killed while a write is in flight leaves the tracker on the
last published checkpoint and no process behind, and resumes from it to the losses of a
run without --async-save; a write that fails in the background stops the run with one
line naming the checkpoint; SIGTERM (--exit-signal-handler) during a write finishes it,
saves the stop iteration, prunes as --save-retain-interval says, and resumes exactly. The
last two also with --use-persistent-ckpt-worker (one writer for the run, handed copies)."""

import os
import re
import signal

import psutil
import pytest

from distributed import (TINY_MODEL, kill_tree, one_error_line, pretrain, start_pretrain,
                         wait_for_line)

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

BASE = TINY_MODEL + ["--global-batch-size", "2", "--train-iters", "6"]
TRACKER = "latest_checkpointed_iteration.txt"
HOOKS = "tests/fault_hooks.py"


def _losses(out):
    """{iteration: the printed lm loss}."""
    return {int(m.group(1)): m.group(2)
            for m in re.finditer(r" iteration +(\d+)/ +\d+ \|.*?lm loss: ([\d.e+-]+) \|", out)}


@pytest.fixture(scope="module")
def reference():
    """The same 6 iterations, uninterrupted, without --async-save (and without saving)."""
    run = pretrain(BASE)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = _losses(run.stdout)
    assert sorted(losses) == list(range(1, 7))
    return losses


def _finish(run, timeout=240):
    try:
        return run.communicate(timeout=timeout)
    finally:
        kill_tree(run)


def test_killed_during_the_background_write_resumes_from_the_last_published(
        tmp_path, reference):
    """SIGKILL to the trainer while iteration 2's write is in flight (it sleeps in the
    writer): the tracker names iteration 1, iteration 2 is only iter_2.incomplete, the
    writer and the results queue's server die with the trainer; the resumed run (again
    with --async-save) loads iteration 1 and trains to the losses of the reference."""
    ckpt = tmp_path / "ckpt"
    run = start_pretrain(BASE + ["--save", str(ckpt), "--save-interval", "1", "--async-save"],
                         script=HOOKS, env={"FAULT_WRITE_SLEEP_AT_SAVE": "2"})
    try:
        # a save starts once the previous write is published: one background write at a time
        wait_for_line(run, r"saved checkpoint at iteration 1 ")
        wait_for_line(run, r"scheduled an asynchronous checkpoint save at iteration 2 ")
        helpers = psutil.Process(run.pid).children(recursive=True)
        assert helpers  # the writer of iteration 2 and the queue's server
        run.kill()
        run.wait(timeout=60)
        gone, alive = psutil.wait_procs(helpers, timeout=10)
        assert not alive, alive  # PR_SET_PDEATHSIG: nothing holds the run's output
    finally:
        kill_tree(run)
    assert (ckpt / TRACKER).read_text() == "1"
    assert (ckpt / "iter_0000002.incomplete").is_dir() and not (ckpt / "iter_0000002").exists()
    resumed = pretrain(BASE + ["--load", str(ckpt), "--save", str(ckpt), "--save-interval",
                               "5", "--async-save"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"loaded checkpoint from {ckpt / 'iter_0000001'} at iteration 1" in resumed.stdout
    losses = _losses(resumed.stdout)
    assert losses == {i: reference[i] for i in range(2, 7)}
    # the run waited for its last write and published it
    assert "saved checkpoint at iteration 6 " in resumed.stdout
    assert (ckpt / TRACKER).read_text() == "6"
    assert (ckpt / "iter_0000006" / "checksums.json").is_file()
    # (the killed run's iter_N.incomplete stay until a save of N replaces them, as with a
    # synchronous save killed half-way; the tracker never names them)
    assert not (ckpt / "iter_0000006.incomplete").exists()


def test_ctrl_c_during_the_background_write_abandons_it_and_resumes(tmp_path, reference):
    """Ctrl-C as a terminal sends it (SIGINT to the run's process group) while iteration
    2's write is in flight (its writer sleeps; it ignores SIGINT in a group of its own):
    one line naming iteration 1 as the last good state and iteration 2's save as
    abandoned, exit 130, no traceback; the
    writer is killed (the run does not wait for it) and iter_2.incomplete removed, the
    tracker still names iteration 1; no process the run started outlives it; resuming
    trains to the reference's losses. (A Ctrl-C while the writer was being forked once
    left it untracked, the exit waiting for it, or ran the trainer's handler in it.)"""
    ckpt = tmp_path / "ckpt"
    run = start_pretrain(BASE + ["--save", str(ckpt), "--save-interval", "1", "--async-save"],
                         script=HOOKS, env={"FAULT_WRITE_SLEEP_AT_SAVE": "2",
                                            "FAULT_WRITE_SLEEP": "120"},
                         new_session=True)
    try:
        wait_for_line(run, r"scheduled an asynchronous checkpoint save at iteration 2 ")
        helpers = psutil.Process(run.pid).children(recursive=True)
        assert len(helpers) == 2, helpers  # iteration 2's writer and the queue's server
        os.killpg(run.pid, signal.SIGINT)
        out, err = _finish(run, timeout=60)  # not waiting for the writer's 120 s
        gone, alive = psutil.wait_procs(helpers, timeout=10)
        assert not alive, alive
    finally:
        kill_tree(run)
    assert run.returncode == 130, err[-3000:]
    error = one_error_line(err)
    # the signal comes as iteration 2's save returns, in iteration 3 or its save
    assert re.match(rf"error: SIGINT received during [^:]*iteration [23]\b[^:]*: stopped "
                    rf"without saving; the asynchronous saves? of iterations? 2( and 3)?, still "
                    rf"being written, (is|are) abandoned and {ckpt}/iter_0000002\.incomplete"
                    rf"(, {ckpt}/iter_0000003\.incomplete)? removed\. "
                    rf"The last good state is the checkpoint of iteration 1 in "
                    rf"--save {ckpt}\. To finish the iteration and save on SIGINT, pass "
                    rf"--exit-signal-handler --exit-signal SIGINT$", error), error
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "saved checkpoint at iteration 2 " not in out
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == [
        "iter_0000001", TRACKER]
    assert (ckpt / TRACKER).read_text() == "1"
    resumed = pretrain(BASE + ["--load", str(ckpt)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"loaded checkpoint from {ckpt / 'iter_0000001'} at iteration 1" in resumed.stdout
    assert _losses(resumed.stdout) == {i: reference[i] for i in range(2, 7)}


def test_a_nan_stop_publishes_the_save_in_flight(tmp_path, reference):
    """A NaN loss in iteration 3 (tests/fault_hooks.py) while iteration 2's write is in
    flight (its writer sleeps 5 s): that save holds a state checked finite before its
    step, so the stop waits for the write and publishes it instead of abandoning it.
    One line naming iteration 2 as the last good state, exit 1; the tracker names
    iteration 2, verified (checksums.json), nothing of iteration 3; resuming from it
    trains to the reference's losses."""
    ckpt = tmp_path / "ckpt"
    run = pretrain(BASE + ["--save", str(ckpt), "--save-interval", "1", "--async-save"],
                   script=HOOKS, env={"FAULT_WRITE_SLEEP_AT_SAVE": "2",
                                      "FAULT_WRITE_SLEEP": "5", "FAULT_NAN_SPLIT": "3"})
    assert run.returncode == 1, run.stderr[-3000:]
    error = one_error_line(run.stderr)
    assert re.match(r"error: non-finite values at iteration 3: lm loss nan on rank 0 .*"
                    rf"The last good state is the checkpoint of iteration 2 in --save {ckpt}\.$",
                    error), error
    assert (ckpt / TRACKER).read_text() == "2"
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == [
        "iter_0000001", "iter_0000002", TRACKER]
    assert (ckpt / "iter_0000002" / "checksums.json").is_file()
    resumed = pretrain(BASE + ["--load", str(ckpt)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(resumed.stdout) == {i: reference[i] for i in range(3, 7)}


WRITERS = {"per-save": [], "persistent": ["--use-persistent-ckpt-worker"]}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_failed_background_write_is_one_line(tmp_path, writer):
    """Iteration 2's writer cannot write (RLIMIT_FSIZE in the forked writer only, EFBIG as a
    full disk): one line naming the checkpoint, iter_2.incomplete removed, iteration 1 and
    the tracker intact, exit 1."""
    ckpt = tmp_path / "ckpt"
    run = start_pretrain(BASE + ["--save", str(ckpt), "--save-interval", "1", "--async-save"]
                         + WRITERS[writer], script=HOOKS, env={"FAULT_WRITE_FSIZE_AT_SAVE": "2"})
    out, err = _finish(run)
    assert run.returncode == 1, err[-3000:]
    assert "scheduled an asynchronous checkpoint save at iteration 2 " in out
    error = one_error_line(err)
    assert re.match(rf"error: checkpoint save of iteration 2 into --save {ckpt} failed on "
                    rf"rank 0: .*(File too large|<class 'OSError'>).* \(the checkpoint needs "
                    rf"about [\d.]+ [KM]B, .* free\); removed {ckpt / 'iter_0000002'}"
                    rf"\.incomplete; the checkpoint of iteration 1 and {TRACKER} are intact",
                    error), error
    assert "saved checkpoint at iteration 1 " in out
    assert "saved checkpoint at iteration 2 " not in out
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == [
        "iter_0000001", TRACKER]
    assert (ckpt / TRACKER).read_text() == "1"


@pytest.mark.parametrize("writer", list(WRITERS))
def test_sigterm_during_the_background_write_saves_and_resumes(tmp_path, reference, writer):
    """SIGTERM (--exit-signal-handler) right after iteration 2's save was scheduled, its
    writer still sleeping: iteration 3 finishes, is saved, the run waits for both writes,
    publishes them in order (--save-retain-interval 2 then deletes iteration 1 and keeps
    2) and exits 0; resuming from iteration 2 (written while iteration 3 trained) trains
    to the reference's losses."""
    ckpt = tmp_path / "ckpt"
    run = start_pretrain(BASE + ["--save", str(ckpt), "--save-interval", "1", "--async-save",
                                 "--exit-signal-handler", "--save-retain-interval", "2"]
                         + WRITERS[writer],
                         script=HOOKS, env={"FAULT_WRITE_SLEEP_AT_SAVE": "2",
                                            "FAULT_WRITE_SLEEP": "2",
                                            "FAULT_SIGTERM_AFTER_SAVE": "2"})
    out, err = _finish(run)
    assert run.returncode == 0, err[-3000:]
    assert "exiting at iteration 3: SIGTERM received" in out, out[-3000:]
    published = re.findall(r"saved checkpoint at iteration (\d+) ", out)
    assert published == ["1", "2", "3"], out[-3000:]
    assert "deleted checkpoint of iteration 1 (--save-retain-interval 2)" in out
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == [
        "iter_0000002", "iter_0000003", TRACKER]
    assert (ckpt / TRACKER).read_text() == "3"
    # iteration 2 was written while iteration 3 trained: resuming from it (the tracker set
    # back) shows that its write was a snapshot of iteration 2, not of what came after
    (ckpt / TRACKER).write_text("2")
    resumed = pretrain(BASE + ["--load", str(ckpt)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"loaded checkpoint from {ckpt / 'iter_0000002'} at iteration 2" in resumed.stdout
    assert _losses(resumed.stdout) == {i: reference[i] for i in range(3, 7)}
