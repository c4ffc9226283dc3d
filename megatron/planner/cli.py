"""Command line of tools/plan.py: Megatron-style flags -> PlanConfig -> report."""

import argparse
import json
import sys
from typing import Dict, List, Optional

from megatron.model_shape import ModelShape
from megatron.pipeline_layers import chunk_layer_counts
from megatron.planner.costs import KV_LAYOUTS, Parallel, Recompute
from megatron.planner.gpus import GPUS, GIB, get_gpu
from megatron.planner.predict import PlanConfig, PlanError, Prediction, predict
from megatron.planner.presets import PRESETS, get_preset
from megatron.schedules import registry
from megatron.trainer.arguments import ArgumentError, validate_args
from megatron.trainer.optimizers import optimizer_states
from megatron.trainer.arguments import build_parser as training_parser


def _splits(value: str):
    if value == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}")


_UNSET = object()  # marks a flag the command line did not give


def _planner_flags(parser: argparse.ArgumentParser) -> None:
    """tools/plan.py's own flags, added to the training parser."""
    g = parser.add_argument_group("planner (tools/plan.py only)")
    g.add_argument("--model", choices=list(PRESETS),
                   help="model preset; explicit model flags override its fields")
    g.add_argument("--gpu", choices=list(GPUS), default="a100-80g",
                   help="hardware to predict for; 'cpu' models the CPU kernels (fp32 "
                   "dropout masks, an extra attention output copy per split, attention "
                   "dropout on SDPA's math kernel)")
    g.add_argument("--world-size", type=int,
                   help="GPUs of the run (as torchrun would launch); default TP x PP x CP x DP")
    g.add_argument("--data-parallel-size", type=int,
                   help="DP (default: world size / (TP x PP x CP), or 1)")
    g.add_argument("--schedule", choices=registry.planner_names(),
                   help="default: as --pipeline-schedule; slimpipe when a --slimpipe-* flag "
                   "is given, seq1f1b when --seq1f1b-splits is given (>1 or auto), "
                   "interleaved-1f1b with virtual stages, else 1f1b; interleaved-seq1f1b is "
                   "Seq1F1B over virtual stages")
    g.add_argument("--kv-cache-layout", dest="kv_cache_layout", choices=KV_LAYOUTS,
                   help="as --seq1f1b-kv-cache, plus 'concat' (the original Seq1F1B code: "
                   "each split keeps a concatenated prefix copy). Default: "
                   "--seq1f1b-kv-cache, or chunked with --slimpipe-attention-balance")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    g.add_argument("--timeline-png", metavar="PATH", help="draw the simulated timeline")
    g.add_argument("--memory-png", metavar="PATH", help="draw memory over time per stage")
    g.add_argument("--timeline-json", metavar="PATH",
                   help="write the simulated timeline in the trace format (and PATH.chrome.json)")
    g.add_argument("--compare-published", action="store_true",
                   help="print predicted vs published Seq1F1B memory and TFLOP/s (markdown) and exit")
    g.add_argument("--make-figures", metavar="DIR",
                   help="draw the timeline, memory and comparison pictures into DIR and exit")
    # '--seq1f1b-splits auto' and '--slimpipe-slices auto' arrive here (see _AUTO)
    for flag in sorted(set(_AUTO.values())):
        g.add_argument(flag, action="store_true", help=argparse.SUPPRESS)


# the planner's 'auto' values of integer training flags, rewritten to planner flags
_AUTO = {"--seq1f1b-splits": "--seq1f1b-splits-auto", "--pipe-sp-splits": "--seq1f1b-splits-auto",
         "--slimpipe-slices": "--slimpipe-slices-auto"}


def _rewrite_auto(argv: List[str]) -> List[str]:
    out, i = [], 0
    while i < len(argv):
        flag, _, value = argv[i].partition("=")
        if flag in _AUTO and value == "auto":
            out.append(_AUTO[flag])
        elif flag in _AUTO and not value and i + 1 < len(argv) and argv[i + 1] == "auto":
            out.append(_AUTO[flag])
            i += 1
        else:
            out.append(argv[i])
        i += 1
    return out


def build_parser() -> argparse.ArgumentParser:
    """pretrain_gpt.py's parser (every training flag, data / logging / checkpoint flags
    accepted and ignored) plus the planner's flags."""
    ap = training_parser(_planner_flags)
    ap.prog = "tools/plan.py"
    ap.description = ("Predict memory per pipeline stage, bubble and throughput of a "
                      "pretrain_gpt.py command line by simulating its schedule. See "
                      "docs/planner.md for the cost model.")
    return ap


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse with every flag the command line did not give left at ``_UNSET`` in
    ``args.given`` bookkeeping: presets and planner defaults fill only those."""
    ap = build_parser()
    defaults = vars(ap.parse_args([]))
    ns = argparse.Namespace(**{k: _UNSET for k in defaults})
    ap.parse_args(_rewrite_auto(sys.argv[1:] if argv is None else list(argv)), namespace=ns)
    if getattr(ap, "problems", None):  # the trainer's parser records bad values, goes on
        raise PlanError("; ".join(ap.problems))
    given = {k for k, v in vars(ns).items() if v is not _UNSET}
    for k, v in defaults.items():
        if getattr(ns, k) is _UNSET:
            setattr(ns, k, v)
    if ns.seq1f1b_splits_auto:
        ns.seq1f1b_splits = "auto"
        given.add("seq1f1b_splits")
    if ns.slimpipe_slices_auto:
        ns.slimpipe_slices = "auto"
        given.add("slimpipe_slices")
    ns.given = given
    return ns


_PRESET_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                 "kv_channels", "swiglu", "normalization")


def _training_args(args) -> argparse.Namespace:
    """A copy of ``args`` with the preset and the planner's defaults filled in, checked
    and completed by the trainer's ``validate_args`` (no file is read)."""
    given = getattr(args, "given", None)
    if given is None:  # parsed without parse(): what differs from the defaults was given
        defaults = vars(build_parser().parse_args([]))
        given = {k for k, v in vars(args).items() if defaults.get(k, _UNSET) != v}
    t = argparse.Namespace(**vars(args))
    t.given = given
    if args.model:
        preset = get_preset(args.model)
        for flag in _PRESET_FLAGS:
            if flag not in given:
                setattr(t, flag, getattr(preset, flag))
        if "num_query_groups" not in given and preset.num_query_groups != preset.num_attention_heads:
            t.num_query_groups = preset.num_query_groups
        if "disable_bias_linear" not in given:
            t.disable_bias_linear = not preset.add_bias_linear
        if "hidden_dropout" not in given:
            t.hidden_dropout = 0.1 if preset.hidden_dropout else 0.0
        if "attention_dropout" not in given:
            t.attention_dropout = 0.1 if preset.attention_dropout else 0.0
        if "position_embedding_type" not in given:
            t.position_embedding_type = preset.position_embedding_type
        if "untie_embeddings_and_output_weights" not in given:
            t.untie_embeddings_and_output_weights = preset.untie_embeddings
    elif args.num_layers is None or args.hidden_size is None or args.num_attention_heads is None:
        missing = [f for f, v in (("--num-layers", args.num_layers), ("--hidden-size",
                   args.hidden_size), ("--num-attention-heads", args.num_attention_heads))
                   if v is None]
        raise PlanError(f"give --model PRESET or all of {', '.join(missing)}")
    if t.seq_length is None:
        raise PlanError("--seq-length is required")
    tp, pp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size
    cp = t.context_parallel_size
    dp = t.data_parallel_size or (t.world_size // (tp * pp * cp) if t.world_size else 1)
    world = t.world_size or tp * pp * cp * dp
    if world != tp * pp * cp * dp:
        raise PlanError(f"--world-size {world} != TP {tp} x PP {pp} x CP {cp} x DP {dp} = "
                        f"{tp * pp * cp * dp}")
    if t.global_batch_size is None:  # the planner's default: 2 x PP microbatches
        t.global_batch_size = t.micro_batch_size * dp * 2 * pp
    t.train_iters = 1 if t.train_iters is None else t.train_iters
    if not (t.data_path or t.data_args_path or t.train_data_path or t.per_split_data_args_path):
        t.mock_data = True
    if t.vocab_size is None and t.tokenizer_type in (None, "NullTokenizer"):
        t.vocab_size = (get_preset(args.model).vocab_size if args.model else 50257)
        t.tokenizer_type = t.tokenizer_type or "NullTokenizer"
    if t.recompute_granularity == "full" and t.recompute_method is None:
        t.recompute_method = "uniform"
    # planner-only values the training checks do not know
    t.seq1f1b_splits = t.seq1f1b_splits if isinstance(t.seq1f1b_splits, int) else 1
    t.slimpipe_slices = t.slimpipe_slices if isinstance(t.slimpipe_slices, int) else None
    layout = args.kv_cache_layout
    if layout is None and "seq1f1b_kv_cache" not in given and args.slimpipe_attention_balance:
        layout = "chunked"
    t.seq1f1b_kv_cache = "chunked" if layout == "chunked" else (
        "buffer" if layout else t.seq1f1b_kv_cache)
    t.pipeline_schedule = None if args.schedule else t.pipeline_schedule
    if args.schedule or isinstance(args.slimpipe_slices, str):
        t.slimpipe_slices = t.slimpipe_slice_length = None  # checked by the planner
        t.slimpipe_attention_balance = False
    cuda = get_gpu(args.gpu).kind != "cpu"
    try:
        validate_args(t, world, cuda_available=cuda, check_files=False)
    except ArgumentError as err:
        raise PlanError(str(err)) from None
    t.kv_cache_layout = layout or t.seq1f1b_kv_cache
    return t


def model_from_args(args, t=None) -> ModelShape:
    """The model of a (validated) training command line."""
    t = t or _training_args(args)
    vocab = t.vocab_size  # NullTokenizer's --vocab-size is its vocabulary (Megatron-LM 0.18+)
    if t.tokenizer_type == "GPT2BPETokenizer":
        vocab = 50257
    shape = ModelShape.from_args(t, vocab_size=vocab, name=args.model or "custom")
    try:  # the trainer's refusal of a --padded-vocab-size below the tokenizer's, here too
        shape.padded_vocab_size(t.tensor_model_parallel_size)
    except ValueError as err:
        raise PlanError(str(err)) from None
    return shape


def config_from_args(args) -> PlanConfig:
    t = _training_args(args)
    model = model_from_args(args, t)
    tp, pp, dp = (t.tensor_model_parallel_size, t.pipeline_model_parallel_size,
                  t.data_parallel_size)
    chunks, chunk_layers = 1, None
    accounted = (t.account_for_embedding_in_pipeline_split
                 or t.account_for_loss_in_pipeline_split)
    if getattr(t, "chunk_layer_counts", None) is not None:  # --pipeline-model-parallel-layout
        chunks = t.virtual_pipeline_model_parallel_size or 1
        chunk_layers = tuple(t.chunk_layer_counts) if chunks > 1 else None
    elif accounted and (t.virtual_pipeline_model_parallel_size or 1) > 1:
        # the trainer counted the slots (--num-layers-per-virtual-pipeline-stage
        # included); the first / last chunk holds a layer fewer than its rank's others
        chunks = t.virtual_pipeline_model_parallel_size
        chunk_layers = tuple(chunk_layer_counts(
            t.stage_layer_counts, chunks, t.account_for_embedding_in_pipeline_split,
            t.account_for_loss_in_pipeline_split))
    elif args.num_layers_per_virtual_pipeline_stage:
        per_stage = model.num_layers // max(pp, 1)
        n = args.num_layers_per_virtual_pipeline_stage
        if n < 1 or model.num_layers % max(pp, 1) or per_stage % n:
            raise PlanError(
                f"--num-layers-per-virtual-pipeline-stage {n} must divide the "
                f"{model.num_layers}/{pp} layers per pipeline stage"
            )
        chunks = per_stage // n
    if args.virtual_pipeline_model_parallel_size and chunk_layers is None:
        if args.num_layers_per_virtual_pipeline_stage:
            raise PlanError("give --num-layers-per-virtual-pipeline-stage or "
                            "--virtual-pipeline-model-parallel-size, not both")
        chunks = args.virtual_pipeline_model_parallel_size
        uneven = (t.decoder_first_pipeline_num_layers is not None
                  or t.decoder_last_pipeline_num_layers is not None)  # checked by the trainer
        if chunks < 1 or not uneven and model.num_layers % (max(pp, 1) * chunks):
            raise PlanError(f"--virtual-pipeline-model-parallel-size {chunks}: --num-layers "
                            f"{model.num_layers} must be divisible by PP {pp} x {chunks}")
    micro = args.micro_batch_size
    # the batch that trains (--decrease-batch-size-if-needed: the multiple below the given)
    gbs = t.num_microbatches * micro * dp
    schedule = args.schedule
    if schedule is None and "pipeline_schedule" in getattr(args, "given", ()):
        schedule = args.pipeline_schedule if args.pipeline_schedule != "1f1b" else None
    splits = args.seq1f1b_splits
    if schedule == "interleaved-seq1f1b":
        if chunks < 2:
            raise PlanError("--schedule interleaved-seq1f1b needs "
                            "--num-layers-per-virtual-pipeline-stage smaller than the layers "
                            "per pipeline stage (at least 2 virtual stages)")
        schedule = "seq1f1b"  # Seq1F1B over the interleaved order of the chunks
    slim = [f for f, v in (("--slimpipe-slices", args.slimpipe_slices),
                           ("--slimpipe-slice-length", args.slimpipe_slice_length)) if v]
    if schedule is None and slim:
        schedule = "slimpipe"
    if slim and schedule != "slimpipe":
        raise PlanError(f"{slim[0]} needs --schedule slimpipe (got --schedule {schedule})")
    if args.slimpipe_attention_balance and schedule != "slimpipe":
        raise PlanError("--slimpipe-attention-balance needs --schedule slimpipe (got "
                        + (f"--schedule {schedule})" if schedule else "no --schedule)"))
    if schedule == "slimpipe":
        if len(slim) == 2:
            raise PlanError("give --slimpipe-slices or --slimpipe-slice-length, not both")
        if splits not in (None, 1):
            raise PlanError("--seq1f1b-splits does not combine with --schedule slimpipe "
                            "(its slices replace the splits); use --slimpipe-slices")
        splits = args.slimpipe_slices
        if args.slimpipe_slice_length:
            length = args.slimpipe_slice_length
            if args.seq_length % length:
                raise PlanError(f"--slimpipe-slice-length {length} does not divide "
                                f"--seq-length {args.seq_length}")
            splits = args.seq_length // length
        if splits is None:
            raise PlanError("--schedule slimpipe needs --slimpipe-slices N (a multiple of "
                            f"--pipeline-model-parallel-size {pp}) or --slimpipe-slice-length L")
    if schedule is None:
        if splits == "auto" or (isinstance(splits, int) and splits > 1):
            schedule = "seq1f1b"
        elif chunks > 1:
            schedule = "interleaved-1f1b"
        else:
            schedule = "1f1b"
    if splits is None:
        splits = "auto" if schedule == "seq1f1b" else 1
    par = Parallel(
        tp=tp, pp=pp, dp=dp, num_chunks=chunks, micro_batch_size=micro,
        global_batch_size=gbs, sequence_parallel=t.sequence_parallel,
        distributed_optimizer=args.use_distributed_optimizer,
        optimizer_states=optimizer_states(args),
        stage_layers=(None if len(set(t.stage_layer_counts)) == 1
                      else tuple(t.stage_layer_counts)),
        chunk_layers=chunk_layers,
        ep=getattr(t, "expert_model_parallel_size", 1) or 1,
        moe_dispatcher=getattr(t, "moe_token_dispatcher_type", "allgather"),
        etp=getattr(t, "expert_tensor_parallel_size", None),
        cp=t.context_parallel_size,
    )
    return PlanConfig(
        model=model,
        seq_length=args.seq_length,
        parallel=par,
        schedule=schedule,
        splits=splits,
        balance_method=args.seq1f1b_balance_method,
        split_alignment=t.seq1f1b_alignment,
        recompute=Recompute(t.recompute_granularity, t.recompute_method or "uniform",
                            t.recompute_num_layers or 1,
                            modules=tuple(t.recompute_modules or ("core_attn",))),
        gpu=args.gpu,
        kv_layout=t.kv_cache_layout,
        microbatch_group_size=args.microbatch_group_size_per_virtual_pipeline_stage,
        attention_balance=args.slimpipe_attention_balance,
        attention_balance_exchange_cost=(
            args.slimpipe_attention_balance_exchange_cost
            if "slimpipe_attention_balance_exchange_cost" in getattr(args, "given", ()) else None),
        act_bytes=2 if (t.bf16 or t.fp16) else 4,
        packed_documents=bool(getattr(t, "reset_attention_mask", False)),
    )


def _fmt_time(t: float) -> str:
    return f"{t:.3f} s" if t >= 1 else f"{t * 1e3:.1f} ms"


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def _model_lines(pred: Prediction) -> List[str]:
    """Parameters (total and active per token), and for MoE / MLA their shape lines."""
    m, p = pred.config.model, pred.config.parallel
    total, active = m.parameter_count(), m.parameter_count(active=True)
    lines = [f"parameters: {_count(total)} total, {_count(active)} active per token "
             f"({active / total:.1%}; FLOPs count the active ones)"]
    if m.multi_latent_attention:
        lines.append(
            f"multi-latent attention: q LoRA rank {m.q_lora_rank or 'none'}, kv LoRA rank "
            f"{m.kv_lora_rank}, head dims qk {m.qk_head_dim} + rope {m.qk_pos_emb_head_dim}, "
            f"v {m.v_head_dim}; K/V cache {m.kv_values_per_token()} values per token and "
            "layer (decompressed keys and values of every head)")
    if m.num_experts is not None:
        moe = sum(map(m.is_moe_layer, range(m.num_layers)))
        shared = (f" + shared expert FFN {m.moe_shared_ffn_hidden_size}"
                  if m.moe_shared_ffn_hidden_size else "")
        volume = [pred.cost.moe_comm_bytes(p.micro_batch_size * n) / 2**20
                  for n in sorted(set(pred.split_lengths))]
        lines.append(
            f"experts: {moe} of {m.num_layers} layers MoE, {m.num_experts} experts of FFN "
            f"{m.expert_ffn}, top-{m.moe_topk}{shared}; EP {p.ep} ({m.num_experts // p.ep} "
            f"experts per GPU), ETP {p.expert_tp}, {p.moe_dispatcher} dispatcher "
            + ("moves " + "/".join(f"{v:.2f}" for v in volume)
               + " MiB per MoE layer and split forward (as much backward)" if any(volume)
               else "moves nothing between expert-parallel ranks (EP 1)"))
    return lines


def _packed_documents_note(pred: Prediction) -> Optional[str]:
    """What the GPU memory table assumes of packed documents' attention: flash-attn's
    varlen kernel (or, without dropout, FlexAttention), which keep no dense mask. With
    attention dropout and no flash-attn on the machine, SDPA runs instead and keeps a
    dense additive mask per split in flight, which the table does not count (the planner
    cannot see what the training machine has installed)."""
    c, cost = pred.config, pred.cost
    # (the chunked cache has no dropout; a recomputed kernel keeps no mask)
    if (not c.packed_documents or cost.on_cpu or not c.model.attention_dropout
            or c.recompute.attention_kernel):
        return None
    largest = max(cost.sdpa_document_bias_bytes(j) for j in range(pred.splits)) / GIB
    return ("packed documents (--reset-attention-mask) with attention dropout: the table "
            "assumes flash-attn is installed (its varlen kernel keeps no mask); without it "
            "SDPA keeps a dense document mask per split in flight, up to "
            f"{largest:.2f} GB each, not counted above (--attention-dropout 0 runs "
            "FlexAttention, which keeps none)")


def report(pred: Prediction) -> str:
    c, p, g = pred.config, pred.config.parallel, pred.gpu
    lines = []
    m = c.model
    lines.append(
        f"model {m.name}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
        f"({m.num_query_groups} K/V groups), FFN {m.ffn_hidden_size} {'SwiGLU' if m.swiglu else 'GeLU'}, "
        f"vocab {m.vocab_size} (padded to {m.padded_vocab_size(p.tp)})"
    )
    lines.extend(_model_lines(pred))
    lines.append(
        f"layout: TP {p.tp} x PP {p.pp} x "
        + (f"CP {p.cp} x " if p.cp > 1 else "")
        + f"DP {p.dp} = {p.world_size} x {g.name}; "
        f"virtual stages {p.num_chunks}; "
        + (f"layers per stage {'+'.join(map(str, p.stage_layers))}; " if p.stage_layers else "")
        + (f"layers per chunk {'+'.join(map(str, p.chunk_layers))}; " if p.chunk_layers else "")
        + f"seq {c.seq_length}; micro-batch {p.micro_batch_size}; "
        f"global batch {p.global_batch_size} ({p.num_microbatches} microbatches); "
        f"SP {'on' if p.sequence_parallel else 'off'}; distributed optimizer "
        f"{'on' if p.distributed_optimizer else 'off'}; recompute {c.recompute.granularity or 'none'}"
        + (f" ({' '.join(c.recompute.modules)})" if c.recompute.granularity == "selective"
           else "")
    )
    sched = c.schedule
    if c.schedule == "seq1f1b":
        sched += f", {pred.splits} splits ({c.balance_method}): lengths {pred.split_lengths}"
    if c.schedule == "slimpipe":
        sched += (f", {pred.splits} uniform slices of {pred.split_lengths[0]} tokens, "
                  f"{p.num_chunks} virtual stage(s)")
        if c.attention_balance:
            sched += ", attention balance"
    lines.append(f"schedule: {sched}")
    lines.append("")
    head = (f"{'stage':>5} {'weights':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'kv':>8} "
            f"{'total':>8} {'reserved':>9}  {'in-flight':>9}")
    lines.append(f"memory per GPU (GB = 2^30 bytes) at each stage's peak; {c.act_bytes * 8}-bit "
                 "activations; total = allocated, reserved = the allocator's estimate:")
    lines.append(head)
    for r, s in enumerate(pred.stages):
        flag = "  OOM" if s["reserved"] * GIB > g.usable_bytes else ""
        lines.append(
            f"{r:>5} {s['weights']:8.2f} {s['gradients']:8.2f} {s['optimizer']:8.2f} "
            f"{s['activations']:8.2f} {s['kv_cache']:8.2f} {s['total']:8.2f} {s['reserved']:9.2f}  "
            f"{s['in_flight_units_peak']:>9}{flag}"
        )
    lines.append(
        f"GPU memory {g.memory_gib:.1f} GB, usable {g.usable_bytes / GIB:.1f} GB "
        f"(reserve {g.reserved_gib} GB); peak allocated {pred.peak_memory_gb:.2f} GB, "
        f"reserved (estimate, +{g.allocator_overhead:.0%} of activations + KV) "
        f"{pred.peak_reserved_gb:.2f} GB -> "
        + ("OUT OF MEMORY" if pred.oom else "fits")
    )
    note = _packed_documents_note(pred)
    if note:
        lines.append(note)
    lines.append("")
    lines.append(f"bubble fraction        {pred.bubble_fraction:.1%}")
    lines.append(f"pipeline time          {_fmt_time(pred.pipeline_time_s)}")
    lines.append(f"iteration time         {_fmt_time(pred.iteration_time_s)}")
    lines.append(f"tokens/s               {pred.tokens_per_s:,.0f}")
    lines.append(
        f"TFLOP/s per GPU        {pred.tflops_per_gpu:.1f} (causal model FLOPs; "
        f"{pred.tflops_per_gpu_full_attention:.1f} counting full S^2 attention as Narayanan et al. 2021)"
    )
    ab = pred.attention_balance
    if ab is not None:
        change = ab["pipeline_time_s"] / ab["pipeline_time_s_unbalanced"] - 1.0
        lines.append("")
        lines.append(
            f"attention balance      {ab['pairs']} pairs ({ab['paired_units']} of "
            f"{ab['units']} units), {ab['moved_attention_fraction']:.2%} of the attention "
            f"work moved, exchanges {_fmt_time(ab['exchange_time_s'])} in total"
        )
        lines.append(
            f"  exchange cost        {ab['exchange_cost']:.4g} per K/V chunk (train with "
            f"--slimpipe-attention-balance-exchange-cost {ab['exchange_cost']:.4g} for this "
            "plan)"
        )
        lines.append(
            f"  without balance      bubble {ab['bubble_fraction_unbalanced']:.1%}, "
            f"pipeline time {_fmt_time(ab['pipeline_time_s_unbalanced'])}"
        )
        lines.append(
            f"  with balance         bubble {ab['bubble_fraction']:.1%}, "
            f"pipeline time {_fmt_time(ab['pipeline_time_s'])} ({change:+.1%})"
        )
        if change > 0:
            lines.append("  (slower: the exchanges cost more than the balancing saves on this "
                         "layout, e.g. across nodes; leave --slimpipe-attention-balance off)")
    if pred.auto_candidates:
        lines.append("")
        slim = c.schedule == "slimpipe"
        lines.append(f"{'--slimpipe-slices' if slim else '--seq1f1b-splits'} auto tried:")
        for cand in pred.auto_candidates:
            mark = "  <- chosen" if cand["splits"] == pred.splits else ""
            lines.append(
                f"  {'n' if slim else 's'}={cand['splits']:>2}: {cand['tokens_per_s']:>12,.0f} tokens/s, "
                f"peak {cand['peak_memory_gb']:6.2f} GB{'  OOM' if cand['oom'] else ''}{mark}"
            )
    return "\n".join(lines)


def balance_records(pred: Prediction) -> Optional[Dict]:
    """Extra timeline record keys of the paired units (``trace.from_simulation``)."""
    if pred.balance_plan is None:
        return None
    out = {}
    for rank, offloads in enumerate(pred.balance_plan.offloads):
        for unit, o in offloads.items():
            out[(rank, unit)] = {"role": o.role, "peer": o.peer,
                                 "wait": pred.pair_waits[(rank, unit)]}
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = build_parser()
    try:
        args = parse(argv)
    except (ArgumentError, PlanError) as err:
        ap.exit(2, f"{ap.prog}: error: {err}\n")
    if args.compare_published or args.make_figures:
        from megatron.planner import published

        if args.compare_published:
            print("Peak memory per GPU (GB), A100 80GB\n")
            print(published.memory_table_markdown(published.compare_memory()))
            print("\n7B on 32 A100s, TFLOP/s per GPU\n")
            print(published.tflops_table_markdown(published.compare_tflops()))
        if args.make_figures:
            for path in published.make_figures(args.make_figures):
                print(f"wrote {path}")
        return 0
    if args.seq_length is None:
        ap.exit(2, f"{ap.prog}: error: the following arguments are required: --seq-length\n")
    try:
        config = config_from_args(args)
        pred = predict(config)
    except PlanError as err:
        ap.exit(2, f"{ap.prog}: error: {err}\n")
    title = (
        f"{config.model.name} seq {config.seq_length} {pred.config.schedule}"
        + (f" s={pred.splits}" if pred.config.schedule == "seq1f1b" else "")
        + (f" n={pred.splits} v={config.parallel.num_chunks}"
           if pred.config.schedule == "slimpipe" else "")
        + f" TP{config.parallel.tp} PP{config.parallel.pp} DP{config.parallel.dp} on {pred.gpu.name}"
    )
    if args.timeline_png or args.timeline_json:
        from megatron.schedules import timeline as trace

        meta = {"title": title, "schedule": pred.config.schedule, "splits": pred.splits}
        if pred.attention_balance is not None:
            meta["attention_balance"] = pred.attention_balance
        tl = trace.from_simulation(pred.sim, meta, balance_records(pred))
        if args.timeline_json:
            trace.write_timeline(args.timeline_json, tl)
            trace.write_chrome_trace(trace.chrome_trace_path(args.timeline_json), tl)
        if args.timeline_png:
            from megatron.planner.draw import draw_timeline, draw_timelines

            if pred.attention_balance is None:
                draw_timeline(tl, args.timeline_png, title)
            else:  # without and with the redistribution, on one time axis
                plain = trace.from_simulation(pred.sim_unbalanced, dict(meta, title=title))
                ab = pred.attention_balance
                draw_timelines(
                    [plain, tl], args.timeline_png,
                    ["without attention balance",
                     f"with attention balance: {ab['pairs']} pairs, "
                     f"{ab['moved_attention_fraction']:.1%} of the attention work moved"],
                    suptitle=title,
                )
    if args.memory_png:
        from megatron.planner.draw import draw_memory, memory_series

        draw_memory(memory_series(pred), args.memory_png, pred.gpu.memory_gib,
                    pred.gpu.usable_bytes / GIB, title)
    if args.json:
        print(json.dumps(pred.to_json(), indent=1))
    else:
        print(report(pred))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
