#!/usr/bin/env python
"""The CPU demo's comparison table, read from the runs' own output files.

    python tools/demo_table.py runs/cpu_demo 1f1b seq1f1b_s4 slimpipe_n4

For every run NAME the directory holds NAME.log (pretrain_gpt.py's output with
--log-interval 1), timeline_NAME.json (--timeline-file) and memory_NAME.json
(--activation-memory-file). A log may hold several processes of one run (exp.sh trains
in two rounds, the second resuming the first's checkpoint). The first run is the
baseline. Columns: tokens/s (the median of the iteration lines, leaving out each
process's first, whose allocations and lazy set-up make it a warm-up; the last [summary]
line's when nothing else is left), the bubble of the last process's recorded training
iteration (Timeline.bubble_fraction), the probe's activation peak
of stage 0 and of the worst stage, the final loss, and whether every iteration's and
validation loss equals the baseline's within --rtol.
Exits 1, with one line per differing run, when the losses differ.
"""

import argparse
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.schedules.timeline import read_timeline  # noqa: E402

ITERATION = re.compile(r"\biteration +(\d+)/ *\d+ \|.*?\| lm loss: ([^ |]+) \|")
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([^ |]+) \|")
ITERATION_SPEED = re.compile(r"\biteration +(\d+)/ *\d+ \|.*?\| tokens/s: ([^ |]+) \|")
# a process's set-up line: the iteration line after it is that process's warm-up
START = re.compile(r"> setup done in ")
SUMMARY = re.compile(r"\[summary\].*final lm loss: ([^ |]+) \|.*tokens/s: ([^ |]+) \|")

CPU_NOTE = ("On CPU the equal losses and the activation peaks (bytes counted by the probe) carry "
            "over to GPUs; tokens/s (median over the iterations, each process's first left "
            "out) and the bubble time runs on 2 shared cores (gloo, probe and timeline on) "
            "and say nothing about GPU speed.")


class RunError(Exception):
    """A run's files are missing or do not hold what the table needs."""


def read_log(path):
    """Losses keyed by ("train" | "valid", iteration), final loss and tokens/s of a log."""
    losses, summary, speeds = {}, None, {}
    warming_up = True  # the next iteration line is the first of a process
    with open(path, errors="replace") as handle:
        for line in handle:
            if START.search(line):
                warming_up = True
            for kind, pattern in (("train", ITERATION), ("valid", VALIDATION)):
                match = pattern.search(line)
                if match:
                    losses[(kind, int(match.group(1)))] = float(match.group(2))
            match = ITERATION_SPEED.search(line)
            if match:
                if not warming_up:
                    speeds[int(match.group(1))] = float(match.group(2))
                warming_up = False
            match = SUMMARY.search(line)
            if match:
                summary = match
    if summary is None:
        raise RunError(f"{path} has no [summary] line (did the run finish?)")
    if not losses:
        raise RunError(f"{path} has no iteration lines with an lm loss")
    tokens_per_s = (statistics.median(speeds.values()) if speeds
                    else float(summary.group(2)))
    return {"losses": losses, "final_loss": float(summary.group(1)),
            "tokens_per_s": tokens_per_s}


def read_run(runs_dir, name):
    """Everything the table shows about one run, from its three files."""
    try:
        run = read_log(os.path.join(runs_dir, f"{name}.log"))
        run["bubble"] = read_timeline(
            os.path.join(runs_dir, f"timeline_{name}.json")).bubble_fraction()
        with open(os.path.join(runs_dir, f"memory_{name}.json")) as handle:
            peaks = [stage["activation_peak_bytes"] for stage in json.load(handle)["stages"]]
    except (OSError, ValueError, KeyError) as err:
        raise RunError(f"{name}: {err}") from None
    run.update(name=name, stage0=peaks[0], worst=max(peaks))
    return run


def loss_difference(run, base):
    """(largest relative difference, where) over the losses both runs logged; a loss
    one run logged and the other did not counts as a difference."""
    if set(run["losses"]) != set(base["losses"]):
        return float("inf"), "the logged iterations"
    worst, where = 0.0, None
    for key, ref in sorted(base["losses"].items()):
        diff = abs(run["losses"][key] - ref) / max(abs(ref), 1e-12)
        if diff > worst:
            worst, where = diff, f"{key[0]} iteration {key[1]}"
    return worst, where


def format_table(runs, rtol):
    base = runs[0]
    header = ("| schedule | tokens/s (x 1F1B) | bubble | stage-0 activations (x) "
              "| worst-stage activations (x) | final loss | losses equal |")
    lines = [header, "|" + "---|" * header.count(" |")]
    for run in runs:
        equal = loss_difference(run, base)[0] <= rtol
        lines.append(
            f"| {run['name']} | {run['tokens_per_s']:.0f} ({run['tokens_per_s'] / base['tokens_per_s']:.2f})"
            f" | {run['bubble']:.1%}"
            f" | {run['stage0'] / 2**20:.1f} MiB ({run['stage0'] / base['stage0']:.2f})"
            f" | {run['worst'] / 2**20:.1f} MiB ({run['worst'] / base['worst']:.2f})"
            f" | {run['final_loss']:.6g} | {'yes' if equal else 'NO'} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="tools/demo_table.py", description=__doc__.split("\n")[0])
    ap.add_argument("runs_dir")
    ap.add_argument("names", nargs="+", help="run names; the first is the baseline (1F1B)")
    ap.add_argument("--rtol", type=float, default=1e-5,
                    help="largest relative loss difference counted as equal")
    args = ap.parse_args(argv)
    try:
        runs = [read_run(args.runs_dir, name) for name in args.names]
    except RunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_table(runs, args.rtol))
    print(CPU_NOTE)
    failed = False
    for run in runs[1:]:
        diff, where = loss_difference(run, runs[0])
        if diff > args.rtol:
            failed = True
            print(f"error: {run['name']}'s losses differ from {runs[0]['name']}'s: relative "
                  f"difference {diff:.3g} at {where} (tolerance {args.rtol:g})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
