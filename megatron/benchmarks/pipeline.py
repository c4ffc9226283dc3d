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
  configuration. Observers attach to our executor only, so 1F1B's timeline and memory
  runs run the executor's one-split program (megatron-core's unit order): every row
  says which runtime produced its tokens/s and which its bubble and memory
  (``runtime_of``, recorded by the runner). The memory probe's saved-tensor hooks slow
  forwards down, so neither throughput nor bubble is ever taken from a memory run;
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
from typing import Dict, List, Optional, Sequence, Tuple

from megatron.schedules.simulate import simulate
from megatron.schedules.timeline import Timeline, read_timeline
from megatron.schedules.actions import Unit
from megatron.schedules.seq1f1b import seq1f1b_schedule

TIMED, TIMELINE, MEMORY, UNIT_CPU = "timed", "timeline", "memory", "unit_cpu"
MCORE_RUNTIME, EXECUTOR_RUNTIME = "megatron-core", "executor"


def runtime_of(forward_backward_func) -> str:
    """Which runtime a schedule function from ``get_forward_backward_func`` runs:
    megatron-core's own schedules, or this project's executor (any other function)."""
    target = getattr(forward_backward_func, "func", forward_backward_func)  # a partial
    module = getattr(target, "__module__", None) or ""
    return MCORE_RUNTIME if module.startswith("megatron.core.") else EXECUTOR_RUNTIME


def records_runtime(records: Sequence[Dict]) -> Optional[str]:
    """The runtime of a set of runs (``, ``-joined if they differ); None when the
    records predate the runner's ``runtime`` field."""
    names = sorted({r["runtime"] for r in records if r.get("runtime")})
    return ", ".join(names) or None


def instrumented_runtime(row: Dict) -> Optional[str]:
    """The runtime of a row's timeline and memory runs (bubble, unit times, memory)."""
    names = sorted({row[k] for k in ("timeline_runtime", "memory_runtime") if row.get(k)})
    return ", ".join(names) or None


def runtime_label(row: Dict) -> str:
    """``megatron-core; executor`` when a row's tokens/s and its bubble and memory come
    from different runtimes, else the one runtime."""
    timed, instrumented = row.get("runtime") or "n/a", instrumented_runtime(row)
    return timed if instrumented in (None, timed) else f"{timed}; {instrumented}"


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

    def schedule_keywords(self) -> Dict:
        """The ``get_forward_backward_func`` keywords that select this schedule (what
        ``flags`` asks the trainer for), for runs that change schedule per iteration."""
        return {"seq1f1b_splits": self.splits,
                "balance_method": self.balance_method or "average", "schedule": None}

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
               micro_batch_size=1, vocab_size=1025, data_path=None, tokenizer_args=(),
               extra_args=(), seed=1234) -> List[str]:
    """``pretrain_gpt.py`` flags shared by every run (everything but schedule and length).
    ``vocab_size`` 1025: 1024 ids and the end of document, the model docs/results measured
    (NullTokenizer's --vocab-size 1024 meant it before 2026-12-08)."""
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


def round_order(configs: Sequence[BenchConfig], round_index: int) -> List[BenchConfig]:
    """Round ``k`` starts at configuration ``k mod n``: over the rounds each configuration
    runs early and late, so a machine that slows down or speeds up favours none."""
    k = round_index % len(configs)
    return list(configs[k:]) + list(configs[:k])


def build_spec(configs: Sequence[BenchConfig], base_argv: Sequence[str], runs: int,
               warmup_iters: int, timed_iters: int, out_dir: str,
               instrument: bool = True, quiet: Optional[Dict] = None,
               timeline_runs: Optional[int] = None, unit_cpu_runs: int = 0,
               memory_runs: bool = True, interleave: bool = False) -> List[Dict]:
    """Runs for ``megatron.benchmarks.runner``, in execution order.

    Round ``k`` (of ``runs``) is one timed run of every configuration (order rotated
    by ``round_order``) followed, for the first ``timeline_runs`` rounds (default all),
    by one timeline run of every configuration; one memory run per configuration ends
    the list (memory does not depend on the machine's speed). ``quiet`` (the runner's
    ``{"threshold", "max_wait", "retries"}``) applies to the timed and timeline runs,
    whose wall times other processes on the host would distort. ``memory_runs=False``
    leaves the memory runs out.

    ``interleave``: round ``k``'s timed runs are ONE run that changes schedule at every
    iteration (the runner's ``interleaved_schedules``: each configuration's
    ``warmup_iters`` + ``timed_iters`` iterations in turn, the order rotating per cycle);
    the runner splits it into one timed record per configuration."""
    if runs < 1 or timed_iters < 1 or warmup_iters < 0:
        raise ValueError("need runs >= 1, timed iterations >= 1, warm-up iterations >= 0")
    timeline_runs = runs if timeline_runs is None else timeline_runs
    spec = []

    def add(entry):
        if quiet and entry["kind"] != MEMORY:
            entry["quiet"] = dict(quiet)
        spec.append(entry)

    for k in range(runs):
        order = round_order(configs, k)
        if interleave:
            add({"name": f"interleaved#{k}", "config": "interleaved", "kind": TIMED,
                 "meta": {"round": k},
                 "interleave": [{"config": c.name, "schedule": c.schedule_keywords()}
                                for c in order],
                 "argv": list(base_argv)
                 + _iteration_flags(len(order) * (warmup_iters + timed_iters))})
        else:
            for config in order:
                add({"name": f"{config.name}#{k}", "config": config.name, "kind": TIMED,
                     "meta": {"round": k},
                     "argv": list(base_argv) + config.flags()
                     + _iteration_flags(warmup_iters + timed_iters)})
        if instrument and k < timeline_runs:
            for config in order:
                path = timeline_path(out_dir, config, k)
                add({"name": f"{config.name}:timeline#{k}", "config": config.name,
                     "kind": TIMELINE, "meta": {"round": k, "timeline_file": path},
                     "argv": list(base_argv) + config.flags()
                     + _iteration_flags(warmup_iters + 1) + ["--timeline-file", path]})
    for k in range(unit_cpu_runs if instrument else 0):
        for config in round_order(configs, k):
            path = os.path.join(out_dir, f"unitcpu_{config.name}_{k}.json")
            add({"name": f"{config.name}:unit-cpu#{k}", "config": config.name,
                 "kind": UNIT_CPU, "meta": {"round": k, "timeline_file": path,
                                            "clock": "thread"},
                 "argv": list(base_argv) + config.flags()
                 + _iteration_flags(warmup_iters + 1) + ["--timeline-file", path]})
    if instrument and memory_runs:
        for config in configs:
            path = memory_path(out_dir, config)
            add({"name": f"{config.name}:memory", "config": config.name, "kind": MEMORY,
                 "meta": {"memory_file": path},
                 "argv": list(base_argv) + config.flags() + _iteration_flags(2)
                 + ["--activation-memory-file", path]})
    return spec


def timeline_path(out_dir: str, config: BenchConfig, round_index: int = 0) -> str:
    return os.path.join(out_dir, f"timeline_{config.name}_{round_index}.json")


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


def recorded_order(timeline: Timeline) -> List[List[Unit]]:
    """Each rank's units in the order they ran (by start time)."""
    return [[Unit(e["kind"], e["microbatch"], e["split"], e["chunk"])
             for e in sorted(units, key=lambda e: e["start"])] for units in timeline.ranks]


def replay(timeline: Timeline, microbatches: int, splits: int):
    """The planner's simulator run on the measured unit durations, in the order the units
    ran, with free communication: the span the run would have had if messages cost
    nothing. (``microbatches`` and ``splits`` are implied by the timeline.)"""
    measured = unit_durations(timeline)
    return simulate(recorded_order(timeline), duration=lambda rank, unit: measured[(rank, unit)])


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


def unit_durations(timeline: Timeline) -> Dict[Tuple[int, Unit], float]:
    """{(rank, unit): measured seconds} of a recorded timeline."""
    return {(rank, Unit(e["kind"], e["microbatch"], e["split"], e["chunk"])): e["end"] - e["start"]
            for rank, units in enumerate(timeline.ranks) for e in units}


def proportional_split_span(base: Timeline, timeline: Timeline) -> float:
    """Span of ``timeline``'s schedule if its split units cost no more in all than 1F1B's
    whole microbatches but kept their measured proportions: on every rank, forward and
    backward durations scaled so their sums are ``base``'s. Over ``ideal_split_span`` it is
    what unequal splits alone cost (``average``'s later splits attend to longer
    prefixes); the measured replay over it is what longer units cost."""
    measured, wanted = unit_durations(timeline), unit_durations(base)
    scale = {}
    for rank in range(timeline.pp_size):
        for forward in (True, False):
            have = sum(d for (r, u), d in measured.items() if r == rank and u.is_forward == forward)
            want = sum(d for (r, u), d in wanted.items() if r == rank and u.is_forward == forward)
            scale[(rank, forward)] = want / have if have > 0 else 1.0
    sim = simulate(recorded_order(timeline),
                   duration=lambda rank, unit: measured[(rank, unit)] * scale[(rank, unit.is_forward)])
    return sim.makespan


def order_mismatch(timeline: Timeline, microbatches: int, splits: int,
                   expected: Optional[Sequence[Sequence[Unit]]] = None) -> Optional[str]:
    """None when every rank ran its units in the shared generator's order
    (``seq1f1b_rank_units``, or ``expected``: every rank's unit list, e.g. SlimPipe's
    ``slimpipe_schedule``); otherwise where the recorded order first departs from it."""
    p = timeline.pp_size
    schedule = seq1f1b_schedule(p, microbatches, splits) if expected is None else expected
    for rank, units in enumerate(timeline.ranks):
        recorded = [str(Unit(e["kind"], e["microbatch"], e["split"], e["chunk"]))
                    for e in units]
        wanted = [str(u) for u in schedule[rank]]
        if recorded != wanted:
            i = next((k for k, (a, b) in enumerate(zip(recorded, wanted)) if a != b),
                     min(len(recorded), len(wanted)))
            return (f"rank {rank} unit {i}: ran {' '.join(recorded[max(0, i - 2):i + 3])}, "
                    f"generator has {' '.join(wanted[max(0, i - 2):i + 3])}")
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


def _median_dicts(dicts: Sequence[Dict]) -> Dict:
    return {k: statistics.median(d[k] for d in dicts) for k in dicts[0]}


def timeline_metrics(path: str, microbatches: int, splits: int, iteration_s: float,
                     expected: Optional[Sequence[Sequence[Unit]]] = None) -> Dict:
    """Bubble, span, replay and per-stage unit times of one recorded timeline
    (``expected``: the unit order to check, as ``order_mismatch``)."""
    timeline = read_timeline(path)
    sim = replay(timeline, microbatches, splits)
    return {
        "timeline_file": path,
        "bubble_fraction": timeline.bubble_fraction(),
        "bubble_fraction_per_stage": stage_bubbles(timeline),
        "pipeline_span_s": timeline.span,
        "timeline_iteration_s": iteration_s,
        "outside_pipeline_s": iteration_s - timeline.span,
        "replay_span_s": sim.makespan,
        "replay_bubble_fraction": sim.bubble_fraction(),
        "communication_wait_s": timeline.span - sim.makespan,
        "stages": unit_breakdown(timeline, microbatches),
        "order_mismatch": order_mismatch(timeline, microbatches, splits, expected),
    }


def aggregate_timelines(runs: List[Dict]) -> Dict:
    """Median of every scalar (element-wise for per-stage values) over timeline runs;
    ``timeline_file`` is the run whose span is the median (the one drawn)."""
    spans = sorted(runs, key=lambda r: r["pipeline_span_s"])
    out = {"timeline_file": spans[(len(spans) - 1) // 2]["timeline_file"],
           "timeline_files": [r["timeline_file"] for r in runs], "timeline_runs": len(runs),
           "order_mismatch": next((r["order_mismatch"] for r in runs if r["order_mismatch"]),
                                  None)}
    for key in ("bubble_fraction", "pipeline_span_s", "timeline_iteration_s",
                "outside_pipeline_s", "replay_span_s", "replay_bubble_fraction",
                "communication_wait_s"):
        out[key] = statistics.median(r[key] for r in runs)
    out["bubble_fraction_runs"] = [r["bubble_fraction"] for r in runs]
    out["bubble_fraction_per_stage"] = [statistics.median(v) for v in
                                        zip(*(r["bubble_fraction_per_stage"] for r in runs))]
    out["stages"] = [_median_dicts(list(stage)) for stage in zip(*(r["stages"] for r in runs))]
    return out


def summarize(configs: Sequence[BenchConfig], records: Sequence[Dict], *, out_dir: str,
              tokens_per_iteration: int, warmup_iters: int, microbatches: int,
              loss_rtol: float = 1e-5, disturbed_cores: Optional[float] = None) -> Dict:
    """Everything ``tools/bench.py`` prints and writes, from the runner's records.

    ``disturbed_cores``: a round in which any timed run saw other processes use this
    many cores or more is "disturbed"; ``paired_ratio_undisturbed`` is the median of the
    per-round ratios over the other rounds (default: every round counts).

    Throughput: tokens/s of each timed run over its timed iterations; the median over
    runs, its ratio to 1F1B's median, and the median of the per-round ratios (each run
    against 1F1B's run of the same round: robust to a machine whose speed drifts).
    Timelines: every scalar is the median over the timeline runs; the comparisons with
    1F1B (compute per stage, the span decomposition) pair each run with 1F1B's run of
    the same round."""
    by_config = {c.name: {TIMED: [], TIMELINE: [], MEMORY: [], UNIT_CPU: []} for c in configs}
    for record in records:
        by_config[record["config"]][record["kind"]].append(record)
    reference_losses = None
    rows, per_round, disturbed = [], {}, set()
    for config in configs:
        recs = by_config[config.name]
        if not recs[TIMED]:
            raise ValueError(f"no timed run of {config.name}")
        throughputs, timed_ms, rounds = [], [], {}
        for i, record in enumerate(recs[TIMED]):
            timed = iteration_times(record)[warmup_iters:]
            throughputs.append(tokens_per_iteration * len(timed) / sum(timed))
            timed_ms.append(1000 * sum(timed) / len(timed))
            k = record.get("meta", {}).get("round", i)
            rounds[k] = throughputs[-1]
            load = record.get("foreign_cores")
            if disturbed_cores is not None and load is not None and load >= disturbed_cores:
                disturbed.add(k)
        per_round[config.name] = rounds
        losses = recs[TIMED][0]["losses"]
        if reference_losses is None:
            reference_losses = losses
        row = {
            "schedule": config.schedule, "splits": config.splits,
            "balance_method": config.balance_method, "name": config.name,
            "label": config.label,
            # which runtime produced the tokens/s, and which the bubble and the memory
            "runtime": records_runtime(recs[TIMED]),
            "timeline_runtime": records_runtime(recs[TIMELINE]),
            "memory_runtime": records_runtime(recs[MEMORY]),
            "tokens_per_s": statistics.median(throughputs),
            "tokens_per_s_runs": throughputs,
            "ms_per_iteration_runs": timed_ms,
            "foreign_cores_runs": [r.get("foreign_cores") for r in recs[TIMED]],
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
            runs = []
            for i, record in enumerate(recs[TIMELINE]):
                meta = record.get("meta", {})
                path = meta.get("timeline_file") or timeline_path(out_dir, config, i)
                metrics = timeline_metrics(path, microbatches, config.splits,
                                           iteration_times(record)[-1])
                metrics["round"] = meta.get("round", i)
                metrics["foreign_cores"] = record.get("foreign_cores")
                runs.append(metrics)
            row["_timeline_runs"] = runs
            row.update(aggregate_timelines(runs))
        if recs[UNIT_CPU]:
            per_run = []
            for record in recs[UNIT_CPU]:
                timeline = read_timeline(record["meta"]["timeline_file"])
                per_run.append(unit_breakdown(timeline, microbatches))
            row["unit_cpu_stages"] = [_median_dicts(list(st)) for st in zip(*per_run)]
        if recs[MEMORY]:
            path = recs[MEMORY][0].get("meta", {}).get("memory_file") or memory_path(out_dir,
                                                                                     config)
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
        paired = [t / per_round[base["name"]][k] for k, t in per_round[row["name"]].items()
                  if k in per_round[base["name"]]]
        row["paired_ratio_runs"] = paired
        row["paired_ratio_median"] = statistics.median(paired) if paired else None
        clean = [t / per_round[base["name"]][k] for k, t in per_round[row["name"]].items()
                 if k in per_round[base["name"]] and k not in disturbed]
        row["paired_ratio_undisturbed"] = statistics.median(clean) if clean else None
        row["undisturbed_rounds"] = len(clean)
        if "stage0_activation_peak_bytes" in row and "stage0_activation_peak_bytes" in base:
            row["stage0_activation_ratio"] = (row["stage0_activation_peak_bytes"]
                                              / base["stage0_activation_peak_bytes"])
            row["worst_stage_activation_ratio"] = (row["worst_stage_activation_peak_bytes"]
                                                   / base["worst_stage_activation_peak_bytes"])
        if "_timeline_runs" in row and "_timeline_runs" in base and row is not base:
            base_runs = {r["round"]: r for r in base["_timeline_runs"]}
            gains, overheads, unequal, longer, comms, computes = [], [], [], [], [], []
            for r in row["_timeline_runs"]:
                b = base_runs.get(r["round"])
                if b is None:
                    continue
                base_timeline = read_timeline(b["timeline_file"])
                ideal = ideal_split_span(base_timeline, microbatches, row["splits"])
                proportional = proportional_split_span(base_timeline,
                                                       read_timeline(r["timeline_file"]))
                # span = base replay x (ideal / base replay) x (replay / ideal) x (span / replay)
                gains.append(b["replay_span_s"] / ideal)  # bubble shrinking alone
                overheads.append(r["replay_span_s"] / ideal)  # unequal and longer units
                unequal.append(proportional / ideal)
                longer.append(r["replay_span_s"] / proportional)
                comms.append(r["pipeline_span_s"] / r["replay_span_s"])
                computes.append([(st["forward_s"] + st["backward_s"])
                                 / (bs["forward_s"] + bs["backward_s"])
                                 for st, bs in zip(r["stages"], b["stages"])])
            if gains:
                row["schedule_gain"] = statistics.median(gains)
                row["split_overhead"] = statistics.median(overheads)
                row["unequal_units_factor"] = statistics.median(unequal)
                row["longer_units_factor"] = statistics.median(longer)
                row["communication_factor"] = statistics.median(comms)
                row["compute_ratio_per_stage"] = [statistics.median(v) for v in zip(*computes)]
    if "_timeline_runs" in base:
        base["compute_ratio_per_stage"] = [1.0] * len(base["stages"])
    if "unit_cpu_stages" in base:
        for row in rows:
            if "unit_cpu_stages" in row:
                row["unit_cpu_ratio_per_stage"] = [
                    (st["forward_s"] + st["backward_s"]) / (b["forward_s"] + b["backward_s"])
                    for st, b in zip(row["unit_cpu_stages"], base["unit_cpu_stages"])]
    for row in rows:
        row.pop("_timeline_runs", None)
    worst = max(row["loss_max_rel_deviation"] for row in rows)
    return {"runs": rows, "loss_max_rel_deviation": worst, "loss_rtol": loss_rtol,
            "losses_equal": worst <= loss_rtol, "disturbed_rounds": sorted(disturbed),
            "disturbed_cores": disturbed_cores}


def check_targets(summary: Dict, splits: int = 4, speed: float = 1.05,
                  memory: float = 0.70) -> List[Dict]:
    """The issue's targets for Seq1F1B with ``splits`` splits, per balance method.

    Speed is judged on the paired per-round ratio (undisturbed rounds), which a machine
    whose speed drifts between runs cannot fake; the ratio of the medians is reported
    beside it."""
    out = []
    for row in summary["runs"]:
        if row["splits"] != splits:
            continue
        paired = row.get("paired_ratio_undisturbed")
        judged = paired if paired is not None else row["tokens_per_s_ratio"]
        out.append({"label": row["label"], "tokens_per_s_ratio": row["tokens_per_s_ratio"],
                    "runtime": row.get("runtime"),
                    "baseline_runtime": summary["runs"][0].get("runtime"),  # 1F1B's
                    "paired_ratio_median": row.get("paired_ratio_median"),
                    "paired_ratio_undisturbed": paired,
                    "speed_target": speed, "speed_met": judged >= speed,
                    "stage0_activation_ratio": row.get("stage0_activation_ratio"),
                    "memory_target": memory,
                    "memory_met": (row.get("stage0_activation_ratio") is not None
                                   and row["stage0_activation_ratio"] <= memory)})
    return out


def json_report(summary: Dict, meta: Optional[Dict] = None) -> Dict:
    """The ``--json`` object: ``runs`` with the issue's keys first, then the details."""
    keys = ("schedule", "splits", "balance_method", "tokens_per_s", "bubble_fraction",
            "stage0_activation_peak_bytes", "loss", "runtime")
    runs = []
    for row in summary["runs"]:
        entry = {k: row.get(k) for k in keys}
        entry.update({k: v for k, v in row.items() if k not in keys and k != "label"})
        runs.append(entry)
    out = {"runs": runs, "losses_equal": summary["losses_equal"],
           "disturbed_rounds": summary.get("disturbed_rounds"),
           "loss_max_rel_deviation": summary["loss_max_rel_deviation"],
           "loss_rtol": summary["loss_rtol"]}
    if meta:
        out["meta"] = meta
    return out


def _mib(value):
    return "n/a" if value is None else f"{value / 2**20:.1f}"


def fmt_pct(value):
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _loss(value):
    return "n/a" if value is None else f"{value:.6f}"


def _loads(values):
    values = [v for v in (values or []) if v is not None]
    return " ".join(f"{v:.2f}" for v in values) if values else "n/a"


def fmt_ratio(value):
    return "n/a" if value is None else f"{value:.3f}"


def check_lines(summary: Dict, losses: str, reference: str, generator: str) -> List[str]:
    """Report lines on what every run must satisfy: losses equal to the reference's,
    recorded timelines in the generator's unit order, rounds disturbed by others.
    ``losses`` is the sentence's start, with ``{verdict}`` for equal / NOT EQUAL;
    ``generator`` the dotted name of the unit-order function (``..._rank_units``)."""
    rows = summary["runs"]
    verdict = "equal" if summary["losses_equal"] else "NOT EQUAL"
    lines = ["", losses.format(verdict=verdict) + ": largest relative deviation of any "
             f"run's per-iteration loss from {reference} is "
             f"{summary['loss_max_rel_deviation']:.2e} (tolerance {summary['loss_rtol']:.0e})."]
    mismatches = [r for r in rows if r.get("order_mismatch")]
    if mismatches:
        lines += ["", f"WARNING: a recorded timeline departs from the generator's unit order "
                  f"({generator}):"]
        lines += [f"* {r['label']}: {r['order_mismatch']}" for r in mismatches]
    elif any("stages" in r for r in rows):
        name = generator.rsplit(".", 1)[-1]
        lines += ["", f"Every recorded timeline follows {name}' order on every rank."]
    if summary.get("disturbed_cores") is not None:
        lines += ["", f"Rounds disturbed by other processes (>= {summary['disturbed_cores']} "
                  f"cores during a timed run): {summary['disturbed_rounds'] or 'none'}."]
    return lines


def format_report(summary: Dict) -> str:
    """Markdown: the main table, then where the time goes."""
    rows = summary["runs"]
    p = max((len(r.get("bubble_fraction_per_stage", [])) for r in rows), default=0)
    lines = [
        "| schedule | runtime: tokens/s; bubble, memory | tokens/s (median) | runs | "
        "ratio to 1F1B | paired ratio: median (undisturbed rounds) | "
        "bubble (stages "
        + ", ".join(str(i) for i in range(p)) + ") | stage-0 act. peak MiB | ratio | "
        "worst-stage act. peak MiB | ratio | final loss | other processes (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        runs = " ".join(f"{t:.0f}" for t in r["tokens_per_s_runs"])
        bubbles = r.get("bubble_fraction_per_stage")
        bubble = ("n/a" if bubbles is None else
                  f"{fmt_pct(r['bubble_fraction'])} ({', '.join(fmt_pct(b) for b in bubbles)})")
        lines.append(
            f"| {r['label']} | {runtime_label(r)} | {r['tokens_per_s']:.1f} | {runs} | "
            f"{r['tokens_per_s_ratio']:.3f} | "
            f"{fmt_ratio(r.get('paired_ratio_median'))} ({fmt_ratio(r.get('paired_ratio_undisturbed'))}"
            f", {r.get('undisturbed_rounds', 0)}) | "
            f"{bubble} | {_mib(r.get('stage0_activation_peak_bytes'))} | "
            f"{fmt_ratio(r.get('stage0_activation_ratio'))} | "
            f"{_mib(r.get('worst_stage_activation_peak_bytes'))} | "
            f"{fmt_ratio(r.get('worst_stage_activation_ratio'))} | "
            f"{_loss(r['loss'])} | {_loads(r.get('foreign_cores_runs'))} |")
    lines += check_lines(summary, "Final losses {verdict} across schedules", "1F1B's",
                         "megatron.schedules.seq1f1b.seq1f1b_rank_units")
    lines += ["", "paired ratio: median over rounds of (this run's tokens/s / 1F1B's run of "
              "the same round), then over the undisturbed rounds and their number; bubble: idle / span per stage in the recorded timelines "
              "(median over the timeline runs); other processes: CPU cores used by other "
              "processes on the host during each timed run."]
    for r in rows:
        if runtime_label(r) != (r.get("runtime") or "n/a"):
            lines += ["", f"runtime: {r['label']}'s tokens/s come from {r['runtime']}, its "
                      f"bubble, timelines and memory from {instrumented_runtime(r)}: without "
                      "observers one split runs megatron-core's own schedule (what a user "
                      "gets), while --timeline-file and --activation-memory-file attach "
                      "observers, which only the executor takes (its one-split program has "
                      "megatron-core's 1F1B unit order)."]
    if any("stages" in r for r in rows):
        timeline_runtimes = sorted({r["timeline_runtime"] for r in rows
                                    if r.get("timeline_runtime")})
        lines += ["", "Where the time goes (timeline runs, last iteration of each; medians over "
                  "the runs; milliseconds; runtime: "
                  f"{', '.join(timeline_runtimes) or 'n/a'}):", "",
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
                    f"{fmt_ratio(ratio)} | {1e3 * st['mean_forward_unit_s']:.1f} | "
                    f"{1e3 * st['mean_backward_unit_s']:.1f} | {tail} |")
        lines += ["", "F/B per mb: forward/backward time per microbatch (all its splits); "
                  "compute vs 1F1B: the stage's busy time over 1F1B's (split overhead); "
                  "replayed span: the planner's simulator run on the measured unit times with "
                  "free communication; comm./wait = span - replayed span; outside pipeline: "
                  "iteration time - span (optimizer step, gradient norm, finalisation)."]
        lines += ["", "Span decomposition (relative to 1F1B's replayed span):", "",
                  "| schedule | span s | gain from the schedule alone | split overhead | "
                  "of it: unequal units | of it: longer units | ceiling without overhead | "
                  "comm./wait factor | outside pipeline s | iteration s (timeline run) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if "schedule_gain" not in r:
                continue
            lines.append(
                f"| {r['label']} | {r['pipeline_span_s']:.3f} | {r['schedule_gain']:.3f}x | "
                f"{r['split_overhead']:.3f}x | {r['unequal_units_factor']:.3f}x | "
                f"{r['longer_units_factor']:.3f}x | "
                f"{r['schedule_gain'] / r['unequal_units_factor']:.3f}x | "
                f"{r['communication_factor']:.3f}x | "
                f"{r['outside_pipeline_s']:.3f} | {r['timeline_iteration_s']:.3f} |")
        lines += ["", "gain from the schedule alone: 1F1B's replayed span over the span the "
                  "split schedule would have with every unit 1/s of the 1F1B unit (bubble "
                  "shrinking only); split overhead: the replayed span with the measured split "
                  "units over that ideal, the product of unequal units (each stage's split "
                  "units scaled to cost in all what 1F1B's do, keeping their measured "
                  "proportions, over the ideal) and longer units (the replayed span over that); "
                  "ceiling without overhead: 1F1B's replayed span over the span with those "
                  "scaled units, the gain if splitting cost nothing but its units stayed "
                  "unequal; comm./wait factor: measured span over replayed span."]
    if any("unit_cpu_stages" in r for r in rows):
        lines += ["", "Unit compute in thread CPU time (the thread's own work, without waiting "
                  "for a core; medians over the unit-CPU runs; milliseconds):", "",
                  "| schedule | stage | F per mb | B per mb | CPU-time compute vs 1F1B | "
                  "wall-clock compute vs 1F1B |", "|---|---|---|---|---|---|"]
        for r in rows:
            if "unit_cpu_stages" not in r:
                continue
            walls = r.get("compute_ratio_per_stage") or [None] * len(r["unit_cpu_stages"])
            cpus = r.get("unit_cpu_ratio_per_stage") or [None] * len(r["unit_cpu_stages"])
            for i, (st, cpu, wall) in enumerate(zip(r["unit_cpu_stages"], cpus, walls)):
                lines.append(f"| {r['label'] if i == 0 else ''} | {i} | "
                             f"{1e3 * st['forward_per_microbatch_s']:.1f} | "
                             f"{1e3 * st['backward_per_microbatch_s']:.1f} | {fmt_ratio(cpu)} | "
                             f"{fmt_ratio(wall)} |")
    return "\n".join(lines)
