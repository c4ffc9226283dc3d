"""--overlap-grad-reduce and --overlap-param-gather keep Megatron-LM's meaning with splits.

dp 2 x pp 2 (4 processes), Seq1F1B with 4 splits and interleaved Seq1F1B (2 virtual
stages, 2 splits): 3 training steps and an evaluation after step 2, each layout with
and without overlap. The overlapped run must give the same losses, grad norms,
validation loss and final parameters, and its reductions must really overlap: from
the second iteration on (megatron-core's DDP learns in the first one how many gradients
each bucket waits for), every bucket group of every model chunk has its reduction in
flight when `finalize_model_grads` runs, launched by the backward hooks of the chunk's
last backward unit. Buckets are small (tests/overlap_runner.py), so a chunk has several.
"""

import glob
import json
import os

import pytest

import distributed
from distributed import TINY_MODEL, assert_close_series, assert_params_close, run_configs

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

FLAGS = TINY_MODEL + ["--micro-batch-size", "1", "--global-batch-size", "8",
                      "--train-iters", "3", "--eval-interval", "2", "--eval-iters", "1",
                      "--pipeline-model-parallel-size", "2"]
SEQ1F1B = ["--seq1f1b-splits", "4"]
INTERLEAVED = ["--virtual-pipeline-model-parallel-size", "2", "--seq1f1b-splits", "2"]
DISTOPT = ["--use-distributed-optimizer"]
OGR = ["--overlap-grad-reduce"]
OPG = ["--overlap-grad-reduce", "--overlap-param-gather"]
# overlapped run -> (its reference, its flags)
PAIRS = {
    "s4_ogr": ("s4", SEQ1F1B + OGR),
    "s4_distopt_opg": ("s4_distopt", SEQ1F1B + DISTOPT + OPG),
    "vp2s2_ogr": ("vp2s2", INTERLEAVED + OGR),
    "vp2s2_distopt_opg": ("vp2s2_distopt", INTERLEAVED + DISTOPT + OPG),
    # config.grad_sync_func per chunk, as Megatron-LM sets it (--align-grad-reduce)
    "vp2s2_ogr_grad_sync_func": ("vp2s2", INTERLEAVED + OGR),
}
GRAD_SYNC_FUNC = {"vp2s2_ogr_grad_sync_func"}
REFERENCES = {"s4": SEQ1F1B, "s4_distopt": SEQ1F1B + DISTOPT, "vp2s2": INTERLEAVED,
              "vp2s2_distopt": INTERLEAVED + DISTOPT}


@pytest.fixture(scope="module")
def overlap_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overlap")
    runs = [{"name": name, "argv": FLAGS + flags, "params": True,
             "grad_sync_func": name in GRAD_SYNC_FUNC}
            for name, flags in list(REFERENCES.items())
            + [(name, flags) for name, (_, flags) in PAIRS.items()]]
    # a checkpoint saved by an overlapped-gather run at its last step (no evaluation
    # gathers before it), then loaded, unchanged, by a plain run. One bucket per chunk
    # (megatron-core's default size): a distributed-optimizer checkpoint saved or loaded
    # with several buckets does not reload the same parameters (checkpointing, not overlap)
    save = FLAGS + SEQ1F1B + DISTOPT + ["--train-iters", "2", "--eval-iters", "0"]
    runs += [{"name": "saved", "argv": save + OPG + ["--save", str(tmp / "ckpt"),
                                                     "--save-interval", "2"],
              "params": True, "bucket_size": None},
             {"name": "loaded", "argv": save + ["--load", str(tmp / "ckpt")], "params": True,
              "bucket_size": None}]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(distributed, "RUNNER",
                      os.path.join(distributed.ROOT, "tests", "overlap_runner.py"))
        results = run_configs(tmp, 4, runs)
    launches = [json.load(open(path)) for path in sorted(glob.glob(str(tmp / "*.rank*.json")))]
    assert len(launches) == 4
    return results, launches


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_overlapped_run_equals_the_reference(overlap_runs, name):
    """Exactly: the same reductions on the same gradients, only started earlier. The grad
    norm of the distributed optimizer is summed over its shards, which the overlapped
    run's smaller buckets lay out differently: equal up to summation order."""
    results, _ = overlap_runs
    run, reference = results[name], results[PAIRS[name][0]]
    assert len(reference["losses"]) == 3 and len(reference["validation_losses"]) == 1
    assert run["losses"] == reference["losses"]
    assert run["validation_losses"] == reference["validation_losses"]
    assert_close_series(run["grad_norms"], reference["grad_norms"], 1e-6, f"{name} grad norm")
    assert_params_close(run["params"], reference["params"], rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_reductions_start_in_backward(overlap_runs, name):
    _, launches = overlap_runs
    for rank, by_run in enumerate(launches):
        iterations = by_run[name]
        assert len(iterations) == 3, (rank, iterations)
        assert len(iterations[0]) == (2 if name.startswith("vp") else 1)  # model chunks
        # the hooks learn in the first iteration; config.grad_sync_func needs no learning
        first = 0 if name in GRAD_SYNC_FUNC else 1
        assert all(started == 0 for iteration in iterations[:first] for started, _ in iteration)
        for iteration in iterations[first:]:
            for started, total in iteration:
                assert started == total, (name, rank, iterations)
    # megatron-core buckets the first pipeline stage's first chunk only
    assert max(by_run[name][0][0][1] for by_run in launches) > 1


def test_reference_runs_reduce_in_finalize(overlap_runs):
    _, launches = overlap_runs
    for by_run in launches:
        for name in REFERENCES:
            assert all(started == 0 for iteration in by_run[name] for started, _ in iteration)


def test_checkpoint_of_overlapped_gather_holds_the_last_step(overlap_runs):
    """The distributed optimizer updates one shard per rank and, with overlapped gather,
    leaves the rest to the next forward: the save gathers first."""
    results, _ = overlap_runs
    assert len(results["saved"]["losses"]) == 2 and results["loaded"]["losses"] == []
    assert_params_close(results["loaded"]["params"], results["saved"]["params"], rtol=0, atol=0)
