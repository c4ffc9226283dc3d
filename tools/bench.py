"""1F1B vs Seq1F1B side by side: throughput, bubble, activation memory, loss.

    python tools/bench.py                                  # CPU: pp=2 over gloo, m=4
    python tools/bench.py --splits 2 4 8 --balance-methods average uniform_comp \\
        --runs 3 --json runs/bench/bench.json --picture picture/bench_cpu_timelines.png
    python tools/bench.py --data-path data/stdlib_content_document \\
        --tokenizer-type GPT2BPETokenizer --vocab-file data/tokenizer/vocab.json \\
        --merge-file data/tokenizer/merges.txt

One torchrun launch (``--pp`` processes) trains the same model on the same data
(mock by default) with 1F1B and with Seq1F1B for every split count and balance
method (``megatron.benchmarks.runner``, in-process ``pretrain`` calls):

1. ``--runs`` rounds; in each, ONE timed run that changes schedule at every
   iteration, cycling through the configurations (the order rotates from cycle to
   cycle and round to round) until each has trained ``--warmup-iters`` +
   ``--timed-iters`` iterations; tokens/s of a configuration over its timed
   iterations. Neighbouring iterations see the same machine, so a host whose speed
   drifts within minutes cannot favour one schedule; the schedules are exact, so the
   model trains as under any one of them. (``--no-interleave``: one run per
   configuration and round instead.) No observer is attached, so 1F1B is
   megatron-core's own schedule function and Seq1F1B this project's executor.
   Then (first ``--timeline-runs`` rounds) one timeline run of every configuration
   (``--timeline-file``, the last of ``--warmup-iters`` + 1 iterations): bubble per
   stage (idle / span), per-unit times, the planner's replay of them.
2. One memory run per configuration (``--activation-memory-file``): activation peak
   per stage (the probe's hooks slow forwards, so nothing is timed from it).

Observers attach to the executor only, so 1F1B's timeline and memory runs run the
executor's one-split program (megatron-core's 1F1B unit order) while its timed runs
run megatron-core's: every row names its runtimes (column ``runtime: tokens/s;
bubble, memory``, e.g. ``megatron-core; executor``; JSON ``runtime``,
``timeline_runtime``, ``memory_runtime``).

Between runs the runner destroys the process groups a run leaves behind (their gloo
threads would otherwise pile up and compete for the cores) and records the CPU used
by other processes during each run; ``--quiet-threshold`` waits for, and retries
runs disturbed by, other processes.

Prints a Markdown table (tokens/s median and ratio to 1F1B, bubble per stage,
stage-0 and worst-stage activation peak and ratio, final loss), checks that the
losses agree across schedules (exit 1 if not), writes the timeline pictures and,
with ``--json``, ``{"runs": [{"schedule", "splits", "balance_method",
"tokens_per_s", "bubble_fraction", "stage0_activation_peak_bytes", "loss", "runtime",
...}]}``.
"""

import argparse
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.benchmarks.pipeline import (  # noqa: E402
    build_configs,
    build_spec,
    check_targets,
    format_report,
    json_report,
    model_argv,
    summarize,
)
from megatron.seqsplit.split_lengths import BALANCE_METHODS  # noqa: E402


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def add_machine_args(group):
    """The options for a shared machine (quiet waits, retries) and threads per process;
    ``quiet_options`` turns them into the runner's ``quiet`` entry."""
    group.add_argument("--quiet-threshold", type=float, default=None,
                       help="before each timed/timeline run wait until other processes use "
                       "fewer than this many cores, and repeat a run during which they used "
                       "more (shared machines); default: no waiting")
    group.add_argument("--quiet-max-wait", type=float, default=300,
                       help="longest wait (s) for a quiet machine before a run")
    group.add_argument("--retries", type=int, default=2,
                       help="repeats of a run disturbed by other processes (with "
                       "--quiet-threshold)")
    group.add_argument("--threads-per-process", type=int, default=1,
                       help="OMP_NUM_THREADS of each process (CPU)")


def quiet_options(args):
    """The runner's ``{"threshold", "max_wait", "retries"}`` (None: no waiting)."""
    if args.quiet_threshold is None:
        return None
    return {"threshold": args.quiet_threshold, "max_wait": args.quiet_max_wait,
            "retries": args.retries}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = parser.add_argument_group("schedules")
    g.add_argument("--pp", type=int, default=2, help="pipeline stages (= processes)")
    g.add_argument("--microbatches", type=int, default=4, help="microbatches per iteration (m)")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8],
                   help="Seq1F1B split counts (1F1B always runs)")
    g.add_argument("--balance-methods", nargs="+", default=list(BALANCE_METHODS),
                   choices=list(BALANCE_METHODS))
    g = parser.add_argument_group("measurement")
    g.add_argument("--runs", type=int, default=3, help="timed runs per configuration")
    g.add_argument("--warmup-iters", type=int, default=1)
    g.add_argument("--timed-iters", type=int, default=3)
    g.add_argument("--timeline-runs", type=int, default=None,
                   help="timeline runs per configuration, one in each of the first rounds "
                   "(default: --runs)")
    g.add_argument("--unit-cpu-runs", type=int, default=0,
                   help="extra timeline runs per configuration that time each unit with its "
                   "thread's CPU time (work without waiting for a core; CPU diagnosis)")
    g.add_argument("--no-interleave", action="store_true",
                   help="time each configuration in a run of its own in every round, instead "
                   "of one run per round that changes schedule at every iteration")
    g.add_argument("--no-instrumented", action="store_true",
                   help="skip the timeline and memory runs (throughput only)")
    add_machine_args(g)
    g.add_argument("--loss-rtol", type=float, default=1e-5,
                   help="largest relative loss difference accepted between schedules")
    g = parser.add_argument_group("model (GPT, RoPE, LayerNorm, GeLU, fp32 on CPU)")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--num-attention-heads", type=int, default=8)
    g.add_argument("--seq-length", type=int, default=2048)
    g.add_argument("--vocab-size", type=int, default=1025,
                   help="mock data vocabulary (1025: 1024 ids and the end of document, the "
                        "model of the recorded results)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--extra-args", type=str, default="",
                   help="more pretrain_gpt.py flags for every run, e.g. \"--bf16 --swiglu\"")
    g = parser.add_argument_group("data (default: mock data)")
    g.add_argument("--data-path", nargs="+", default=None)
    g.add_argument("--tokenizer-type", default="GPT2BPETokenizer")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g = parser.add_argument_group("output")
    g.add_argument("--out-dir", default=os.path.join("runs", "bench"),
                   help="timelines, memory reports, per-run pictures, log")
    g.add_argument("--json", default=None, help="write the results as JSON here")
    g.add_argument("--picture", default=None,
                   help="also draw all timelines on one time axis here (PNG)")
    g.add_argument("--report-only", action="store_true",
                   help="do not train: summarise the records an earlier run left in --out-dir "
                   "(same schedule flags)")
    g.add_argument("--master-port", type=int, default=None)
    args = parser.parse_args(argv)
    for name in ("pp", "microbatches", "runs", "timed_iters", "threads_per_process"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup_iters < 0:
        parser.error("--warmup-iters must be >= 0")
    if args.warmup_iters == 0 and not args.no_interleave:
        # the run's first iteration (start-up, first allocations) is slow, and interleaved
        # it would belong to one configuration only
        parser.error("--warmup-iters 0 would time the run's slow first iteration for one "
                     "configuration only when the schedules are interleaved: use "
                     "--warmup-iters 1 or more, or --no-interleave")
    if args.num_layers % args.pp:
        parser.error(f"--num-layers {args.num_layers} is not divisible by --pp {args.pp}")
    return args


def tokenizer_args(args):
    out = ["--tokenizer-type", args.tokenizer_type]
    for flag, value in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file),
                        ("--tokenizer-model", args.tokenizer_model)):
        if value:
            out += [flag, value]
    return out


def machine_notes(threads):
    load = os.getloadavg()
    try:
        import torch

        torch_version = torch.__version__
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # pragma: no cover
        torch_version, device = "?", "?"
    return {"host_cpus": os.cpu_count(), "load_average": [round(x, 2) for x in load],
            "torch": torch_version, "device": device, "python": platform.python_version(),
            "threads_per_process": threads, "processor": platform.processor() or platform.machine()}


def launch(args, spec, out_dir):
    """One torchrun launch of the runner over the whole spec; returns its records."""
    spec_path = os.path.join(out_dir, "spec.json")
    out_path = os.path.join(out_dir, "records.json")
    log_path = os.path.join(out_dir, "bench.log")
    with open(spec_path, "w") as handle:
        json.dump(spec, handle, indent=1)
    if os.path.exists(out_path):
        os.remove(out_path)
    env = dict(os.environ, PYTHONWARNINGS="ignore",
               OMP_NUM_THREADS=str(args.threads_per_process),
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in
                                                    os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.pp),
           "--master-port", str(args.master_port or _free_port()),
           "-m", "megatron.benchmarks.runner", spec_path, out_path]
    print(f"# {len(spec)} runs in one launch: {' '.join(shlex.quote(c) for c in cmd)}",
          flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in proc.stdout:
            log.write(line)
            if line.startswith("[bench]"):
                print(line.rstrip(), flush=True)
        proc.wait()
    if proc.returncode != 0:
        tail = open(log_path).read()[-4000:]
        sys.exit(f"benchmark launch failed ({proc.returncode}); log {log_path}:\n{tail}")
    with open(out_path) as handle:
        return json.load(handle)


def _shrink_png(path, colors=64):
    """Re-save a PNG with a small palette (the pictures have few colours)."""
    try:
        from PIL import Image
    except ImportError:  # matplotlib depends on Pillow; keep the full PNG otherwise
        return
    image = Image.open(path).convert("RGB")
    image.quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def draw_pictures(summary, out_dir, picture, meta):
    from megatron.planner import draw
    from megatron.schedules.timeline import read_timeline

    drawn = []
    timelines, titles = [], []
    for row in summary["runs"]:
        if "timeline_file" not in row:
            continue
        timeline = read_timeline(row["timeline_file"])
        title = (f"{row['label']} (recorded, {row.get('timeline_runtime') or 'runtime n/a'}, "
                 f"pp={meta['pp']}, m={meta['microbatches']}, seq {meta['seq_length']})")
        path = os.path.join(out_dir, f"timeline_{row['name']}.png")
        draw.draw_timeline(timeline, path, title)
        drawn.append(path)
        timelines.append(timeline)
        titles.append(row["label"])
    if timelines:
        combined = os.path.join(out_dir, "timelines.png")
        suptitle = (f"recorded timelines, last iteration: pp={meta['pp']}, "
                    f"{meta['microbatches']} microbatches of {meta['seq_length']} tokens")
        draw.draw_timelines(timelines, combined, titles, suptitle=suptitle, dpi=72)
        drawn.append(combined)
        if picture:
            os.makedirs(os.path.dirname(os.path.abspath(picture)), exist_ok=True)
            draw.draw_timelines(timelines, picture, titles, suptitle=suptitle, dpi=64)
            _shrink_png(picture)
            drawn.append(picture)
    return drawn


def main(argv=None):
    args = parse_args(argv)
    out_dir = os.path.abspath(args.out_dir)
    os.makedirs(out_dir, exist_ok=True)
    configs = build_configs(args.splits, args.balance_methods)
    base = model_argv(args.num_layers, args.hidden_size, args.num_attention_heads,
                      args.seq_length, args.pp, args.microbatches,
                      micro_batch_size=args.micro_batch_size, vocab_size=args.vocab_size,
                      data_path=args.data_path,
                      tokenizer_args=tokenizer_args(args) if args.data_path else (),
                      extra_args=shlex.split(args.extra_args), seed=args.seed)
    quiet = quiet_options(args)
    spec = build_spec(configs, base, args.runs, args.warmup_iters, args.timed_iters, out_dir,
                      instrument=not args.no_instrumented, quiet=quiet,
                      timeline_runs=args.timeline_runs, unit_cpu_runs=args.unit_cpu_runs,
                      interleave=not args.no_interleave)
    command = "python tools/bench.py " + " ".join(shlex.quote(a) for a in
                                                  (argv if argv is not None else sys.argv[1:]))
    meta_path = os.path.join(out_dir, "meta.json")
    if args.report_only:
        with open(os.path.join(out_dir, "records.json")) as handle:
            records = json.load(handle)
        with open(meta_path) as handle:
            meta = json.load(handle)
        before = meta["machine_before"]
    else:
        before = machine_notes(args.threads_per_process)
        started = time.time()
        records = launch(args, spec, out_dir)
        meta = run_meta(args, command, base, before, started, quiet)
        with open(meta_path, "w") as handle:
            json.dump(meta, handle, indent=1)
    report(args, configs, records, meta, out_dir)
    return 0 if summary_ok(out_dir) else 1


def run_meta(args, command, base, before, started, quiet):
    return {"command": command.strip(), "pp": args.pp, "microbatches": args.microbatches,
            "micro_batch_size": args.micro_batch_size, "seq_length": args.seq_length,
            "num_layers": args.num_layers, "hidden_size": args.hidden_size,
            "num_attention_heads": args.num_attention_heads,
            "data": args.data_path or "mock", "runs": args.runs,
            "warmup_iters": args.warmup_iters, "timed_iters": args.timed_iters,
            "interleave": not args.no_interleave,
            "machine_before": before, "machine_after": machine_notes(args.threads_per_process),
            "wall_s": round(time.time() - started, 1), "pretrain_argv": base,
            "quiet": quiet}


def summary_ok(out_dir):
    with open(os.path.join(out_dir, "summary.json")) as handle:
        return json.load(handle)["losses_equal"]


def report(args, configs, records, meta, out_dir):
    before = meta["machine_before"]
    tokens = args.micro_batch_size * args.microbatches * args.seq_length
    summary = summarize(configs, records, out_dir=out_dir, tokens_per_iteration=tokens,
                        warmup_iters=args.warmup_iters, microbatches=args.microbatches,
                        loss_rtol=args.loss_rtol, disturbed_cores=args.quiet_threshold)
    with open(os.path.join(out_dir, "summary.json"), "w") as handle:
        json.dump(json_report(summary, meta), handle, indent=1)
    print(f"# {meta['command']}")
    print(f"# pp={args.pp} m={args.microbatches} x {args.micro_batch_size} x "
          f"{args.seq_length} tokens; {args.num_layers} layers, hidden {args.hidden_size}, "
          f"{args.num_attention_heads} heads; data {'mock' if not args.data_path else args.data_path}; "
          f"{args.runs} rounds of {args.warmup_iters} warm-up + {args.timed_iters} timed "
          f"iterations per configuration, "
          f"{'separate runs' if args.no_interleave else 'interleaved iteration by iteration'}")
    print(f"# load average before {before['load_average']} after "
          f"{meta['machine_after']['load_average']} on {before['host_cpus']} CPUs; "
          f"{meta['wall_s']} s")
    print()
    print(format_report(summary))
    targets = check_targets(summary)
    if targets and args.microbatches == 4:
        print()
        for t in targets:
            ratio = t["stage0_activation_ratio"]
            paired = t["paired_ratio_undisturbed"]
            print(f"target {t['label']} ({t['runtime']}): tokens/s paired x"
                  f"{'n/a' if paired is None else f'{paired:.3f}'} against 1F1B on "
                  f"{t['baseline_runtime']} (undisturbed rounds; ratio "
                  f"of medians x{t['tokens_per_s_ratio']:.3f}) "
                  f"(>= {t['speed_target']}: {'met' if t['speed_met'] else 'MISSED'}), "
                  f"stage-0 activation x{'n/a' if ratio is None else f'{ratio:.3f}'} "
                  f"(<= {t['memory_target']}: {'met' if t['memory_met'] else 'MISSED'})")
    drawn = draw_pictures(summary, out_dir, args.picture, meta) if not args.no_instrumented else []
    if drawn:
        print(f"\ntimeline pictures: {', '.join(os.path.relpath(p) for p in drawn)}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        data = json_report(summary, meta)
        data["targets"] = targets
        with open(args.json, "w") as handle:
            json.dump(data, handle, indent=1)
        print(f"json: {args.json}")
    if not summary["losses_equal"]:
        print(f"ERROR: losses differ across schedules by {summary['loss_max_rel_deviation']:.2e}"
              f" (> {args.loss_rtol:.0e})", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
