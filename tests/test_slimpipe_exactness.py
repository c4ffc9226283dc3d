"""SlimPipe (uniform slices over virtual stages) is exact.

Every configuration trains 3 iterations (then one evaluation, the forward-only path)
from a shared iteration-0 checkpoint and is compared, inside this test, with a
single-process pp=1 run of the same model, batch and flags: per-iteration loss and
grad norm within 1e-5 relative, validation loss, every parameter after the optimizer
steps within 1e-5, and the per-microbatch loss reports the schedule returns. The last
stage's recorded units show every microbatch ran as n slices in each of its model
chunks; the packed-document cases run on a corpus holding every split case.

The runs share their launches with the other exactness suites (tests/conftest.py's
`exactness_runs`: one launch per world size, the CI budget is tight). Which grid cell
each case covers:

======================  ====  ===  ======  ==  ====  ==============================
case                    pp    v    n       tp  mbs   also
======================  ====  ===  ======  ==  ====  ==============================
A_m1_pp2v2_n2           2     2    2 = p   1   1     one microbatch
B_mbs2_pp2v4_n4_docs    2     4    4 = 2p  1   2     packed documents, GQA/RoPE/SwiGLU
A_m3_pp2v1_len12        2     1    4       1   1     --slimpipe-slice-length, v = 1, m = 3
A_mbs2_tp2pp2v2_n4_sp   2     2    4       2   2     sequence parallel (slice % tp)
A_m3_pp4v2_n8           4     2    8 = 2p  1   1     m = 3 (< p, not a multiple of p)
B_m3_pp2v2_n4_chunked   2     2    4 = 2p  1   1     --seq1f1b-kv-cache chunked, GQA
B_m3_pp2v2_n4_balance   2     2    4 = 2p  1   1     --slimpipe-attention-balance, GQA
A_m3_pp2v1_n4_balance   2     1    4       1   1     attention balance without v
A_mbs2_tp2pp2v2_balance 2     2    4       2   2     attention balance, tp = 2
A_m3_pp4v2_n8_balance   4     2    8 = 2p  1   1     attention balance over 4 ranks
B_mbs2_pp2v2_n4_docs_b  2     2    4 = 2p  1   2     attention balance, packed documents
A_m3_pp2v2_n4_recomp_b  2     2    4 = 2p  1   1     attention balance, full recomputation
======================  ====  ===  ======  ==  ====  ==============================

The attention-balance cases (`--slimpipe-attention-balance`, chunked KV cache) pair
units of different ranks that then exchange query slices, K/V chunks and partial
results in every layer; ``test_balance_cases_exchange`` checks that each case's plan
has such pairs (forward and backward), so the equality is not that of an unused path.

pp = 4 with v = 4 (16 layers) and pp = 4 with n = p run in the generator tests only
(tests/test_slimpipe_schedule.py), not here: every process launch costs seconds of the
CI budget.
"""

import pytest

from distributed import (
    GQA_ROPE_SWIGLU,
    TINY_MODEL,
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

MODEL_A = TINY_MODEL + ["--num-layers", "8"]  # MHA, learned positions, LayerNorm, GeLU, tied
MODEL_B = MODEL_A + GQA_ROPE_SWIGLU
MODELS = {"A": MODEL_A, "B": MODEL_B}
# one evaluation (forward_only), Megatron-LM's after the last iteration, which must agree
# too: no periodic one (--eval-interval past the end) and no test set (--split gives it
# nothing), so the evaluation costs one schedule call as the periodic one did
EVAL = ["--train-iters", "3", "--eval-interval", "1000", "--eval-iters", "1",
        "--split", "969,31,0"]
CALLS = 4  # 3 training steps, 1 evaluation
MICROBATCHES = {"m1": 1, "m3": 3, "mbs2": 2}
BATCHES = {
    "m1": ["--micro-batch-size", "1", "--global-batch-size", "1"] + EVAL,
    "m3": ["--micro-batch-size", "1", "--global-batch-size", "3"] + EVAL,
    "mbs2": ["--micro-batch-size", "2", "--global-batch-size", "4"] + EVAL,
}
EXTRAS = {"": [], "_docs": ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
          + DOCUMENT_FLAGS,
          "_sp": ["--sequence-parallel"], "_chunked": ["--seq1f1b-kv-cache", "chunked"],
          "_balance": ["--seq1f1b-kv-cache", "chunked", "--slimpipe-attention-balance"]}
EXTRAS["_docs_balance"] = EXTRAS["_docs"] + EXTRAS["_balance"]
EXTRAS["_recompute_balance"] = EXTRAS["_balance"] + [
    "--recompute-granularity", "full", "--recompute-method", "uniform",
    "--recompute-num-layers", "1"]
# the flags of each case's single-process reference (sequence parallel at tp=1, the
# chunked KV cache and attention balance without slices change nothing)
REFERENCE_EXTRA = {"_sp": "", "_chunked": "", "_balance": "", "_docs_balance": "_docs",
                   "_recompute_balance": ""}


def layout(pp, vp, tp=1):
    flags = ["--pipeline-model-parallel-size", str(pp)]
    flags += ["--virtual-pipeline-model-parallel-size", str(vp)] if vp > 1 else []
    return flags + (["--tensor-model-parallel-size", str(tp)] if tp > 1 else [])


def slices(n):
    return ["--pipeline-schedule", "slimpipe", "--slimpipe-slices", str(n)]


# name -> (world size, model, batch, layout, schedule flags, extra label)
CASES = {
    "A_m1_pp2v2_n2": (2, "A", "m1", layout(2, 2), slices(2), ""),
    "B_mbs2_pp2v4_n4_docs": (2, "B", "mbs2", layout(2, 4), slices(4), "_docs"),
    "A_m3_pp2v1_len12": (2, "A", "m3", layout(2, 1), ["--slimpipe-slice-length", "12"], ""),
    "A_mbs2_tp2pp2v2_n4_sp": (4, "A", "mbs2", layout(2, 2, tp=2), slices(4), "_sp"),
    "A_m3_pp4v2_n8": (4, "A", "m3", layout(4, 2), slices(8), ""),
    "B_m3_pp2v2_n4_chunked": (2, "B", "m3", layout(2, 2), slices(4), "_chunked"),
    "B_m3_pp2v2_n4_balance": (2, "B", "m3", layout(2, 2), slices(4), "_balance"),
    "A_m3_pp2v1_n4_balance": (2, "A", "m3", layout(2, 1), slices(4), "_balance"),
    "A_mbs2_tp2pp2v2_balance": (4, "A", "mbs2", layout(2, 2, tp=2), slices(4), "_balance"),
    "A_m3_pp4v2_n8_balance": (4, "A", "m3", layout(4, 2), slices(8), "_balance"),
    "B_mbs2_pp2v2_n4_docs_balance": (2, "B", "mbs2", layout(2, 2), slices(4), "_docs_balance"),
    "A_m3_pp2v2_n4_recompute_balance": (2, "A", "m3", layout(2, 2), slices(4),
                                        "_recompute_balance"),
}


def reference_extra(extra):
    return REFERENCE_EXTRA.get(extra, extra)


def reference_name(model, batch, extra):
    return f"ref_{model}_{batch}{reference_extra(extra)}"


def plan(tmp, corpus):
    """The runs (tests/conftest.py's `exactness_runs` trains them with the other
    exactness suites'): every case and the single-process references."""
    inits, starts = [], {}
    for model, flags in MODELS.items():
        run, starts[model] = init_run(f"init_{model}", tmp / f"init_{model}",
                                      flags + BATCHES["m1"][:4])
        inits.append(run)
    by_world = {1: [], 2: [], 4: []}
    references = {}
    for name, (world, model, batch, lay, schedule, extra) in CASES.items():
        argv = with_corpus(MODELS[model] + BATCHES[batch] + starts[model] + lay + schedule
                           + EXTRAS[extra], corpus)
        by_world[world].append({"name": name, "argv": argv, "params": True})
        references[reference_name(model, batch, extra)] = with_corpus(
            MODELS[model] + BATCHES[batch] + starts[model] + EXTRAS[reference_extra(extra)],
            corpus)
    for ref, argv in references.items():
        by_world[1].append({"name": ref, "argv": argv, "params": True})
    return Plan(inits, by_world)


@pytest.fixture(scope="module")
def results(exactness_runs):
    return exactness_runs[__name__]


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_slimpipe_run_equals_single_process(results, name):
    world, model, batch, lay, schedule, extra = CASES[name]
    run, expected = results[name], results[reference_name(model, batch, extra)]
    assert len(run["losses"]) == 3
    flags = dict(zip(schedule, schedule[1:])) | dict(zip(lay, lay[1:]))
    n = (int(flags["--slimpipe-slices"]) if "--slimpipe-slices" in flags
         else 48 // int(flags["--slimpipe-slice-length"]))
    chunks = int(flags.get("--virtual-pipeline-model-parallel-size", 1))
    check_split_units(name, run["forward_units"], splits=n, method="average",
                      seq_length=48, calls=CALLS, microbatches=MICROBATCHES[batch],
                      chunks=chunks)
    if extra.startswith("_docs"):
        missing = set(DOCUMENT_CASES) - document_cases(run["forward_units"])
        assert not missing, f"{name}: the rows it trained on have no document {missing}"
    check_reports(name, run["reports"], expected["reports"], calls=CALLS,
                  microbatches=MICROBATCHES[batch])
    assert_close_series(run["losses"], expected["losses"], 1e-5, f"{name} loss")
    assert_close_series(run["grad_norms"], expected["grad_norms"], 1e-5, f"{name} grad norm")
    assert run["final_validation_loss"] is not None and run["test_loss"] is None
    assert_close_series([run["final_validation_loss"]], [expected["final_validation_loss"]],
                        1e-5, f"{name} validation loss")
    assert_params_close(run["params"], expected["params"])


BALANCE_CASES = [n for n, case in CASES.items() if case[5].endswith("_balance")]


def _balance_askers(name):
    from megatron.model_shape import ModelShape
    from megatron.schedules.attention_balance import SliceCosts, balanced_slimpipe
    from megatron.trainer.arguments import parse_args

    world, model, batch, lay, schedule, extra = CASES[name]
    args = parse_args(with_corpus(MODELS[model] + BATCHES[batch] + lay + schedule + EXTRAS[extra],
                                  None),  # the plan does not depend on the data
                      world_size=world, cuda_available=False)
    # the vocabulary is not part of the per-layer costs
    costs = SliceCosts.from_model(ModelShape.from_args(args, vocab_size=args.vocab_size),
                                  args.seq_length // args.slimpipe_slices)
    plan = balanced_slimpipe(args.pipeline_model_parallel_size, args.num_microbatches,
                             args.virtual_pipeline_model_parallel_size or 1,
                             args.slimpipe_slices, costs)
    return [o.asker for offloads in plan.offloads for o in offloads.values() if o.role == "ask"]


def test_balance_cases_exchange():
    """Every balance case's plan pairs units (what its run executes), and the cases
    together exchange in forward and in backward units."""
    askers = {name: _balance_askers(name) for name in BALANCE_CASES}
    assert all(askers.values()), askers
    every = [u for units in askers.values() for u in units]
    assert any(u.is_forward for u in every) and any(not u.is_forward for u in every)
