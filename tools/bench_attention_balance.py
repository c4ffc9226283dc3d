"""SlimPipe with and without --slimpipe-attention-balance: throughput, bubble, loss.

    python tools/bench_attention_balance.py                 # CPU: pp=2, v=2, n=8, m=4
    python tools/bench_attention_balance.py --runs 5 --quiet-threshold 0.5 \\
        --quiet-max-wait 120 --json runs/bench_attention_balance/result.json

One torchrun launch (``--pp`` processes, ``megatron.benchmarks.runner``) trains the
same model on the same mock data from the same seed with SlimPipe and the chunked KV
cache (``--pipeline-schedule slimpipe --slimpipe-slices N
--virtual-pipeline-model-parallel-size V --seq1f1b-kv-cache chunked``), once plain and
once with ``--slimpipe-attention-balance``:

1. ``--runs`` rounds, each one timed run of both (the order alternates from round to
   round; ``--warmup-iters`` + ``--timed-iters`` iterations, tokens/s over the timed
   ones); the paired ratio of a round is balanced tokens/s over plain tokens/s;
2. ``--timeline-runs`` rounds (default 1) also record a ``--timeline-file`` run of
   both: bubble per stage (idle / span) and the per-stage busy time.

Prints a Markdown table, the plan's numbers (pairs, share of attention moved, the cost
model's predicted makespan ratio) and the same prediction with the GEMM / attention
ratio fitted to the plain run's recorded units; checks that every run's losses equal
the plain run's (relative ``--loss-rtol``, exit 1 otherwise). ``--json PATH`` writes
everything. See megatron/benchmarks/slimpipe_balance.py.
"""

import argparse
import json
import os
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.benchmarks.pipeline import model_argv  # noqa: E402
from megatron.benchmarks.slimpipe_balance import (  # noqa: E402
    build_balance_spec,
    build_configs,
    format_balance_report,
    json_balance_report,
    model_costs,
    plan_numbers,
    slimpipe_argv,
    summarize_balance,
)
from tools.bench import add_machine_args, launch, machine_notes, quiet_options  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = parser.add_argument_group("schedule")
    g.add_argument("--pp", type=int, default=2, help="pipeline stages (= processes)")
    g.add_argument("--vp", type=int, default=2, help="virtual stages (model chunks) per rank")
    g.add_argument("--slices", type=int, default=8, help="SlimPipe slices per microbatch (n)")
    g.add_argument("--microbatches", type=int, default=4, help="microbatches per iteration (m)")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g = parser.add_argument_group("measurement")
    g.add_argument("--runs", type=int, default=3, help="rounds of timed runs")
    g.add_argument("--warmup-iters", type=int, default=1)
    g.add_argument("--timed-iters", type=int, default=2)
    g.add_argument("--timeline-runs", type=int, default=1,
                   help="rounds that also record a timeline run of each configuration")
    add_machine_args(g)
    g.add_argument("--loss-rtol", type=float, default=1e-5,
                   help="largest relative loss difference accepted between the two")
    g = parser.add_argument_group("model (GPT, RoPE, LayerNorm, GeLU, mock data)")
    g.add_argument("--num-layers", type=int, default=8)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--num-attention-heads", type=int, default=8)
    g.add_argument("--seq-length", type=int, default=2048)
    g.add_argument("--vocab-size", type=int, default=1024)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--extra-args", type=str, default="",
                   help="more pretrain_gpt.py flags for every run, e.g. \"--swiglu\"")
    g = parser.add_argument_group("output")
    g.add_argument("--out-dir", default=os.path.join("runs", "bench_attention_balance"),
                   help="spec, records, timelines, log")
    g.add_argument("--json", default=None, help="write the results as JSON here")
    g.add_argument("--report-only", action="store_true",
                   help="do not train: summarise the records an earlier run left in --out-dir")
    g.add_argument("--master-port", type=int, default=None)
    args = parser.parse_args(argv)
    for name in ("pp", "vp", "slices", "microbatches", "runs", "timed_iters",
                 "threads_per_process"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup_iters < 0 or args.timeline_runs < 0:
        parser.error("--warmup-iters and --timeline-runs must be >= 0")
    if args.pp < 2:
        parser.error("attention balance moves work between pipeline ranks: --pp must be >= 2")
    if args.num_layers % (args.pp * args.vp):
        parser.error(f"--num-layers {args.num_layers} is not divisible by --pp x --vp "
                     f"= {args.pp * args.vp}")
    return args


def base_argv(args):
    """``pretrain_gpt.py`` flags of both configurations (everything but the balance)."""
    return model_argv(args.num_layers, args.hidden_size, args.num_attention_heads,
                      args.seq_length, args.pp, args.microbatches,
                      micro_batch_size=args.micro_batch_size, vocab_size=args.vocab_size,
                      extra_args=slimpipe_argv(args.slices, args.vp)
                      + shlex.split(args.extra_args), seed=args.seed)


def main(argv=None):
    args = parse_args(argv)
    out_dir = os.path.abspath(args.out_dir)
    os.makedirs(out_dir, exist_ok=True)
    configs = build_configs(args.slices)
    base = base_argv(args)
    quiet = quiet_options(args)
    spec = build_balance_spec(configs, base, args.runs, args.warmup_iters, args.timed_iters,
                              out_dir, quiet=quiet, timeline_runs=args.timeline_runs)
    # the plan the balanced runs execute (every rank derives it from the same flags)
    balanced_argv = spec[[r["config"] for r in spec].index(configs[1].name)]["argv"]
    parsed, costs = model_costs(balanced_argv, world_size=args.pp)
    plan = plan_numbers(args.pp, parsed.num_microbatches,
                        parsed.virtual_pipeline_model_parallel_size or 1,
                        parsed.slimpipe_slices, costs)
    command = "python tools/bench_attention_balance.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    meta_path = os.path.join(out_dir, "meta.json")
    if args.report_only:
        with open(os.path.join(out_dir, "records.json")) as handle:
            records = json.load(handle)
        with open(meta_path) as handle:
            meta = json.load(handle)
    else:
        before = machine_notes(args.threads_per_process)
        started = time.time()
        records = launch(args, spec, out_dir)
        meta = {"command": command.strip(), "pp": args.pp, "vp": args.vp,
                "slices": args.slices, "microbatches": args.microbatches,
                "micro_batch_size": args.micro_batch_size, "seq_length": args.seq_length,
                "num_layers": args.num_layers, "hidden_size": args.hidden_size,
                "num_attention_heads": args.num_attention_heads, "runs": args.runs,
                "warmup_iters": args.warmup_iters, "timed_iters": args.timed_iters,
                "machine_before": before,
                "machine_after": machine_notes(args.threads_per_process),
                "wall_s": round(time.time() - started, 1), "pretrain_argv": base,
                "quiet": quiet}
        with open(meta_path, "w") as handle:
            json.dump(meta, handle, indent=1)
    tokens = args.micro_batch_size * args.microbatches * args.seq_length
    summary = summarize_balance(configs, records, out_dir=out_dir, tokens_per_iteration=tokens,
                                warmup_iters=args.warmup_iters, pp=args.pp,
                                microbatches=args.microbatches, vp=args.vp,
                                slices=args.slices, plan=plan, loss_rtol=args.loss_rtol,
                                disturbed_cores=args.quiet_threshold)
    report = json_balance_report(summary, meta)
    with open(os.path.join(out_dir, "summary.json"), "w") as handle:
        json.dump(report, handle, indent=1)
    before = meta["machine_before"]
    print(f"# {meta['command']}")
    print(f"# pp={args.pp} v={args.vp} n={args.slices} slices, m={args.microbatches} x "
          f"{args.micro_batch_size} x {args.seq_length} tokens; {args.num_layers} layers, "
          f"hidden {args.hidden_size}, {args.num_attention_heads} heads; mock data; "
          f"{args.runs} rounds of {args.warmup_iters} warm-up + {args.timed_iters} timed "
          f"iterations; {before['host_cpus']} CPUs, load average before "
          f"{before['load_average']} after {meta['machine_after']['load_average']}; "
          f"{meta['wall_s']} s")
    print()
    print(format_balance_report(summary))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
        print(f"\njson: {args.json}")
    if not summary["losses_equal"]:
        print(f"ERROR: losses differ by {summary['loss_max_rel_deviation']:.2e} "
              f"(> {args.loss_rtol:.0e})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
