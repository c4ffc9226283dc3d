"""Multi-token prediction (DeepSeek-V3's MTP, Megatron-LM's --mtp-num-layers) is exact
under Seq1F1B: pp=2 with sequence splits reproduces pp=2 unsplit and a single process
(loss, grad norm and every MTP depth's logged loss per iteration, validation loss, every
parameter after the steps, relative 1e-5, fp32, dropout 0), every microbatch run in
splits that tile the sequence. Each split's MTP layers embed the tokens 1..D places past
each position and their losses read the labels and loss mask as far ahead, which for a
split's last positions lie in the next splits (``megatron.seqsplit.mtp``); the MTP
layers' attention runs over the split's K/V cache like the decoder's.

* T: 2 MTP depths on the tiny MHA model with RoPE, LayerNorm and GeLU, init std 0.25
  so that positions matter; also with TP=2 and sequence parallelism, and on packed
  documents (--reset-attention-mask: the MTP layers attend within each document).
* U (DeepSeek-V3's dense attention): 1 MTP depth of multi-latent attention with query
  compression and its norms, RoPE, SwiGLU, RMSNorm, loss weight 0.3; the chunked KV cache.

Both untie the output layer from the embeddings, as DeepSeek-V3 does (with them tied and
pp > 1 megatron-core's own checkpoint code refuses the MTP stage: refused before work).
The last stage's copy of the embedding (the MTP layers embed the shifted tokens) is tied
to the first stage's: its gradient joins the first stage's each step.

Breaking the read past the split (the shifted windows cut at the split's end) moves
T's first MTP losses from 6.64 / 6.58 to 6.23 / 5.71: the comparison sees it.
"""

import pytest

from distributed import (
    TINY_MODEL,
    TRACKER,
    Plan,
    assert_close_series,
    assert_params_close,
    init_run,
)
from packed_documents import CASES as DOCUMENT_CASES
from packed_documents import DOCUMENT_FLAGS, document_cases, with_corpus
from split_checks import check_split_units

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

# DeepSeek-V3's dense attention, scaled down: MLA with query compression and its norms,
# RoPE, SwiGLU, RMSNorm, no biases, untied embeddings
DEEPSEEK_ATTENTION = [
    "--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--multi-latent-attention", "--kv-lora-rank", "12", "--qk-head-dim", "8",
    "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--q-lora-rank", "16",
    "--qk-layernorm", "--rope-type", "rope"]
MODELS = {
    "T": TINY_MODEL + ["--mtp-num-layers", "2", "--init-method-std", "0.25",
                       "--untie-embeddings-and-output-weights",
                       "--position-embedding-type", "rope"],
    "U": TINY_MODEL + DEEPSEEK_ATTENTION + ["--mtp-num-layers", "1",
                                            "--mtp-loss-scaling-factor", "0.3"],
    # DeepSeek-V3: U's attention, MoE from the second layer on with a shared expert and
    # the sigmoid router's expert bias and seq_aux_loss, so the MTP layer (a copy of the
    # last) is an MoE layer whose routing statistics are its own microbatch's
    "V": TINY_MODEL + DEEPSEEK_ATTENTION + [
        "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
        "--moe-layer-freq", "[0]*1+[1]*3", "--moe-shared-expert-intermediate-size", "24",
        "--moe-router-score-function", "sigmoid", "--moe-router-pre-softmax",
        "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.002",
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1",
        "--moe-token-dispatcher-type", "alltoall", "--mtp-num-layers", "2"],
}
# --calculate-per-token-loss (megatron-core 0.17+ weighs each depth's loss by the call's
# loss tokens: the whole microbatch's under splits, seqsplit/mtp.py)
MODELS["Vp"] = MODELS["V"] + ["--calculate-per-token-loss"]
DEPTHS = {"T": 2, "U": 1, "V": 2, "Td": 2, "Vp": 2}
# T trained on packed documents (the corpus whose rows hold every split case): the MTP
# layers attend within documents; their shifts run across document ends, as megatron-core's
# (without packed-sequence parameters) do
DOCUMENT_MODELS = {"Td": "T"}
DOCS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"] + DOCUMENT_FLAGS
ITERATIONS, MICROBATCHES = 2, 4
BATCH = ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2",
         "--eval-interval", "1000", "--eval-iters", "1", "--split", "969,31,0"]
PP2 = ["--pipeline-model-parallel-size", "2"]
# name -> (model, split count, extra flags of the split run, world size)
CASES = {
    "T_pp2_tp2_sp_s2": ("T", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                        4),
    "U_pp2_s4_chunked": ("U", 4, ["--seq1f1b-kv-cache", "chunked"], 2),
    # the last stage holds decoder layers 2-4: megatron-core >= 0.17 numbers the MTP
    # layers 1, 2 (their own count), so their K/V caches must not be the decoder's 2's
    "T_pp2_last3_s4": ("T", 4, ["--decoder-last-pipeline-num-layers", "3"], 2),
    # decoder MoE layers 2-4 on the last stage: the MTP routers (numbered 1, 2 by
    # megatron-core >= 0.17) keep their own statistics
    "V_pp2_last3_s3": ("V", 3, ["--decoder-last-pipeline-num-layers", "3",
                                "--use-distributed-optimizer"], 2),
    "Td_pp2_s3": ("Td", 3, [], 2),
    "Vp_pp2_s4": ("Vp", 4, [], 2),
    # megatron-core checkpoints each MTP layer under full recomputation: its attention
    # recomputed in backward over the split's cached prefix
    "T_pp2_s3_recompute": ("T", 3, ["--recompute-granularity", "full", "--recompute-method",
                                    "uniform", "--recompute-num-layers", "1"], 2),
    # SlimPipe's slices read past their ends the same way
    "U_pp2_slimpipe_n4": ("U", 4, ["--pipeline-schedule", "slimpipe", "--slimpipe-slices",
                                   "4"], 2),
}


# a checkpoint of the MTP stage saved and resumed: this case saves every iteration
# (distributed optimizer), and its iteration-1 checkpoint is resumed with decoder layers 2-4
# on the last stage (the MTP layers' and the embedding copy's tensors resharded); the
# resumed iteration 2 must equal the uninterrupted one
SAVING_CASE, RESUMED_CASE = "V_pp2_last3_s3", "V_resumed_pp2_s2"
# cases that need megatron-core >= 0.19 (refused before work on 0.16 to 0.18)
NEEDS_MCORE_17 = {"T_pp2_s3_recompute"}


def _runs_here(name):
    """(0.18's MTP recomputation fails inside megatron-core: refused there too)"""
    from megatron.trainer.mtp_arguments import (
        recompute_runs_under_splits,
        recompute_takes_its_arguments,
    )

    return name not in NEEDS_MCORE_17 or (recompute_runs_under_splits()
                                          and recompute_takes_its_arguments())


def _splits(n):
    return ["--seq1f1b-splits", str(n), "--seq1f1b-balance-method", "average"]


def plan(tmp, corpus):
    """The split runs, their s = 1 runs on the same layout and the single-process
    references, from one iteration-0 checkpoint per model."""
    inits, starts = [], {}
    for model, flags in MODELS.items():
        run, starts[model] = init_run(f"init_{model}", tmp / f"init_{model}", flags + BATCH)
        inits.append(run)
    runs = {1: [], 2: [], 4: []}
    bases = {model: MODELS[model] + BATCH + starts[model] for model in MODELS}
    for model, same in DOCUMENT_MODELS.items():  # DOCS last: its --split wins over BATCH's
        bases[model] = with_corpus(bases[same] + DOCS, corpus)
    for model, base in bases.items():
        runs[2].append({"name": f"mtp_{model}_pp2_s1", "argv": base + PP2 + _splits(1),
                        "params": True})
        runs[1].append({"name": f"mtp_ref_{model}", "argv": base, "params": True})
    for name, (model, n, extra, world) in CASES.items():
        if not _runs_here(name):
            continue
        base = bases[model]
        splits = [] if "slimpipe" in name else _splits(n)  # SlimPipe: its slices
        save = (["--save", str(tmp / name), "--save-interval", "1"]
                if name == SAVING_CASE else [])
        runs[world].append({"name": name, "argv": base + PP2 + splits + extra + save,
                            "params": True})
    runs[2].append({"name": RESUMED_CASE, "params": True,
                    "after": [str(tmp / SAVING_CASE / TRACKER)],
                    "argv": MODELS["V"] + BATCH + PP2 + _splits(2) + [
                        "--use-distributed-optimizer", "--load", str(tmp / SAVING_CASE),
                        "--ckpt-step", "1"]})
    return Plan(inits, runs)


@pytest.fixture(scope="module")
def results(exactness_runs):
    return exactness_runs[__name__]


@pytest.mark.parametrize("name", CASES)
def test_split_run_equals_unsplit_runs(results, name):
    if not _runs_here(name):
        pytest.skip("MTP with full recomputation under splits needs megatron-core >= 0.19")
    model, n, _, world = CASES[name]
    run = results[name]
    assert len(run["losses"]) == ITERATIONS
    check_split_units(name, run["forward_units"], splits=n, method="average", seq_length=48,
                      calls=ITERATIONS + 1,
                      microbatches=MICROBATCHES if world == 4 else MICROBATCHES * 2 // world)
    depths = [f"mtp_{k + 1} loss" for k in range(DEPTHS[model])]
    for other, what in ((f"mtp_ref_{model}", "pp=1 single process"),
                        (f"mtp_{model}_pp2_s1", "same layout, s=1")):
        expected = results[other]
        assert not expected["forward_units"], f"{other} ran splits"
        assert_close_series(run["losses"], expected["losses"], 1e-5, f"{name} loss vs {what}")
        assert_close_series(run["grad_norms"], expected["grad_norms"], 1e-5,
                            f"{name} grad norm vs {what}")
        for losses in (run["mtp_losses"], expected["mtp_losses"]):
            assert [sorted(step) for step in losses] == [depths] * ITERATIONS, (name, other)
        for depth in depths:
            assert_close_series([step[depth] for step in run["mtp_losses"]],
                                [step[depth] for step in expected["mtp_losses"]], 1e-5,
                                f"{name} {depth} vs {what}")
        if model == "V":  # the MoE loss over the decoder's and the MTP layers' routers
            assert_close_series([step["seq_load_balancing_loss"] for step in run["moe_losses"]],
                                [step["seq_load_balancing_loss"]
                                 for step in expected["moe_losses"]], 1e-5,
                                f"{name} seq_load_balancing_loss vs {what}")
        assert_close_series([run["final_validation_loss"]], [expected["final_validation_loss"]],
                            1e-5, f"{name} validation loss vs {what}")
        assert_params_close(run["params"], expected["params"])
    if model in DOCUMENT_MODELS:
        assert document_cases(run["forward_units"]) == set(DOCUMENT_CASES), name


def test_the_mtp_layers_were_built_and_trained(results):
    """T holds 2 MTP layers, U one of MLA; each has its projection of [token embedding,
    hidden state] and its own transformer layer, and their MTP losses are real
    cross-entropies (near ln 200 at the start)."""
    import torch

    for model, depth in DEPTHS.items():
        names = torch.load(results[f"mtp_ref_{model}"]["params"])
        projections = sorted(n for n in names if n.endswith("eh_proj.weight"))
        assert [n.split("mtp.layers.")[1].split(".")[0] for n in projections] == [
            str(k) for k in range(depth)], (model, projections)
        assert names[projections[0]].shape == (32, 64), model
        if model == "U":
            assert any("mtp.layers.0." in n and "linear_kv_down_proj" in n for n in names)
        for step in results[f"mtp_ref_{model}"]["mtp_losses"]:
            assert all(4.5 < value < 8 for value in step.values()), step


def test_the_mtp_stage_resumes_from_its_checkpoint(results):
    """Iteration 1's checkpoint (distributed optimizer, MoE + MLA MTP depths, decoder
    layers 2-4 and the MTP layers on the last stage) resumed at pp=2 with even stages and
    s = 2: iteration 2's loss, grad norm, MTP and aux losses, the validation loss and every
    parameter equal the uninterrupted runs'."""
    run = results[RESUMED_CASE]
    for other in (SAVING_CASE, "mtp_ref_V"):
        expected = results[other]
        assert_close_series(run["losses"], expected["losses"][1:], 1e-5, f"loss vs {other}")
        assert_close_series(run["grad_norms"], expected["grad_norms"][1:], 1e-5,
                            f"grad norm vs {other}")
        for depth in ("mtp_1 loss", "mtp_2 loss"):
            assert_close_series([step[depth] for step in run["mtp_losses"]],
                                [step[depth] for step in expected["mtp_losses"][1:]], 1e-5,
                                f"{depth} vs {other}")
        assert_close_series([step["seq_load_balancing_loss"] for step in run["moe_losses"]],
                            [step["seq_load_balancing_loss"]
                             for step in expected["moe_losses"][1:]], 1e-5, other)
        assert_close_series([run["final_validation_loss"]],
                            [expected["final_validation_loss"]], 1e-5, other)
        assert_params_close(run["params"], expected["params"])
