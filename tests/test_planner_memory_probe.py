"""The planner predicts what the activation-memory probe measures, stage by stage.

Every configuration below trains one iteration with ``--activation-memory-file`` (the
probe of megatron/schedules/memory_probe.py: tensors autograd saved, plus the K/V
cache, sampled at unit boundaries); ``tools/plan.py`` then reads the *same* command
line (with ``--gpu cpu``: the CPU kernels' saved tensors) and must predict each stage's
activation + K/V peak within 3%. Configurations share two launches (2 and 4
processes). Together they cover TP 1/2, SP on/off, GQA + SwiGLU + RMSNorm, RoPE and
learned positions, hidden and attention dropout on/off, Seq1F1B s = 2, 3, 4, 8 with
both balance methods, both K/V cache layouts, interleaved stages, SlimPipe v = 1, 2,
selective / full (uniform) / full (block) recomputation, micro-batch size 2, uneven
stages (--decoder-first/last-pipeline-num-layers), virtual stages with the embedding and
loss counted as layers (unequal chunks of a rank), --pipeline-model-parallel-layout (an
embedding-only and a loss-only chunk), and first, middle and last stages
with a vocabulary whose logits dominate the last stage.

Mixture of experts (in the 4-process launch): EP = 2 with the alltoall dispatcher, a
shared expert, a first dense layer (--moe-layer-freq), the sigmoid router with expert
bias and seq_aux_loss, top-1 with the probability on the experts' input
(--moe-apply-probs-on-input: planned 1.013x / 1.038x of the probe before its terms were
counted); whole experts under TP = 2 with SP (--expert-tensor-parallel-size 1, EP = 2 over
the TP ranks: 1.002x / 1.016x; 1.062x / 1.054x while the planner split them over TP and
gathered the shards); and the allgather dispatcher with aux_loss, z-loss and a gated shared expert,
whose final parameters also check the planner's total parameter count. Treating the MoE
layer as a dense MLP would miss by 7-25% on these, so 3% tells them apart.

Context parallelism (in the 4-process launch): CP = 2 at PP = 2 with s = 3 (GQA, RoPE) and
unsplit with selective recomputation and hidden dropout: each rank's part of the tokens,
the whole split's K/V in every rank's cache; planned within 0.2% of context-parallel rank
0's stages when measured.

Attention variants (in the 2-process launch): query/key LayerNorms and L2 norms, the
output gate, and sliding windows with attention sinks, each planned within 2%.

Multi-token prediction (in the 2-process launch): 2 dense MTP depths, and one MoE + MLA
depth after an MoE + MLA model, on the last stage (within 0.1% when measured; not
counting them, the last stage was planned at 0.39x / 0.59x of the probe).

Recomputed modules (--recompute-modules layernorm, mlp, shared_experts, mla_up_proj:
megatron-core's checkpoints, which free their outputs in place; the probe counts a
storage at its size when sampled): on the MoE + MLA model, with the chunked cache, and
under TP = 2 with SP; within 0.4% when measured (the MoE + MLA model was planned 1.14x,
1.30x and 1.06x of the probe with `layernorm`, `mlp shared_experts`, `mla_up_proj` when
they were not counted).

Multi-latent attention (in the 2-process launch): an MoE + MLA model (query and kv
latents, query-key head 16 + 8 rotary, value head 12, shared expert, first layer dense,
s = 2, selective recomputation) and a dense one (LayerNorm latent norms of
--qk-layernorm, s = 3, no recomputation); both also check the parameter count. With
standard attention's terms at head size dqk + dpe the MoE + MLA model was planned
+12.4% / +6.5% above the probe. MLA under TP = 2 with sequence parallelism (in the
4-process launch): the MoE + MLA model with RMSNorm latent norms (--qk-layernorm), s = 2,
selective recomputation; with the norms' terms counted whole instead of per sequence
shard it was planned +3.9% / +2.3% above the probe.
"""

import json

import pytest

from distributed import run_configs

from megatron.planner.cli import config_from_args, parse
from megatron.planner.predict import boundary_activation_peaks, predict

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "256", "--max-position-embeddings", "256", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "2048", "--train-iters", "1",
        "--lr", "1e-4", "--eval-iters", "0", "--log-interval", "1", "--seed", "1"]
ROPE = ["--position-embedding-type", "rope"]
LLAMA = ["--group-query-attention", "--num-query-groups", "2", "--swiglu",
         "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear"]
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]
PP2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96",
       "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm",
       "--global-batch-size", "4", "--moe-aux-loss-coeff", "1e-2"]
MLA = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "24",
       "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12"] + ROPE

CONFIGS = {  # name -> (processes, flags after BASE)
    "1f1b_dropout_mbs2": (2, ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
                              "--global-batch-size", "8"]),
    "s4_uniform_comp_rope_gqa": (2, PP2 + ["--seq1f1b-splits", "4", "--seq1f1b-balance-method",
                                           "uniform_comp"] + ROPE + LLAMA + NO_DROPOUT),
    "s2_chunked_selective": (2, PP2 + ["--seq1f1b-splits", "2", "--seq1f1b-kv-cache", "chunked",
                                       "--attention-dropout", "0",
                                       "--recompute-granularity", "selective"] + ROPE),
    "interleaved_full_uniform": (2, PP2 + ["--num-layers-per-virtual-pipeline-stage", "1",
                                           "--recompute-granularity", "full",
                                           "--recompute-method", "uniform"] + NO_DROPOUT),
    "slimpipe_v1_chunked": (2, PP2 + ["--slimpipe-slices", "4", "--seq1f1b-kv-cache", "chunked"]
                            + ROPE + NO_DROPOUT),
    "slimpipe_v2_block": (2, PP2 + ["--slimpipe-slices", "4",
                                    "--virtual-pipeline-model-parallel-size", "2",
                                    "--recompute-granularity", "full", "--recompute-method",
                                    "block", "--recompute-num-layers", "1"] + NO_DROPOUT),
    "tp2_sp_s8_dropout_mbs2": (4, TP2PP2 + ["--sequence-parallel", "--micro-batch-size", "2",
                                            "--global-batch-size", "4", "--seq1f1b-splits", "8"]
                               + ROPE + LLAMA),
    "tp2_selective_dropout": (4, TP2PP2 + ["--global-batch-size", "4",
                                           "--recompute-granularity", "selective"]),
    "pp4_s3_uniform_comp_block": (4, ["--pipeline-model-parallel-size", "4",
                                      "--global-batch-size", "4", "--seq1f1b-splits", "3",
                                      "--seq1f1b-balance-method", "uniform_comp",
                                      "--recompute-granularity", "full", "--recompute-method",
                                      "block", "--recompute-num-layers", "1"]
                                  + ROPE + NO_DROPOUT),
    # uneven stages, 1 + 2 + 2 + 1 layers: each stage planned with its own layer count
    "pp4_uneven_s2": (4, ["--num-layers", "6", "--pipeline-model-parallel-size", "4",
                          "--decoder-first-pipeline-num-layers", "1",
                          "--decoder-last-pipeline-num-layers", "1", "--global-batch-size", "4",
                          "--seq1f1b-splits", "2"] + ROPE + NO_DROPOUT),
    # virtual stages with the embedding and the loss counted as layers: chunks of
    # 1 + 2 + 2 + 1 layers, each planned with its own count
    "pp2_vp2_accounted_s2": (2, PP2 + ["--num-layers", "6",
                                       "--virtual-pipeline-model-parallel-size", "2",
                                       "--account-for-embedding-in-pipeline-split",
                                       "--account-for-loss-in-pipeline-split",
                                       "--seq1f1b-splits", "2"] + ROPE + NO_DROPOUT),
    # --pipeline-model-parallel-layout: 2 virtual stages per rank, the first chunk holding
    # the embedding alone and the last the loss alone (chunks of 0, 2, 2, 0 layers)
    "pp2_layout_vp2_s2": (2, PP2 + ["--pipeline-model-parallel-layout", "E|tt|tt|L",
                                    "--seq1f1b-splits", "2"] + ROPE + NO_DROPOUT),
    "moe_ep2_alltoall_s4": (4, PP2 + MOE + [
        "--seq1f1b-splits", "4", "--expert-model-parallel-size", "2",
        "--moe-token-dispatcher-type", "alltoall", "--moe-shared-expert-intermediate-size",
        "64", "--moe-layer-freq", "[0]*1+[1]*3", "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias", "--moe-router-load-balancing-type",
        "seq_aux_loss", "--moe-router-topk", "1", "--moe-apply-probs-on-input"]
        + ROPE + NO_DROPOUT),
    # whole experts under TP (--expert-tensor-parallel-size 1) over 2 expert-parallel ranks
    # that are the TP ranks: each rank's experts see its sequence-parallel shard
    "moe_tp2_sp_etp1_ep2_s2": (4, TP2PP2 + MOE + [
        "--sequence-parallel", "--expert-tensor-parallel-size", "1",
        "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
        "--seq1f1b-splits", "2"] + ROPE + NO_DROPOUT),
    "moe_allgather_s2_zloss": (4, PP2 + MOE + [
        "--seq1f1b-splits", "2", "--moe-z-loss-coeff", "1e-3",
        "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate",
        "--moe-layer-freq", "2"]),
    "moe_mla_s2_selective": (2, PP2 + MOE + MLA + [
        "--seq1f1b-splits", "2", "--recompute-granularity", "selective",
        "--moe-layer-freq", "[0]*1+[1]*3", "--moe-shared-expert-intermediate-size", "64"]
                             + NO_DROPOUT),
    # gpt-oss's MLP: quick GeGLU with the linear offset and the clamp
    "quick_geglu_clamp_s2": (2, PP2 + [
        "--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value",
        "7.0", "--disable-bias-linear", "--seq1f1b-splits", "2"] + ROPE + NO_DROPOUT),
    "quick_geglu_s2": (2, PP2 + ["--quick-geglu", "--disable-bias-linear",
                                 "--seq1f1b-splits", "2"] + ROPE + NO_DROPOUT),
    # Llama-4's layers without RoPE (every second one): q, k stay views of the fused QKV
    # output and keep no cos/sin there, unsplit and split
    "no_rope_freq_s1": (2, PP2 + ["--no-rope-freq", "2"] + ROPE + NO_DROPOUT),
    "no_rope_freq_s2": (2, PP2 + ["--no-rope-freq", "2", "--seq1f1b-splits", "2"]
                        + ROPE + NO_DROPOUT),
    # DeepSeek's Megatron-LM recomputation: core attention and every MoE layer
    "moe_s3_moe_layer_recompute": (2, PP2 + MOE + [
        "--seq1f1b-splits", "3", "--recompute-activations", "--moe-layer-recompute",
        "--moe-layer-freq", "[0]*1+[1]*3", "--moe-shared-expert-intermediate-size", "64"]
                                   + ROPE + NO_DROPOUT),
    # gpt-oss's attention: windows in every other layer and learnable sinks (the windowed
    # layers' SDPA with its band mask, the sinks' fused kernels with their LSE)
    "window_sinks_s2": (2, PP2 + ["--window-size", "64,0", "--window-attn-skip-freq", "2",
                                  "--softmax-type", "learnable", "--seq1f1b-splits", "2"]
                        + ROPE + NO_DROPOUT),
    # Qwen3-Next's gated attention and Llama-4's query/key L2 norms
    "output_gate_s2": (2, PP2 + ["--attention-output-gate", "--seq1f1b-splits", "2"]
                       + ROPE + NO_DROPOUT),
    "qk_l2_norm_s2": (2, PP2 + ["--qk-l2-norm", "--seq1f1b-splits", "2"] + ROPE + NO_DROPOUT),
    # Qwen3's per-head query/key norms (LayerNorm here): their input, a view of QKV's
    # output, keeps all of it (planned 15% under the probe when not counted)
    "qk_layernorm_s2": (2, PP2 + ["--qk-layernorm", "--seq1f1b-splits", "2"] + ROPE
                        + NO_DROPOUT),
    "mla_qk_layernorm_s3": (2, PP2 + MLA + ["--qk-layernorm", "--disable-bias-linear",
                                            "--seq1f1b-splits", "3"] + NO_DROPOUT),
    # MLA under TP with SP: per-head terms divided by TP, the latents not, their norms'
    # own terms (RMSNorm here) by TP (the latent is scattered back to the sequence shard)
    "moe_mla_tp2_sp_qk_layernorm_s2_selective": (4, TP2PP2 + MOE + MLA + [
        "--sequence-parallel", "--seq1f1b-splits", "2", "--moe-layer-freq", "[0]*1+[1]*3",
        "--moe-shared-expert-intermediate-size", "64", "--qk-layernorm",
        "--recompute-granularity", "selective"] + NO_DROPOUT),
    # DeepSeek-V3's multi-token prediction on the last stage: 2 dense depths, and one
    # MoE + MLA depth (each a copy of the last layer, with its norms, projection, output
    # head and loss, and its K/V cache)
    "mtp_s2": (2, PP2 + ROPE + ["--untie-embeddings-and-output-weights", "--mtp-num-layers",
                                "2", "--seq1f1b-splits", "2"] + NO_DROPOUT),
    "mtp_moe_mla_s2_selective": (2, PP2 + MOE + MLA + [
        "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
        "--mtp-num-layers", "1", "--seq1f1b-splits", "2", "--moe-layer-freq", "[0]*1+[1]*3",
        "--moe-shared-expert-intermediate-size", "64", "--recompute-granularity",
        "selective"] + NO_DROPOUT),
    # megatron-core's module checkpoints (--recompute-modules): the norms, the dense
    # first layer's MLP, the shared expert and MLA's up-projections without core
    # attention's; the up-projections with the chunked cache; the norms and the MLP
    # under TP with SP, with dropout (CPU: SDPA's math kernel)
    "moe_mla_s2_modules": (2, PP2 + MOE + MLA + [
        "--seq1f1b-splits", "2", "--moe-layer-freq", "[0]*1+[1]*3",
        "--moe-shared-expert-intermediate-size", "64", "--recompute-granularity", "selective",
        "--recompute-modules", "layernorm", "mlp", "shared_experts", "mla_up_proj"]
                           + NO_DROPOUT),
    "mla_s3_chunked_up_proj": (2, PP2 + MLA + [
        "--disable-bias-linear", "--seq1f1b-splits", "3", "--seq1f1b-kv-cache", "chunked",
        "--recompute-granularity", "selective", "--recompute-modules", "core_attn",
        "mla_up_proj"] + NO_DROPOUT),
    # context parallelism: each rank's part of every split, the split's gathered K/V in
    # every rank's cache (the probe's file is the last context-parallel rank's, whose
    # queries see the most keys: the stage's peak, which the planner plans)
    "cp2_s3_rope_gqa": (4, PP2 + ["--context-parallel-size", "2", "--seq1f1b-splits", "3",
                                  "--seq1f1b-split-alignment", "2"] + ROPE + LLAMA
                        + NO_DROPOUT),
    "cp2_s1_selective_hidden_dropout": (4, PP2 + [
        "--context-parallel-size", "2", "--attention-dropout", "0",
        "--recompute-granularity", "selective"]),
    # the chunked cache under CP: each chunk the whole split, on every rank
    "cp2_s3_chunked_rope_gqa": (4, PP2 + ["--context-parallel-size", "2", "--seq1f1b-splits",
                                          "3", "--seq1f1b-split-alignment", "2",
                                          "--seq1f1b-kv-cache", "chunked"] + ROPE + LLAMA
                                + NO_DROPOUT),
    # MoE with MLA (YaRN) and an MTP depth under CP: each rank routes its part's tokens,
    # the experts over 2 expert-parallel ranks that are the CP ranks
    "cp2_mtp_moe_mla_ep2_s2_selective": (4, PP2 + MOE + MLA + [
        "--untie-embeddings-and-output-weights", "--mtp-num-layers", "1",
        "--context-parallel-size", "2", "--expert-model-parallel-size", "2",
        "--moe-token-dispatcher-type", "alltoall", "--seq1f1b-splits", "2",
        "--recompute-granularity", "selective", "--moe-layer-freq", "[0]*1+[1]*3",
        "--moe-shared-expert-intermediate-size", "64"] + NO_DROPOUT),
    "tp2_sp_layernorm_mlp_dropout_s2": (4, TP2PP2 + [
        "--sequence-parallel", "--global-batch-size", "4", "--seq1f1b-splits", "2",
        "--recompute-granularity", "selective", "--recompute-modules", "layernorm", "mlp"]
                                        + ROPE + LLAMA),
}
# runs whose final parameters come back
PARAMS = {"moe_allgather_s2_zloss", "moe_mla_s2_selective", "mla_qk_layernorm_s3",
          "mtp_moe_mla_s2_selective"}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe")
    out = {}
    for world in (2, 4):
        runs = [{"name": name, "argv": BASE + flags + ["--activation-memory-file",
                                                       str(tmp / f"{name}.json")],
                 "params": name in PARAMS}
                for name, (procs, flags) in CONFIGS.items() if procs == world]
        results = run_configs(tmp, world, runs)
        for name in PARAMS & results.keys():
            out[f"{name}.params"] = results[name]["params"]
        for run in runs:
            stages = json.loads((tmp / f"{run['name']}.json").read_text())["stages"]
            out[run["name"]] = [s["activation_peak_bytes"] for s in stages]
    return out


def planned(name):
    procs, flags = CONFIGS[name]
    args = parse(BASE + flags + ["--gpu", "cpu", "--world-size", str(procs)])
    return boundary_activation_peaks(predict(config_from_args(args)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_planner_matches_probe_per_stage(measured, name):
    actual, predicted = measured[name], planned(name)
    assert len(actual) == len(predicted)
    for stage, (a, p) in enumerate(zip(actual, predicted)):
        assert abs(p - a) <= 0.03 * a, f"{name} stage {stage}: planned {p}, measured {a}"


def test_planner_counts_the_moe_models_parameters(measured):
    """ModelShape's total parameter count (router, experts, shared expert, dense layers
    of --moe-layer-freq, tied embedding over the padded vocabulary) equals the trained
    model's; active parameters are fewer by the experts a token does not use."""
    import torch

    name = "moe_allgather_s2_zloss"
    params = torch.load(measured[f"{name}.params"])
    trained = sum(t.numel() for n, t in params.items() if not n.endswith("expert_bias"))
    procs, flags = CONFIGS[name]
    cost = predict(config_from_args(parse(BASE + flags + ["--gpu", "cpu", "--world-size",
                                                          str(procs)]))).cost
    shape = cost.shape  # the padded vocabulary, as built
    assert shape.parameter_count() == trained
    experts = sum(t.numel() for n, t in params.items() if ".local_experts." in n)
    moe_layers = 2  # --moe-layer-freq 2 of 4 layers
    unused = experts * (4 - 2) // 4  # 2 of 4 experts per token
    assert shape.parameter_count(active=True) == trained - unused
    assert moe_layers * 4 * shape.expert_params() == experts


@pytest.mark.parametrize("name", ["moe_mla_s2_selective", "mla_qk_layernorm_s3",
                                  "mtp_moe_mla_s2_selective"])
def test_planner_counts_the_mla_models_parameters(measured, name):
    """MLA's projections, and its latent norms only with --qk-layernorm (megatron-core's
    local spec builds IdentityOp without it), as trained; with an MTP depth, its copy of
    the last layer, norms and projection too."""
    import torch

    params = torch.load(measured[f"{name}.params"])
    trained = sum(t.numel() for n, t in params.items() if not n.endswith("expert_bias"))
    procs, flags = CONFIGS[name]
    cost = predict(config_from_args(parse(BASE + flags + ["--gpu", "cpu", "--world-size",
                                                          str(procs)]))).cost
    assert cost.shape.parameter_count() == trained
