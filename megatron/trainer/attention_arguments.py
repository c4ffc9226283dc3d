"""Attention variants with Megatron-LM 0.19's flags, types and meanings: sliding windows
and attention sinks (gpt-oss uses both; Gemma and Mistral the windows), Llama-4's query/key
L2 norm and Qwen3-Next's gated attention.

``--window-size LEFT,RIGHT`` is megatron-core's ``window_size``: each query sees the
LEFT keys before it and itself (RIGHT keys after it, which causal attention here
requires to be 0; LEFT -1: unlimited). ``--window-attn-skip-freq`` picks the layers that
keep full attention: N (every N-th layer, as gpt-oss and Gemma alternate) or a 0/1
pattern per layer (1: sliding window). The kernels are in ``megatron.seqsplit``: every
split attends to at most LEFT keys of its cached prefix per query, exact against the
unsplit window (docs/megatron_lm.md).

``--softmax-type`` is megatron-core's: ``vanilla`` (plain softmax), ``off-by-one`` (a zero
logit per head joins every query's softmax, with no value) or ``learnable`` (that logit a
parameter per head, gpt-oss's attention sinks). The sinks run in the CPU kernels
(``megatron.seqsplit.cpu_split_attention``) and in the chunked KV cache's kernel
(``lse_attention``, any device); flash-attn 2, SDPA and FlexAttention have none, so a CUDA
run with splits and sinks needs ``--seq1f1b-kv-cache chunked``.

``--qk-l2-norm`` and ``--attention-output-gate`` act on each token's own projections
(megatron-core's L2Norm and its SelfAttention's gate), so a split computes them as the
whole sequence does."""

from megatron.trainer.moe_arguments import layer_pattern


def window_size_type(text):
    """Megatron-LM's tuple_type: "128,0" or "(128,0)" -> (128, 0)."""
    if isinstance(text, tuple):
        return text
    return tuple(int(part) for part in text.strip("()").split(","))


def window_skip_freq_type(text):
    """--window-attn-skip-freq: N (one full-attention layer every N) or a pattern."""
    return layer_pattern(text, "a sliding-window layer")


SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def add_attention_arguments(group):
    """Into the model group, beside the attention flags."""
    group.add_argument("--qk-l2-norm", action="store_true",
                       help="Llama-4's query/key L2 normalisation (megatron-core's weightless "
                            "L2Norm where --qk-layernorm's norms would be)")
    group.add_argument("--attention-output-gate", action="store_true",
                       help="gated attention (Qwen3-Next): the QKV projection also makes a "
                            "gate per head channel, and attention's output is multiplied by "
                            "its sigmoid")
    group.add_argument("--softmax-type", choices=SOFTMAX_TYPES, default="vanilla",
                       help="attention softmax: vanilla; off-by-one (a zero logit per head in "
                            "every softmax, no value); learnable (that logit learnt per head: "
                            "gpt-oss's attention sinks; on CUDA with splits it needs "
                            "--seq1f1b-kv-cache chunked)")
    group.add_argument("--window-size", type=window_size_type, default=None,
                       help="sliding-window attention: LEFT,0 lets each query see the LEFT "
                            "keys before it and itself (megatron-core's window_size)")
    group.add_argument("--window-attn-skip-freq", type=window_skip_freq_type, default=None,
                       help="layers with full attention among sliding-window ones: N (every "
                            "N-th layer) or a pattern such as \"[1,1,1,0]*3\" (1: sliding "
                            "window), one entry per layer")


def check_attention_args(args):
    """The combinations that cannot run exactly here stop before any work, one line each;
    returns the problems."""
    return _window_problems(args) + _sink_problems(args) + _projection_problems(args)


def _projection_problems(args):
    """--qk-l2-norm and --attention-output-gate: megatron-core has them for standard
    attention only; --qk-layernorm is moot beside --qk-l2-norm (the L2 norms replace its
    norms, as in megatron-core's spec)."""
    problems = [f"{flag} is not supported with --multi-latent-attention (megatron-core has "
                "it for standard attention only): drop one of them"
                for flag, given in (("--qk-l2-norm", args.qk_l2_norm),
                                    ("--attention-output-gate", args.attention_output_gate))
                if given and args.multi_latent_attention]
    if args.qk_l2_norm and args.qk_layernorm and not args.multi_latent_attention:
        args.flag_notes.append("note: --qk-layernorm has no effect with --qk-l2-norm (the "
                               "L2 norms take the query/key norms' place, as in megatron-core)")
    return problems


def _sink_problems(args):
    kind = args.softmax_type
    if kind == "vanilla":
        return []
    flag = f"--softmax-type {kind}"
    problems = []
    # context-parallel parts run the split kernels too, one split or more
    splits = ((args.seq1f1b_splits or 1) > 1 or args.slimpipe_slices is not None
              or args.context_parallel_size > 1)
    if (getattr(args, "device", None) == "cuda" and splits
            and args.seq1f1b_kv_cache != "chunked"):
        problems.append(f"{flag} on CUDA needs --seq1f1b-kv-cache chunked: its kernel has "
                        "the sinks, while flash-attn 2, SDPA and FlexAttention there have none")
    if args.attention_dropout > 0:
        problems.append(f"{flag} needs --attention-dropout 0 (the kernels with sinks have no "
                        f"dropout; got {args.attention_dropout})")
    chunked_with_documents = args.reset_attention_mask and (
        args.seq1f1b_kv_cache == "chunked" or getattr(args, "device", None) == "cuda")
    for other, given in (("--multi-latent-attention", args.multi_latent_attention),
                         ("--slimpipe-attention-balance", args.slimpipe_attention_balance),
                         ("--reset-attention-mask on CUDA or with the chunked KV cache",
                          chunked_with_documents),
                         ("--attention-backend flex", args.attention_backend == "flex")):
        if given:
            problems.append(f"{flag} is not supported with {other} yet: drop one of them")
    return problems


def _window_problems(args):
    size, skip = args.window_size, args.window_attn_skip_freq
    if size is None:
        if skip is not None:
            args.flag_notes.append("note: --window-attn-skip-freq without --window-size has "
                                   "no effect (every layer keeps full attention)")
        return []
    if len(size) != 2:
        return [f"--window-size takes LEFT,RIGHT (two integers), got {','.join(map(str, size))}"]
    left, right = size
    problems = []
    if right != 0:
        problems.append(f"--window-size {left},{right}: attention here is causal, so the keys "
                        f"after each query must be 0: give {left},0")
    if left < -1:
        problems.append(f"--window-size {left},{right}: LEFT is the keys a query sees before "
                        "itself, >= 0 (-1: unlimited)")
    if isinstance(skip, list) and len(skip) != args.num_layers:
        problems.append(f"--window-attn-skip-freq gives {len(skip)} layers, --num-layers is "
                        f"{args.num_layers}: give one 0 or 1 per layer")
    elif isinstance(skip, int) and skip < 1:
        problems.append(f"--window-attn-skip-freq must be >= 1, got {skip}")
    for flag, given in (("--reset-attention-mask", args.reset_attention_mask),
                        ("--multi-latent-attention", args.multi_latent_attention),
                        ("--slimpipe-attention-balance", args.slimpipe_attention_balance)):
        if given:
            problems.append(f"--window-size is not supported with {flag} yet: drop one of them")
    return problems


def attention_config_fields(args) -> dict:
    """TransformerConfig's window_size, window_attn_skip_freq, softmax_type, qk_l2_norm and
    attention_output_gate."""
    return {"window_size": args.window_size, "window_attn_skip_freq": args.window_attn_skip_freq,
            "softmax_type": args.softmax_type, "qk_l2_norm": args.qk_l2_norm,
            "attention_output_gate": args.attention_output_gate}
