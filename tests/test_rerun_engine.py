"""Megatron-LM's rerun engine (--rerun-mode, megatron-core's RerunStateMachine) in real runs,
with Megatron-LM's own fault injection: --error-injection-rate 1 rejects the first result
validated in iteration 2 (iteration 1 is never validated), on every rank that validates.

* transient_error: the iteration is rerun in place, the rejection is not reproduced, the
  run stops before the optimizer step with Megatron-LM's exit code 17 and one line naming
  the iteration; nothing of iteration 2 is saved; the resumed run (the fault gone) trains
  to the losses of a run that never had it;
* persistent_error: reproduced in place; on CPU (no other GPU to rerun it on) a stop with
  exit 17 naming the iteration, nothing saved; on the GPU path (tests/fault_hooks.py) the
  rerun is saved with exit 16, and the job resumed on another node reruns the iteration
  from that checkpoint and ends with the final diagnosis (exit 17);
* a NaN in one Seq1F1B split (tests/fault_hooks.py) is rejected as its microbatch's loss,
  the one result per microbatch Megatron-LM's loss_func validates;
* a non-fatal rejection (--check-for-spiky-loss) reruns iteration 2 in place and training
  goes on: at pp=2 with --seq1f1b-splits 2 and dropout the losses, grad norms and MoE
  load-balancing losses equal those of a --rerun-mode disabled run (the rerun replays the
  same microbatches and RNG; the repeated pass's MoE losses are counted once), and the
  timeline written (--timeline-file) holds one pass of iteration 2's units;
* report_stats (megatron-core >= 0.19; 0.16.1's report is broken, and refused): every
  iteration run twice, the same losses, the variability report printed.

The independent runs are started together, the resumes after them."""

import re

import pytest

from distributed import TINY_MODEL, kill_tree, one_error_line, start_pretrain
from megatron import mcore_compat
from megatron.schedules.seq1f1b import seq1f1b_rank_units
from megatron.schedules.timeline import read_timeline

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

# dropout on: a rerun must restore the RNG streams to give the same result; experts with
# a load-balancing loss: what a repeated pass records must be logged once
PP2 = TINY_MODEL + ["--global-batch-size", "4", "--pipeline-model-parallel-size", "2",
                    "--seq1f1b-splits", "2", "--train-iters", "2", "--hidden-dropout", "0.1",
                    "--attention-dropout", "0.1", "--num-experts", "4", "--moe-router-topk",
                    "2", "--moe-router-load-balancing-type", "aux_loss",
                    "--moe-aux-loss-coeff", "0.1", "--disable-bias-linear"]
ONE = TINY_MODEL + ["--global-batch-size", "2", "--train-iters", "2"]
INJECT = ["--rerun-mode", "validate_results", "--error-injection-rate", "1"]
PERSISTENT = INJECT + ["--error-injection-type", "persistent_error"]
HOOKS = "tests/fault_hooks.py"
TRACKER = "latest_checkpointed_iteration.txt"
REPORT_STATS = mcore_compat.rerun_report_stats_works()


def _losses(out):
    """{iteration: (lm loss, grad norm)} as printed."""
    return {int(m.group(1)): (m.group(2), m.group(3)) for m in re.finditer(
        r" iteration +(\d+)/ +\d+ \|.*?lm loss: ([\d.e+-]+) \|.*? grad norm: ([\d.e+-]+) \|",
        out)}


def _balancing_losses(out):
    """{iteration: load_balancing_loss} as printed."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(
        r" iteration +(\d+)/ +\d+ \|.*?load_balancing_loss: ([\d.e+-]+) \|", out)}


def _finish(procs, timeout=600):
    done = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            kill_tree(proc)
        done[name] = (proc.returncode, out, err)
    return done


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rerun")
    gpu = {"FAULT_RERUN_AS_ON_GPU": "1"}
    first = {
        "disabled": start_pretrain(PP2, world_size=2),
        "transient": start_pretrain(PP2 + INJECT + ["--save", str(root / "transient"),
                                                    "--save-interval", "1"], world_size=2),
        "goes_on": start_pretrain(PP2 + INJECT + ["--check-for-spiky-loss",
                                                  "--no-check-for-nan-in-loss-and-grad",
                                                  "--timeline-file",
                                                  str(root / "goes_on_timeline.json")],
                                  world_size=2),
        "persistent": start_pretrain(ONE + PERSISTENT + ["--save", str(root / "persistent"),
                                                         "--save-interval", "1"]),
        "gpu": start_pretrain(ONE + PERSISTENT + ["--save", str(root / "gpu"),
                                                  "--save-interval", "1"],
                              script=HOOKS, env=gpu),
        "nan_in_split": start_pretrain(PP2 + ["--rerun-mode", "validate_results"],
                                       world_size=2, script=HOOKS,
                                       env={"FAULT_NAN_SPLIT": "2:1"}),
    }
    if REPORT_STATS:
        first["report_stats"] = start_pretrain(PP2 + ["--rerun-mode", "report_stats"],
                                               world_size=2)
    done = _finish(first)
    second = {
        # the transient fault is gone: the job restarted with validation on; a strict
        # load (the checkpoint's rerun object is read, not left unexpected)
        "resumed": start_pretrain(PP2 + ["--rerun-mode", "validate_results",
                                         "--load", str(root / "transient"),
                                         "--dist-ckpt-strictness", "raise_all"],
                                  world_size=2),
        "elsewhere": start_pretrain(ONE + PERSISTENT + ["--load", str(root / "gpu")],
                                    script=HOOKS, env=dict(gpu, FAULT_NODE_NAME="elsewhere")),
    }
    done.update(_finish(second))
    return root, done


def _saved(directory):
    return (directory / TRACKER).read_text(), sorted(p.name for p in directory.glob("iter_*"))


def test_transient_error_reruns_in_place_exits_17_and_the_resumed_run_equals_no_fault(runs):
    root, done = runs
    reference = _losses(done["disabled"][1])
    assert sorted(reference) == [1, 2], done["disabled"][2][-3000:]
    code, out, err = done["transient"]
    assert code != 0 and "exitcode  : 17" in err, err[-3000:]  # torchrun reports its workers'
    assert "Need to rerun step to check reproducibility" in err  # megatron-core's own line
    line = one_error_line(err)
    # the first validation of each rank: stage 0's grad bucket, the last stage's loss
    assert re.match(r"error: --rerun-mode validate_results: iteration 2: found NaN in local "
                    r"grad norm for bucket #0 .* on rank 0 \(injected by --error-injection-"
                    r"type transient_error; the value was [\d.]+\); found NaN in local forward "
                    r"loss calculation on rank 1 \(injected .*\), was not reproduced when the "
                    r"iteration was rerun in place on the same rank: a transient fault\. "
                    r"Stopped before the optimizer step \(exit 17", line), line
    assert line.endswith(f"checkpoint of iteration 1 in --save {root / 'transient'}."), line
    assert _losses(out) == {1: reference[1]}
    # nothing of iteration 2 (megatron-core 0.16.1 saves iteration 1 again, 0.19 nothing)
    assert _saved(root / "transient") == ("1", ["iter_0000001"])
    code, out, err = done["resumed"]
    assert code == 0, err[-3000:]
    assert (f"loaded checkpoint from {root / 'transient' / 'iter_0000001'} at iteration 1"
            in out), out[-2000:]
    assert _losses(out) == {2: reference[2]}


def test_persistent_error_on_cpu_stops_naming_the_iteration_without_saving(runs):
    root, done = runs
    code, out, err = done["persistent"]
    assert code == 17, err[-3000:]
    line = one_error_line(err)
    assert re.match(r"error: --rerun-mode validate_results: iteration 2: found NaN in local "
                    r"forward loss calculation on rank 0 \(injected by --error-injection-type "
                    r"persistent_error; the value was [\d.]+\), was reproduced when the "
                    r"iteration was rerun in place: not a transient fault\. Megatron-LM would "
                    r"save and exit 16 to "
                    r"rerun the iteration on another GPU; a CPU run has no other device, so "
                    r"it stops here \(exit 17\) without saving", line), line
    assert out.count("saved checkpoint at iteration") == 1  # iteration 1's, nothing after
    assert _saved(root / "persistent") == ("1", ["iter_0000001"])


def test_a_nan_in_one_split_is_the_microbatch_loss_megatron_lm_validates(runs):
    """Split 1 of microbatch 0 alone turns NaN in iteration 2 (tests/fault_hooks.py): the
    machine's first validation on the last stage (invocation #1, not the split's #2)
    rejects the microbatch's loss, the NaN reproduces in place, the run stops."""
    _, done = runs
    code, out, err = done["nan_in_split"]
    assert code != 0 and "exitcode  : 17" in err, err[-3000:]
    # (megatron-core 0.16.1 numbers iterations from 0 here, 0.19 from 1)
    assert re.search(r"Unexpected result nan on rank 1 at iteration #[12] invocation #1 "
                     r"\(message='found NaN in local forward loss calculation'\)", err), \
        err[-3000:]
    line = one_error_line(err)
    assert re.match(r"error: --rerun-mode validate_results: iteration 2: .*found NaN in local "
                    r"forward loss calculation on rank 1 \(value nan\), was reproduced", line), \
        line


def test_validate_results_with_splits_equals_disabled(runs):
    """Every rejection of iteration 2 (spiky loss, not fatal) reruns it in place and
    training goes on with the rerun's gradients: pp=2, s=2, the losses and grad norms
    of the disabled run."""
    _, done = runs
    code, out, err = done["goes_on"]
    assert code == 0, err[-3000:]
    assert "First rerun: unexpected result is not reproducible" in err, err[-3000:]
    assert "Continuing normal execution because failed validation was not fatal" in err
    assert _losses(out) == _losses(done["disabled"][1])


def test_a_rerun_pass_is_recorded_and_logged_once(runs):
    """Iteration 2 ran twice in the run that goes on: its MoE load-balancing loss is the
    disabled run's (not the sum over both passes) and the timeline of the last iteration
    holds each unit once, in Seq1F1B's order (pp=2, 4 microbatches, s=2)."""
    root, done = runs
    code, out, err = done["goes_on"]
    assert code == 0, err[-3000:]
    balancing = _balancing_losses(out)
    assert sorted(balancing) == [1, 2], out[-3000:]
    assert balancing == _balancing_losses(done["disabled"][1])
    timeline = read_timeline(str(root / "goes_on_timeline.json"))
    for rank, units in enumerate(timeline.ranks):
        assert [(u["kind"], u["microbatch"], u["split"]) for u in units] == [
            (u.kind, u.microbatch, u.split) for u in seq1f1b_rank_units(rank, 2, 4, 2)]


def test_gpu_path_saves_the_rerun_and_another_node_gives_the_diagnosis(runs):
    """Megatron-LM's path for a reproduced result on GPUs: the rerun saved (the state
    before iteration 2) with exit 16; resumed on another node, iteration 2 is rerun from
    that checkpoint: the injected persistent error does not reproduce there, exit 17."""
    root, done = runs
    code, out, err = done["gpu"]
    assert code == 16, err[-3000:]
    line = one_error_line(err)
    assert re.match(r"error: --rerun-mode validate_results: iteration 2: .* was reproduced "
                    r"when the iteration was rerun in place; saved a checkpoint holding the "
                    r"rerun \(exit 16", line), line
    assert out.count("saved checkpoint at iteration 1") == 2  # the interval's, the rerun's
    assert _saved(root / "gpu") == ("1", ["iter_0000001"])
    code, out, err = done["elsewhere"]
    assert code == 17, err[-3000:]
    assert "Getting RerunStateMachine state from checkpoint. Will rerun step." in err
    assert "Second rerun: unexpected result is not reproducible on a different GPU" in err
    line = one_error_line(err)
    assert re.match(r"error: --rerun-mode validate_results: iteration 2: .*: rerun from the "
                    r"checkpoint on another GPU, the diagnosis is final", line), line


def test_report_stats_runs_every_iteration_twice_with_the_same_losses(runs):
    _, done = runs
    if not REPORT_STATS:
        pytest.skip("megatron-core 0.16.1's report_stats is refused (tests/"
                    "test_megatron_launch.py::test_rerun_mode_flags)")
    code, out, err = done["report_stats"]
    assert code == 0, err[-3000:]
    assert "Stats on computation determinism in validation calls" in out
    assert "From validation call 'found NaN in local forward loss calculation'" in out
    assert _losses(out) == _losses(done["disabled"][1])
