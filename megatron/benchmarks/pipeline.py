"""1F1B vs Seq1F1B benchmark: the runs to launch and what their records mean.

``tools/bench.py`` is the command line; this module holds the logic so that tests
can exercise it without processes:

* ``BenchConfig`` / ``build_configs``: 1F1B plus Seq1F1B for each (splits, balance
  method);
* ``build_spec``: the list of in-process runs for ``megatron.benchmarks.runner``:
  ``runs`` rounds of *timed* runs, configurations alternating inside each round
  (no observer attached: 1F1B is megatron-core's own schedule function and Seq1F1B
  our executor, exactly what a user gets), then one *timeline* run
  (``--timeline-file``) and one *memory* run (``--activation-memory-file``) per
  configuration. The memory probe's saved-tensor hooks slow forwards down, so
  neither throughput nor bubble is ever taken from a memory run;
* ``summarize``: tokens/s (median over the timed runs), bubble per stage from the
  recorded timeline, stage activation peaks, final losses and their agreement, and
  where the time goes (per-unit times, communication/wait, split overhead, the
  planner's simulator replaying the measured unit times);
* ``format_report``: the Markdown tables ``tools/bench.py`` prints.
"""

import json
import os
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from megatron.planner.simulate import simulate
from megatron.planner.trace import Timeline, read_timeline
from megatron.schedules.units import Unit, seq1f1b_schedule

TIMED, TIMELINE, MEMORY = "timed", "timeline", "memory"


@dataclass(frozen=True)
class BenchConfig:
    """One schedule to compare: 1F1B (splits 1) or Seq1F1B with a balance method."""

    splits: int = 1
    balance_method: Optional[str] = None

    @property
    def schedule(self) -> str:
        return "1f1b" if self.splits == 1 else "seq1f1b"

    @property
    def name(self) -> str:
        return "1f1b" if self.splits == 1 else f"seq1f1b_s{self.splits}_{self.balance_method}"

    @property
    def label(self) -> str:
        return "1F1B" if self.splits == 1 else f"Seq1F1B s={self.splits} {self.balance_method}"

    def flags(self) -> List[str]:
        if self.splits == 1:
            return []
        return ["--seq1f1b-splits", str(self.splits),
                "--seq1f1b-balance-method", self.balance_method]


def build_configs(splits: Sequence[int], balance_methods: Sequence[str]) -> List[BenchConfig]:
    """1F1B first, then Seq1F1B for every split count > 1 and balance method."""
    configs = [BenchConfig()]
    for s in splits:
        if s < 1:
            raise ValueError(f"split counts must be >= 1, got {s}")
        if s == 1:
            continue
        for method in balance_methods:
            configs.append(BenchConfig(s, method))
    return configs


def model_argv(num_layers, hidden_size, heads, seq_length, pp, microbatches,
               micro_batch_size=1, vocab_size=1024, data_path=None, tokenizer_args=(),
               extra_args=(), seed=1234) -> List[str]:
    """``pretrain_gpt.py`` flags shared by every run (everything but schedule and length)."""
    argv = [
        "--num-layers", str(num_layers), "--hidden-size", str(hidden_size),
        "--num-attention-heads", str(heads),
        "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
        "--position-embedding-type", "rope",
        "--micro-batch-size", str(micro_batch_size),
        "--global-batch-size", str(micro_batch_size * microbatches),
        "--pipeline-model-parallel-size", str(pp),
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--lr", "1e-4", "--lr-warmup-iters", "0", "--lr-decay-style", "constant",
        "--eval-iters", "0", "--seed", str(seed),
    ]
    if data_path:
        argv += ["--data-path"] + list(data_path) + list(tokenizer_args)
    else:
        argv += ["--mock-data", "--tokenizer-type", "NullTokenizer",
                 "--vocab-size", str(vocab_size)]
    return argv + list(extra_args)


def _iteration_flags(iterations: int) -> List[str]:
    return ["--train-iters", str(iterations), "--log-interval", str(iterations)]


def build_spec(configs: Sequence[BenchConfig], base_argv: Sequence[str], runs: int,
               warmup_iters: int, timed_iters: int, out_dir: str,
               instrument: bool = True) -> List[Dict]:
    """Runs for ``megatron.benchmarks.runner``, in execution order."""
    if runs < 1 or timed_iters < 1 or warmup_iters < 0:
        raise ValueError("need runs >= 1, timed iterations >= 1, warm-up iterations >= 0")
    spec = []
    for round_index in range(runs):
        for config in configs:
            spec.append({
                "name": f"{config.name}#{round_index}", "config": config.name, "kind": TIMED,
                "argv": list(base_argv) + config.flags()
                + _iteration_flags(warmup_iters + timed_iters)})
    if instrument:
        for config in configs:
            spec.append({
                "name": f"{config.name}:timeline", "config": config.name, "kind": TIMELINE,
                "argv": list(base_argv) + config.flags()
                + _iteration_flags(warmup_iters + 1)
                + ["--timeline-file", timeline_path(out_dir, config)]})
        for config in configs:
            spec.append({
                "name": f"{config.name}:memory", "config": config.name, "kind": MEMORY,
                "argv": list(base_argv) + config.flags() + _iteration_flags(2)
                + ["--activation-memory-file", memory_path(out_dir, config)]})
    return spec


def timeline_path(out_dir: str, config: BenchConfig) -> str:
    return os.path.join(out_dir, f"timeline_{config.name}.json")


def memory_path(out_dir: str, config: BenchConfig) -> str:
    return os.path.join(out_dir, f"memory_{config.name}.json")


# ------------------------------------------------------------------------ summary
def iteration_times(record: Dict) -> List[float]:
    """Per-iteration seconds of a run: the slowest rank's ``train_step`` each iteration."""
    return [max(step) for step in zip(*record["iteration_seconds"])]


def stage_bubbles(timeline: Timeline) -> List[float]:
    """Idle / total per pipeline stage over the recorded iteration's span."""
    span = timeline.span
    if span <= 0:
        return [0.0] * timeline.pp_size
    return [1.0 - sum(e["end"] - e["start"] for e in units) / span for units in timeline.ranks]


def replay(timeline: Timeline, microbatches: int, splits: int):
    """The planner's simulator run on the measured unit durations (no communication cost):
    the span the schedule would have if messages were free and instantaneous."""
    p = timeline.pp_size
    measured = {}
    for rank, units in enumerate(timeline.ranks):
        for e in units:
            measured[(rank, Unit(e["kind"], e["microbatch"], e["split"], e["chunk"]))] = (
                e["end"] - e["start"])
    return simulate(seq1f1b_schedule(p, microbatches, splits),
                    duration=lambda rank, unit: measured[(rank, unit)])


def ideal_split_span(base: Timeline, microbatches: int, splits: int) -> float:
    """Span of the ``splits``-way schedule if splitting were free: every unit takes 1/s of
    the 1F1B unit time measured on its rank (mean forward / backward of ``base``)."""
    means = []
    for units in base.ranks:
        fwd = [e["end"] - e["start"] for e in units if e["kind"] == "F"]
        bwd = [e["end"] - e["start"] for e in units if e["kind"] == "B"]
        means.append((sum(fwd) / max(len(fwd), 1), sum(bwd) / max(len(bwd), 1)))
    sim = simulate(seq1f1b_schedule(base.pp_size, microbatches, splits),
                   duration=lambda rank, unit: means[rank][0 if unit.is_forward else 1] / splits)
    return sim.makespan


def order_mismatch(timeline: Timeline, microbatches: int, splits: int) -> Optional[str]:
    """None when every rank ran its units in the shared generator's order
    (``seq1f1b_rank_units``); otherwise where the recorded order first departs from it."""
    p = timeline.pp_size
    for rank, units in enumerate(timeline.ranks):
        recorded = [f"{e['kind']}{e['microbatch']}.{e['split']}" for e in units]
        expected = [str(u) for u in seq1f1b_schedule(p, microbatches, splits)[rank]]
        if recorded != expected:
            i = next((k for k, (a, b) in enumerate(zip(recorded, expected)) if a != b),
                     min(len(recorded), len(expected)))
            return (f"rank {rank} unit {i}: ran {' '.join(recorded[max(0, i - 2):i + 3])}, "
                    f"generator has {' '.join(expected[max(0, i - 2):i + 3])}")
    return None


def unit_breakdown(timeline: Timeline, microbatches: int) -> List[Dict]:
    """Per stage: forward and backward busy seconds, per microbatch, and mean unit times."""
    out = []
    for units in timeline.ranks:
        fwd = [e["end"] - e["start"] for e in units if e["kind"] == "F"]
        bwd = [e["end"] - e["start"] for e in units if e["kind"] == "B"]
        out.append({
            "forward_s": sum(fwd), "backward_s": sum(bwd),
            "forward_per_microbatch_s": sum(fwd) / microbatches,
            "backward_per_microbatch_s": sum(bwd) / microbatches,
            "mean_forward_unit_s": sum(fwd) / max(len(fwd), 1),
            "mean_backward_unit_s": sum(bwd) / max(len(bwd), 1),
        })
    return out


def summarize(configs: Sequence[BenchConfig], records: Sequence[Dict], *, out_dir: str,
              tokens_per_iteration: int, warmup_iters: int, microbatches: int,
              loss_rtol: float = 1e-5) -> Dict:
    """Everything ``tools/bench.py`` prints and writes, from the runner's records."""
    by_config = {c.name: {TIMED: [], TIMELINE: [], MEMORY: []} for c in configs}
    for record in records:
        by_config[record["config"]][record["kind"]].append(record)
    reference_losses = None
    rows = []
    for config in configs:
        recs = by_config[config.name]
        if not recs[TIMED]:
            raise ValueError(f"no timed run of {config.name}")
        throughputs, timed_ms = [], []
        for record in recs[TIMED]:
            timed = iteration_times(record)[warmup_iters:]
            throughputs.append(tokens_per_iteration * len(timed) / sum(timed))
            timed_ms.append(1000 * sum(timed) / len(timed))
        losses = recs[TIMED][0]["losses"]
        if reference_losses is None:
            reference_losses = losses
        row = {
            "schedule": config.schedule, "splits": config.splits,
            "balance_method": config.balance_method, "name": config.name,
            "label": config.label,
            "tokens_per_s": statistics.median(throughputs),
            "tokens_per_s_runs": throughputs,
            "ms_per_iteration_runs": timed_ms,
            "loss": losses[-1] if losses else None,
            "losses": losses,
        }
        # every run of every configuration trains the same model on the same data
        deviation = 0.0
        for record in recs[TIMED] + recs[TIMELINE] + recs[MEMORY]:
            for value, ref in zip(record["losses"], reference_losses):
                deviation = max(deviation, abs(value - ref) / max(abs(ref), 1e-12))
        row["loss_max_rel_deviation"] = deviation
        if recs[TIMELINE]:
            path = timeline_path(out_dir, config)
            timeline = read_timeline(path)
            sim = replay(timeline, microbatches, config.splits)
            last_iteration = iteration_times(recs[TIMELINE][0])[-1]
            row.update({
                "timeline_file": path,
                "bubble_fraction": timeline.bubble_fraction(),
                "bubble_fraction_per_stage": stage_bubbles(timeline),
                "pipeline_span_s": timeline.span,
                "timeline_iteration_s": last_iteration,
                "outside_pipeline_s": last_iteration - timeline.span,
                "replay_span_s": sim.makespan,
                "replay_bubble_fraction": sim.bubble_fraction(),
                "communication_wait_s": timeline.span - sim.makespan,
                "stages": unit_breakdown(timeline, microbatches),
                "order_mismatch": order_mismatch(timeline, microbatches, config.splits),
            })
        if recs[MEMORY]:
            path = memory_path(out_dir, config)
            with open(path) as handle:
                stages = json.load(handle)["stages"]
            peaks = [st["activation_peak_bytes"] for st in stages]
            row.update({
                "memory_file": path,
                "stage_activation_peak_bytes": peaks,
                "stage0_activation_peak_bytes": peaks[0],
                "worst_stage_activation_peak_bytes": max(peaks),
            })
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["tokens_per_s_ratio"] = row["tokens_per_s"] / base["tokens_per_s"]
        if "stage0_activation_peak_bytes" in row and "stage0_activation_peak_bytes" in base:
            row["stage0_activation_ratio"] = (row["stage0_activation_peak_bytes"]
                                              / base["stage0_activation_peak_bytes"])
            row["worst_stage_activation_ratio"] = (row["worst_stage_activation_peak_bytes"]
                                                   / base["worst_stage_activation_peak_bytes"])
        if "timeline_file" in row and "timeline_file" in base:
            ideal = ideal_split_span(read_timeline(base["timeline_file"]), microbatches,
                                     row["splits"])
            row["ideal_span_s"] = ideal
            # span = base span x (ideal / base replay) x (replay / ideal) x (span / replay)
            row["schedule_gain"] = base["replay_span_s"] / ideal  # bubble shrinking alone
            row["split_overhead"] = row["replay_span_s"] / ideal  # longer units
            row["communication_factor"] = row["pipeline_span_s"] / row["replay_span_s"]
        if "stages" in row and "stages" in base:
            row["compute_ratio_per_stage"] = [
                (st["forward_s"] + st["backward_s"]) / (b["forward_s"] + b["backward_s"])
                for st, b in zip(row["stages"], base["stages"])]
    worst = max(row["loss_max_rel_deviation"] for row in rows)
    return {"runs": rows, "loss_max_rel_deviation": worst, "loss_rtol": loss_rtol,
            "losses_equal": worst <= loss_rtol}


def check_targets(summary: Dict, splits: int = 4, speed: float = 1.05,
                  memory: float = 0.70) -> List[Dict]:
    """The issue's targets for Seq1F1B with ``splits`` splits, per balance method."""
    out = []
    for row in summary["runs"]:
        if row["splits"] != splits:
            continue
        out.append({"label": row["label"], "tokens_per_s_ratio": row["tokens_per_s_ratio"],
                    "speed_target": speed, "speed_met": row["tokens_per_s_ratio"] >= speed,
                    "stage0_activation_ratio": row.get("stage0_activation_ratio"),
                    "memory_target": memory,
                    "memory_met": (row.get("stage0_activation_ratio") is not None
                                   and row["stage0_activation_ratio"] <= memory)})
    return out


def json_report(summary: Dict, meta: Optional[Dict] = None) -> Dict:
    """The ``--json`` object: ``runs`` with the issue's keys first, then the details."""
    keys = ("schedule", "splits", "balance_method", "tokens_per_s", "bubble_fraction",
            "stage0_activation_peak_bytes", "loss")
    runs = []
    for row in summary["runs"]:
        entry = {k: row.get(k) for k in keys}
        entry.update({k: v for k, v in row.items() if k not in keys and k != "label"})
        runs.append(entry)
    out = {"runs": runs, "losses_equal": summary["losses_equal"],
           "loss_max_rel_deviation": summary["loss_max_rel_deviation"],
           "loss_rtol": summary["loss_rtol"]}
    if meta:
        out["meta"] = meta
    return out


def _mib(value):
    return "n/a" if value is None else f"{value / 2**20:.1f}"


def _pct(value):
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _loss(value):
    return "n/a" if value is None else f"{value:.6f}"


def _ratio(value):
    return "n/a" if value is None else f"{value:.3f}"


def format_report(summary: Dict) -> str:
    """Markdown: the main table, then where the time goes."""
    rows = summary["runs"]
    p = max((len(r.get("bubble_fraction_per_stage", [])) for r in rows), default=0)
    lines = [
        "| schedule | tokens/s (median) | runs | ratio to 1F1B | bubble (stages "
        + ", ".join(str(i) for i in range(p)) + ") | stage-0 act. peak MiB | ratio | "
        "worst-stage act. peak MiB | ratio | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        runs = " ".join(f"{t:.0f}" for t in r["tokens_per_s_runs"])
        bubbles = r.get("bubble_fraction_per_stage")
        bubble = ("n/a" if bubbles is None else
                  f"{_pct(r['bubble_fraction'])} ({', '.join(_pct(b) for b in bubbles)})")
        lines.append(
            f"| {r['label']} | {r['tokens_per_s']:.1f} | {runs} | {r['tokens_per_s_ratio']:.3f} | "
            f"{bubble} | {_mib(r.get('stage0_activation_peak_bytes'))} | "
            f"{_ratio(r.get('stage0_activation_ratio'))} | "
            f"{_mib(r.get('worst_stage_activation_peak_bytes'))} | "
            f"{_ratio(r.get('worst_stage_activation_ratio'))} | "
            f"{_loss(r['loss'])} |")
    lines.append("")
    verdict = "equal" if summary["losses_equal"] else "NOT EQUAL"
    lines.append(f"Final losses {verdict} across schedules: largest relative deviation of any "
                 f"run's per-iteration loss from 1F1B's is {summary['loss_max_rel_deviation']:.2e} "
                 f"(tolerance {summary['loss_rtol']:.0e}).")
    mismatches = [r for r in rows if r.get("order_mismatch")]
    if mismatches:
        lines += ["", "WARNING: the executor did not run the shared generator's unit order "
                  "(megatron.schedules.units.seq1f1b_rank_units):"]
        lines += [f"* {r['label']}: {r['order_mismatch']}" for r in mismatches]
    elif any("stages" in r for r in rows):
        lines += ["", "Every recorded timeline follows the generator's unit order on every rank."]
    if any("stages" in r for r in rows):
        lines += ["", "Where the time goes (the timeline run of each schedule, last iteration; "
                  "milliseconds):", "",
                  "| schedule | stage | F per mb | B per mb | compute vs 1F1B | mean F unit | "
                  "mean B unit | span | replayed span | comm./wait | outside pipeline |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if "stages" not in r:
                continue
            ratios = r.get("compute_ratio_per_stage", [None] * len(r["stages"]))
            for i, (st, ratio) in enumerate(zip(r["stages"], ratios)):
                tail = (f"{1e3 * r['pipeline_span_s']:.1f} | {1e3 * r['replay_span_s']:.1f} | "
                        f"{1e3 * r['communication_wait_s']:.1f} | "
                        f"{1e3 * r['outside_pipeline_s']:.1f}" if i == 0 else " | | | ")
                lines.append(
                    f"| {r['label'] if i == 0 else ''} | {i} | "
                    f"{1e3 * st['forward_per_microbatch_s']:.1f} | "
                    f"{1e3 * st['backward_per_microbatch_s']:.1f} | "
                    f"{_ratio(ratio)} | {1e3 * st['mean_forward_unit_s']:.1f} | "
                    f"{1e3 * st['mean_backward_unit_s']:.1f} | {tail} |")
        lines += ["", "F/B per mb: forward/backward time per microbatch (all its splits); "
                  "compute vs 1F1B: the stage's busy time over 1F1B's (split overhead); "
                  "replayed span: the planner's simulator run on the measured unit times with "
                  "free communication; comm./wait = span - replayed span; outside pipeline: "
                  "iteration time - span (optimizer step, gradient norm, finalisation)."]
        lines += ["", "Span decomposition (relative to 1F1B's replayed span):", "",
                  "| schedule | span s | gain from the schedule alone | split overhead | "
                  "comm./wait factor | outside pipeline s | iteration s (timeline run) |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            if "ideal_span_s" not in r:
                continue
            lines.append(
                f"| {r['label']} | {r['pipeline_span_s']:.3f} | {r['schedule_gain']:.3f}x | "
                f"{r['split_overhead']:.3f}x | {r['communication_factor']:.3f}x | "
                f"{r['outside_pipeline_s']:.3f} | {r['timeline_iteration_s']:.3f} |")
        lines += ["", "gain from the schedule alone: 1F1B's replayed span over the span the "
                  "split schedule would have with every unit 1/s of the 1F1B unit (bubble "
                  "shrinking only); split overhead: the replayed span with the measured split "
                  "units over that ideal; comm./wait factor: measured span over replayed span."]
    return "\n".join(lines)
