"""tools/plan.py reads a pretrain_gpt.py command line as it is (training's own parser
and checks), takes the dtype from --bf16/--fp16 and models the CPU kernels with --gpu cpu."""

import dataclasses
import json

import pytest

from megatron.planner.cli import config_from_args, main, parse, report
from megatron.planner.predict import PlanError, predict

TRAINING = [
    "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
    "--seq-length", "8192", "--max-position-embeddings", "8192",
    "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", "1000",
    "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "10",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "42",
    "--pipeline-model-parallel-size", "4", "--tensor-model-parallel-size", "2",
    "--sequence-parallel", "--seq1f1b-splits", "4", "--position-embedding-type", "rope",
    # data, logging and checkpoint flags: accepted, never read
    "--data-path", "/nonexistent/corpus_text_document", "--split", "949,50,1",
    "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/nonexistent/vocab.json",
    "--merge-file", "/nonexistent/merges.txt", "--save", "/nonexistent/ckpt",
    "--load", "/nonexistent/ckpt", "--save-interval", "500", "--log-interval", "10",
    "--eval-interval", "100", "--eval-iters", "10", "--tensorboard-dir", "/nonexistent/tb",
    "--exit-signal-handler",
]


def plan(argv):
    return predict(config_from_args(parse(argv)))


def test_a_training_command_line_is_planned_unchanged(capsys):
    assert main(TRAINING + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parallel"]["world_size"] == 8 and out["splits"] == 4
    assert out["model"]["vocab_size"] == 50257  # the GPT-2 BPE vocabulary, file not read
    assert out["model"]["position_embedding_type"] == "rope"
    assert out["activation_dtype_bytes"] == 4  # no --bf16: fp32, as the run would train


def test_dtype_follows_the_precision_flags():
    fp32, bf16 = plan(TRAINING), plan(TRAINING + ["--bf16"])
    assert fp32.config.act_bytes == 4 and bf16.config.act_bytes == 2
    for a, b in zip(fp32.stages[:-1], bf16.stages[:-1]):
        # activations about double (fp32 statistics and 1-byte masks stay), weights too
        assert 1.8 < a["activations"] / b["activations"] <= 2.0
        assert a["weights"] == pytest.approx(2 * b["weights"], rel=1e-2)
        assert a["reserved"] >= a["total"]
    # the last stage's fp32 logits softmax is fp32 in both
    assert fp32.stages[-1]["activations"] / bf16.stages[-1]["activations"] < 1.8


def test_optimizer_states_follow_the_optimizer():
    """Adam keeps m and v per parameter, SGD its momentum buffer (none at momentum 0),
    beside the fp32 master weights of a --bf16 run."""
    params = plan(TRAINING).cost.rank_params(1)
    for flags, states in (([], 2), (["--optimizer", "sgd"], 1),
                          (["--optimizer", "sgd", "--sgd-momentum", "0"], 0)):
        static = plan(TRAINING + ["--bf16"] + flags).cost.static_memory(1)
        assert static["optimizer"] == pytest.approx((4 + 4 * states) * params)
        assert plan(TRAINING + flags).cost.static_memory(1)["optimizer"] == \
            pytest.approx(4 * states * params)  # fp32: no master copy


def test_a_decreased_batch_is_planned_as_it_trains():
    """--decrease-batch-size-if-needed on 24 ranks (DP 3 at TP 2 x PP 4): the global batch
    of 16 trains as 15, 5 microbatches, and is planned so."""
    decreased = plan(TRAINING + ["--world-size", "24", "--decrease-batch-size-if-needed"])
    assert decreased.config.parallel.dp == 3
    assert decreased.config.parallel.global_batch_size == 15
    assert decreased.config.parallel.num_microbatches == 5


def test_gpu_cpu_models_the_cpu_kernels():
    """Dropout masks in the activation dtype, and attention dropout on SDPA's math
    kernel (scores stored) on CPU; neither on a GPU."""
    gpu = plan(TRAINING + ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"])
    cpu = plan(TRAINING + ["--hidden-dropout", "0.1", "--attention-dropout", "0.1",
                           "--gpu", "cpu"])
    no_attention_dropout = plan(TRAINING + ["--hidden-dropout", "0.1",
                                            "--attention-dropout", "0", "--gpu", "cpu"])
    assert gpu.stages[0]["activations"] < no_attention_dropout.stages[0]["activations"]
    assert no_attention_dropout.stages[0]["activations"] < cpu.stages[0]["activations"]


def test_training_checks_apply(capsys):
    """The trainer's validation runs (here: heads not divisible by TP), and an unknown
    flag is refused by name."""
    with pytest.raises(PlanError, match="--tensor-model-parallel-size"):
        plan(TRAINING + ["--tensor-model-parallel-size", "3"])
    with pytest.raises(SystemExit) as exc:
        main(TRAINING + ["--no-such-flag"])
    assert exc.value.code == 2 and "--no-such-flag" in capsys.readouterr().err


def test_context_parallelism_divides_the_tokens_not_the_kv_cache():
    """Each CP rank holds its part of every split (activations, messages, GEMMs divided
    by C) and the whole split's K/V in its cache; gradients are averaged over DP x CP."""
    one = plan(TRAINING + ["--world-size", "8"])
    two = plan(TRAINING + ["--context-parallel-size", "2", "--world-size", "16"])
    assert two.config.parallel.cp == 2 and two.config.parallel.world_size == 16
    for a, b in zip(one.stages, two.stages):
        assert 0.45 < b["activations"] / a["activations"] < 0.55, (a, b)
        # the same cache, plus one layer's gathered split K/V at the peak (a transient)
        assert 1.0 <= b["kv_cache"] / a["kv_cache"] < 1.05, (a, b)
    assert two.iteration_time_s < one.iteration_time_s
    with pytest.raises(PlanError, match="CP 2"):
        plan(TRAINING + ["--context-parallel-size", "2", "--world-size", "12"])


@pytest.mark.parametrize("flags,chunks", [
    # 15 layers + the loss = 16 slots over 4 ranks x 2 chunks: the last chunk one short
    (["--account-for-loss-in-pipeline-split", "--num-layers", "15",
      "--virtual-pipeline-model-parallel-size", "2"], [2, 2, 2, 2, 2, 2, 2, 1]),
    # the embedding as well, given as layers per virtual stage (slots, as Megatron-LM)
    (["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
      "--num-layers", "14", "--num-layers-per-virtual-pipeline-stage", "2"],
     [1, 2, 2, 2, 2, 2, 2, 1]),
])
def test_virtual_stages_with_counted_embedding_or_loss(flags, chunks):
    """The planner prices each model chunk by its own layers where the trainer's first /
    last chunk holds one fewer (megatron-core's layout, `pipeline_layers`): the layers are
    laid out in pipeline order once each, and a rank's weights are its layers'."""
    pred = plan(TRAINING + flags)
    cost, par = pred.cost, pred.config.parallel
    assert par.num_chunks == 2 and list(par.chunk_layers) == chunks
    assert pred.to_json()["parallel"]["chunk_layers"] == chunks
    order = [cost.layer_indices(r, c) for c in range(2) for r in range(4)]
    assert [len(layers) for layers in order] == chunks
    assert [i for layers in order for i in layers] == list(range(sum(chunks)))
    layer = cost.layer_params(0)["linear"] + cost.layer_params(0)["other"]
    held = [chunks[r] + chunks[4 + r] for r in range(4)]  # rank 1 holds 4 layers
    assert cost.rank_param_parts(1)["dense"] == pytest.approx(held[1] * layer)
    # the last rank: its layers (3) and the output layer and final norm
    edge = cost.rank_param_parts(3)["dense"] - held[3] * layer
    assert edge == pytest.approx(cost.vocab * 1024 / 2 + 2 * 1024)
    # a short chunk's units also run a layer fewer: attention time per layer is alike
    from megatron.schedules.actions import FORWARD, Unit
    per_layer = [cost.forward_time_parts(r, Unit(FORWARD, 0, 0, c))["attention"]
                 / chunks[c * 4 + r] for c in range(2) for r in range(4)]
    assert per_layer == pytest.approx([per_layer[0]] * 8)


MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512",
       "--disable-bias-linear", "--swiglu", "--use-distributed-optimizer",
       "--world-size", "32"]  # TP 2 x PP 4 x DP 4


def test_moe_expert_memory_follows_expert_parallelism():
    """Each GPU holds E / EP experts (weights, fp32 gradients); the distributed optimizer
    shards dense states over DP and expert states over DP x TP / (EP x ETP); dense memory
    is the same at every EP."""
    ep1, ep2, ep4 = (plan(TRAINING + MOE + ["--expert-model-parallel-size", str(ep)]).cost
                     for ep in (1, 2, 4))
    h, f, t = 1024, 512, 2
    expert = 3 * h * f // t  # one expert's weights on one TP rank (SwiGLU)
    layers = 2  # 8 layers over PP 4, all MoE
    for cost, ep in ((ep1, 1), (ep2, 2), (ep4, 4)):
        parts = cost.rank_param_parts(1)
        assert parts["experts"] == layers * 8 // ep * expert
        assert parts["dense"] == ep1.rank_param_parts(1)["dense"]
        static = cost.static_memory(1)
        assert static["weights"] == 4 * (parts["dense"] + parts["experts"])  # fp32 run
        assert static["optimizer"] == pytest.approx(
            8 * (parts["dense"] / 4 + parts["experts"] / (4 // ep)))
    # whole experts (--expert-tensor-parallel-size 1): each GPU holds E / EP unsplit
    # experts, their states sharded over the DP x TP / EP ranks holding the same ones
    whole = plan(TRAINING + MOE + ["--expert-model-parallel-size", "4",
                                   "--expert-tensor-parallel-size", "1"]).cost
    parts = whole.rank_param_parts(1)
    assert parts["experts"] == layers * 8 // 4 * expert * t
    assert whole.static_memory(1)["optimizer"] == pytest.approx(
        8 * (parts["dense"] / 4 + parts["experts"] / (4 * 2 // 4)))
    # ... and see their TP rank's sequence-parallel shard of the tokens, not all of them
    assert whole.par.expert_token_share == 0.5 and ep4.par.expert_token_share == 1


def test_moe_flops_count_active_parameters_and_dispatch_volume():
    """FLOPs grow with top-k, not with the number of experts; the alltoall dispatcher
    moves k copies of (EP - 1) / EP of the tokens each way, allgather the tokens of the
    EP x TP group; active parameters and the experts line are reported."""
    shape = lambda extra: plan(TRAINING + MOE + extra).cost.shape
    few, many = shape([]), shape(["--num-experts", "64"])
    # only the router grows with the experts (2 h E)
    assert many.layer_flops_per_token() - few.layer_flops_per_token() == 2 * 1024 * (64 - 8)
    top4 = shape(["--moe-router-topk", "4"])
    assert top4.layer_flops_per_token() - few.layer_flops_per_token() == 2 * 2 * 3 * 1024 * 512
    assert many.parameter_count() - few.parameter_count() == 8 * 56 * (3 * 1024 * 512 + 1024)
    assert many.parameter_count(active=True) - few.parameter_count(active=True) == 8 * 56 * 1024
    a2a = plan(TRAINING + MOE + ["--expert-model-parallel-size", "4",
                                 "--moe-token-dispatcher-type", "alltoall"])
    tokens = a2a.split_lengths[0]
    assert a2a.cost.moe_comm_bytes(tokens) == 2 * 2 * tokens * 2 * 1024 * 3 / 4
    ag = plan(TRAINING + MOE + ["--expert-model-parallel-size", "4"])  # allgather, SP on
    assert ag.cost.moe_comm_bytes(tokens) == 2 * tokens * 2 * 1024 * 7 / 2
    text = report(a2a)
    assert "active per token" in text and "8 experts of FFN 512, top-2" in text
    assert "EP 4 (2 experts per GPU), ETP 2, alltoall dispatcher" in text


def test_mla_flags_give_its_shape_and_cache():
    """--multi-latent-attention and its sizes (read by the planner): projections' weights,
    attention FLOPs per pair, and a K/V cache of decompressed keys (qk + rope head dims)
    and values per head."""
    mla = ["--multi-latent-attention", "--q-lora-rank", "256", "--kv-lora-rank", "128",
           "--qk-head-dim", "64", "--qk-pos-emb-head-dim", "32", "--v-head-dim", "64"]
    pred = plan(TRAINING + mla + ["--tensor-model-parallel-size", "1"])  # MLA: TP 1 only
    shape = pred.cost.shape
    h, a = 1024, 16
    assert shape.attention_linear_params() == (h * 256 + 256 * a * 96 + h * (128 + 32)
                                               + 128 * a * (64 + 64) + a * 64 * h)
    assert shape.layer_flops_per_pair() == 2 * a * (96 + 64)
    assert shape.kv_values_per_token() == a * (96 + 64)
    assert pred.cost.kv_bytes_per_token() == 4 * a * (96 + 64)  # fp32, TP 1
    with pytest.raises(PlanError, match="--kv-lora-rank"):
        plan(TRAINING + ["--multi-latent-attention", "--kv-lora-rank", "x",
                         "--tensor-model-parallel-size", "1"])


def test_vocabulary_padding_follows_the_flag():
    """--make-vocab-size-divisible-by pads the LM head's logits as training does."""
    padded = plan(TRAINING).cost.vocab
    exact = plan(TRAINING + ["--make-vocab-size-divisible-by", "1"]).cost.vocab
    assert (padded, exact) == (50432, 50258)  # 128 x TP 2 multiple; 1 x TP 2 multiple


@pytest.mark.distributed  # runs the example script (a bash process)
def test_qwen3_4b_example_is_planned_as_it_is(capsys):
    """examples/train_qwen3_4b_seq1f1b.sh with PLAN=1 hands its training flags unchanged
    to tools/plan.py: Megatron-LM's Qwen3-4B shape at 16k tokens with 4 Seq1F1B splits
    (planned in-process: a Python process would cost seconds of start-up)."""
    assert main(_example_argv("train_qwen3_4b_seq1f1b.sh") + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = out["model"]
    assert (model["num_layers"], model["hidden_size"], model["num_attention_heads"]) == \
        (36, 2560, 32)
    assert model["vocab_size"] == 151936 and out["splits"] == 4
    assert out["parallel"]["world_size"] == 8
    # the seed port's PP=8: 36 = 3 + 6 x 5 + 3 (--decoder-first/last-pipeline-num-layers)
    assert out["parallel"]["pipeline_model_parallel_size"] == 8
    assert out["parallel"]["stage_layers"] == [3] + [5] * 6 + [3]
    # the planner prices each stage by its own layers: the embedding stage's 3 layers
    # and the vocabulary weigh less than a middle stage's 5 layers' activations
    stages = out["stages"]
    assert stages[0]["activations"] < stages[1]["activations"]
    assert stages[0]["weights"] > stages[1]["weights"] < stages[-1]["weights"]
    assert abs(out["peak_memory_gb"] - max(s["total"] for s in stages)) < 1e-3


def _example_argv(script, **env):
    """The flags an example hands to tools/plan.py under PLAN=1, printed by bash itself
    (PYTHON=printf: no Python process), to plan here in-process."""
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PLAN="1", PYTHON="printf %s\\n", **env)
    proc = subprocess.run(["bash", os.path.join(root, "examples", script)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = proc.stdout.splitlines()
    assert words[0] == "tools/plan.py"
    return words[1:]


@pytest.mark.distributed  # runs the example scripts (bash processes)
def test_moe_examples_are_planned_as_they_are(capsys):
    """The DeepSeek-V3-style and Mixtral-style scripts' flags are accepted unchanged and
    planned with their experts (and MLA), fitting an 80 GB GPU as their comments say."""

    deepseek = _example_argv("train_deepseek_v3_style_seq1f1b.sh")
    assert main(deepseek + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model, par = out["model"], out["parallel"]
    assert (model["num_experts"], model["moe_topk"], model["moe_layer_freq"][:4]) == \
        (256, 8, [0, 0, 0, 1])
    assert model["multi_latent_attention"] and model["kv_lora_rank"] == 512
    # TP=2 with SP, the port's layout (the default)
    assert (par["tensor_model_parallel_size"], par["pipeline_model_parallel_size"]) == (2, 4)
    assert (par["expert_model_parallel_size"], par["data_parallel_size"]) == (1, 1)
    assert par["sequence_parallel"]
    assert out["parameters"]["active"] < out["parameters"]["total"] / 4
    assert out["splits"] == 4 and not out["oom"]
    # LAYOUT: Megatron-LM's --pipeline-model-parallel-layout, lighter on the last stage
    # (MTP depth and output layer): a lower peak and a shorter iteration, as its comment says
    even = plan(_example_argv("train_deepseek_v3_style_seq1f1b.sh"))
    layout = plan(_example_argv("train_deepseek_v3_style_seq1f1b.sh",
                                LAYOUT="Et*5|t*5|t*4|t*2mL"))
    assert layout.config.parallel.stage_layers == (5, 5, 4, 2)
    assert layout.peak_memory_gb < 0.8 * even.peak_memory_gb
    assert layout.iteration_time_s < 0.8 * even.iteration_time_s
    # TP=1: PP=4 x DP=2 with the experts over EP=2
    tp1 = plan(_example_argv("train_deepseek_v3_style_seq1f1b.sh", TP="1"))
    assert (tp1.config.parallel.tp, tp1.config.parallel.ep) == (1, 2) and not tp1.oom
    assert not tp1.config.parallel.sequence_parallel
    # 64k tokens on 16 GPUs: out of memory with DP=2, fits with CP=2 (its comment's numbers;
    # the experts over the stage's DP x CP x TP / ETP ranks: EP 2 either way)
    long = {cp: plan(_example_argv("train_deepseek_v3_style_seq1f1b.sh", NNODES="2",
                                   SEQ_LENGTH="65536", CP=cp)) for cp in ("1", "2")}
    assert long["1"].oom and not long["2"].oom
    assert [long[cp].config.parallel.ep for cp in ("1", "2")] == [2, 2]
    assert (round(long["1"].peak_memory_gb), round(long["2"].peak_memory_gb)) == (89, 54)

    mixtral = plan(_example_argv("train_mixtral_style_seq1f1b.sh"))
    shape = mixtral.config.model
    assert (shape.num_experts, shape.moe_topk, shape.num_layers) == (8, 2, 32)
    assert mixtral.config.parallel.ep == 4 and mixtral.config.parallel.world_size == 32
    assert not mixtral.oom
    # Mixtral 8x7B: 46.7B parameters, 12.9B active (the published counts)
    assert round(shape.parameter_count() / 1e9, 1) == 46.7
    assert round(shape.parameter_count(active=True) / 1e9, 1) == 12.9
    assert "alltoall dispatcher moves" in report(mixtral)


def test_packed_documents_on_gpu_say_what_the_table_assumes(capsys):
    """With attention dropout and without flash-attn, SDPA keeps a dense document mask per
    split in flight: the planner cannot know what the training machine has, so it says
    what its table assumes and how large that mask gets."""
    flags = TRAINING + ["--bf16", "--reset-attention-mask"]  # dropout 0.1, Megatron-LM's
    assert main(flags) == 0
    out = capsys.readouterr().out
    # the last of 4 splits of 8192 tokens, 2048 queries over 8192 keys in bf16: 32 MiB
    assert "SDPA keeps a dense document mask per split in flight, up to 0.03 GB each" in out
    assert plan(flags).cost.sdpa_document_bias_bytes(3) == 2048 * 8192 * 2
    for other in (flags + ["--attention-dropout", "0"], flags + ["--recompute-activations"],
                  TRAINING + ["--bf16"],
                  TRAINING + ["--reset-attention-mask", "--gpu", "cpu"]):  # CPU: counted
        assert main(other) == 0
        assert "dense document mask" not in capsys.readouterr().out, other


def test_yarn_is_planned_as_rope_and_learned_positions_are_not():
    """YaRN keeps RoPE's tensors (cos and sin, scaled); learned positions keep none."""
    base = TRAINING[:TRAINING.index("--position-embedding-type")]
    rest = TRAINING[TRAINING.index("--position-embedding-type") + 2:]
    rope, yarn, learned = (plan(base + ["--position-embedding-type", kind] + rest).stages
                           for kind in ("rope", "yarn", "learned_absolute"))
    assert [s["activations"] for s in yarn] == [s["activations"] for s in rope]
    assert yarn[0]["activations"] > learned[0]["activations"]


# Public models as their Megatron-LM flags (shapes from each model's published config),
# each with a long-context Seq1F1B layout; (billions total, billions active per token) as
# their publishers round them, embeddings and output layer included. DeepSeek-V3's 685B
# hold its MTP layer with its own copies of the embedding and output layer (1.85B), which
# Megatron-LM's MTP shares with the model: 683B here
COMMON = ["--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-4", "--bf16",
          "--use-distributed-optimizer", "--sequence-parallel",
          "--normalization", "RMSNorm", "--position-embedding-type", "rope",
          "--untie-embeddings-and-output-weights", "--tokenizer-type", "NullTokenizer",
          "--attention-dropout", "0", "--hidden-dropout", "0", "--gpu", "h100-80g"]
PUBLISHED_MODELS = {
    "Qwen3-8B": ((8.2, 8.2), "--disable-bias-linear --swiglu --num-layers 36 --hidden-size 4096 --ffn-hidden-size 12288 "
                 "--num-attention-heads 32 --group-query-attention --num-query-groups 8 "
                 "--kv-channels 128 --qk-layernorm --rotary-base 1000000 "
                 "--vocab-size 151935 --make-vocab-size-divisible-by 128 "
                 "--seq-length 131072 --tensor-model-parallel-size 4 "
                 "--pipeline-model-parallel-size 4 --context-parallel-size 2 "
                 "--global-batch-size 16 --seq1f1b-splits 8 --world-size 32"),
    "Qwen3-30B-A3B": ((30.5, 3.3), "--disable-bias-linear --swiglu --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 "
                      "--num-attention-heads 32 --group-query-attention --num-query-groups 4 "
                      "--kv-channels 128 --qk-layernorm --num-experts 128 "
                      "--moe-ffn-hidden-size 768 --moe-router-topk 8 "
                      "--moe-token-dispatcher-type alltoall --vocab-size 151935 "
                      "--make-vocab-size-divisible-by 128 --seq-length 65536 "
                      "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 "
                      "--expert-model-parallel-size 8 --global-batch-size 32 "
                      "--seq1f1b-splits 4 --world-size 64"),
    "Llama-3.1-70B": ((70.6, 70.6), "--disable-bias-linear --swiglu --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 "
                      "--num-attention-heads 64 --group-query-attention --num-query-groups 8 "
                      "--rotary-base 500000 --use-rope-scaling --rope-scaling-factor 8 "
                      "--vocab-size 128255 --make-vocab-size-divisible-by 128 "
                      "--seq-length 131072 --tensor-model-parallel-size 8 "
                      "--pipeline-model-parallel-size 8 --context-parallel-size 2 "
                      "--global-batch-size 16 --seq1f1b-splits 4 "
                      "--recompute-granularity full --recompute-method uniform "
                      "--recompute-num-layers 1 --world-size 128"),
    "DeepSeek-V3": ((685 - 1.85, 37), "--disable-bias-linear --swiglu --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 "
                    "--num-attention-heads 128 --multi-latent-attention --q-lora-rank 1536 "
                    "--kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 "
                    "--v-head-dim 128 --qk-layernorm --num-experts 256 "
                    "--moe-layer-freq ([0]*3+[1]*58) --moe-ffn-hidden-size 2048 "
                    "--moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 "
                    "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                    "--moe-router-num-groups 8 --moe-router-group-topk 4 "
                    "--moe-router-topk-scaling-factor 2.5 --moe-token-dispatcher-type alltoall "
                    "--mtp-num-layers 1 --vocab-size 129279 --make-vocab-size-divisible-by 128 "
                    "--seq-length 32768 --max-position-embeddings 163840 "
                    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 8 "
                    "--expert-model-parallel-size 32 --decoder-first-pipeline-num-layers 7 "
                    "--decoder-last-pipeline-num-layers 6 --global-batch-size 128 "
                    "--seq1f1b-splits 4 --world-size 512"),
    "Kimi-K2": ((1040, 32.6), "--disable-bias-linear --swiglu --num-layers 61 "
                "--hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 64 "
                "--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 "
                "--qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm "
                "--num-experts 384 --moe-layer-freq ([0]*1+[1]*60) --moe-ffn-hidden-size 2048 "
                "--moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 "
                "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                "--moe-router-topk-scaling-factor 2.827 --moe-token-dispatcher-type alltoall "
                "--vocab-size 163839 --make-vocab-size-divisible-by 128 --seq-length 32768 "
                "--max-position-embeddings 131072 --tensor-model-parallel-size 2 "
                "--pipeline-model-parallel-size 8 --expert-model-parallel-size 32 "
                "--decoder-first-pipeline-num-layers 7 --decoder-last-pipeline-num-layers 6 "
                "--global-batch-size 128 --seq1f1b-splits 4 --world-size 512"),
    # biased linear layers (biases are not counted here: 0.1% of it), attention sinks,
    # a 128-token window on every other layer; OpenAI's 5.13B active leave out the input
    # embedding (201088 x 2880, 0.58B)
    "gpt-oss-120b": ((116.8, 5.13 + 0.58), "--num-layers 36 --hidden-size 2880 "
                     "--ffn-hidden-size 2880 --num-attention-heads 64 --group-query-attention "
                     "--num-query-groups 8 --kv-channels 64 --num-experts 128 "
                     "--moe-ffn-hidden-size 2880 --moe-router-topk 4 --quick-geglu "
                     "--glu-linear-offset 1.0 --activation-func-clamp-value 7.0 "
                     "--softmax-type learnable --window-size 127,0 --window-attn-skip-freq 2 "
                     "--rotary-base 150000 --moe-token-dispatcher-type alltoall "
                     "--padded-vocab-size 201088 --vocab-size 201087 --seq-length 65536 "
                     "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 "
                     "--expert-model-parallel-size 8 --expert-tensor-parallel-size 1 "
                     "--global-batch-size 32 --seq1f1b-splits 4 --seq1f1b-kv-cache chunked "
                     "--world-size 64"),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_MODELS))
def test_public_models_have_their_published_sizes_and_are_planned(name):
    """The flags that define these models here give their published parameter counts,
    pass the trainer's checks at their full shapes and a cluster layout, and are planned."""
    (total, active), flags = PUBLISHED_MODELS[name]
    flags = flags.split()
    prediction = plan(COMMON + flags)
    shape = prediction.config.model
    # the published figures are rounded (Qwen3-30B-A3B's 3.3B active is 3.35B)
    assert shape.parameter_count() / 1e9 == pytest.approx(total, rel=0.02)
    # published active counts leave MTP out
    without_mtp = dataclasses.replace(shape, mtp_num_layers=0)
    assert without_mtp.parameter_count(active=True) / 1e9 == pytest.approx(active, rel=0.02)
    assert prediction.peak_memory_gb > 0 and "tokens/s" in report(prediction)
