"""Checkpoints and schedules as Megatron-LM (issue #28 point 4), in real processes: the
resumed learning-rate schedule (refused when it differs from the checkpoint's, unless
--override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler), an empty --load
(a warning and a start from random; fatal with --exit-on-missing-checkpoint; still
refused where it would overwrite another run's checkpoints), --save-retain-interval,
the evaluation on the validation and test sets after training, and --skip-train.

One process trains the runs that succeed in turn (tests/dist_runner.py); each refusal is
a process of its own, since it ends the process."""

import pytest

from distributed import (TINY_MODEL, TRACKER, Launch, one_error_line, start_pretrain)
from megatron.trainer.arguments import ArgumentErrors, parse_args

# --train-iters 4 by default; evaluation at 2 and 4 (one batch each), then once more on
# the validation set and on the test set (mock data, --split 969,30,1: both exist)
BASE = TINY_MODEL + ["--num-layers", "2", "--global-batch-size", "2", "--eval-interval", "2",
                     "--lr-decay-style", "linear"]
BASE[BASE.index("--eval-iters") + 1] = "1"


def _iters(n):
    return ["--train-iters", str(n)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("schedule")
    short, straight = tmp / "short", tmp / "straight"
    launch = Launch(tmp, 1, [
        # every iteration saved, only multiples of 2 (and the latest) kept
        {"name": "straight", "argv": BASE + _iters(4) + [
            "--save", str(straight), "--save-interval", "1", "--save-retain-interval", "2"]},
        # stopped by --exit-interval (at its last iteration): no evaluation after it
        {"name": "short", "argv": BASE + _iters(2) + ["--save", str(short),
                                                      "--save-interval", "2",
                                                      "--exit-interval", "2"]},
        {"name": "override", "argv": BASE + _iters(4) + [
            "--load", str(short), "--override-opt_param-scheduler"]},
        {"name": "kept", "argv": BASE + _iters(4) + [
            "--load", str(short), "--use-checkpoint-opt-param-scheduler"]},
        # an empty --load other than --save: a warning, then the run from random
        {"name": "missing", "argv": BASE + _iters(4) + [
            "--load", str(tmp / "nothing"), "--save", str(tmp / "fresh"),
            "--save-interval", "1000"]},
        {"name": "skip", "argv": BASE + _iters(4) + ["--load", str(straight), "--skip-train",
                                                     "--save", str(tmp / "unused"),
                                                     "--save-interval", "1"]},
    ])
    results = launch.result()
    printed = launch.log.read_text()
    # the refusals, side by side: each ends its process
    refusals = {
        "differs": BASE + _iters(4) + ["--load", str(short)],
        "exit_on_missing": BASE + _iters(4) + ["--load", str(tmp / "nothing"),
                                               "--exit-on-missing-checkpoint"],
        # an empty --load does not make --save's checkpoints this run's to overwrite
        "overwrite": BASE + _iters(4) + ["--load", str(tmp / "nothing"), "--save", str(short),
                                         "--save-interval", "1000"],
    }
    procs = {name: start_pretrain(argv) for name, argv in refusals.items()}
    refused = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        refused[name] = (proc.returncode, out, err)
    return tmp, results, printed, refused


@pytest.mark.distributed
def test_a_differing_schedule_is_refused_naming_both_flags(runs):
    tmp, _, _, refused = runs
    code, _, err = refused["differs"]
    assert code != 0
    assert one_error_line(err) == (
        f"error: --load {tmp / 'short' / 'iter_0000002'}: this run's learning-rate schedule "
        f"differs from the checkpoint's (decay samples (--lr-decay-iters/-samples, else "
        f"--train-iters/-samples) saved 4, now 8; weight-decay schedule samples "
        f"(--train-iters/-samples) saved 4, now 8): pass --override-opt_param-scheduler to "
        f"train with this command line's schedule, or --use-checkpoint-opt_param-scheduler to "
        f"keep the checkpoint's (as Megatron-LM)")


@pytest.mark.distributed
def test_override_takes_the_command_lines_schedule_and_use_checkpoint_keeps_the_saved(runs):
    _, results, printed, _ = runs
    straight, short = results["straight"], results["short"]
    assert len(straight["learning_rates"]) == 4 and straight["learning_rates"][2] > 0
    # the resumed iterations 3 and 4 run at the uninterrupted 4-iteration run's rates
    assert results["override"]["learning_rates"] == straight["learning_rates"][2:]
    assert "learning-rate schedule of this command line replaces the checkpoint's " \
           "(--override-opt_param-scheduler): decay samples" in printed
    # the checkpoint's schedule had decayed to --min-lr (0) at its end: it stays there
    assert short["learning_rates"][-1] == 0.0
    assert results["kept"]["learning_rates"] == [0.0, 0.0]
    assert "learning-rate schedule kept from the checkpoint " \
           "(--use-checkpoint-opt_param-scheduler): decay samples" in printed
    assert len(results["kept"]["losses"]) == 2


@pytest.mark.distributed
def test_an_empty_load_warns_and_starts_from_random(runs):
    tmp, results, printed, refused = runs
    assert (f"warning: could not find the metadata file {tmp / 'nothing' / TRACKER}: no "
            f"checkpoint is loaded and training starts from random") in printed
    assert results["missing"]["losses"] == results["straight"]["losses"]
    assert (tmp / "fresh" / TRACKER).read_text() == "4"

    code, _, err = refused["exit_on_missing"]
    assert code != 0
    assert one_error_line(err) == (
        f"error: --load {tmp / 'nothing'}: no such directory (--exit-on-missing-checkpoint)")
    code, _, err = refused["overwrite"]
    assert code != 0
    assert one_error_line(err).startswith(
        f"error: --save {tmp / 'short'} already holds checkpoints (iter_0000002) and this run "
        f"(--load {tmp / 'nothing'}) does not resume from them")
    assert (tmp / "short" / TRACKER).read_text() == "2"


@pytest.mark.distributed
def test_save_retain_interval_keeps_multiples_and_the_latest(runs):
    tmp, _, printed, _ = runs
    kept = sorted(p.name for p in (tmp / "straight").iterdir() if p.name.startswith("iter_"))
    assert kept == ["iter_0000002", "iter_0000004"]
    assert (tmp / "straight" / TRACKER).read_text() == "4"
    for iteration in (1, 3):
        assert (f"deleted checkpoint of iteration {iteration} (--save-retain-interval 2)"
                in printed)


@pytest.mark.distributed
def test_validation_and_test_sets_are_evaluated_after_training(runs):
    _, results, printed, _ = runs
    straight = results["straight"]
    assert len(straight["validation_losses"]) == 2  # iterations 2 and 4
    # the end-of-training evaluation reads the next validation batch, not the last one
    assert straight["final_validation_loss"] not in (None, *straight["validation_losses"])
    assert straight["test_loss"] is not None
    for name in ("validation", "test"):
        line = next(line for line in printed.splitlines()
                    if line.startswith(f" validation loss at iteration 4 on {name} set | "
                                       f"lm loss value: "))
        assert f"-" * (len(line) + 1) in printed  # Megatron-LM's box around it
    # a stopped run (--exit-interval, a signal) evaluates nothing more, as Megatron-LM
    assert len(results["short"]["validation_losses"]) == 1
    assert results["short"]["final_validation_loss"] is None
    assert results["short"]["test_loss"] is None


@pytest.mark.distributed
def test_skip_train_evaluates_the_loaded_checkpoint(runs):
    tmp, results, printed, _ = runs
    skip, straight = results["skip"], results["straight"]
    assert skip["losses"] == [] and skip["validation_losses"] == []
    assert "skipping training (--skip-train is on) ..." in printed
    # the weights the straight run ended with, on the same validation and test batches
    assert skip["final_validation_loss"] == straight["final_validation_loss"]
    assert skip["test_loss"] == straight["test_loss"]
    assert not (tmp / "unused").exists()  # --skip-train saves nothing


def _errors(*flags):
    with pytest.raises(ArgumentErrors) as error:
        parse_args(BASE + _iters(4) + list(flags), world_size=1, cuda_available=False,
                   check_files=False)
    return error.value.problems


def test_flag_combinations_megatron_lm_refuses():
    assert _errors("--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler") \
        == ["--override-opt_param-scheduler (take this command line's schedule) and "
            "--use-checkpoint-opt_param-scheduler (keep the checkpoint's) contradict each "
            "other: keep one"]
    assert _errors("--save", "/tmp/x", "--save-interval", "2", "--save-retain-interval", "3") \
        == ["--save-retain-interval (3) must be a multiple of --save-interval (2), as in "
            "Megatron-LM: the retained iterations must be saved ones"]
    args = parse_args(BASE + _iters(4) + ["--skip-train", "--load", "/tmp/x"], world_size=1,
                      cuda_available=False, check_files=False)
    assert args.skip_train and args.no_load_optim  # as Megatron-LM
