"""Megatron-LM's multi-latent attention flags: names, defaults and meanings as in its
``megatron/training/arguments.py`` (0.19), their checks, and the MLATransformerConfig
fields."""

# the MLA flags implemented here; the other MLA options stay refused
# (megatron_lm_flags.REFUSED_FLAGS) with their reason
MLA_FLAGS = (
    "--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
    "--qk-pos-emb-head-dim", "--v-head-dim", "--rope-type", "--rotary-scaling-factor",
    "--mscale", "--mscale-all-dim",
)

_DEFAULTS = {"--q-lora-rank": None, "--kv-lora-rank": 32, "--qk-head-dim": 128,
             "--qk-pos-emb-head-dim": 64, "--v-head-dim": 128, "--rope-type": None,
             "--rotary-scaling-factor": 1.0, "--mscale": 1.0, "--mscale-all-dim": 0.0}

# YaRN's flags without a yarn_ prefix: MLA's, and also standard attention's under
# --position-embedding-type yarn (rope_arguments.YARN_ATTRIBUTES), as in Megatron-LM
_SHARED_WITH_YARN = ("--rotary-scaling-factor", "--mscale", "--mscale-all-dim")


def add_mla_arguments(parser):
    g = parser.add_argument_group(
        "multi-latent attention",
        "Megatron-LM's MLA flags with its meanings (DeepSeek-V2/V3); exact under "
        "--seq1f1b-splits (docs/megatron_lm.md#multi-latent-attention)")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="multi-latent attention: queries and keys/values through low-rank "
                        "latents, a decoupled rotary part per head")
    g.add_argument("--q-lora-rank", type=int, default=None,
                   help="rank of the query's low-rank latent (none: no query compression)")
    g.add_argument("--kv-lora-rank", type=int, default=32,
                   help="rank of the key/value low-rank latent")
    g.add_argument("--qk-head-dim", type=int, default=128,
                   help="per-head query/key size without the rotary part (the query-key "
                        "head is --qk-head-dim + --qk-pos-emb-head-dim)")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64,
                   help="per-head size of the decoupled rotary part of queries and keys")
    g.add_argument("--v-head-dim", type=int, default=128, help="per-head value size")
    g.add_argument("--rope-type", choices=("rope", "yarn"), default=None,
                   help="MLA's rotary embedding; default yarn with --multi-latent-attention "
                        "(as Megatron-LM); standard attention's YaRN is "
                        "--position-embedding-type yarn")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0,
                   help="YaRN's scaling factor (MLA with --rope-type yarn, or "
                        "--position-embedding-type yarn)")
    g.add_argument("--mscale", type=float, default=1.0,
                   help="YaRN's mscale (MLA with --rope-type yarn, or "
                        "--position-embedding-type yarn)")
    g.add_argument("--mscale-all-dim", type=float, default=0.0,
                   help="YaRN's mscale_all_dim; also scales MLA's softmax")


def check_mla_args(args):
    """Megatron-LM's MLA defaults and checks; returns the problems, one line each."""
    problems = []
    given = [flag for flag, default in _DEFAULTS.items()
             if getattr(args, flag.lstrip("-").replace("-", "_")) != default]
    if not args.multi_latent_attention:
        if args.position_embedding_type == "yarn":  # YaRN of standard attention reads them
            given = [flag for flag in given if flag not in _SHARED_WITH_YARN]
        if args.rope_type == "yarn":
            problems.append("--rope-type yarn is MLA's YaRN (for --multi-latent-attention); "
                            "standard attention takes YaRN with --position-embedding-type "
                            "yarn: use that, or add --multi-latent-attention")
        elif given and given != ["--rope-type"]:
            args.flag_notes.append(f"note: {', '.join(given)} without "
                                   "--multi-latent-attention: the attention is standard, "
                                   "these flags have no effect")
        return problems
    if args.rope_type is None:
        args.rope_type = "yarn"  # Megatron-LM: MLATransformerConfig's default
    if args.group_query_attention:
        problems.append("--group-query-attention and --multi-latent-attention exclude each "
                        "other (as in Megatron-LM): drop one")
    if args.position_embedding_type != "rope":
        problems.append("--multi-latent-attention rotates its decoupled part with RoPE/YaRN: "
                        "it needs --position-embedding-type rope (Megatron-LM's default)")
    for flag in ("--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim"):
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value < 1:
            problems.append(f"{flag} must be >= 1, got {value}")
    if args.q_lora_rank is not None and args.q_lora_rank < 1:
        problems.append(f"--q-lora-rank must be >= 1, got {args.q_lora_rank} (leave it out "
                        "for no query compression)")
    if args.qk_layernorm and args.q_lora_rank is None:
        problems.append("--qk-layernorm with --multi-latent-attention needs --q-lora-rank: "
                        "without a query latent megatron-core 0.16 normalises only the "
                        "key/value latent and 0.19 a norm fused into the query projection "
                        "(Transformer Engine only); give --q-lora-rank or drop --qk-layernorm")
    if args.rotary_interleaved:
        problems.append("--rotary-interleaved is not supported with --multi-latent-attention "
                        "(megatron-core's YaRN refuses it): drop it")
    if getattr(args, "slimpipe_attention_balance", False):
        problems.append("--slimpipe-attention-balance does not exchange MLA's keys and values "
                        "(their head sizes differ): drop it with --multi-latent-attention")
    if args.use_rope_scaling:
        problems.append("--use-rope-scaling (Llama-3 RoPE) is not applied to MLA's rotary part "
                        "by megatron-core: drop it (MLA scales with --rope-type yarn)")
    return problems


def mla_config_fields(args):
    """The MLATransformerConfig fields of the MLA flags (none without MLA). YaRN's
    original_max_position_embeddings, beta_fast and beta_slow keep megatron-core's
    defaults (4096, 32, 1), as in Megatron-LM, whose parser has no flag for them under
    MLA (its --yarn-* flags are for standard attention)."""
    if not getattr(args, "multi_latent_attention", False):
        return {}
    return dict(
        multi_latent_attention=True,
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim,
        rope_type=args.rope_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        rotary_scaling_factor=args.rotary_scaling_factor,
        mscale=args.mscale,
        mscale_all_dim=args.mscale_all_dim,
    )
