"""Seq1F1B is exact: split runs reproduce the unsplit run, layout by layout.

Every configuration trains 2 iterations from a shared iteration-0 checkpoint and is
compared, inside this test, with (a) the same layout and flags at s = 1 (megatron-core's
own 1F1B) and (b) a single-process pp=1 run with the same flags: per-iteration loss,
grad norm and validation loss within 1e-5 relative, every parameter after the optimizer
steps within 1e-5 (`assert_params_close`). Every microbatch count (5) is a multiple of
no split count. What the last stage ran is checked too: every microbatch
in s splits that tile the sequence, and with packed documents the split cases the data
must exercise.
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
    DOCUMENT_DATA,
    DOCUMENT_FLAGS,
    document_cases,
    with_corpus,
)
from split_checks import check_reports, check_split_units

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

# A: MHA, learned absolute positions, LayerNorm, GeLU, tied embeddings.
MODEL_A = TINY_MODEL
# B: GQA (4 heads, 2 groups), RoPE, SwiGLU, RMSNorm, untied embeddings.
MODEL_B = TINY_MODEL + GQA_ROPE_SWIGLU
MODELS = {"A": MODEL_A, "B": MODEL_B}
# 5 microbatches per iteration: not a multiple of any split count
# 2 iterations: the second's step uses Adam moments of the first (3 until 2026-12-07, cut
# for CI time; every other exactness suite keeps its own count)
ITERATIONS, MICROBATCHES = 2, 5
# one evaluation (forward_only), Megatron-LM's after the last iteration, which must agree
# too: no periodic one (--eval-interval past the end) and no test set (--split gives it
# nothing), so the evaluation costs one schedule call as the periodic one did
EVAL = ["--eval-interval", "1000", "--eval-iters", "1", "--split", "969,31,0"]
BATCHES = {
    "mbs2": ["--micro-batch-size", "2", "--global-batch-size", "10", "--train-iters", "2"] + EVAL,
    "mbs1": ["--micro-batch-size", "1", "--global-batch-size", "5", "--train-iters", "2"] + EVAL,
}
PP2, PP4 = ["--pipeline-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "4"]
TP2 = ["--tensor-model-parallel-size", "2"]
PER_TOKEN = ["--calculate-per-token-loss"]
# packed documents, on a corpus whose rows hold every split case (tests/packed_documents.py):
# documents crossing split edges, shorter than a split, a boundary exactly at a split
# edge, one document spanning every split
DOCS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"] + DOCUMENT_FLAGS
RECOMPUTE = {
    "_full_uniform": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "1"],
    "_full_block": ["--recompute-granularity", "full", "--recompute-method", "block",
                    "--recompute-num-layers", "2"],
    "_selective": ["--recompute-granularity", "selective"],
}
# with 2 layers per stage: one checkpoint over both layers, and only the first layer
# of each stage recomputed (the second keeps its activations)
PARTIAL_RECOMPUTE = {
    "_full_uniform2": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                       "--recompute-num-layers", "2"],
    "_full_block1": ["--recompute-granularity", "full", "--recompute-method", "block",
                     "--recompute-num-layers", "1"],
}
SP = ["--sequence-parallel"]  # split lengths then align to the TP size
# 46 tokens: `average` splits of unequal length (the remainder rule), in training
SEQ46 = ["--seq-length", "46"]
DOCS_RECOMPUTE = {f"_docs{label}": DOCS + flags for label, flags in RECOMPUTE.items()}
VARIANTS = {"": [], "_pertoken": PER_TOKEN, "_docs": DOCS, "_sp": SP, "_seq46": SEQ46,
            **RECOMPUTE, **PARTIAL_RECOMPUTE, **DOCS_RECOMPUTE}
# the chunked KV cache (per-split chunks merged by log-sum-exp) on top of a variant; at
# s = 1 it changes nothing, so its references are the variant's own
CHUNKED = ["--seq1f1b-kv-cache", "chunked"]
CHUNKED_VARIANTS = {"": [], "_docs": DOCS, "_full_uniform": RECOMPUTE["_full_uniform"],
                    "_selective": RECOMPUTE["_selective"]}
VARIANTS.update({f"{label}_chunked": flags + CHUNKED for label, flags in CHUNKED_VARIANTS.items()})


def splits(n, method="average"):
    return ["--seq1f1b-splits", str(n), "--seq1f1b-balance-method", method]


# name -> (world size, model, batch, layout flags, split flags, extra flags)
CASES = {}


def add(model, batch, layout_name, n, method, label=""):
    world, layout = LAYOUTS[layout_name]
    name = f"{model}_{batch}_{layout_name}_s{n}_{method}{label}"
    CASES[name] = (world, model, batch, layout, splits(n, method), VARIANTS[label])
    if n > 1:  # its s = 1 reference: same layout, same flags
        add(model, batch, layout_name, 1, "average", label.removesuffix("_chunked"))


LAYOUTS = {"pp1": (1, []), "pp2": (2, PP2), "pp4": (4, PP4), "tp2pp2": (4, TP2 + PP2),
           "tp2pp4": (8, TP2 + PP4)}
SPLIT_CELLS = [(n, method) for n in (2, 3, 4) for method in ("average", "uniform_comp")]
# every (pp, s, balance method) cell: pp 2 with both model families, pp 4 and tp=2 x pp=2
# with the families taking turns (in opposite orders, so that each family meets every
# cell at one of them); tp=2 x pp=4 (8 processes on CI's 2 cores) with each family and
# balance method once
for n, method in SPLIT_CELLS:
    for model, batch in (("A", "mbs2"), ("B", "mbs1")):
        add(model, batch, "pp2", n, method)
for i, (n, method) in enumerate(SPLIT_CELLS):
    add(*(("A", "mbs2"), ("B", "mbs1"))[i % 2], "tp2pp2", n, method)
    add(*(("B", "mbs1"), ("A", "mbs2"))[i % 2], "pp4", n, method)
add("A", "mbs2", "tp2pp4", 3, "average")
add("B", "mbs1", "tp2pp4", 4, "uniform_comp")
# the other model / micro-batch size pairings
add("A", "mbs1", "pp2", 3, "average")
add("B", "mbs2", "pp2", 4, "uniform_comp")
add("B", "mbs1", "pp1", 3, "average")
add("B", "mbs1", "pp2", 4, "average", "_seq46")
add("A", "mbs2", "pp2", 3, "average", "_pertoken")
add("B", "mbs1", "pp1", 3, "average", "_pertoken")
# sequence parallel (tp=2): exact against tp=1
for n, method in ((2, "average"), (4, "uniform_comp")):
    add("B", "mbs1", "tp2pp2", n, method, "_sp")
add("A", "mbs2", "tp2pp2", 3, "average", "_sp")
# activation recomputation: the recomputed forward rewrites the same cache slots
for label in RECOMPUTE:
    add("B", "mbs1", "pp2", 3, "average", label)
    add("A", "mbs2", "pp2", 4, "uniform_comp", label)
add("A", "mbs2", "pp2", 4, "uniform_comp", "_full_uniform2")
add("B", "mbs1", "pp2", 3, "average", "_full_block1")
# packed documents: s in {2, 3, 4}, tp in {1, 2}, micro-batch size 1 and 2
for n, method in ((2, "average"), (3, "average"), (4, "uniform_comp")):
    add("A", "mbs2", "pp2", n, method, "_docs")
    add("B", "mbs1", "pp2", n, method, "_docs")
for n, method in ((2, "average"), (4, "uniform_comp")):
    for model, batch in (("A", "mbs2"), ("B", "mbs1")):
        add(model, batch, "tp2pp2", n, method, "_docs")
# packed documents with each recomputation mode
for label, (model, batch, n, method) in zip(DOCS_RECOMPUTE, (
        ("A", "mbs2", 4, "uniform_comp"), ("B", "mbs1", 2, "average"), ("B", "mbs1", 4, "average"))):
    add(model, batch, "pp2", n, method, label)
# chunked KV cache: GQA and MHA, mbs 1 and 2, pp 2 and 4, tp 2, packed documents,
# full and selective recomputation
for model, batch, layout_name, n, method, label in (
        ("B", "mbs1", "pp2", 4, "average", ""),
        ("A", "mbs2", "pp2", 3, "uniform_comp", ""),
        ("B", "mbs1", "pp4", 3, "average", ""),
        ("B", "mbs1", "tp2pp2", 2, "average", ""),
        ("A", "mbs2", "pp2", 4, "uniform_comp", "_docs"),
        ("B", "mbs1", "pp2", 3, "average", "_full_uniform"),
        ("B", "mbs1", "pp2", 2, "average", "_selective")):
    add(model, batch, layout_name, n, method, f"{label}_chunked")


def variant(extra):
    return next(name for name, flags in VARIANTS.items() if flags == extra)


def reference_name(model, batch, extra):
    return f"ref_{model}_{batch}{variant(extra).removesuffix('_chunked')}"


def _argv(model, batch, start, flags, corpus):
    return with_corpus(MODELS[model] + BATCHES[batch] + start + flags, corpus)


# the packed-document reference without the document mask (same data, same positions)
UNMASKED = [flag for flag in DOCS if flag != "--reset-attention-mask"]


def plan(tmp, corpus):
    """The runs (tests/conftest.py's `exactness_runs` trains them with the other
    exactness suites'): every case, and the single-process references."""
    inits, starts = [], {}
    for model, flags in MODELS.items():
        run, starts[model] = init_run(f"init_{model}", tmp / f"init_{model}",
                                      flags + BATCHES["mbs1"])
        inits.append(run)
    by_world = {1: [], 2: [], 4: [], 8: []}
    references = {"ref_A_mbs2_docs_unmasked": _argv("A", "mbs2", starts["A"], UNMASKED, corpus)}
    for name, (world, model, batch, layout, split_flags, extra) in CASES.items():
        argv = _argv(model, batch, starts[model], layout + split_flags + extra, corpus)
        by_world[world].append({"name": name, "argv": argv, "params": True})
        ref_extra = extra[:-len(CHUNKED)] if extra[-len(CHUNKED):] == CHUNKED else extra
        references[reference_name(model, batch, extra)] = _argv(
            model, batch, starts[model], ref_extra, corpus)
    for ref, argv in references.items():
        by_world[1].append({"name": ref, "argv": argv, "params": True})
    return Plan(inits, by_world)


@pytest.fixture(scope="module")
def results(exactness_runs):
    return exactness_runs[__name__]


def _unsplit_name(name):
    prefix = name.split("_s")[0]
    label = max((v for v in VARIANTS if name.endswith(v)), key=len)  # "_docs_selective"
    return f"{prefix}_s1_average{label.removesuffix('_chunked')}"


@pytest.mark.parametrize("name", [n for n in CASES if "_s1_" not in n])
def test_split_run_equals_unsplit_runs(results, name):
    world, model, batch, layout, split_flags, extra = CASES[name]
    run = results[name]
    assert len(run["losses"]) == ITERATIONS
    n, method = int(split_flags[1]), split_flags[3]
    seq_length = 46 if extra == SEQ46 else 48
    check_split_units(name, run["forward_units"], splits=n, method=method,
                      seq_length=seq_length, calls=ITERATIONS + 1, microbatches=MICROBATCHES)
    if DOCUMENT_DATA in extra:
        missing = set(DOCUMENT_CASES) - document_cases(run["forward_units"])
        assert not missing, f"{name}: the rows it trained on have no document {missing}"
    # megatron-core's 1F1B on the same layout returned the same per-microbatch reports
    check_reports(name, run["reports"], results[_unsplit_name(name)]["reports"],
                  calls=ITERATIONS + 1, microbatches=MICROBATCHES)
    comparisons = [(reference_name(model, batch, extra), "pp=1 single process"),
                   (_unsplit_name(name), "same layout, s=1")]
    for other, what in comparisons:
        expected = results[other]
        assert not expected["forward_units"], f"{other} ran splits"
        assert_close_series(run["losses"], expected["losses"], 1e-5, f"{name} loss vs {what}")
        assert_close_series(run["grad_norms"], expected["grad_norms"], 1e-5,
                            f"{name} grad norm vs {what}")
        assert run["final_validation_loss"] is not None and run["test_loss"] is None
        assert_close_series([run["final_validation_loss"]], [expected["final_validation_loss"]],
                            1e-5, f"{name} validation loss vs {what}")
        assert_params_close(run["params"], expected["params"])


@pytest.mark.parametrize("name", [n for n in CASES if "_s1_" in n])
def test_unsplit_layouts_equal_single_process(results, name):
    world, model, batch, layout, split_flags, extra = CASES[name]
    expected = results[reference_name(model, batch, extra)]
    assert_close_series(results[name]["losses"], expected["losses"], 1e-5, name)


def test_document_masking_changes_the_model(results):
    """The packed-document runs really mask: on the same rows and positions, their
    losses differ from plain causal attention's."""
    plain = results["ref_A_mbs2_docs_unmasked"]["losses"]
    docs = results["ref_A_mbs2_docs"]["losses"]
    assert all(abs(a - b) > 1e-4 for a, b in zip(plain, docs)), (plain, docs)
