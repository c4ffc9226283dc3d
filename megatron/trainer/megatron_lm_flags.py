"""Megatron-LM flags this trainer accepts without effect, and those it refuses.

A Megatron-LM launch script carries flags for fusions, deprecated switches and
features this trainer does not build. Each one is listed here with the reason, so the
script either runs (no-ops, shown in ``--help`` and noted once at start-up) or stops
with the reason and the alternative, never with "unrecognized arguments".
"""

# flag -> (takes a value, reason shown in --help and in the start-up note)
NO_OP_FLAGS = {
    "--use-mcore-models": (False, "models are always megatron-core's"),
    "--no-async-tensor-model-parallel-allreduce": (
        False, "deprecated in Megatron-LM; megatron-core decides the TP all-reduce overlap"),
    "--no-gradient-accumulation-fusion": (
        False, "the fused weight-gradient accumulation (an apex/TE CUDA kernel) is never used "
               "here"),
    "--no-masked-softmax-fusion": (
        False, "there is no fused masked softmax: attention runs in SDPA, flash-attn, "
               "FlexAttention or the chunked kernel"),
    "--no-bias-gelu-fusion": (False, "the bias+GeLU fusion is always off here"),
    "--no-bias-swiglu-fusion": (False, "the bias+SwiGLU fusion is always off here"),
    "--no-bias-dropout-fusion": (False, "the bias+dropout fusion is always off here"),
    "--no-persist-layer-norm": (False, "the persistent apex LayerNorm is never used here"),
    "--no-rope-fusion": (False, "the fused RoPE kernel is always off here"),
    "--cross-entropy-loss-fusion": (
        False, "the loss uses megatron-core's vocab-parallel cross entropy (same values, "
               "unfused)"),
    "--attention-softmax-in-fp32": (
        False, "the attention kernels here accumulate the softmax in fp32 already"),
    "--no-scatter-gather-tensors-in-pipeline": (
        False, "pipeline p2p always sends whole tensors here"),
    "--distribute-saved-activations": (
        False, "not implemented: under full recomputation the checkpointed layer input is "
               "kept whole on each TP rank (use --sequence-parallel to divide it by TP)"),
    "--no-overlap-p2p-communication": (
        False, "p2p overlap is chosen by the schedule (interleaved stages overlap it)"),
    "--use-cpu-initialization": (
        False, "weights are initialised on the training device, with Megatron-LM's seeds"),
    "--no-one-logger": (False, "NVIDIA's one-logger is never used here"),
    "--no-barrier-with-level-1-timing": (
        False, "level-1 timers here never add a barrier"),
    "--ckpt-fully-parallel-save": (
        False, "torch_dist saves are written by all ranks in parallel here already"),
    "--no-ckpt-fully-parallel-save": (
        False, "torch_dist saves are written by all ranks in parallel here; this cannot be "
               "turned off"),
    "--ckpt-fully-parallel-load": (
        False, "torch_dist loads are read by all ranks in parallel here already"),
    "--use-dist-ckpt": (False, "checkpoints are always megatron-core distributed ones "
                               "(torch_dist)"),
    "--auto-detect-ckpt-format": (False, "only torch_dist checkpoints exist here"),
    "--tiktoken-pattern": (True, "only for --tokenizer-type TikTokenizer, which is not "
                                 "supported here"),
    "--tensorboard-queue-size": (True, "TensorBoard's default queue is used"),
    "--log-world-size-to-tensorboard": (False, "the world size is printed at start-up"),
}

# flag that takes a number, value that is accepted, reason and alternative otherwise
SIZE_ONE_FLAGS = {
    "--context-parallel-size": (
        "context parallelism is not implemented; Seq1F1B divides the sequence over "
        "pipeline time instead: use --seq1f1b-splits (or --pipeline-schedule slimpipe) "
        "with TP and --sequence-parallel"),
    "--expert-model-parallel-size": (
        "mixture-of-experts layers are not built here (dense GPT only); train MoE "
        "models with Megatron-LM"),
    "--expert-tensor-parallel-size": (
        "mixture-of-experts layers are not built here (dense GPT only); train MoE "
        "models with Megatron-LM"),
}

_MOE = ("mixture-of-experts layers are not built by this trainer (dense GPT only); drop "
        "the MoE flags or train MoE models with Megatron-LM")
_ENCODER = ("encoder-decoder and encoder models are not built here (decoder-only GPT); "
            "drop the flag or use Megatron-LM")
_OTHER_MODEL = ("this model family is not built here (decoder-only GPT only); "
                "use Megatron-LM")

# flag or flag prefix (ending in '-') -> reason and alternative
REFUSED_FLAGS = {
    "--num-experts": _MOE,
    "--moe-": _MOE,
    "--cp-comm-type": SIZE_ONE_FLAGS["--context-parallel-size"],
    "--hierarchical-context-parallel-sizes": SIZE_ONE_FLAGS["--context-parallel-size"],
    "--fp8-": ("fp8 needs Transformer Engine layers, which the sequence-split schedules do "
               "not support yet; use --bf16"),
    "--no-fp8-wgrad": ("fp8 is not supported here; use --bf16"),
    "--encoder-": _ENCODER,
    "--decoder-num-layers": _ENCODER,
    "--decoder-seq-length": _ENCODER,
    "--pipeline-model-parallel-split-rank": _ENCODER,
    "--multi-latent-attention": ("multi-latent attention is not built here; use "
                                 "--group-query-attention"),
    "--q-lora-rank": "multi-latent attention is not built here; use --group-query-attention",
    "--kv-lora-rank": "multi-latent attention is not built here; use --group-query-attention",
    "--hybrid-": "Mamba/hybrid models are not built here (transformer GPT only)",
    "--mamba-": "Mamba/hybrid models are not built here (transformer GPT only)",
    "--spec": "custom layer specs are not loaded from the command line here",
    "--retro-": _OTHER_MODEL,
    "--bert-": _OTHER_MODEL,
    "--vision-": _OTHER_MODEL,
    "--dino-": _OTHER_MODEL,
    "--biencoder-": _OTHER_MODEL,
    "--ict-": _OTHER_MODEL,
    "--retriever-": _OTHER_MODEL,
    "--inference-": "inference is not part of this trainer; use Megatron-LM's inference",
    "--use-legacy-models": ("Megatron-LM's legacy models are gone; this trainer builds "
                            "megatron-core models: drop the flag"),
    "--use-torch-fsdp2": ("FSDP is not supported with the pipeline schedules here; use "
                          "--use-distributed-optimizer (ZeRO-1 sharding)"),
    "--use-custom-fsdp": ("FSDP is not supported with the pipeline schedules here; use "
                          "--use-distributed-optimizer (ZeRO-1 sharding)"),
    "--use-megatron-fsdp": ("FSDP is not supported with the pipeline schedules here; use "
                            "--use-distributed-optimizer (ZeRO-1 sharding)"),
    "--tp-comm-": ("TP communication overlap needs Transformer Engine userbuffers, which "
                   "are not used here; drop it"),
    "--async-save": ("asynchronous saves are not supported: checkpoints are written "
                     "synchronously, verified and then published; drop it"),
    "--yaml-cfg": "YAML configuration files are not read here; pass the flags",
    "--step-batch-size-schedule": ("batch-size schedules by tokens are not supported; use "
                                   "--rampup-batch-size START INCREMENT SAMPLES"),
    "--optimizer-cpu-offload": "optimizer CPU offload is not supported here",
    "--enable-cuda-graph": ("CUDA graphs do not fit the sequence-split schedules (shapes "
                            "change per split); drop it"),
    "--use-ring-exchange-p2p": "ring-exchange p2p is not supported; drop it",
}


def refusal_for(flag: str):
    """The reason a Megatron-LM flag is refused here, or None."""
    if flag in REFUSED_FLAGS:
        return REFUSED_FLAGS[flag]
    for prefix, reason in REFUSED_FLAGS.items():
        if prefix.endswith("-") and flag.startswith(prefix):
            return reason
    return None


def take_refused(argv):
    """Split argv into (the rest, [(flag, reason)]): refused flags and their values are
    taken out before parsing, so every other flag is still checked."""
    rest, refused, index = [], [], 0
    while index < len(argv):
        token = argv[index]
        flag = token.split("=", 1)[0]
        reason = refusal_for(flag) if token.startswith("--") else None
        if reason is None:
            rest.append(token)
            index += 1
            continue
        refused.append((flag, reason))
        index += 1
        # a value follows unless the next token is another flag (numbers may be negative)
        if "=" not in token and index < len(argv) and not _is_flag(argv[index]):
            index += 1
    return rest, refused


def _is_flag(token: str) -> bool:
    if not token.startswith("-"):
        return False
    try:
        float(token)
        return False
    except ValueError:
        return True


def add_no_op_flags(parser):
    group = parser.add_argument_group(
        "Megatron-LM flags accepted without effect",
        "Each is accepted so that Megatron-LM launch scripts run unchanged; the reason "
        "says why it changes nothing here. A note at start-up lists the ones given.")
    for flag, (takes_value, reason) in NO_OP_FLAGS.items():
        dest = "noop_" + flag.lstrip("-").replace("-", "_")
        if takes_value:
            group.add_argument(flag, dest=dest, default=None, metavar="VALUE", help=reason)
        else:
            group.add_argument(flag, dest=dest, action="store_true", help=reason)
    group = parser.add_argument_group(
        "Megatron-LM features refused",
        "These stop the run before any work, with the reason and the alternative: "
        + "; ".join(f"{flag}{'*' if flag.endswith('-') else ''}"
                    for flag in REFUSED_FLAGS) + ".")
    for flag, reason in SIZE_ONE_FLAGS.items():
        dest = flag.lstrip("-").replace("-", "_")
        group.add_argument(flag, dest=dest, type=int, default=1,
                           help=f"only 1 is accepted: {reason}")


def no_op_flags_given(args):
    """(flag, reason) for every no-op flag on the command line."""
    given = []
    for flag, (takes_value, reason) in NO_OP_FLAGS.items():
        value = getattr(args, "noop_" + flag.lstrip("-").replace("-", "_"), None)
        if (value is not None) if takes_value else value:
            given.append((flag, reason))
    return given


def size_one_problems(args):
    problems = []
    for flag, reason in SIZE_ONE_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value != 1:
            problems.append(f"{flag} {value} is refused: {reason}")
    return problems
