"""RoPE's per-layer and long-context flags for standard attention, with Megatron-LM 0.19's
names, defaults and meanings: layers without RoPE (``--no-rope-freq``), linear position
interpolation (``--rotary-seq-len-interpolation-factor``) and YaRN
(``--position-embedding-type yarn`` with the ``--yarn-*`` flags and the unprefixed
``--rotary-scaling-factor``, ``--mscale``, ``--mscale-all-dim`` it shares with MLA).
Llama-3 scaling (``--use-rope-scaling``) and the base, percent and interleaving flags stay
in the model group of ``arguments.py``."""

from megatron.trainer.moe_arguments import layer_pattern

# YaRN's config attributes -> (the flag that sets it, megatron-core's default). GPTModel's
# yarn branch reads them off the TransformerConfig, which does not declare them;
# Megatron-LM sets them after building the config (training/argument_utils.py), and so
# do we (yarn_config_attributes).
YARN_ATTRIBUTES = {
    "yarn_rotary_scaling_factor": ("--rotary-scaling-factor", 1.0),
    "yarn_original_max_position_embeddings": ("--yarn-original-max-position-embeddings", 4096),
    "yarn_beta_fast": ("--yarn-beta-fast", 32.0),
    "yarn_beta_slow": ("--yarn-beta-slow", 1.0),
    "yarn_mscale": ("--mscale", 1.0),
    "yarn_mscale_all_dim": ("--mscale-all-dim", 0.0),
    "yarn_correction_range_round_to_int": ("--yarn-correction-range-round-to-int", True),
}
_YARN_ONLY_FLAGS = ("--yarn-original-max-position-embeddings", "--yarn-beta-fast",
                    "--yarn-beta-slow", "--yarn-correction-range-round-to-int")


def no_rope_freq_type(text):
    """--no-rope-freq: N (RoPE skipped in every N-th layer, Llama-4's NoPE layers) or a
    pattern of 0/1 per layer (1: no RoPE)."""
    return layer_pattern(text, "a layer without RoPE")


def _dest(flag):
    return flag.lstrip("-").replace("-", "_")


def add_rope_scaling_arguments(group):
    """Into the model group, beside --position-embedding-type (whose choices hold yarn)."""
    group.add_argument("--no-rope-freq", type=no_rope_freq_type, default=None,
                       help="layers without RoPE (Llama-4's NoPE layers): N skips RoPE in "
                            "every N-th layer; or a pattern such as \"([0]*3+[1]*1)*2\" "
                            "(1: no RoPE), one entry per layer")
    group.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                       help="linear position interpolation: RoPE reads position p as "
                            "p / factor (standard attention with --position-embedding-type "
                            "rope)")
    group.add_argument("--yarn-original-max-position-embeddings", type=int, default=None,
                       help="YaRN: the context length the model was trained at (default "
                            "4096, megatron-core's)")
    group.add_argument("--yarn-beta-fast", type=float, default=None,
                       help="YaRN's frequency-correction beta_fast (default 32)")
    group.add_argument("--yarn-beta-slow", type=float, default=None,
                       help="YaRN's frequency-correction beta_slow (default 1)")
    group.add_argument("--yarn-correction-range-round-to-int", action="store_true",
                       default=None,
                       help="YaRN: round the correction range's ends to integers (the "
                            "default)")
    group.add_argument("--no-yarn-correction-range-round-to-int", action="store_false",
                       dest="yarn_correction_range_round_to_int",
                       help="YaRN: keep the correction range's ends fractional")


def check_rope_scaling_args(args):
    """Megatron-LM's combinations that would be silently ignored there (megatron-core
    drops the interpolation factor under YaRN and MLA) or crash (YaRN with interleaved
    pairs or with MLA's config) stop here, one line each; returns the problems."""
    problems = []
    kind = args.position_embedding_type
    problems += _no_rope_problems(args)
    factor = args.rotary_seq_len_interpolation_factor
    if factor is not None:
        if factor < 1:
            problems.append(f"--rotary-seq-len-interpolation-factor must be >= 1 (positions "
                            f"are divided by it), got {factor}")
        elif args.multi_latent_attention:
            problems.append("--rotary-seq-len-interpolation-factor does not reach "
                            "--multi-latent-attention's rotary part (megatron-core ignores "
                            "it there): drop it; MLA scales with --rope-type yarn")
        elif kind == "yarn":
            problems.append("--rotary-seq-len-interpolation-factor has no effect under "
                            "--position-embedding-type yarn (megatron-core's YaRN ignores "
                            "it): drop it; YaRN scales with --rotary-scaling-factor")
        elif kind != "rope":
            problems.append(f"--rotary-seq-len-interpolation-factor scales RoPE: it needs "
                            f"--position-embedding-type rope, not {kind}")
    if kind == "yarn":
        if args.multi_latent_attention:
            problems.append("--position-embedding-type yarn is YaRN for standard attention; "
                            "--multi-latent-attention takes YaRN through --rope-type yarn "
                            "(its default) with --position-embedding-type rope")
        if args.rotary_interleaved:
            problems.append("--rotary-interleaved is not supported with "
                            "--position-embedding-type yarn (megatron-core's YaRN refuses "
                            "it): drop it")
        if args.yarn_original_max_position_embeddings is not None and (
                args.yarn_original_max_position_embeddings < 1):
            problems.append("--yarn-original-max-position-embeddings must be >= 1, got "
                            f"{args.yarn_original_max_position_embeddings}")
        if args.rotary_scaling_factor <= 0:
            problems.append(f"--rotary-scaling-factor must be > 0, got "
                            f"{args.rotary_scaling_factor}")
    else:
        given = [flag for flag in _YARN_ONLY_FLAGS if getattr(args, _dest(flag)) is not None]
        if given and args.multi_latent_attention:
            # one would think they tune MLA's YaRN; megatron-core keeps its defaults there
            problems.append(f"{', '.join(given)}: standard attention's YaRN flags "
                            "(--position-embedding-type yarn); MLA's YaRN keeps "
                            "megatron-core's original length and betas (4096, 32, 1): drop "
                            "them")
        elif given:
            args.flag_notes.append(f"note: {', '.join(given)} without --position-embedding-type "
                                   "yarn: these flags have no effect")
    return problems


def _no_rope_problems(args):
    pattern = args.no_rope_freq
    if pattern is None:
        return []
    if args.multi_latent_attention:
        return ["--no-rope-freq does not reach --multi-latent-attention (megatron-core's MLA "
                "ropes every layer): drop it"]
    if args.position_embedding_type not in ("rope", "yarn"):
        return [f"--no-rope-freq skips RoPE in some layers: it needs --position-embedding-type "
                f"rope or yarn, not {args.position_embedding_type}"]
    layers = args.num_layers
    if isinstance(pattern, list):
        if len(pattern) != layers:
            return [f"--no-rope-freq gives {len(pattern)} layers, --num-layers is {layers}: "
                    "give one 0 or 1 per layer"]
    elif pattern < 1 or layers % pattern:
        return [f"--no-rope-freq {pattern} must divide --num-layers ({layers}) (as in "
                "megatron-core)"]
    return []


def yarn_config_attributes(args) -> dict:
    """The config attributes of YaRN for standard attention (none otherwise), as
    Megatron-LM sets them: each flag's value, megatron-core's default where not given."""
    if args.position_embedding_type != "yarn" or args.multi_latent_attention:
        return {}
    values = {}
    for attribute, (flag, default) in YARN_ATTRIBUTES.items():
        value = getattr(args, _dest(flag))
        values[attribute] = default if value is None else value
    return values
