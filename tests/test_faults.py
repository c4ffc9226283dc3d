"""Faults injected into real training processes (torchrun, pp 2, Seq1F1B s 2): a NaN, SIGTERM
to the launcher or to the workers, the wall-clock limit, a stopped peer. Each test asserts
what the user sees and that no checkpoint was lost or written after the fault."""

import os
import re
import signal
import time

import psutil
import pytest

from distributed import TINY_MODEL, kill_tree, one_error_line, start_pretrain, wait_for_line

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

PP2_SEQ1F1B = TINY_MODEL + ["--global-batch-size", "4", "--pipeline-model-parallel-size", "2",
                            "--seq1f1b-splits", "2"]
TRACKER = "latest_checkpointed_iteration.txt"


def _torchrun(argv, launcher_flags=()):
    return start_pretrain(argv, world_size=2, launcher_flags=launcher_flags)


def _finish(proc, timeout):
    try:
        return proc.communicate(timeout=timeout)
    finally:
        kill_tree(proc)


def _wait_for_iteration(proc, target):
    """Read stdout until the last rank logged iteration `target` (--log-interval 1)."""
    wait_for_line(proc, rf" iteration\s+{target}/")


def _workers(proc):
    return psutil.Process(proc.pid).children()


def test_non_finite_loss_stops_before_saving(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = _torchrun(PP2_SEQ1F1B + ["--train-iters", "30", "--lr", "1e4", "--save", str(ckpt),
                                    "--save-interval", "1"])
    out, err = _finish(proc, 300)
    assert proc.returncode != 0
    error = one_error_line(err)
    match = re.match(r"error: non-finite values at iteration (\d+): .*(nan|inf).* on rank \d "
                     r"\(pipeline stage \d", error)
    assert match, error
    bad = int(match.group(1))
    assert bad >= 2, "lr 1e4 should still give a finite first iteration"
    assert error.endswith(f"checkpoint of iteration {bad - 1} in --save {ckpt}.")
    # the last good iteration is the latest checkpoint; nothing at or after the bad one
    assert (ckpt / TRACKER).read_text() == str(bad - 1)
    saved = sorted(int(p.name[len("iter_"):]) for p in ckpt.glob("iter_*"))
    assert saved and max(saved) == bad - 1, saved


def test_check_can_be_turned_off_and_clip_grad_0_prints_no_placeholder(tmp_path):
    proc = _torchrun(PP2_SEQ1F1B + ["--train-iters", "4", "--lr", "1e4", "--clip-grad", "0",
                                    "--no-check-for-nan-in-loss-and-grad"])
    out, err = _finish(proc, 300)
    assert proc.returncode == 0, err[-3000:]
    lines = [line for line in out.splitlines() if line.startswith(" iteration")]
    assert len(lines) == 4
    assert "lm loss: nan" in lines[-1]  # it did train on through non-finite values
    assert not any("grad norm" in line for line in lines), lines  # no norm: none printed


@pytest.mark.parametrize("target", ["launcher", "workers", "workers_and_data_readers"])
def test_sigterm_saves_and_exits(tmp_path, target):
    """SLURM preemption: SIGTERM to torchrun (it forwards SIGTERM), to every worker, or,
    with --num-workers, to every worker and its DataLoader processes (SLURM signals every
    process of the step: the readers must outlive the save)."""
    ckpt = tmp_path / "ckpt"
    readers = ["--num-workers", "2"] if target == "workers_and_data_readers" else []
    proc = _torchrun(PP2_SEQ1F1B + ["--train-iters", "100000", "--exit-signal-handler",
                                    "--save", str(ckpt), "--save-interval", "100000"] + readers)
    try:
        _wait_for_iteration(proc, 3)
        victims = ([proc] if target == "launcher" else
                   _workers(proc) if not readers else
                   psutil.Process(proc.pid).children(recursive=True))
        assert len(victims) >= (6 if readers else 1)
        for victim in victims:
            victim.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        kill_tree(proc)
    match = re.search(r"exiting at iteration (\d+): SIGTERM received", out)
    assert match, out[-2000:] + err[-3000:]
    stopped = int(match.group(1))
    assert (ckpt / TRACKER).read_text() == str(stopped)
    assert f"saved checkpoint at iteration {stopped}" in out
    if target != "launcher":
        assert proc.returncode == 0, err[-3000:]  # workers exit 0 and so does torchrun
    # (torchrun itself re-raises the SIGTERM it got: its own exit status is then 1)
    # nothing lost: the next run resumes from the saved iteration
    resume = _torchrun(PP2_SEQ1F1B + ["--train-iters", str(stopped + 1), "--load", str(ckpt),
                                      "--save", str(ckpt), "--save-interval", "1000",
                                      "--override-opt_param-scheduler"])  # saved: 100000
    out, err = _finish(resume, 300)
    assert resume.returncode == 0, err[-3000:]
    assert f"loaded checkpoint from {ckpt / f'iter_{stopped:07d}'} at iteration {stopped}" in out


def test_exit_duration_saves_and_exits(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = _torchrun(PP2_SEQ1F1B + ["--train-iters", "100000", "--exit-duration-in-mins", "0.05",
                                    "--save", str(ckpt), "--save-interval", "100000"])
    out, err = _finish(proc, 300)
    assert proc.returncode == 0, err[-3000:]
    match = re.search(r"exiting at iteration (\d+): --exit-duration-in-mins reached", out)
    assert match, out[-2000:]
    assert (ckpt / TRACKER).read_text() == match.group(1)


def test_stopped_peer_ends_the_job_within_the_timeout(tmp_path):
    """One rank SIGSTOPped: the other's p2p step times out after
    --distributed-timeout-minutes (0.25 here: 15 s; fractions of a minute are accepted so
    a test need not wait the 10-minute default), says so, and torchrun ends the job."""
    proc = _torchrun(PP2_SEQ1F1B + ["--train-iters", "100000", "--distributed-timeout-minutes",
                                    "0.25"], launcher_flags=["--shutdown-timeout", "5"])
    stopped = None
    try:
        _wait_for_iteration(proc, 3)
        stopped = _workers(proc)[-1]
        stopped.send_signal(signal.SIGSTOP)
        start = time.time()
        out, err = proc.communicate(timeout=15 + 60)
        took = time.time() - start
    finally:
        if stopped is not None and stopped.is_running():
            stopped.kill()
        kill_tree(proc)
    assert proc.returncode != 0
    assert took < 15 + 60
    error = one_error_line(err)
    assert re.match(r"error: rank 0: iteration \d+'s .* did not complete within "
                    r"--distributed-timeout-minutes 0.25: a peer rank is stopped, dead or hung",
                    error), error


def test_ctrl_c_is_one_line_and_with_the_handler_saves(tmp_path):
    """Ctrl-C as a terminal sends it (SIGINT to the whole process group: torchrun and its
    workers): one line, no traceback from any worker, nothing half-written. With
    --exit-signal-handler --exit-signal SIGINT, SIGINT to the workers: the iteration
    finishes, the checkpoint is saved, every worker exits 0 (so torchrun does)."""
    ckpt = tmp_path / "ckpt"
    argv = PP2_SEQ1F1B + ["--train-iters", "100000", "--save", str(ckpt), "--save-interval", "2"]
    proc = start_pretrain(argv, world_size=2, new_session=True)
    try:
        _wait_for_iteration(proc, 3)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        kill_tree(proc)
    assert proc.returncode != 0
    error = one_error_line(err)
    latest = (ckpt / TRACKER).read_text()  # 2, or a later save the signal did not beat
    assert re.match(rf"error: SIGINT received during iteration \d+'s .*: stopped without saving\. "
                    rf"The last good state is the checkpoint of iteration {latest} in --save "
                    rf"{ckpt}\. To finish the iteration and save on SIGINT, pass "
                    rf"--exit-signal-handler --exit-signal SIGINT$", error), error
    # torchrun's own SignalException traceback is torch's launcher; no worker's is there
    assert "KeyboardInterrupt" not in err and "[rank" not in err, err[-3000:]
    assert not list(ckpt.glob("*.incomplete")), list(ckpt.iterdir())

    proc = _torchrun(PP2_SEQ1F1B + ["--train-iters", "100000", "--load", str(ckpt),
                                    "--save", str(ckpt), "--save-interval", "100000",
                                    "--exit-signal-handler", "--exit-signal", "SIGINT"])
    try:
        _wait_for_iteration(proc, 4)
        for worker in _workers(proc):
            worker.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, err[-3000:]
    match = re.search(r"exiting at iteration (\d+): SIGINT received \(--exit-signal-handler\)",
                      out)
    assert match, out[-2000:]
    assert (ckpt / TRACKER).read_text() == match.group(1)


def test_exit_signal_handler_for_training_stops_at_once_with_exit_0(tmp_path):
    """--exit-signal-handler-for-training: SIGTERM stops the run at once, one note, exit 0
    (Megatron-LM's orderly shutdown), nothing saved."""
    ckpt = tmp_path / "ckpt"
    proc = start_pretrain(TINY_MODEL + ["--train-iters", "100000", "--save", str(ckpt),
                                        "--save-interval", "100000",
                                        "--exit-signal-handler-for-training"])
    try:
        _wait_for_iteration(proc, 2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, err[-3000:]
    notes = [line for line in err.splitlines() if line.startswith("note: SIGTERM")]
    assert notes == [f"note: SIGTERM received during {notes[0].split('during ', 1)[1]}"] and \
        "stopped without saving. No checkpoint of this run was saved." in notes[0], err[-3000:]
    assert "Traceback" not in err
    assert not list(ckpt.glob("iter_*"))
