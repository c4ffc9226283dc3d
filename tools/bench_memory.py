"""Stage activation peaks of 1F1B and Seq1F1B (or SlimPipe), measured side by side in one run.

    python tools/bench_memory.py                      # CPU: pp=4 over gloo, s in {2, 4, 8}
    python tools/bench_memory.py --splits 2 4 8 --seq-length 2048 --json out.json
    python tools/bench_memory.py --slimpipe 4 8 --vp 1 2 --num-layers 8   # SlimPipe
    python tools/bench_memory.py --pp 2 --splits 4 --context-parallel 2  # and with CP 2

Each configuration trains the same model with ``pretrain_gpt.py
--activation-memory-file``: the probe counts the bytes autograd holds for backward
(parameters excluded) plus the KV cache, sampled at every pipeline unit boundary of the
last iteration (see megatron/schedules/memory_probe.py). Stage 0's peak is compared with

* the schedule's count of what is in flight: the paper's ``(s + p - 1) / (s p)`` of a
  1F1B stage's microbatches for Seq1F1B (activations only), the generator's slices held
  ``/ (n v)`` of one microbatch for SlimPipe, and
* the planner's prediction for the same command line (``tools/plan.py ... --gpu cpu``,
  ``megatron.planner.predict.boundary_activation_peaks``: every stage's activations and
  KV cache walked over its units, sampled at unit boundaries as the probe samples).
  One memory model serves the planner and this table; tests/test_planner_memory_probe.py
  holds it within 3% of the probe on small models, this tool shows it at the
  benchmark's shapes.

With ``--slimpipe N ...`` the rows are SlimPipe runs (``--slimpipe-slices N`` with each
``--vp V``) instead of Seq1F1B. With ``--context-parallel C`` every split count also runs
with ``--context-parallel-size C`` (``pp x C`` processes; the peaks are context-parallel
rank 0's stages), each row's ratio still to 1F1B without it.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.planner.cli import config_from_args, parse as parse_plan  # noqa: E402
from megatron.planner.predict import PlanError, boundary_activation_peaks, predict  # noqa: E402
from megatron.schedules.slimpipe import slimpipe_rank_units  # noqa: E402
from megatron.schedules.seq1f1b import in_flight_peak  # noqa: E402
from megatron.trainer.arguments import ArgumentError  # noqa: E402

MIB = 2 ** 20


def model_flags(args, schedule):
    """pretrain_gpt.py's flags for one configuration (the probe's file left out)."""
    return [
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq_length),
        "--max-position-embeddings", str(args.seq_length), "--position-embedding-type", "rope",
        "--micro-batch-size", "1", "--global-batch-size", str(args.microbatches),
        "--train-iters", "2", "--log-interval", "1", "--eval-iters", "0",
        "--attention-dropout", "0", "--hidden-dropout", "0",
        # 1025 entries, the last the end of document: the model the recorded peaks
        # measured (NullTokenizer's --vocab-size 1024 meant it before 2026-12-08)
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1025",
        "--pipeline-model-parallel-size", str(args.pp),
    ] + list(schedule) + args.extra


def processes(args, flags):
    cp = flags[flags.index("--context-parallel-size") + 1] if "--context-parallel-size" in flags \
        else "1"
    return args.pp * int(cp)


def measured_peaks(args, flags, out_path):
    """Every stage's probed activation + KV-cache peak (bytes), from a real run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
           str(processes(args, flags)),
           "--master-port", str(args.master_port), os.path.join(ROOT, "pretrain_gpt.py")]
    cmd += flags + ["--activation-memory-file", out_path]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    with open(out_path) as handle:
        return [stage["activation_peak_bytes"] for stage in json.load(handle)["stages"]]


def planned_peaks(args, flags):
    """Every stage's peak (bytes) as the planner predicts it for the same command line."""
    try:
        plan_args = parse_plan(flags + ["--gpu", "cpu", "--world-size",
                                        str(processes(args, flags))])
        return boundary_activation_peaks(predict(config_from_args(plan_args)))
    except (PlanError, ArgumentError) as err:
        sys.exit(f"bench_memory: the planner refuses {' '.join(flags)}: {err}")


def measure(args, tmp, name, schedule):
    flags = model_flags(args, schedule)
    planned = planned_peaks(args, flags)  # first: a flag the planner refuses stops before a run
    return {"stage_peaks_bytes": measured_peaks(args, flags, os.path.join(tmp, f"{name}.json")),
            "planned_peaks_bytes": planned}


def largest_miss(row):
    """The largest |measured / planned - 1| over the stages."""
    return max(abs(m / p - 1.0) for m, p in zip(row["stage_peaks_bytes"],
                                                row["planned_peaks_bytes"]))


def slimpipe_rows(args, tmp):
    p, m = args.pp, args.microbatches
    rows = []
    for v in args.vp:
        for n in args.slimpipe:
            flags = ["--pipeline-schedule", "slimpipe", "--slimpipe-slices", str(n)]
            if v > 1:
                flags += ["--virtual-pipeline-model-parallel-size", str(v)]
            held = in_flight_peak(slimpipe_rank_units(0, p, m, v, n))
            rows.append({"schedule": "slimpipe", "vp": v, "slices": n, "slices_held": held,
                         "paper_microbatches": held / (n * v),
                         **measure(args, tmp, f"slim_v{v}_n{n}", flags)})
    return rows


def print_slimpipe_table(rows, base_peak, per_microbatch):
    print("| schedule | v | n | slices held (generator) | held / (nv) | stage-0 peak MiB "
          "| peak / M | peak / 1F1B | planned MiB | measured / planned | largest miss, "
          "any stage | worst stage MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        peak0, plan0 = row["stage_peaks_bytes"][0], row["planned_peaks_bytes"][0]
        worst = max(row["stage_peaks_bytes"]) / MIB
        common = (f"{peak0 / MIB:.1f} | {peak0 / per_microbatch:.3f} | {peak0 / base_peak:.3f} "
                  f"| {plan0 / MIB:.1f} | {peak0 / plan0:.3f} | {largest_miss(row):.2%} "
                  f"| {worst:.1f} |")
        if row["schedule"] == "1f1b":
            print(f"| 1F1B | 1 | 1 | - | - | {common}")
        else:
            print(f"| SlimPipe | {row['vp']} | {row['slices']} | {row['slices_held']} | "
                  f"{row['paper_microbatches']:.3f} | {common}")


def print_seq1f1b_table(rows, base_peak):
    print("| schedule | s | CP | stage-0 peak MiB | ratio to 1F1B | (s+p-1)/(sp) | planned MiB | "
          "measured / planned | largest miss, any stage | worst stage MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        peak0, plan0 = row["stage_peaks_bytes"][0], row["planned_peaks_bytes"][0]
        name = "1F1B" if row["splits"] == 1 else "Seq1F1B"
        print(f"| {name} | {row['splits']} | {row.get('context_parallel', 1)} | "
              f"{peak0 / MIB:.1f} | {peak0 / base_peak:.3f} | "
              f"{row['paper_ratio']:.3f} | {plan0 / MIB:.1f} | {peak0 / plan0:.3f} | "
              f"{largest_miss(row):.2%} | {max(row['stage_peaks_bytes']) / MIB:.1f} |")


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--slimpipe", type=int, nargs="+", default=None,
                        help="SlimPipe slice counts (multiples of --pp) to run instead of "
                             "Seq1F1B splits")
    parser.add_argument("--vp", type=int, nargs="+", default=[1, 2],
                        help="with --slimpipe: virtual stages per rank (--num-layers must be "
                             "a multiple of pp x each)")
    parser.add_argument("--context-parallel", type=int, default=None,
                        help="also run every split count with --context-parallel-size C")
    parser.add_argument("--master-port", type=int, default=29571)
    parser.add_argument("--json", type=str, default=None)
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="more pretrain_gpt.py flags for every run, e.g. "
                             "--extra --recompute-granularity selective")
    return parser


def main():
    args = build_parser().parse_args()

    p, m = args.pp, args.microbatches
    with tempfile.TemporaryDirectory() as tmp:
        baseline = {"schedule": "1f1b", "splits": 1, "paper_ratio": 1.0,
                    **measure(args, tmp, "s1", ["--seq1f1b-splits", "1"])}
        base_peak = baseline["stage_peaks_bytes"][0]
        per_microbatch = base_peak / min(p, m)
        rows = [baseline]
        if args.slimpipe:
            rows += slimpipe_rows(args, tmp)
        for s in ([] if args.slimpipe else args.splits):
            rows.append({"schedule": "seq1f1b", "splits": s, "paper_ratio": (s + p - 1) / (s * p),
                         **measure(args, tmp, f"s{s}", ["--seq1f1b-splits", str(s)])})
        cp = args.context_parallel
        for s in ([1] + args.splits if cp and cp > 1 and not args.slimpipe else []):
            rows.append({"schedule": "seq1f1b", "splits": s, "context_parallel": cp,
                         "paper_ratio": (s + p - 1) / (s * p),
                         **measure(args, tmp, f"s{s}_cp{cp}", [
                             "--seq1f1b-splits", str(s), "--context-parallel-size", str(cp)])})
    command = "python tools/bench_memory.py " + " ".join(sys.argv[1:])
    print(f"# {command.strip()}")
    print(f"# pp={p} microbatches={m} layers={args.num_layers} hidden={args.hidden_size} "
          f"heads={args.heads} seq={args.seq_length} fp32 CPU {' '.join(args.extra)}; "
          "stage-0 activation peak, planned = tools/plan.py --gpu cpu on the same flags")
    print(f"# M (one microbatch on stage 0, from 1F1B) = {per_microbatch / MIB:.1f} MiB")
    if args.slimpipe:
        print_slimpipe_table(rows, base_peak, per_microbatch)
    else:
        print_seq1f1b_table(rows, base_peak)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump({"command": command, "runs": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
