"""SlimPipe with and without attention balance: the runs and what their records mean.

``tools/bench_attention_balance.py`` is the command line; this module holds the logic
so that tests can exercise it without processes. It builds on
``megatron.benchmarks.pipeline`` (spec, throughput, paired ratios, loss agreement,
timeline metrics) with two configurations of one SlimPipe shape (chunked KV cache):

* ``plain``: ``--pipeline-schedule slimpipe --seq1f1b-kv-cache chunked``;
* ``balanced``: the same plus ``--slimpipe-attention-balance``.

``plan_numbers`` is what the balanced run executes, from the cost model alone
(``megatron.schedules.attention_balance``): the pairs, the share of attention work
moved and the predicted makespan ratio. ``fit_slice_costs`` fits the same cost model
to the plain run's recorded forward units (time = a + b x slice index), so the
prediction can be repeated with this machine's ratio of GEMM to attention work.
"""

import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from megatron.benchmarks.pipeline import (
    TIMED,
    TIMELINE,
    aggregate_timelines,
    build_spec,
    check_lines,
    iteration_times,
    fmt_pct,
    fmt_ratio,
    summarize,
    timeline_metrics,
)
from megatron.schedules.timeline import Timeline, read_timeline
from megatron.schedules.attention_balance import (
    SliceCosts,
    balanced_slimpipe,
    moved_fraction,
)
from megatron.schedules.slimpipe import slimpipe_schedule
from megatron.seqsplit.attention_exchange import ASK


@dataclass(frozen=True)
class BalanceConfig:
    """One of the two runs compared; the attributes ``pipeline.summarize`` reads."""

    slices: int
    attention_balance: bool = False

    schedule = "slimpipe"
    balance_method = "average"  # SlimPipe's slices are uniform

    @property
    def splits(self) -> int:
        return self.slices

    @property
    def name(self) -> str:
        return "slimpipe_chunked_balanced" if self.attention_balance else "slimpipe_chunked"

    @property
    def label(self) -> str:
        return (f"SlimPipe n={self.slices} chunked"
                + (" + attention balance" if self.attention_balance else ""))

    def flags(self) -> List[str]:
        return ["--slimpipe-attention-balance"] if self.attention_balance else []


def build_configs(slices: int) -> List[BalanceConfig]:
    """Plain first (the reference of the ratios and of the losses), then balanced."""
    return [BalanceConfig(slices, False), BalanceConfig(slices, True)]


def slimpipe_argv(slices: int, vp: int) -> List[str]:
    """SlimPipe flags both configurations share (the chunked KV cache balance needs)."""
    argv = ["--pipeline-schedule", "slimpipe", "--slimpipe-slices", str(slices),
            "--seq1f1b-kv-cache", "chunked"]
    if vp > 1:
        argv += ["--virtual-pipeline-model-parallel-size", str(vp)]
    return argv


def build_balance_spec(configs: Sequence[BalanceConfig], base_argv: Sequence[str], runs: int,
                       warmup_iters: int, timed_iters: int, out_dir: str,
                       quiet: Optional[Dict] = None, timeline_runs: int = 1) -> List[Dict]:
    """``runs`` rounds of alternating timed runs, timeline runs in the first
    ``timeline_runs`` rounds, no memory runs (``pipeline.build_spec``)."""
    return build_spec(configs, base_argv, runs, warmup_iters, timed_iters, out_dir,
                      instrument=timeline_runs > 0, quiet=quiet, timeline_runs=timeline_runs,
                      memory_runs=False)


# ------------------------------------------------------------------------ the plan
def model_costs(argv: Sequence[str], world_size: int):
    """(parsed arguments, ``SliceCosts.from_model``) exactly as the balanced run builds
    them (``megatron.schedules.executor.PipelineExecutor``)."""
    from megatron.model_shape import ModelShape
    from megatron.trainer.arguments import parse_args

    args = parse_args(list(argv), world_size=world_size, cuda_available=False)
    # the vocabulary does not enter SliceCosts (the LM head is not a per-slice layer cost)
    costs = SliceCosts.from_model(ModelShape.from_args(args, vocab_size=0),
                                  args.seq_length // args.slimpipe_slices,
                                  args.slimpipe_attention_balance_exchange_cost)
    return args, costs


def plan_numbers(pp: int, microbatches: int, vp: int, slices: int,
                 costs: SliceCosts) -> Dict:
    """What ``balanced_slimpipe`` pairs and what the cost model predicts for it."""
    plan = balanced_slimpipe(pp, microbatches, vp, slices, costs)
    asks = [(rank, unit, o) for rank, offloads in enumerate(plan.offloads)
            for unit, o in offloads.items() if o.role == ASK]
    asks.sort(key=lambda a: plan.start[(a[0], a[1])])
    return {
        "gemm_per_chunk": costs.gemm,
        "pairs": len(asks),
        "forward_askers": sum(1 for _, u, _ in asks if u.is_forward),
        "backward_askers": sum(1 for _, u, _ in asks if not u.is_forward),
        "moved_chunks": sum(o.num_chunks for _, _, o in asks),
        "moved_fraction": moved_fraction(plan),
        "makespan": plan.makespan,
        "makespan_unbalanced": plan.makespan_unbalanced,
        "predicted_ratio": plan.makespan_unbalanced / plan.makespan,
        "pair_list": [f"rank {r} {u} -> rank {o.peer} {o.peer_unit} ({o.num_chunks} chunks)"
                      for r, u, o in asks],
    }


def _line_fit(points):
    """Least squares y = a + b x over (x, y) points; None without two distinct x."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(y for _, y in points)
    b = (sum((x - mx) * (y - my) for x, y in points)
         / sum((x - mx) ** 2 for x in xs))
    return my - b * mx, b


def fit_slice_costs(timeline: Timeline) -> Optional[Dict]:
    """The cost model's parameters from a recorded run without balance.

    Forward of slice ``j`` = ``b (gemm + j + own_block)`` (``SliceCosts``; own_block is
    0.5 for long slices), so a line ``a + b j`` through every forward unit (all ranks and
    chunks) gives ``gemm = a / b - 0.5`` in units of one chunk's attention; the backward line's slope
    over the forward's is the backward attention factor (the model's 2.5)."""
    forward = [(e["split"], e["end"] - e["start"]) for r in timeline.ranks for e in r
               if e["kind"] == "F"]
    backward = [(e["split"], e["end"] - e["start"]) for r in timeline.ranks for e in r
                if e["kind"] == "B"]
    fit_f, fit_b = _line_fit(forward), _line_fit(backward)
    if fit_f is None or fit_f[1] <= 0:
        return None
    a, b = fit_f
    out = {"forward_intercept_s": a, "forward_slope_s": b, "gemm_per_chunk": a / b - 0.5}
    if fit_b is not None:
        out.update({"backward_intercept_s": fit_b[0], "backward_slope_s": fit_b[1],
                    "backward_attention_factor": fit_b[1] / b})
    return out


# ------------------------------------------------------------------------ summary
def summarize_balance(configs: Sequence[BalanceConfig], records: Sequence[Dict], *,
                      out_dir: str, tokens_per_iteration: int, warmup_iters: int,
                      pp: int, microbatches: int, vp: int, slices: int,
                      plan: Optional[Dict] = None, loss_rtol: float = 1e-5,
                      disturbed_cores: Optional[float] = None) -> Dict:
    """Throughput, paired ratios and losses of the timed runs (``pipeline.summarize``:
    ratios are balanced / plain), bubble per stage from the timeline runs (their order
    checked against ``slimpipe_schedule``), the timeline runs' losses checked too, the
    plan and, from the plain timeline, the fitted cost model and its prediction."""
    timed = [r for r in records if r["kind"] == TIMED]
    summary = summarize(configs, timed, out_dir=out_dir,
                        tokens_per_iteration=tokens_per_iteration, warmup_iters=warmup_iters,
                        microbatches=microbatches, loss_rtol=loss_rtol,
                        disturbed_cores=disturbed_cores)
    expected = slimpipe_schedule(pp, microbatches, vp, slices)
    reference = summary["runs"][0]["losses"]
    for row in summary["runs"]:
        timelines = [r for r in records if r["config"] == row["name"] and r["kind"] == TIMELINE]
        for record in timelines:
            for value, ref in zip(record["losses"], reference):
                row["loss_max_rel_deviation"] = max(
                    row["loss_max_rel_deviation"], abs(value - ref) / max(abs(ref), 1e-12))
        if timelines:
            runs = []
            for record in timelines:
                metrics = timeline_metrics(record["meta"]["timeline_file"], microbatches,
                                           slices, iteration_times(record)[-1], expected)
                metrics["round"] = record["meta"].get("round")
                runs.append(metrics)
            row.update(aggregate_timelines(runs))
    worst = max(row["loss_max_rel_deviation"] for row in summary["runs"])
    summary.update({"loss_max_rel_deviation": worst, "losses_equal": worst <= loss_rtol,
                    "plan": plan, "shape": {"pp": pp, "vp": vp, "slices": slices,
                                            "microbatches": microbatches}})
    plain = summary["runs"][0]
    if plan is not None and "timeline_file" in plain:
        fit = fit_slice_costs(read_timeline(plain["timeline_file"]))
        if fit is not None and fit["gemm_per_chunk"] > 0:
            measured = plan_numbers(pp, microbatches, vp, slices,
                                    SliceCosts(gemm=fit["gemm_per_chunk"]))
            fit["predicted_ratio"] = measured["predicted_ratio"]
            fit["pairs"] = measured["pairs"]
            fit["moved_fraction"] = measured["moved_fraction"]
        summary["measured_costs"] = fit
    return summary


def format_balance_report(summary: Dict) -> str:
    """Markdown: the comparison table, the plan's numbers, the per-stage busy times."""
    rows = summary["runs"]
    plain = rows[0]
    p = max((len(r.get("bubble_fraction_per_stage", [])) for r in rows), default=0)
    lines = [
        "| configuration | tokens/s (median) | tokens/s runs | paired ratio per round "
        "(balanced / plain) | paired ratio median (undisturbed) | final loss | bubble "
        "(stages " + ", ".join(str(i) for i in range(p)) + ") | span ms | replayed span ms "
        "| message wait ms | iteration ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = r is plain
        runs = " ".join(f"{t:.0f}" for t in r["tokens_per_s_runs"])
        paired = "-" if base else " ".join(f"{x:.3f}" for x in r["paired_ratio_runs"])
        median = ("-" if base else f"{fmt_ratio(r['paired_ratio_median'])} "
                  f"({fmt_ratio(r['paired_ratio_undisturbed'])}, {r['undisturbed_rounds']} rounds)")
        bubbles = r.get("bubble_fraction_per_stage")
        bubble = ("n/a" if bubbles is None else
                  f"{fmt_pct(r['bubble_fraction'])} ({', '.join(fmt_pct(b) for b in bubbles)})")
        spans = " | ".join("n/a" if key not in r else f"{1e3 * r[key]:.0f}" for key in (
            "pipeline_span_s", "replay_span_s", "communication_wait_s",
            "timeline_iteration_s"))
        lines.append(f"| {r['label']} | {r['tokens_per_s']:.1f} | {runs} | {paired} | "
                     f"{median} | {r['loss']:.6f} | {bubble} | {spans} |")
    lines += check_lines(summary, "Losses {verdict}", "the plain run's",
                         "megatron.schedules.slimpipe.slimpipe_rank_units")
    plan = summary.get("plan")
    if plan is not None:
        lines += ["", f"Plan (cost model: `balanced_slimpipe` with `SliceCosts.from_model`, "
                  f"GEMM work per slice = {plan['gemm_per_chunk']:.2f} chunk attentions): "
                  f"{plan['pairs']} pairs ({plan['forward_askers']} forward and "
                  f"{plan['backward_askers']} backward askers), {plan['moved_chunks']} chunks "
                  f"moved = {fmt_pct(plan['moved_fraction'])} of the attention work; predicted "
                  f"makespan ratio unbalanced / balanced = {plan['predicted_ratio']:.3f} "
                  f"({plan['makespan_unbalanced']:.1f} / {plan['makespan']:.1f} model units)."]
    fit = summary.get("measured_costs")
    if fit is not None:
        line = (f"Measured slice costs (plain timeline, forward units: "
                f"{1e3 * fit['forward_intercept_s']:.1f} ms + "
                f"{1e3 * fit['forward_slope_s']:.2f} ms x slice index): GEMM work per slice = "
                f"{fit['gemm_per_chunk']:.2f} chunk attentions")
        if "backward_attention_factor" in fit:
            line += (f", backward attention factor {fit['backward_attention_factor']:.2f} "
                     f"(model 2.5)")
        if "predicted_ratio" in fit:
            line += (f"; with that GEMM share the plan has {fit['pairs']} pairs moving "
                     f"{fmt_pct(fit['moved_fraction'])} and predicts "
                     f"{fit['predicted_ratio']:.3f}")
        lines += ["", line + "."]
    if any("stages" in r for r in rows):
        lines += ["", "Per stage (timeline run, last iteration; ms): busy time (forward + "
                  "backward units, exchanges included) and idle time within the span.", "",
                  "| configuration | stage | F busy | B busy | busy | idle |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            if "stages" not in r:
                continue
            for i, st in enumerate(r["stages"]):
                busy = st["forward_s"] + st["backward_s"]
                lines.append(f"| {r['label'] if i == 0 else ''} | {i} | "
                             f"{1e3 * st['forward_s']:.0f} | {1e3 * st['backward_s']:.0f} | "
                             f"{1e3 * busy:.0f} | {1e3 * (r['pipeline_span_s'] - busy):.0f} |")
    lines += ["", "paired ratio: tokens/s of the balanced run over the plain run of the same "
              "round (> 1: balance is faster); bubble: idle / span per stage in the recorded "
              "timeline (a unit's time includes waiting for its exchange partner); span: "
              "first unit start to last unit end; replayed span: the simulator "
              "on the measured unit times in the recorded order with free messages "
              "(pipeline.replay); message wait = span - replayed span (time ranks spent "
              "blocked in the lowered programs' point-to-point batches); iteration: "
              "train_step wall time of the timeline run."]
    return "\n".join(lines)


def json_balance_report(summary: Dict, meta: Optional[Dict] = None) -> Dict:
    """The ``--json`` object: per configuration its numbers, the plan, the fit."""
    out = {"runs": [dict(row) for row in summary["runs"]],
           "plan": summary.get("plan"), "measured_costs": summary.get("measured_costs"),
           "losses_equal": summary["losses_equal"],
           "loss_max_rel_deviation": summary["loss_max_rel_deviation"],
           "loss_rtol": summary["loss_rtol"],
           "disturbed_rounds": summary.get("disturbed_rounds"), "shape": summary.get("shape")}
    if meta:
        out["meta"] = meta
    return out
