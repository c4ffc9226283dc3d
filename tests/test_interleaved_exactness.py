"""Interleaved Seq1F1B (virtual pipeline stages x sequence splits) is exact.

Every configuration trains 3 iterations (then one evaluation) from a shared
iteration-0 checkpoint and is compared, inside this test, with a single-process
pp=1 run of the same model, batch and flags: per-iteration loss and grad norm
within 1e-5 relative, validation loss, and every parameter after the optimizer
steps within 1e-5, and the per-microbatch loss reports the schedule returns. The last
stage's recorded units show every microbatch ran as s splits in each of its model
chunks; the packed-document case runs on a corpus holding every split case. A
checkpoint saved by an interleaved run loads into pp=1.
"""

import pytest

from distributed import (
    GQA_ROPE_SWIGLU,
    TINY_MODEL,
    TRACKER,
    Plan,
    assert_close_series,
    assert_params_close,
    init_run,
)
from packed_documents import (
    CASES as DOCUMENT_CASES,
    DOCUMENT_FLAGS,
    document_cases,
    with_corpus,
)
from split_checks import check_reports, check_split_units

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

# 8 layers so that pp=4 x 2 chunks and pp=2 x 4 chunks both have a layer per chunk.
MODEL_A = TINY_MODEL + ["--num-layers", "8"]  # MHA, learned positions, LayerNorm, GeLU, tied
MODEL_B = MODEL_A + GQA_ROPE_SWIGLU
# 16 layers: pp=4 x 4 chunks, a layer per chunk
MODEL_C = TINY_MODEL + ["--num-layers", "16"]
MODELS = {"A": MODEL_A, "B": MODEL_B, "C": MODEL_C}
# one evaluation (forward_only), Megatron-LM's after the last iteration, which must agree
# too: no periodic one (--eval-interval past the end) and no test set (--split gives it
# nothing), so the evaluation costs one schedule call as the periodic one did
EVAL = ["--eval-interval", "1000", "--eval-iters", "1", "--split", "969,31,0"]
CALLS = 4  # 3 training steps, 1 evaluation
MICROBATCHES = {"mbs1": 8, "mbs2": 4, "m5g3": 5}
BATCHES = {
    "mbs1": ["--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "3"] + EVAL,
    "mbs2": ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3"] + EVAL,
    # m = 5 is not a multiple of p: megatron-core accepts it with groups of 3 microbatches
    "m5g3": ["--micro-batch-size", "1", "--global-batch-size", "5", "--train-iters", "3",
             "--microbatch-group-size-per-virtual-pipeline-stage", "3"] + EVAL,
}
DOCS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"] + DOCUMENT_FLAGS
EXTRAS = {"": [], "_pertoken": ["--calculate-per-token-loss"], "_docs": DOCS,
          "_sp": ["--sequence-parallel"],
          "_recompute": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                         "--recompute-num-layers", "1"],
          "_chunked": ["--seq1f1b-kv-cache", "chunked"]}


def layout(pp, vp, tp=1):
    flags = ["--pipeline-model-parallel-size", str(pp), "--virtual-pipeline-model-parallel-size",
             str(vp)]
    return flags + (["--tensor-model-parallel-size", str(tp)] if tp > 1 else [])


def splits(n, method="average"):
    return ["--seq1f1b-splits", str(n), "--seq1f1b-balance-method", method]


# name -> (world size, model, batch, layout, split flags, extra label)
CASES = {
    "A_mbs1_pp2v2_s1": (2, "A", "mbs1", layout(2, 2), splits(1), ""),
    "A_mbs1_pp2v2_s2": (2, "A", "mbs1", layout(2, 2), splits(2), ""),
    "A_mbs2_pp2v2_s3_uniform_comp": (2, "A", "mbs2", layout(2, 2), splits(3, "uniform_comp"), ""),
    "B_mbs1_pp2v2_s4": (2, "B", "mbs1", layout(2, 2), splits(4), ""),
    "B_mbs2_pp2v4_s2": (2, "B", "mbs2", layout(2, 4), splits(2), ""),
    "A_m5g3_pp2v2_s3": (2, "A", "m5g3", layout(2, 2), splits(3), ""),
    "A_mbs2_pp2v2_s2_pertoken": (2, "A", "mbs2", layout(2, 2), splits(2), "_pertoken"),
    "B_mbs2_pp2v2_s3_docs": (2, "B", "mbs2", layout(2, 2), splits(3), "_docs"),
    "B_mbs1_pp2v2_s2_recompute": (2, "B", "mbs1", layout(2, 2), splits(2), "_recompute"),
    "A_mbs1_pp4v2_s1": (4, "A", "mbs1", layout(4, 2), splits(1), ""),
    "A_mbs1_pp4v2_s2": (4, "A", "mbs1", layout(4, 2), splits(2), ""),
    "B_mbs2_pp4v2_s4_uniform_comp": (4, "B", "mbs2", layout(4, 2), splits(4, "uniform_comp"), ""),
    "A_mbs2_tp2pp2v2_s2": (4, "A", "mbs2", layout(2, 2, tp=2), splits(2), ""),
    "B_mbs1_tp2pp2v2_s4_sp": (4, "B", "mbs1", layout(2, 2, tp=2), splits(4), "_sp"),
    "C_mbs1_pp4v4_s2": (4, "C", "mbs1", layout(4, 4), splits(2), ""),
    "B_mbs2_pp2v2_s3_chunked": (2, "B", "mbs2", layout(2, 2), splits(3), "_chunked"),
    # tp=2 x pp=4: eight processes
    "A_mbs1_tp2pp4v2_s2_uniform_comp": (8, "A", "mbs1", layout(4, 2, tp=2),
                                        splits(2, "uniform_comp"), ""),
}
SAVED = "A_mbs1_pp2v2_s2"  # also saves its final checkpoint, reloaded into pp=1 below


def reference_name(model, batch, extra):
    # sequence parallel is meaningless at tp=1 and the chunked cache at s=1: their
    # reference is the plain run
    return f"ref_{model}_{batch}{'' if extra in ('_sp', '_chunked') else extra}"


def plan(tmp, corpus):
    """The runs (tests/conftest.py's `exactness_runs` trains them with the other
    exactness suites'): every case, the single-process references, and the saved
    interleaved checkpoint reloaded into one process (once it is written)."""
    inits, starts = [], {}
    for model, flags in MODELS.items():
        run, starts[model] = init_run(f"init_{model}", tmp / f"init_{model}",
                                      flags + BATCHES["mbs1"])
        inits.append(run)
    by_world = {1: [], 2: [], 4: [], 8: []}
    references = {}
    saved_dir = tmp / "saved_interleaved"
    for name, (world, model, batch, lay, split_flags, extra) in CASES.items():
        argv = with_corpus(MODELS[model] + BATCHES[batch] + starts[model] + lay + split_flags
                           + EXTRAS[extra], corpus)
        if name == SAVED:  # first in its launch: the reload below waits for it
            argv += ["--save", str(saved_dir), "--save-interval", "1000"]
            by_world[world].insert(0, {"name": name, "argv": argv, "params": True,
                                       "writes": str(saved_dir / TRACKER)})
        else:
            by_world[world].append({"name": name, "argv": argv, "params": True})
        ref_extra = "" if extra in ("_sp", "_chunked") else extra
        references[reference_name(model, batch, extra)] = with_corpus(
            MODELS[model] + BATCHES[batch] + starts[model] + EXTRAS[ref_extra], corpus)
    for ref, argv in references.items():
        by_world[1].append({"name": ref, "argv": argv, "params": True})
    # the interleaved checkpoint (model0/model1 per rank) into one process: no more steps
    by_world[1].append({"name": "reloaded", "params": True, "after": [str(saved_dir / TRACKER)],
                        "argv": MODEL_A + BATCHES["mbs1"] + ["--load", str(saved_dir)]})
    return Plan(inits, by_world)


@pytest.fixture(scope="module")
def results(exactness_runs):
    return exactness_runs[__name__]


@pytest.mark.parametrize("name", list(CASES))
def test_interleaved_run_equals_single_process(results, name):
    world, model, batch, lay, split_flags, extra = CASES[name]
    run, expected = results[name], results[reference_name(model, batch, extra)]
    assert len(run["losses"]) == 3
    check_split_units(name, run["forward_units"], splits=int(split_flags[1]),
                      method=split_flags[3], seq_length=48, calls=CALLS,
                      microbatches=MICROBATCHES[batch], chunks=int(lay[3]))
    if extra == "_docs":
        missing = set(DOCUMENT_CASES) - document_cases(run["forward_units"])
        assert not missing, f"{name}: the rows it trained on have no document {missing}"
    check_reports(name, run["reports"], expected["reports"], calls=CALLS,
                  microbatches=MICROBATCHES[batch])
    assert_close_series(run["losses"], expected["losses"], 1e-5, f"{name} loss")
    assert_close_series(run["grad_norms"], expected["grad_norms"], 1e-5, f"{name} grad norm")
    assert run["final_validation_loss"] is not None
    assert_close_series([run["final_validation_loss"]], [expected["final_validation_loss"]],
                        1e-5, f"{name} validation loss")
    assert_params_close(run["params"], expected["params"])


def test_interleaved_checkpoint_loads_into_one_process(results):
    assert results["reloaded"]["losses"] == []  # resumed at iteration 3 of 3
    assert_params_close(results["reloaded"]["params"], results[SAVED]["params"], rtol=0, atol=0)
