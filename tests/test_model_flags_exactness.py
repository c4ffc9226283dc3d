"""Megatron-LM's model flags (issue #28 point 2) are exact under Seq1F1B: pp=2 with
sequence splits reproduces pp=2 unsplit and a single process, as tests/test_seq1f1b_exactness.py
asserts (loss, grad norm and validation loss per iteration within 1e-5, every parameter
after the steps within 1e-5, every microbatch run in splits that tile the sequence).

Two tiny models cover every flag (the unit checks are in tests/test_model_flags.py):

* Q ("Qwen-like"): GQA, RoPE interleaved and skipped in every second layer
  (--no-rope-freq 2, Llama-4's NoPE layers), SwiGLU, RMSNorm, --qk-layernorm,
  --add-qkv-bias without other biases (--disable-bias-linear), a vocabulary of
  --padded-vocab-size 210 (the tokenizer's 201 would pad to 256), with the chunked KV cache;
* S: MHA, LayerNorm, tied embeddings, --squared-relu, RoPE with Llama-3 scaling
  (--use-rope-scaling --rope-scaling-factor 4) and position interpolation
  (--rotary-seq-len-interpolation-factor 2), biased linear layers,
  --apply-residual-connection-post-layernorm, buffer KV cache.

And issue #28 point 5: Megatron-LM's own model settings for Qwen3, Qwen2.5 and
Llama-3.1 (RECIPES: their flags as Megatron-LM's examples give them, only the sizes scaled
down), and Qwen3 with YaRN, with sliding windows in every other layer, and with those windows
and learnable attention sinks (gpt-oss's attention), Qwen3 with gated attention and
with query/key L2 norms, each trained with Seq1F1B at pp=2 against one process (the sinks'
parameters compared too).
"""

import pytest
import torch

from distributed import (
    GQA_ROPE_SWIGLU,
    TINY_MODEL,
    Plan,
    assert_close_series,
    assert_params_close,
    init_run,
)
from split_checks import check_split_units

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

MODELS = {
    "Q": TINY_MODEL + GQA_ROPE_SWIGLU + ["--qk-layernorm", "--disable-bias-linear",
                                         "--add-qkv-bias", "--rotary-interleaved",
                                         "--no-rope-freq", "2", "--padded-vocab-size", "210"],
    "S": TINY_MODEL + ["--squared-relu", "--position-embedding-type", "rope",
                       "--use-rope-scaling", "--rope-scaling-factor", "4",
                       "--rotary-seq-len-interpolation-factor", "2",
                       "--apply-residual-connection-post-layernorm"],
}
# Megatron-LM's model flags of each family, from its examples (Qwen3-4B:
# examples/rl/model_configs/qwen3_4b.sh; Qwen2.5-7B and Llama-3.1-8B:
# examples/post_training/modelopt/conf/...), sizes scaled down: 4 layers, hidden 32, 4
# heads of 16 channels (kv-channels differs from hidden / heads, as in Qwen3), 2 query
# groups, FFN 96, sequence 48. Left out: Qwen2.5's --padded-vocab-size 152064 (the
# flag is covered by model Q above; 152064 rows would dwarf the scaled-down model) and
# --bf16 (CPU trains in fp32).
_SCALED = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
           "--kv-channels", "16", "--group-query-attention", "--num-query-groups", "2",
           "--ffn-hidden-size", "96", "--seq-length", "48"]
RECIPES = {
    "qwen3": _SCALED + [
        "--max-position-embeddings", "48", "--normalization", "RMSNorm", "--norm-epsilon",
        "1e-6", "--qk-layernorm", "--position-embedding-type", "rope", "--rotary-percent",
        "1.0", "--rotary-base", "1000000", "--use-rotary-position-embeddings", "--swiglu",
        "--disable-bias-linear", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--no-masked-softmax-fusion", "--attention-softmax-in-fp32",
        "--make-vocab-size-divisible-by", "128"],
    "qwen2.5": _SCALED + [
        "--no-masked-softmax-fusion", "--disable-bias-linear", "--add-qkv-bias",
        "--position-embedding-type", "rope", "--no-rope-fusion", "--normalization", "RMSNorm",
        "--swiglu", "--max-position-embeddings", "48", "--make-vocab-size-divisible-by", "1",
        "--use-mcore-models", "--rotary-percent", "1.0", "--rotary-base", "1000000",
        "--no-bias-swiglu-fusion", "--untie-embeddings-and-output-weights"],
    "llama3.1": _SCALED + [
        "--no-masked-softmax-fusion", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--use-rotary-position-embeddings",
        "--rotary-percent", "1.0", "--no-rope-fusion", "--no-position-embedding",
        "--normalization", "RMSNorm", "--swiglu", "--max-position-embeddings", "48",
        "--make-vocab-size-divisible-by", "1", "--use-mcore-models", "--rotary-base",
        "500000", "--use-rope-scaling"],
}
# Qwen3 with YaRN, as its model card extends the context (factor 4 over the original
# length; here 12 tokens, a quarter of the sequence): Megatron-LM's YaRN flags for
# standard attention in place of plain RoPE
RECIPES["qwen3-yarn"] = [
    flag for flag in RECIPES["qwen3"] if flag != "--use-rotary-position-embeddings"]
RECIPES["qwen3-yarn"][RECIPES["qwen3-yarn"].index("rope")] = "yarn"
RECIPES["qwen3-yarn"] += ["--rotary-scaling-factor", "4",
                          "--yarn-original-max-position-embeddings", "12"]
# Qwen3 with sliding-window attention in every other layer, as gpt-oss and Gemma
# alternate them (Megatron-LM's --window-size and --window-attn-skip-freq): a window of 20
# keys over splits of 12 reaches into the previous split's keys and not further
RECIPES["qwen3-swa"] = RECIPES["qwen3"] + ["--window-size", "20,0",
                                           "--window-attn-skip-freq", "2"]
# and gpt-oss's attention sinks: a learnt logit per head in every softmax
RECIPES["qwen3-swa-sinks"] = RECIPES["qwen3-swa"] + ["--softmax-type", "learnable"]
# Qwen3-Next's gated attention, and Llama-4's query/key L2 norm (in the qk norms' place)
RECIPES["qwen3-gate"] = RECIPES["qwen3"] + ["--attention-output-gate"]
RECIPES["qwen3-l2norm"] = [flag for flag in RECIPES["qwen3"] if flag != "--qk-layernorm"] + [
    "--qk-l2-norm"]
# what TINY_MODEL adds: data, vocabulary, dropout 0, learning rate, logging, seed
_RUN = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--lr", "1e-3",
        "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0", "--seed", "1234"]
# recipe -> (split count, extra flags of the split run)
RECIPE_CASES = {"qwen3": (4, []), "qwen2.5": (3, ["--seq1f1b-kv-cache", "chunked"]),
                "llama3.1": (2, []), "qwen3-yarn": (3, []), "qwen3-swa": (4, []),
                # the chunked cache's kernel here; the TP=2 run below, the buffer's
                "qwen3-swa-sinks": (3, ["--seq1f1b-kv-cache", "chunked"]),
                "qwen3-gate": (4, []), "qwen3-l2norm": (3, ["--seq1f1b-kv-cache", "chunked"])}
ITERATIONS, MICROBATCHES = 3, 5  # 5 microbatches: a multiple of no split count
# one evaluation, Megatron-LM's after the last iteration (none periodic, no test set)
BATCH = ["--micro-batch-size", "1", "--global-batch-size", "5", "--train-iters", "3",
         "--eval-interval", "1000", "--eval-iters", "1", "--split", "969,31,0"]
PP2 = ["--pipeline-model-parallel-size", "2"]
TP2 = ["--tensor-model-parallel-size", "2"]
# name -> (model, split count, extra flags of the split run)
CASES = {
    "Q_pp2_s3": ("Q", 3, ["--seq1f1b-kv-cache", "chunked"]),
    "S_pp2_s2": ("S", 2, []),
}


def _splits(n):
    return ["--seq1f1b-splits", str(n), "--seq1f1b-balance-method", "average"]


def plan(tmp, corpus):
    """The split runs, their s = 1 runs on the same layout and the single-process
    references, from one iteration-0 checkpoint per model."""
    inits, starts = [], {}
    for model, flags in MODELS.items():
        run, starts[model] = init_run(f"init_{model}", tmp / f"init_{model}", flags + BATCH)
        inits.append(run)
    runs = {1: [], 2: []}
    for name, (model, n, extra) in CASES.items():
        base = MODELS[model] + BATCH + starts[model]
        runs[2].append({"name": name, "argv": base + PP2 + _splits(n) + extra, "params": True})
        runs[2].append({"name": f"{model}_pp2_s1", "argv": base + PP2 + _splits(1),
                        "params": True})
        runs[1].append({"name": f"ref_{model}", "argv": base, "params": True})
    # the recipes: the split run against one process only (the s = 1 comparison above
    # covers the flags; this proves the families' combinations), one init run each
    for recipe, (n, extra) in RECIPE_CASES.items():
        flags = RECIPES[recipe] + _RUN + BATCH
        run, start = init_run(f"init_{recipe}", tmp / f"init_{recipe}", flags)
        inits.append(run)
        runs[2].append({"name": f"{recipe}_pp2_s{n}", "argv": flags + start + PP2 + _splits(n)
                        + extra, "params": True})
        runs[1].append({"name": f"ref_{recipe}", "argv": flags + start, "params": True})
        if recipe == "qwen3-swa-sinks":  # the sinks split by head across TP ranks
            runs[2].append({"name": f"{recipe}_tp2_s{n}", "params": True,
                            "argv": flags + start + TP2 + _splits(n)})
    return Plan(inits, runs)


@pytest.fixture(scope="module")
def results(exactness_runs):
    return exactness_runs[__name__]


@pytest.mark.parametrize("name", CASES)
def test_split_run_equals_unsplit_runs(results, name):
    model, n, _ = CASES[name]
    run = results[name]
    assert len(run["losses"]) == ITERATIONS
    check_split_units(name, run["forward_units"], splits=n, method="average", seq_length=48,
                      calls=ITERATIONS + 1, microbatches=MICROBATCHES)
    for other, what in ((f"ref_{model}", "pp=1 single process"),
                        (f"{model}_pp2_s1", "same layout, s=1")):
        expected = results[other]
        assert not expected["forward_units"], f"{other} ran splits"
        assert_close_series(run["losses"], expected["losses"], 1e-5, f"{name} loss vs {what}")
        assert_close_series(run["grad_norms"], expected["grad_norms"], 1e-5,
                            f"{name} grad norm vs {what}")
        assert run["final_validation_loss"] is not None
        assert_close_series([run["final_validation_loss"]], [expected["final_validation_loss"]],
                            1e-5, f"{name} validation loss vs {what}")
        assert_params_close(run["params"], expected["params"])


def key_bias_entries(names, heads=4, groups=2, channels=16):
    """The key part of every layer's QKV bias (megatron-core's layout: per query group,
    its query heads, then its key, then its value), for _SCALED's attention. Without QK
    norm its exact gradient is zero: q . b_k shifts all of a query's scores alike, which
    softmax ignores. What it trains to is rounding noise normalised by Adam (moves of up
    to lr per step; two exact runs ended 1e-6 apart on an AVX2 host while the query and
    value biases agreed to 4e-8), so it is left out of the parameter comparison."""
    per_group = (heads // groups + 2) * channels
    key = torch.zeros(groups, per_group, dtype=torch.bool)
    key[:, heads // groups * channels:(heads // groups + 1) * channels] = True
    return {name: key.flatten() for name in names if name.endswith("linear_qkv.bias")}


@pytest.mark.parametrize("recipe", RECIPE_CASES)
def test_megatron_lm_recipe_trains_exactly_with_seq1f1b(results, recipe):
    n, _ = RECIPE_CASES[recipe]
    run, ref = results[f"{recipe}_pp2_s{n}"], results[f"ref_{recipe}"]
    assert len(run["losses"]) == ITERATIONS and not ref["forward_units"]
    check_split_units(recipe, run["forward_units"], splits=n, method="average", seq_length=48,
                      calls=ITERATIONS + 1, microbatches=MICROBATCHES)
    assert_close_series(run["losses"], ref["losses"], 1e-5, f"{recipe} loss")
    assert_close_series(run["grad_norms"], ref["grad_norms"], 1e-5, f"{recipe} grad norm")
    assert run["final_validation_loss"] is not None
    assert_close_series([run["final_validation_loss"]], [ref["final_validation_loss"]], 1e-5,
                        f"{recipe} validation loss")
    names = set(torch.load(ref["params"]))
    noise_only = key_bias_entries(names) if recipe == "qwen2.5" else None  # no QK norm
    assert_params_close(run["params"], ref["params"], not_compared=noise_only)
    has = {"qk norm": any("q_layernorm" in n for n in names),
           "qkv bias": any(n.endswith("linear_qkv.bias") for n in names),
           "output layer": "output_layer.weight" in names,
           "position embedding": any("position_embeddings" in n for n in names)}
    expected = {"qwen3": {"qk norm": True, "qkv bias": False, "output layer": False},
                "qwen3-yarn": {"qk norm": True, "qkv bias": False, "output layer": False},
                "qwen3-swa": {"qk norm": True, "qkv bias": False, "output layer": False},
                "qwen3-swa-sinks": {"qk norm": True, "qkv bias": False, "output layer": False},
                "qwen3-gate": {"qk norm": True, "qkv bias": False, "output layer": False},
                "qwen3-l2norm": {"qk norm": False, "qkv bias": False, "output layer": False},
                "qwen2.5": {"qk norm": False, "qkv bias": True, "output layer": True},
                "llama3.1": {"qk norm": False, "qkv bias": False, "output layer": True}}
    assert has == dict(expected[recipe], **{"position embedding": False}), (recipe, has)
    sinks = {n for n in names if n.endswith("core_attention.softmax_offset")}
    assert len(sinks) == (4 if recipe.endswith("sinks") else 0), (recipe, sinks)
    # _SCALED's QKV: 4 heads and 2 groups of 16 channels, 128 rows; the gate adds 64
    qkv_rows = {torch.load(ref["params"])[n].shape[0] for n in names
                if n.endswith("linear_qkv.weight")}
    assert qkv_rows == ({192} if recipe == "qwen3-gate" else {128}), (recipe, qkv_rows)


def test_the_flags_built_their_parameters(results):
    """--qk-layernorm, --add-qkv-bias, --padded-vocab-size and the post-norm residual
    layer's norms (the other flags add no parameter; their effect on the config and the
    model is in tests/test_model_flags.py and tests/test_post_norm_residual.py)."""
    import torch

    for run in ("ref_Q", "Q_pp2_s3", "ref_S", "S_pp2_s2"):
        params = torch.load(results[run]["params"])
        names = set(params)
        vocab = {params[n].shape[0] for n in names
                 if n.endswith(("word_embeddings.weight", "output_layer.weight"))}
        assert vocab == ({210} if run.endswith("Q") or run.startswith("Q_") else {256}), run
        post_norms = {n.split(".")[-2] for n in names if ".layers." in n and "_norm." in n}
        legacy = run.startswith(("ref_S", "S_"))  # the layer of the post-norm residual
        assert post_norms == ({"input_norm", "post_attention_norm"} if legacy else set()), run
        assert legacy != any("input_layernorm" in n for n in names), run
        qk_norms = {n for n in names if "q_layernorm" in n or "k_layernorm" in n}
        qkv_bias = {n for n in names if n.endswith("linear_qkv.bias")}
        other_bias = {n for n in names if n.endswith(("linear_proj.bias", "linear_fc1.bias"))}
        if run.startswith(("ref_Q", "Q_")):  # 4 layers: a q and a k norm weight each
            assert len(qk_norms) == 8 and len(qkv_bias) == 4 and not other_bias, run
        else:
            assert not qk_norms and len(qkv_bias) == 4 and len(other_bias) == 8, run


def test_yarn_changes_what_the_model_computes(results):
    """YaRN is not a no-op: the same Qwen3 weights and data (same seed, one process) give
    another gradient with YaRN than with plain RoPE (about 5% in norm at the first
    iteration, where exact runs agree within 1e-5)."""
    plain = results["ref_qwen3"]["grad_norms"][0]
    yarn = results["ref_qwen3-yarn"]["grad_norms"][0]
    assert abs(plain - yarn) > 1e-2 * plain, (plain, yarn)


def test_sliding_window_changes_what_the_model_computes(results):
    """The window is not a no-op: the same Qwen3 weights and data give another gradient
    with 20-key windows in every other layer than with full attention."""
    full = results["ref_qwen3"]["grad_norms"][0]
    windowed = results["ref_qwen3-swa"]["grad_norms"][0]
    assert abs(full - windowed) > 1e-3 * full, (full, windowed)


def test_attention_sinks_change_what_the_model_computes(results):
    """The learnable sinks are not a no-op: against the same model without them (same
    seed, one process) the gradient differs."""
    plain = results["ref_qwen3-swa"]["grad_norms"][0]
    sinks = results["ref_qwen3-swa-sinks"]["grad_norms"][0]
    assert abs(plain - sinks) > 1e-3 * plain, (plain, sinks)


def test_attention_sinks_split_by_head_across_tp_ranks(results):
    """TP=2 with splits: each rank learns its heads' sinks; the run equals one process
    (losses, grad norms with every rank's sinks counted, the gathered parameters)."""
    run, ref = results["qwen3-swa-sinks_tp2_s3"], results["ref_qwen3-swa-sinks"]
    assert_close_series(run["losses"], ref["losses"], 1e-5, "tp2 sinks loss")
    assert_close_series(run["grad_norms"], ref["grad_norms"], 1e-5, "tp2 sinks grad norm")
    assert_params_close(run["params"], ref["params"])


def test_the_gate_changes_what_the_model_computes(results):
    """Against Qwen3, same seed, one process. (The L2 norms are Qwen3's RMS qk norms
    without their weights, which start at 1: the same function at iteration 0; that they
    replace the norms is checked on the spec, tests/test_gate_and_l2_norm_flags.py, and by
    the parameters above.)"""
    plain = results["ref_qwen3"]["grad_norms"][0]
    gated = results["ref_qwen3-gate"]["grad_norms"][0]
    assert abs(plain - gated) > 1e-3 * plain, (plain, gated)
