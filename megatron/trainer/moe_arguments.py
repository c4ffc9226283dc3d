"""Megatron-LM's mixture-of-experts flags: names, defaults and meanings as in its
``megatron/training/arguments.py``, their checks, and the TransformerConfig fields."""

from megatron import mcore_compat

# the MoE flags implemented here; the other --moe-* flags stay refused
# (megatron_lm_flags.REFUSED_FLAGS) with their reason
MOE_FLAGS = (
    "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
    "--moe-shared-expert-intermediate-size", "--moe-layer-freq",
    "--moe-router-score-function", "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "--moe-router-load-balancing-type",
    "--moe-aux-loss-coeff", "--moe-z-loss-coeff", "--moe-router-topk-scaling-factor",
    "--moe-router-num-groups", "--moe-router-group-topk", "--moe-token-dispatcher-type",
    "--moe-grouped-gemm", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
    "--moe-per-layer-logging", "--moe-router-pre-softmax", "--moe-router-dtype",
    "--moe-layer-recompute", "--moe-shared-expert-gate", "--moe-apply-probs-on-input",
    "--moe-enable-deepep", "--moe-flex-dispatcher-backend", "--moe-expert-capacity-factor",
    "--moe-pad-expert-input-to-capacity", "--moe-token-drop-policy",
    "--moe-router-force-load-balancing", "--moe-input-jitter-eps",
    "--moe-use-upcycling", "--moe-upcycling-granularity", "--moe-router-force-biased",
)

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn",
                        "quantile_balancing", "none")


def layer_pattern(text, one_means):
    """A per-layer flag as Megatron-LM reads it (--moe-layer-freq, --no-rope-freq): N (an
    int) or a Python list expression of 0/1 per layer such as "[0]*1+[1]*3"."""
    if isinstance(text, int):
        return text
    if "[" not in text:
        return int(text)
    try:  # only list arithmetic: no names, no builtins
        pattern = eval(text, {"__builtins__": {}}, {})  # noqa: S307
    except Exception as error:
        raise ValueError(f"not a list expression: {error}") from None
    if not isinstance(pattern, list) or any(value not in (0, 1) for value in pattern):
        raise ValueError(f"the pattern must be a list of 0 and 1 per layer (1: {one_means})")
    return pattern


def moe_freq_type(text):
    """--moe-layer-freq: N (one MoE layer every N layers, from the first) or a pattern."""
    return layer_pattern(text, "an MoE layer")


def add_moe_arguments(parser):
    g = parser.add_argument_group(
        "mixture of experts",
        "Megatron-LM's MoE flags with its meanings; exact under --seq1f1b-splits "
        "(docs/megatron_lm.md#mixture-of-experts)")
    g.add_argument("--num-experts", type=int, default=None,
                   help="experts per MoE layer (none: dense MLPs)")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="each expert's hidden size (default --ffn-hidden-size)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="hidden size of the shared expert every token also runs through")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="scale the shared expert's output by a per-token sigmoid gate "
                        "(Qwen2-MoE's); only with --moe-shared-expert-intermediate-size")
    g.add_argument("--moe-apply-probs-on-input", action="store_true",
                   help="scale each expert's input by the router probability instead of "
                        "its output (Llama 4's); needs --moe-router-topk 1")
    g.add_argument("--moe-layer-freq", type=moe_freq_type, default=1,
                   help='N: an MoE layer every N layers; or "[0]*1+[1]*3": 0 dense, 1 MoE '
                        "per layer (first-k-dense)")
    g.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid",
                                                            "sqrtsoftplus"),
                   default="softmax",
                   help="as Megatron-LM: the router's scores, a softmax over the experts, "
                        "or a sigmoid or sqrt(softplus) per expert normalised over the top-k "
                        "(sqrtsoftplus needs megatron-core >= 0.19)")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: a per-expert routing bias updated after "
                        "each step by --moe-router-bias-update-rate")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-router-load-balancing-type", nargs="+", default="aux_loss",
                   choices=LOAD_BALANCING_TYPES)
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    g.add_argument("--moe-router-force-load-balancing", action="store_true",
                   help="as Megatron-LM, for benchmarks only: each router's logits are "
                        "replaced by random ones (megatron-core's, drawn from the "
                        "expert-parallel RNG stream and replayed by recomputation), so the "
                        "experts get about equal shares of the tokens whatever the weights; "
                        "a split run draws other random logits than an unsplit one (as "
                        "dropout does)")
    g.add_argument("--moe-router-force-biased", type=float, default=None, metavar="STD",
                   help="as Megatron-LM (megatron-core >= 0.19), for benchmarks only: random "
                        "logits as --moe-router-force-load-balancing plus a random per-expert "
                        "bias of this std (the same on every rank; a negative std draws it once "
                        "per layer), for a skewed but reproducible expert load; a split run "
                        "draws per split")
    g.add_argument("--moe-input-jitter-eps", type=float, default=None,
                   help="as Megatron-LM (Switch Transformer's jitter): while training, each "
                        "router's input is multiplied by noise uniform in [1 - eps, 1 + eps] "
                        "(the experts get the input as it is); the noise is replayed by "
                        "recomputation, and a split run draws other noise than an unsplit one "
                        "(as dropout does)")
    g.add_argument("--moe-use-upcycling", action="store_true",
                   help="as Megatron-LM: load the dense model's checkpoint in --load, turn it "
                        "into this MoE model (every expert a copy of the dense MLP, or of a "
                        "slice of it with --moe-upcycling-granularity; megatron-core's "
                        "upcycling), save that into --save as iteration 1 and train on from "
                        "there; the runs after it resume from --save without this flag")
    g.add_argument("--moe-upcycling-granularity", type=int, default=1,
                   help="as Megatron-LM: how many times smaller an expert's FFN is than the "
                        "dense model's (the dense FFN is --moe-ffn-hidden-size times this)")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="normalise the scores (softmax or sigmoid) over all experts before "
                        "the top-k selection instead of after it")
    g.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), default=None,
                   help="the router's logits, scores and the weighting of the experts' "
                        "outputs in this dtype (default: the activations')")
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="group-limited routing: experts in this many groups")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="group-limited routing: the groups a token may use")
    g.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall", "flex"),
                   default="allgather",
                   help="flex (DeepEP / HybridEP kernels on CUDA) runs as alltoall here, "
                        "with a note: the same tokens reach the same experts")
    g.add_argument("--moe-enable-deepep", action="store_true",
                   help="Megatron-LM's older spelling of --moe-flex-dispatcher-backend "
                        "deepep; needs --moe-token-dispatcher-type flex")
    g.add_argument("--moe-flex-dispatcher-backend", choices=("deepep", "hybridep", "ncclep"),
                   default=None, help="the flex dispatcher's kernels (not used here: flex "
                                      "runs as alltoall)")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="grouped GEMM experts on CUDA; on CPU the experts run one after "
                        "the other (same values), with a note")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="experts divided over this many ranks of the data-parallel group "
                        "(with --expert-tensor-parallel-size 1, of the TP x DP ranks; "
                        "all-to-all over gloo on CPU)")
    g.add_argument("--moe-layer-recompute", action="store_true",
                   help="recompute each MoE layer in backward (Megatron-LM's older spelling "
                        "of --recompute-granularity selective --recompute-modules ... moe)")
    g.add_argument("--moe-per-layer-logging", action="store_true",
                   help="also write each layer's aux losses to TensorBoard/wandb "
                        "(moe/<name>_layer_<i>), as Megatron-LM")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="token dropping as Megatron-LM: each expert takes at most this "
                        "factor times its even share of a forward call's tokens (a negative "
                        "value: no dropping); whole microbatches only (--seq1f1b-splits 1, "
                        "no SlimPipe, no context parallelism): a split would drop others")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="with --moe-expert-capacity-factor: each expert's input padded to "
                        "its capacity (megatron-core's)")
    g.add_argument("--moe-token-drop-policy", choices=("probs", "position"), default="probs",
                   help="which tokens an expert over its capacity drops: the lowest "
                        "probabilities, or the last positions (megatron-core's)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="tensor parallelism inside each expert: as in Megatron-LM it "
                        "defaults to --tensor-model-parallel-size; 1 keeps experts whole "
                        "(then with --expert-model-parallel-size > 1, over the TP x DP ranks)")


def check_moe_args(args, cuda_available):
    """Megatron-LM's MoE defaults and checks; returns the problems, one line each."""
    problems = []
    tp = args.tensor_model_parallel_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp  # Megatron-LM's default
    elif args.expert_tensor_parallel_size not in (1, tp):
        problems.append(f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size} is "
                        f"refused: 1 (whole experts, as DeepSeek-V3's and Qwen3's recipes) or "
                        f"the tensor-parallel size ({tp}, Megatron-LM's default) are "
                        "supported here")
    if args.num_experts == 0:
        args.num_experts = None
    for dest in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(args, dest)  # one value: not a list (as Megatron-LM)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, dest, value[0])
    given = [flag for flag in MOE_FLAGS[1:] if _given(args, flag)]
    if args.num_experts is None:
        if args.expert_model_parallel_size != 1:
            problems.append("--expert-model-parallel-size needs --num-experts")
        elif given:
            args.flag_notes.append(f"note: {', '.join(given)} without --num-experts: the "
                                   "model is dense, the MoE flags have no effect")
        return problems
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if not 1 <= args.moe_router_topk <= args.num_experts:
        problems.append(f"--moe-router-topk {args.moe_router_topk} must be between 1 and "
                        f"--num-experts ({args.num_experts})")
    if (args.moe_router_topk == 1 and args.moe_router_score_function == "softmax"
            and not args.moe_router_pre_softmax):
        # megatron-core's rule (its config raises it at model build): a softmax over the
        # one chosen expert is 1 for every token
        problems.append("--moe-router-topk 1 with the softmax router needs "
                        "--moe-router-pre-softmax (as in Megatron-LM)")
    problems += _flex_dispatcher(args)
    if args.moe_input_jitter_eps is not None and args.moe_input_jitter_eps <= 0:
        # megatron-core's uniform noise needs 1 - eps < 1 + eps (its first forward fails)
        problems.append(f"--moe-input-jitter-eps must be > 0, got {args.moe_input_jitter_eps}")
    if args.moe_apply_probs_on_input and args.moe_router_topk != 1:
        # megatron-core asserts it in the experts' first forward
        problems.append(f"--moe-apply-probs-on-input needs --moe-router-topk 1 (got "
                        f"{args.moe_router_topk}), as megatron-core asserts")
    if args.moe_shared_expert_gate and not args.moe_shared_expert_intermediate_size:
        args.flag_notes.append("note: --moe-shared-expert-gate without "
                               "--moe-shared-expert-intermediate-size: there is no shared "
                               "expert to gate (as in Megatron-LM, no effect)")
    etp, ep = args.expert_tensor_parallel_size, args.expert_model_parallel_size
    if etp < tp and ep == 1:
        # megatron-core marks expert weights for the dense (data-parallel) reduction when
        # EP is 1, so the copies each TP rank trains on its tokens are never summed
        problems.append(f"--expert-tensor-parallel-size {etp} under --tensor-model-parallel-"
                        f"size {tp} needs --expert-model-parallel-size > 1: at EP 1 "
                        f"megatron-core reduces the experts' gradients over data-parallel "
                        f"ranks only, so each TP rank's copy of an expert trains on its own "
                        f"tokens and the copies drift apart; give EP > 1 or drop the flag")
    elif (stage_ranks := args.data_parallel_size * tp * args.context_parallel_size) % (etp * ep):
        problems.append(f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size "
                        f"{etp} does not divide the {stage_ranks} ranks of a pipeline stage "
                        f"(data-parallel x context-parallel x tensor-parallel size)")
    if args.num_experts % args.expert_model_parallel_size:
        problems.append(f"--num-experts {args.num_experts} is not divisible by "
                        f"--expert-model-parallel-size {args.expert_model_parallel_size}")
    if isinstance(args.moe_layer_freq, list) and len(args.moe_layer_freq) != args.num_layers:
        problems.append(f"--moe-layer-freq gives {len(args.moe_layer_freq)} layers, "
                        f"--num-layers is {args.num_layers}: give one 0 or 1 per layer")
    if tp > 1 and not args.sequence_parallel:
        # megatron-core's MoELayer raises this at model build, after the groups exist
        problems.append(f"--num-experts with --tensor-model-parallel-size {tp} needs "
                        "--sequence-parallel (megatron-core requires it for MoE with TP)")
    problems += _token_dropping_problems(args)
    problems += _upcycling_problems(args)
    problems += _balancing_problems(args)
    if args.moe_router_force_biased is not None and not mcore_compat.config_has(
            "moe_router_force_biased"):
        problems.append("--moe-router-force-biased needs megatron-core >= 0.19 (the installed "
                        "one's router has no biased logits): upgrade megatron-core or use "
                        "--moe-router-force-load-balancing")
    if (args.moe_router_score_function == "sqrtsoftplus"
            and "sqrtsoftplus" not in mcore_compat.moe_router_score_functions()):
        problems.append("--moe-router-score-function sqrtsoftplus needs megatron-core >= 0.19 "
                        "(the installed one's router has softmax and sigmoid): upgrade "
                        "megatron-core or choose one of those")
    if (args.moe_router_num_groups is None) != (args.moe_router_group_topk is None):
        problems.append("--moe-router-num-groups and --moe-router-group-topk go together")
    overlap = any(flag == "--moe-shared-expert-overlap" for flag, _ in args.no_op_flags)
    if overlap and args.recompute_granularity == "selective" and "shared_experts" in (
            args.recompute_modules or ()):
        problems.append("--recompute-modules shared_experts does not go with "
                        "--moe-shared-expert-overlap (megatron-core's config refuses it, so "
                        "Megatron-LM stops too)")
    if overlap and args.moe_token_dispatcher_type != "alltoall":
        # megatron-core's config refuses it there, so Megatron-LM stops too
        problems.append("--moe-shared-expert-overlap only works with "
                        "--moe-token-dispatcher-type alltoall (as in Megatron-LM)")
    if args.moe_grouped_gemm and not cuda_available:
        args.flag_notes.append("note: --moe-grouped-gemm is a CUDA kernel: on CPU the "
                               "experts run one after the other (the same values)")
        args.moe_grouped_gemm = False
    if etp > 1 and not args.disable_bias_linear:
        # megatron-core asserts it at build
        problems.append(f"--num-experts with biased linear layers needs "
                        f"--expert-tensor-parallel-size 1 (got {etp}, the default: the TP "
                        "size): megatron-core has expert biases only without expert tensor "
                        "parallelism; add --disable-bias-linear to split experts over TP")
    if args.moe_grouped_gemm and not args.disable_bias_linear:
        # megatron-core's grouped experts assert at build time
        problems.append("--moe-grouped-gemm has no expert biases in megatron-core: add "
                        "--disable-bias-linear, or drop --moe-grouped-gemm to run the "
                        "experts one after the other with their biases")
    return problems


def _balancing_problems(args):
    """Megatron-LM's S-BASE routing (sinkhorn) balances the tokens of one router call
    against each other: under sequence splits (or context parallelism) a call holds part
    of the microbatch, so the routing would not be the unsplit model's; whole microbatches
    run megatron-core's own. Its quantile balancing (0.19) is not built here."""
    types = args.moe_router_load_balancing_type
    types = types if isinstance(types, list) else [types]
    problems = []
    if "quantile_balancing" in types:
        problems.append("--moe-router-load-balancing-type quantile_balancing is not "
                        "implemented here; use aux_loss, seq_aux_loss, global_aux_loss, "
                        "sinkhorn, none, or --moe-router-enable-expert-bias")
    if "sinkhorn" not in types:
        return problems
    if len(types) > 1:
        problems.append("--moe-router-load-balancing-type sinkhorn routes alone (as in "
                        "megatron-core): give it without other types")
    coeffs = args.moe_aux_loss_coeff
    if any(coeff != 0 for coeff in (coeffs if isinstance(coeffs, list) else [coeffs])):
        problems.append("--moe-router-load-balancing-type sinkhorn takes no "
                        "--moe-aux-loss-coeff (megatron-core asserts it is 0)")
    if (args.seq1f1b_splits or 1) > 1 or args.slimpipe_slices is not None:
        problems.append("--moe-router-load-balancing-type sinkhorn balances the tokens of "
                        "each router call against each other, and under sequence splits a "
                        "call holds one split: the routing would not be the whole "
                        "microbatch's; use --seq1f1b-splits 1, or aux_loss, seq_aux_loss, "
                        "global_aux_loss or --moe-router-enable-expert-bias")
    if args.context_parallel_size > 1:
        problems.append("--moe-router-load-balancing-type sinkhorn with context parallelism "
                        "would balance each rank's part of the sequence alone here; use "
                        "another load-balancing type")
    return problems


def _upcycling_problems(args):
    """--moe-use-upcycling: what megatron-core's upcycling (upcycling_utils) can convert;
    as Megatron-LM, the dense checkpoint gives the weights only (no optimizer, no RNG)."""
    granularity = args.moe_upcycling_granularity
    if not args.moe_use_upcycling:
        return []
    problems = []
    if args.load is None:
        problems.append("--moe-use-upcycling needs --load DIR, the dense model's checkpoint")
    if args.save is None:
        problems.append("--moe-use-upcycling needs --save DIR (as in Megatron-LM): the "
                        "upcycled checkpoint is written there before training goes on")
    if granularity < 1 or args.num_experts % granularity:
        problems.append(f"--moe-upcycling-granularity {granularity} must be >= 1 and divide "
                        f"--num-experts ({args.num_experts})")
    freq = args.moe_layer_freq
    if freq != 1 and not (isinstance(freq, list) and all(freq)):
        problems.append("--moe-use-upcycling converts every layer's MLP into experts "
                        "(megatron-core's upcycling): --moe-layer-freq must make every layer "
                        "an MoE layer")
    if args.use_checkpoint_args:
        problems.append("--moe-use-upcycling with --use-checkpoint-args would take the dense "
                        "checkpoint's shape (no experts): give the MoE model's flags")
    if not (args.no_load_optim and args.no_load_rng):
        args.flag_notes.append("note: --moe-use-upcycling loads the dense checkpoint's "
                               "weights only (--no-load-optim --no-load-rng, as Megatron-LM)")
        args.no_load_optim = args.no_load_rng = True
    return problems


def _flex_dispatcher(args):
    """Megatron-LM's flex dispatcher (DeepSeek-V3's and Qwen3-235B's recipes) as the
    all-to-all dispatcher: its DeepEP / HybridEP / NCCL EP kernels only move the tokens
    (CUDA), and megatron-core's split-aware MoE layer here drives the all-to-all one."""
    problems = []
    flex = args.moe_token_dispatcher_type == "flex"
    # megatron-core's config raises these for a dispatcher other than flex
    if args.moe_enable_deepep and not flex:
        problems.append("--moe-enable-deepep needs --moe-token-dispatcher-type flex (as "
                        "megatron-core requires)")
    if args.moe_enable_deepep and args.moe_flex_dispatcher_backend == "hybridep":
        problems.append("--moe-enable-deepep and --moe-flex-dispatcher-backend hybridep "
                        "name two backends; keep one (as megatron-core requires)")
    if args.moe_flex_dispatcher_backend == "ncclep" and not flex:
        problems.append("--moe-flex-dispatcher-backend ncclep needs "
                        "--moe-token-dispatcher-type flex (as megatron-core requires)")
    if flex and not problems:
        backend = "deepep" if args.moe_enable_deepep else (
            args.moe_flex_dispatcher_backend or "deepep")
        args.flag_notes.append(
            f"note: --moe-token-dispatcher-type flex ({backend}) runs as alltoall here: the "
            f"sequence-split MoE layer drives megatron-core's all-to-all dispatcher (the "
            f"same tokens reach the same experts; the {backend} kernels are not used)")
        args.moe_token_dispatcher_type = "alltoall"
    return problems


def _token_dropping_problems(args):
    if args.moe_expert_capacity_factor is not None and args.moe_expert_capacity_factor < 0:
        args.moe_expert_capacity_factor = None  # megatron-core's: negative means dropless
    problems = []
    if args.moe_pad_expert_input_to_capacity and args.moe_expert_capacity_factor is None:
        problems.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor "
                        "(as megatron-core asserts)")
    if args.moe_expert_capacity_factor is None:
        return problems
    parts = [flag for flag, used in (
        (f"--seq1f1b-splits {args.seq1f1b_splits}", (args.seq1f1b_splits or 1) > 1),
        ("SlimPipe's slices", args.slimpipe_slices is not None),
        (f"--context-parallel-size {args.context_parallel_size}",
         args.context_parallel_size > 1)) if used]
    if parts:
        problems.append(f"--moe-expert-capacity-factor with {' and '.join(parts)}: token "
                        f"dropping decides by the expert load of one forward call, which is "
                        f"then a part of the microbatch, so other tokens would be dropped than "
                        f"unsplit; use --seq1f1b-splits 1 (1F1B) without context parallelism "
                        f"for this model, or drop the flag (every token reaches its experts)")
    return problems


def router_losses_on(args) -> bool:
    """Whether an MoE model's router adds a load-balancing loss or a z-loss."""
    if getattr(args, "num_experts", None) is None:
        return False
    types = args.moe_router_load_balancing_type
    coeffs = args.moe_aux_loss_coeff
    types = types if isinstance(types, list) else [types]
    coeffs = coeffs if isinstance(coeffs, list) else [coeffs] * len(types)
    return args.moe_z_loss_coeff is not None or any(
        t in ("aux_loss", "seq_aux_loss", "global_aux_loss") and c > 0
        for t, c in zip(types, coeffs))


def _given(args, flag):
    defaults = {"--moe-router-topk": 2, "--moe-layer-freq": 1,
                "--moe-router-score-function": "softmax",
                "--moe-router-enable-expert-bias": False,
                "--moe-router-bias-update-rate": 1e-3,
                "--moe-router-load-balancing-type": "aux_loss", "--moe-aux-loss-coeff": 0.0,
                "--moe-token-dispatcher-type": "allgather", "--moe-grouped-gemm": False,
                "--expert-model-parallel-size": 1, "--moe-per-layer-logging": False,
                "--moe-router-pre-softmax": False, "--moe-router-dtype": None,
                "--moe-layer-recompute": False, "--moe-shared-expert-gate": False,
                "--moe-apply-probs-on-input": False, "--moe-enable-deepep": False,
                "--moe-flex-dispatcher-backend": None,
                "--moe-pad-expert-input-to-capacity": False,
                "--moe-token-drop-policy": "probs",
                "--moe-router-force-load-balancing": False, "--moe-input-jitter-eps": None,
                "--moe-use-upcycling": False, "--moe-upcycling-granularity": 1,
                "--moe-router-force-biased": None,
                "--expert-tensor-parallel-size": args.tensor_model_parallel_size}
    value = getattr(args, flag.lstrip("-").replace("-", "_"))
    return value != defaults.get(flag)


def moe_config_fields(args):
    """The TransformerConfig fields of the MoE flags (none for a dense model)."""
    if getattr(args, "num_experts", None) is None:
        return {}
    return dict(
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate,
        moe_apply_probs_on_input=args.moe_apply_probs_on_input,
        moe_layer_freq=args.moe_layer_freq,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_dtype=args.moe_router_dtype,
        moe_router_num_groups=args.moe_router_num_groups,
        moe_router_group_topk=args.moe_router_group_topk,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_grouped_gemm=args.moe_grouped_gemm,
        expert_model_parallel_size=args.expert_model_parallel_size,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=args.moe_token_drop_policy,
        moe_router_force_load_balancing=args.moe_router_force_load_balancing,
        moe_input_jitter_eps=args.moe_input_jitter_eps,
        # megatron-core >= 0.19's field (refused before on older ones)
        **({"moe_router_force_biased": args.moe_router_force_biased}
           if args.moe_router_force_biased is not None else {}),
    )
