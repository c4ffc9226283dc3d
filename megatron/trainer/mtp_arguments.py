"""Megatron-LM's multi-token prediction flags (DeepSeek-V3's MTP): names, defaults and
meanings as in its ``megatron/training/arguments.py`` (0.19), their checks, and the
TransformerConfig fields. The model is megatron-core's MTP block on the last pipeline
stage; under sequence splits its shifts read past each split (``megatron.seqsplit.mtp``)."""

from megatron import mcore_compat

# the MTP flags implemented here; the others (--mtp-standalone, set by a pipeline layout,
# and --mtp-hybrid-override-pattern, for hybrid models) stay refused with their reason
MTP_FLAGS = ("--mtp-num-layers", "--mtp-loss-scaling-factor", "--mtp-use-repeated-layer",
             "--mtp-detach-heads")

# position embeddings whose MTP megatron-core runs (Megatron-LM 0.19's check, less mrope)
MTP_POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")


def add_mtp_arguments(parser):
    g = parser.add_argument_group(
        "multi-token prediction",
        "Megatron-LM's MTP flags with its meanings (DeepSeek-V3); exact under "
        "--seq1f1b-splits (docs/megatron_lm.md#multi-token-prediction)")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="MTP depths: layer k predicts the token k + 1 places ahead from the "
                        "previous depth's output and that token's embedding (on the last "
                        "pipeline stage, with its own loss)")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="weight of the MTP losses' mean over the depths, added to the "
                        "language-model loss")
    g.add_argument("--mtp-use-repeated-layer", action="store_true",
                   help="one MTP layer applied at every depth (megatron-core >= 0.17)")
    g.add_argument("--mtp-detach-heads", action="store_true",
                   help="MTP's inputs from the model and its output head detached: its loss "
                        "trains the MTP layers only (megatron-core >= 0.17)")


def recompute_runs_under_splits() -> bool:
    """Whether megatron-core's MTP layer can be recomputed (full recomputation) with a
    split: up to 0.17 it hands every argument, the split too, to the checkpoint's
    save_for_backward, which takes tensors only; 0.18+ passes the non-tensors by closure
    (``mcore_compat.mtp_recompute_passes_the_split_by_closure``)."""
    return mcore_compat.mtp_recompute_passes_the_split_by_closure()


def recompute_takes_its_arguments() -> bool:
    """Whether megatron-core's MTP layer can run full recomputation at all (not on 0.18,
    ``mcore_compat.mtp_recompute_takes_its_arguments``)."""
    return mcore_compat.mtp_recompute_takes_its_arguments()


def check_mtp_args(args):
    """The combinations that cannot run here stop before any work, one line each;
    returns the problems."""
    depths = args.mtp_num_layers
    problems = []
    for flag, given, field in (("--mtp-use-repeated-layer", args.mtp_use_repeated_layer,
                                "mtp_use_repeated_layer"),
                               ("--mtp-detach-heads", args.mtp_detach_heads,
                                "mtp_detach_heads")):
        if given and not mcore_compat.config_has(field):
            problems.append(f"{flag} needs megatron-core >= 0.17 (the installed one has no "
                            f"{field}): upgrade megatron-core or drop it")
        elif given and not depths:
            args.flag_notes.append(f"note: {flag} has no effect without --mtp-num-layers")
    if not depths:
        return problems
    if depths < 0:
        return problems + [f"--mtp-num-layers must be >= 1, got {depths}"]
    if args.position_embedding_type not in MTP_POSITION_EMBEDDINGS:
        problems.append(f"--mtp-num-layers is not supported with --position-embedding-type "
                        f"{args.position_embedding_type} (Megatron-LM allows "
                        f"{', '.join(MTP_POSITION_EMBEDDINGS)})")
    if args.pipeline_model_parallel_size > 1 and not args.untie_embeddings_and_output_weights:
        problems.append("--mtp-num-layers with pipeline parallelism needs "
                        "--untie-embeddings-and-output-weights (as DeepSeek-V3): with tied "
                        "ones megatron-core's checkpoint of the MTP stage fails its own check")
    if (args.pipeline_model_parallel_size > 1
            and args.position_embedding_type == "learned_absolute"):
        problems.append("--mtp-num-layers with pipeline parallelism and learned absolute "
                        "position embeddings is not supported: megatron-core gives the MTP "
                        "stage its own copy of them, untied from the first stage's (its "
                        "checkpoint fails its own check); use --position-embedding-type rope")
    splits = (args.seq1f1b_splits or 1) > 1 or args.slimpipe_slices is not None
    if splits and args.mtp_use_repeated_layer:
        problems.append("--mtp-use-repeated-layer is not supported under sequence splits yet "
                        "(its one attention layer runs at every depth, and its K/V cache "
                        "keeps one prefix per layer): drop it or run with --seq1f1b-splits 1")
    if (depths and args.recompute_granularity == "full"
            and not recompute_takes_its_arguments()):
        problems.append("--mtp-num-layers with --recompute-granularity full fails inside the "
                        "installed megatron-core (0.18's MTP layer passes padding_mask to a "
                        "checkpointed forward that does not take it): use megatron-core 0.19, "
                        "or --recompute-granularity selective")
    elif splits and args.recompute_granularity == "full" and not recompute_runs_under_splits():
        problems.append("--mtp-num-layers with --recompute-granularity full under sequence "
                        "splits needs megatron-core >= 0.19 (0.16's and 0.17's MTP "
                        "recomputation saves the split with the tensors and fails; 0.18's "
                        "fails on its own): upgrade megatron-core, or use "
                        "--recompute-granularity selective")
    for flag, given in (("--slimpipe-attention-balance", args.slimpipe_attention_balance),
                        ("--window-size", args.window_size is not None)):
        if given:
            problems.append(f"--mtp-num-layers is not supported with {flag} yet: drop one "
                            "of them")
    return problems


def mtp_config_fields(args):
    """TransformerConfig's MTP fields (megatron-core's defaults without MTP)."""
    fields = {"mtp_num_layers": args.mtp_num_layers or None,
              "mtp_loss_scaling_factor": args.mtp_loss_scaling_factor}
    for field in ("mtp_use_repeated_layer", "mtp_detach_heads"):
        if getattr(args, field, False):
            fields[field] = True
    return fields
