"""Seq1F1B is exact: split runs reproduce the unsplit run, layout by layout.

Every configuration trains 3 iterations from a shared iteration-0 checkpoint and is
compared, inside this test, with (a) the same layout at s = 1 (megatron-core's own
1F1B) and (b) a single-process pp=1 run: per-iteration loss and grad norm within
1e-5 relative, every parameter after the optimizer steps within 1e-5.
"""

import pytest

from distributed import (
    GQA_ROPE_SWIGLU,
    TINY_MODEL,
    assert_close_series,
    assert_params_close,
    init_checkpoint,
    run_configs,
)

# A: MHA, learned absolute positions, LayerNorm, GeLU, tied embeddings.
MODEL_A = TINY_MODEL
# B: GQA (4 heads, 2 groups), RoPE, SwiGLU, RMSNorm, untied embeddings.
MODEL_B = TINY_MODEL + GQA_ROPE_SWIGLU
MODELS = {"A": MODEL_A, "B": MODEL_B}
# microbatches per iteration are not multiples of the split counts
# evaluation (forward_only) runs after iteration 3 and must agree too
EVAL = ["--eval-interval", "3", "--eval-iters", "1"]
BATCHES = {
    "mbs2": ["--micro-batch-size", "2", "--global-batch-size", "6", "--train-iters", "3"] + EVAL,
    "mbs1": ["--micro-batch-size", "1", "--global-batch-size", "5", "--train-iters", "3"] + EVAL,
}
PP2, PP4 = ["--pipeline-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "4"]
TP2 = ["--tensor-model-parallel-size", "2"]
PER_TOKEN = ["--calculate-per-token-loss"]
# packed documents (mock documents end with EOD at random lengths, so they cross split
# edges, are shorter than splits and sometimes end exactly at one)
DOCS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
RECOMPUTE = {
    "_full_uniform": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "1"],
    "_full_block": ["--recompute-granularity", "full", "--recompute-method", "block",
                    "--recompute-num-layers", "2"],
    "_selective": ["--recompute-granularity", "selective"],
}
SP = ["--sequence-parallel"]  # split lengths then align to the TP size
DOCS_RECOMPUTE = {f"_docs{label}": DOCS + flags for label, flags in RECOMPUTE.items()}
VARIANTS = {"": [], "_pertoken": PER_TOKEN, "_docs": DOCS, "_sp": SP, **RECOMPUTE,
            **DOCS_RECOMPUTE}
# the chunked KV cache (per-split chunks merged by log-sum-exp) on top of a variant; at
# s = 1 it changes nothing, so its references are the variant's own
CHUNKED = ["--seq1f1b-kv-cache", "chunked"]
CHUNKED_VARIANTS = {"": [], "_docs": DOCS, "_full_uniform": RECOMPUTE["_full_uniform"],
                    "_selective": RECOMPUTE["_selective"]}
VARIANTS.update({f"{label}_chunked": flags + CHUNKED for label, flags in CHUNKED_VARIANTS.items()})


def splits(n, method="average"):
    return ["--seq1f1b-splits", str(n), "--seq1f1b-balance-method", method]


# pp in {1, 2, 4} x tp in {1, 2}; name -> (world size, model, batch, layout flags, split flags, extra flags)
CASES = {}
for model, batch in (("A", "mbs2"), ("B", "mbs1")):
    for n, method in ((1, "average"), (2, "average"), (3, "uniform_comp"), (4, "average"),
                      (4, "uniform_comp")):
        CASES[f"{model}_{batch}_pp2_s{n}_{method}"] = (2, model, batch, PP2, splits(n, method), [])
        CASES[f"{model}_{batch}_pp4_s{n}_{method}"] = (4, model, batch, PP4, splits(n, method), [])
    for n, method in ((1, "average"), (3, "average"), (4, "uniform_comp")):
        CASES[f"{model}_{batch}_tp2pp2_s{n}_{method}"] = (
            4, model, batch, TP2 + PP2, splits(n, method), [])
    # tp=2 x pp=4: eight processes
    for n, method in ((1, "average"), (4, "uniform_comp")):
        CASES[f"{model}_{batch}_tp2pp4_s{n}_{method}"] = (
            8, model, batch, TP2 + PP4, splits(n, method), [])
for n in (1, 3):
    CASES[f"A_mbs2_pp2_s{n}_pertoken"] = (2, "A", "mbs2", PP2, splits(n), PER_TOKEN)
    CASES[f"B_mbs1_pp1_s{n}_pertoken"] = (1, "B", "mbs1", [], splits(n), PER_TOKEN)
# sequence parallel (tp=2): exact against tp=1
for n, method in ((1, "average"), (2, "average"), (4, "uniform_comp")):
    CASES[f"B_mbs1_tp2pp2_s{n}_{method}_sp"] = (4, "B", "mbs1", TP2 + PP2, splits(n, method), SP)
CASES["A_mbs2_tp2pp2_s3_average_sp"] = (4, "A", "mbs2", TP2 + PP2, splits(3), SP)
# activation recomputation: the recomputed forward rewrites the same cache slots
for label, flags in RECOMPUTE.items():
    for n in (1, 3):
        CASES[f"B_mbs1_pp2_s{n}_average{label}"] = (2, "B", "mbs1", PP2, splits(n), flags)
    CASES[f"A_mbs2_pp2_s4_uniform_comp{label}"] = (
        2, "A", "mbs2", PP2, splits(4, "uniform_comp"), flags)
# packed documents: s in {2, 3, 4}, tp in {1, 2}, micro-batch size 1 and 2
for n, method in ((1, "average"), (2, "average"), (3, "average"), (4, "uniform_comp")):
    CASES[f"A_mbs2_pp2_s{n}_{method}_docs"] = (2, "A", "mbs2", PP2, splits(n, method), DOCS)
    CASES[f"B_mbs1_pp2_s{n}_{method}_docs"] = (2, "B", "mbs1", PP2, splits(n, method), DOCS)
for n, method in ((1, "average"), (2, "average"), (4, "uniform_comp")):
    for model, batch in (("A", "mbs2"), ("B", "mbs1")):
        CASES[f"{model}_{batch}_tp2pp2_s{n}_{method}_docs"] = (
            4, model, batch, TP2 + PP2, splits(n, method), DOCS)
# packed documents with each recomputation mode (and the unsplit run with the same flags)
for (label, flags), (model, batch, n, method) in zip(DOCS_RECOMPUTE.items(), (
        ("A", "mbs2", 4, "uniform_comp"), ("B", "mbs1", 2, "average"), ("B", "mbs1", 4, "average"))):
    for n_, method_ in ((1, "average"), (n, method)):
        CASES[f"{model}_{batch}_pp2_s{n_}_{method_}{label}"] = (
            2, model, batch, PP2, splits(n_, method_), flags)
CASES["B_mbs1_pp1_s3_average"] = (1, "B", "mbs1", [], splits(3), [])
# chunked KV cache: GQA and MHA, mbs 1 and 2, pp 2 and 4, tp 2, packed documents,
# full and selective recomputation
for name, world, layout, n, method, label in (
        ("B_mbs1_pp2", 2, PP2, 4, "average", ""),
        ("A_mbs2_pp2", 2, PP2, 3, "uniform_comp", ""),
        ("B_mbs1_pp4", 4, PP4, 3, "average", ""),
        ("B_mbs1_tp2pp2", 4, TP2 + PP2, 2, "average", ""),
        ("A_mbs2_pp2", 2, PP2, 4, "uniform_comp", "_docs"),
        ("B_mbs1_pp2", 2, PP2, 3, "average", "_full_uniform"),
        ("B_mbs1_pp2", 2, PP2, 2, "average", "_selective")):
    model, batch = name.split("_")[:2]
    CASES[f"{name}_s{n}_{method}{label}_chunked"] = (
        world, model, batch, layout, splits(n, method), VARIANTS[f"{label}_chunked"])


def variant(extra):
    return next(name for name, flags in VARIANTS.items() if flags == extra)


def reference_name(model, batch, extra):
    return f"ref_{model}_{batch}{variant(extra).removesuffix('_chunked')}"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("seq1f1b")
    starts = {}
    for model, flags in MODELS.items():
        sub = tmp / model
        sub.mkdir()
        base = flags + BATCHES["mbs1"]
        starts[model] = init_checkpoint(sub, base)
    by_world = {1: [], 2: [], 4: [], 8: []}
    references = {}
    for name, (world, model, batch, layout, split_flags, extra) in CASES.items():
        argv = MODELS[model] + BATCHES[batch] + starts[model] + layout + split_flags + extra
        by_world[world].append({"name": name, "argv": argv, "params": True})
        ref = reference_name(model, batch, extra)
        ref_extra = extra[:-len(CHUNKED)] if extra[-len(CHUNKED):] == CHUNKED else extra
        references[ref] = MODELS[model] + BATCHES[batch] + starts[model] + ref_extra
    for ref, argv in references.items():
        by_world[1].append({"name": ref, "argv": argv, "params": True})
    out = {}
    for world, runs in by_world.items():
        out.update(run_configs(tmp, world, runs))
    return out


def _unsplit_name(name):
    prefix = name.split("_s")[0]
    if name.endswith("pertoken"):
        return f"{prefix}_s1_pertoken"
    label = max((v for v in VARIANTS if name.endswith(v)), key=len)  # "_docs_selective"
    return f"{prefix}_s1_average{label.removesuffix('_chunked')}"


@pytest.mark.parametrize("name", [n for n in CASES if "_s1_" not in n])
def test_split_run_equals_unsplit_runs(results, name):
    world, model, batch, layout, split_flags, extra = CASES[name]
    run = results[name]
    assert len(run["losses"]) == 3
    comparisons = [(reference_name(model, batch, extra), "pp=1 single process")]
    if _unsplit_name(name) in results:
        comparisons.append((_unsplit_name(name), "same layout, s=1"))
    for other, what in comparisons:
        expected = results[other]
        assert_close_series(run["losses"], expected["losses"], 1e-5, f"{name} loss vs {what}")
        assert_close_series(run["grad_norms"], expected["grad_norms"], 1e-5,
                            f"{name} grad norm vs {what}")
        assert len(run["validation_losses"]) == 1
        assert_close_series(run["validation_losses"], expected["validation_losses"], 1e-5,
                            f"{name} validation loss vs {what}")
        assert_params_close(run["params"], expected["params"])


@pytest.mark.parametrize("name", [n for n in CASES if "_s1_" in n])
def test_unsplit_layouts_equal_single_process(results, name):
    world, model, batch, layout, split_flags, extra = CASES[name]
    expected = results[reference_name(model, batch, extra)]
    assert_close_series(results[name]["losses"], expected["losses"], 1e-5, name)


def test_document_masking_changes_the_model(results):
    """The packed-document runs really mask: their losses differ from plain causal ones."""
    plain, docs = results["ref_A_mbs2"]["losses"], results["ref_A_mbs2_docs"]["losses"]
    # (mock documents are long: the first batch happens to hold no boundary)
    assert sum(abs(a - b) > 1e-4 for a, b in zip(plain, docs)) >= 2, (plain, docs)
