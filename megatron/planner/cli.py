"""Command line of tools/plan.py: Megatron-style flags -> PlanConfig -> report."""

import argparse
import json
import sys
from typing import Dict, List, Optional

from megatron.planner.costs import KV_LAYOUTS, Parallel, Recompute
from megatron.planner.gpus import GPUS, GIB
from megatron.planner.predict import SCHEDULES, PlanConfig, PlanError, Prediction, predict
from megatron.planner.presets import PRESETS, ModelSpec, get_preset
from megatron.seqsplit.plan import BALANCE_METHODS


def _splits(value: str):
    if value == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="tools/plan.py",
        description="Predict memory per pipeline stage, bubble and throughput of a Megatron "
        "training configuration under 1F1B, interleaved 1F1B or Seq1F1B, by simulating "
        "the schedule. See docs/planner.md for the cost model.",
    )
    m = ap.add_argument_group("model (a preset, or explicit Megatron flags; flags override the preset)")
    m.add_argument("--model", choices=list(PRESETS), help="model preset")
    m.add_argument("--num-layers", type=int)
    m.add_argument("--hidden-size", type=int)
    m.add_argument("--num-attention-heads", type=int)
    m.add_argument("--num-query-groups", type=int, help="K/V groups (GQA); default: heads")
    m.add_argument("--group-query-attention", action="store_true", help="accepted for Megatron compatibility")
    m.add_argument("--ffn-hidden-size", type=int, help="default 4h (SwiGLU: Megatron's 8h/3 rounded to 64)")
    m.add_argument("--kv-channels", type=int)
    m.add_argument("--swiglu", action="store_true", default=None)
    m.add_argument("--vocab-size", type=int, help="default 50257 (GPT-2 BPE) without a preset")
    m.add_argument("--disable-bias-linear", action="store_true", default=None)
    m.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"])
    m.add_argument("--hidden-dropout", type=float)
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="accepted; the planner always counts an output layer on the last stage")

    p = ap.add_argument_group("parallelism and batch")
    p.add_argument("--seq-length", type=int)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--global-batch-size", type=int,
                   help="default: 2 x pipeline size microbatches per data-parallel rank")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--world-size", type=int, help="optional check: must equal TP x PP x DP")

    s = ap.add_argument_group("schedule")
    s.add_argument("--schedule", choices=SCHEDULES + ("interleaved-seq1f1b",),
                   help="default: slimpipe when a --slimpipe-* flag is given, seq1f1b when "
                   "--seq1f1b-splits is given (>1 or auto), interleaved-1f1b with virtual "
                   "stages, else 1f1b; seq1f1b with virtual stages is interleaved Seq1F1B "
                   "(interleaved-seq1f1b names it explicitly)")
    s.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    s.add_argument("--virtual-pipeline-model-parallel-size", type=int,
                   help="model chunks per pipeline rank (instead of "
                   "--num-layers-per-virtual-pipeline-stage)")
    s.add_argument("--slimpipe-slices", type=int,
                   help="SlimPipe: uniform slices per microbatch (a multiple of the PP size)")
    s.add_argument("--slimpipe-slice-length", type=int,
                   help="SlimPipe: tokens per slice, dividing --seq-length (instead of "
                   "--slimpipe-slices)")
    s.add_argument("--slimpipe-attention-balance", action="store_true",
                   help="SlimPipe: redistribute attention work between concurrent heavy and "
                   "light slice units of different ranks (simulated; the report shows the "
                   "bubble with and without it)")
    s.add_argument("--slimpipe-attention-balance-exchange-cost", type=float,
                   help="the plan's communication cost per K/V chunk, as pretrain_gpt.py "
                   "takes it (default: derived from the GPU's links and attention speed and "
                   "printed, to pass to training)")
    s.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int,
                   help="interleaved schedule group size (megatron-core default: PP size)")
    s.add_argument("--seq1f1b-splits", "--pipe-sp-splits", dest="seq1f1b_splits", type=_splits,
                   help="N or 'auto' (best predicted throughput that fits)")
    s.add_argument("--seq1f1b-balance-method", "--pipe-sp-strategy", dest="seq1f1b_balance_method",
                   choices=BALANCE_METHODS, default="average")
    s.add_argument("--seq1f1b-split-alignment", type=int,
                   help="split lengths are multiples of this (default: TP size with --sequence-parallel, else 1)")
    s.add_argument("--kv-cache-layout", "--seq1f1b-kv-cache", dest="kv_cache_layout",
                   choices=KV_LAYOUTS, default=None,
                   help="buffer: one full-length K/V buffer per in-flight microbatch; chunked: "
                   "per-split chunks (both this project's executor, --seq1f1b-kv-cache); concat: "
                   "each split keeps a concatenated prefix copy (original Seq1F1B code). Default: "
                   "chunked with --slimpipe-attention-balance (which needs it), else buffer")
    s.add_argument("--recompute-granularity", choices=["full", "selective"])
    s.add_argument("--recompute-method", choices=["uniform", "block"], default="uniform")
    s.add_argument("--recompute-num-layers", type=int, default=1)

    o = ap.add_argument_group("hardware and output")
    o.add_argument("--gpu", choices=list(GPUS), default="a100-80g")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    o.add_argument("--timeline-png", metavar="PATH", help="draw the simulated timeline")
    o.add_argument("--memory-png", metavar="PATH", help="draw memory over time per stage")
    o.add_argument("--timeline-json", metavar="PATH",
                   help="write the simulated timeline in the trace format (and PATH.chrome.json)")
    o.add_argument("--compare-published", action="store_true",
                   help="print predicted vs published Seq1F1B memory and TFLOP/s (markdown) and exit")
    o.add_argument("--make-figures", metavar="DIR",
                   help="draw the timeline, memory and comparison pictures into DIR and exit")
    return ap


def model_from_args(args) -> ModelSpec:
    if args.model:
        base = get_preset(args.model)
    else:
        missing = [
            flag for flag, v in (
                ("--num-layers", args.num_layers),
                ("--hidden-size", args.hidden_size),
                ("--num-attention-heads", args.num_attention_heads),
            ) if v is None
        ]
        if missing:
            raise PlanError(f"give --model PRESET or all of {', '.join(missing)}")
        h = args.hidden_size
        swiglu = bool(args.swiglu)
        ffn = args.ffn_hidden_size or (int(4 * h * 2 / 3 / 64) * 64 if swiglu else 4 * h)
        base = ModelSpec(
            name="custom",
            num_layers=args.num_layers,
            hidden_size=h,
            num_attention_heads=args.num_attention_heads,
            num_query_groups=args.num_query_groups or args.num_attention_heads,
            ffn_hidden_size=ffn,
            swiglu=swiglu,
            vocab_size=args.vocab_size or 50257,
        )
    overrides = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        swiglu=args.swiglu,
        vocab_size=args.vocab_size,
        normalization=args.normalization,
        add_bias_linear=False if args.disable_bias_linear else None,
        hidden_dropout=None if args.hidden_dropout is None else args.hidden_dropout > 0,
    )
    spec = base.with_overrides(**overrides)
    if args.model and args.num_attention_heads and args.num_query_groups is None:
        if base.num_query_groups == base.num_attention_heads:  # MHA preset stays MHA
            spec = spec.with_overrides(num_query_groups=spec.num_attention_heads)
    return spec


def config_from_args(args) -> PlanConfig:
    model = model_from_args(args)
    tp, pp, dp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.data_parallel_size)
    if args.world_size is not None and args.world_size != tp * pp * dp:
        raise PlanError(
            f"--world-size {args.world_size} != TP {tp} x PP {pp} x DP {dp} = {tp * pp * dp}"
        )
    chunks = 1
    if args.num_layers_per_virtual_pipeline_stage:
        per_stage = model.num_layers // max(pp, 1)
        n = args.num_layers_per_virtual_pipeline_stage
        if n < 1 or model.num_layers % max(pp, 1) or per_stage % n:
            raise PlanError(
                f"--num-layers-per-virtual-pipeline-stage {n} must divide the "
                f"{model.num_layers}/{pp} layers per pipeline stage"
            )
        chunks = per_stage // n
    if args.virtual_pipeline_model_parallel_size:
        if args.num_layers_per_virtual_pipeline_stage:
            raise PlanError("give --num-layers-per-virtual-pipeline-stage or "
                            "--virtual-pipeline-model-parallel-size, not both")
        chunks = args.virtual_pipeline_model_parallel_size
        if chunks < 1 or model.num_layers % (max(pp, 1) * chunks):
            raise PlanError(f"--virtual-pipeline-model-parallel-size {chunks}: --num-layers "
                            f"{model.num_layers} must be divisible by PP {pp} x {chunks}")
    micro = args.micro_batch_size
    gbs = args.global_batch_size or micro * dp * 2 * pp
    schedule = args.schedule
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
        global_batch_size=gbs, sequence_parallel=args.sequence_parallel,
        distributed_optimizer=args.use_distributed_optimizer,
    )
    return PlanConfig(
        model=model,
        seq_length=args.seq_length,
        parallel=par,
        schedule=schedule,
        splits=splits,
        balance_method=args.seq1f1b_balance_method,
        split_alignment=args.seq1f1b_split_alignment,
        recompute=Recompute(args.recompute_granularity, args.recompute_method,
                            args.recompute_num_layers),
        gpu=args.gpu,
        kv_layout=args.kv_cache_layout or (
            "chunked" if args.slimpipe_attention_balance else "buffer"),
        microbatch_group_size=args.microbatch_group_size_per_virtual_pipeline_stage,
        attention_balance=args.slimpipe_attention_balance,
        attention_balance_exchange_cost=args.slimpipe_attention_balance_exchange_cost,
    )


def _fmt_time(t: float) -> str:
    return f"{t:.3f} s" if t >= 1 else f"{t * 1e3:.1f} ms"


def report(pred: Prediction) -> str:
    c, p, g = pred.config, pred.config.parallel, pred.gpu
    lines = []
    m = c.model
    lines.append(
        f"model {m.name}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
        f"({m.num_query_groups} K/V groups), FFN {m.ffn_hidden_size} {'SwiGLU' if m.swiglu else 'GeLU'}, "
        f"vocab {m.vocab_size}"
    )
    lines.append(
        f"layout: TP {p.tp} x PP {p.pp} x DP {p.dp} = {p.world_size} x {g.name}; "
        f"virtual stages {p.num_chunks}; seq {c.seq_length}; micro-batch {p.micro_batch_size}; "
        f"global batch {p.global_batch_size} ({p.num_microbatches} microbatches); "
        f"SP {'on' if p.sequence_parallel else 'off'}; distributed optimizer "
        f"{'on' if p.distributed_optimizer else 'off'}; recompute {c.recompute.granularity or 'none'}"
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
    head = f"{'stage':>5} {'weights':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'kv':>8} {'total':>8}  {'in-flight':>9}"
    lines.append("memory per GPU (GB = 2^30 bytes) at each stage's peak:")
    lines.append(head)
    for r, s in enumerate(pred.stages):
        flag = "  OOM" if s["total"] * GIB > g.usable_bytes else ""
        lines.append(
            f"{r:>5} {s['weights']:8.2f} {s['gradients']:8.2f} {s['optimizer']:8.2f} "
            f"{s['activations']:8.2f} {s['kv_cache']:8.2f} {s['total']:8.2f}  "
            f"{s['in_flight_units_peak']:>9}{flag}"
        )
    lines.append(
        f"GPU memory {g.memory_gib:.1f} GB, usable {g.usable_bytes / GIB:.1f} GB "
        f"(reserve {g.reserved_gib} GB); peak {pred.peak_memory_gb:.2f} GB -> "
        + ("OUT OF MEMORY" if pred.oom else "fits")
    )
    lines.append("")
    lines.append(f"bubble fraction        {pred.bubble_fraction:.1%}")
    lines.append(f"pipeline time          {_fmt_time(pred.pipeline_time_s)}")
    lines.append(f"iteration time         {_fmt_time(pred.iteration_time_s)}")
    lines.append(f"tokens/s               {pred.tokens_per_s:,.0f}")
    lines.append(
        f"TFLOP/s per GPU        {pred.tflops_per_gpu:.1f} (causal model FLOPs; "
        f"{pred.tflops_per_gpu_full_attention:.1f} counting full S^2 attention as Megatron-LM's formula)"
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
        lines.append("--seq1f1b-splits auto tried:")
        for cand in pred.auto_candidates:
            mark = "  <- chosen" if cand["splits"] == pred.splits else ""
            lines.append(
                f"  s={cand['splits']:>2}: {cand['tokens_per_s']:>12,.0f} tokens/s, "
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
    args = ap.parse_args(argv)
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
        ap.error("the following arguments are required: --seq-length")
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
        from megatron.planner import trace

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
