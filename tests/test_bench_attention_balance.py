"""tools/bench_attention_balance.py without processes: the spec it launches, the plan's
numbers and the report made from a fake runner OUT (records + recorded timelines)."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.benchmarks.pipeline import TIMED, TIMELINE, order_mismatch  # noqa: E402
from megatron.benchmarks.slimpipe_balance import (  # noqa: E402
    build_balance_spec,
    build_configs,
    fit_slice_costs,
    format_balance_report,
    json_balance_report,
    plan_numbers,
    summarize_balance,
)
from megatron.schedules.simulate import simulate  # noqa: E402
from megatron.schedules.timeline import Timeline, write_timeline  # noqa: E402
from megatron.schedules.attention_balance import SliceCosts  # noqa: E402
from megatron.schedules.slimpipe import slimpipe_schedule  # noqa: E402
from megatron.schedules.seq1f1b import seq1f1b_schedule  # noqa: E402
from tools.bench_attention_balance import base_argv, parse_args  # noqa: E402

P, M, V, N = 2, 4, 2, 8


def test_spec_alternates_plain_and_balanced():
    args = parse_args(["--runs", "3", "--quiet-threshold", "0.5", "--quiet-max-wait", "120"])
    assert (args.pp, args.vp, args.slices, args.microbatches) == (P, V, N, M)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads,
            args.seq_length) == (8, 256, 8, 2048)
    configs = build_configs(args.slices)
    base = base_argv(args)
    for flag, value in (("--pipeline-schedule", "slimpipe"), ("--slimpipe-slices", "8"),
                        ("--seq1f1b-kv-cache", "chunked"), ("--attention-dropout", "0"),
                        ("--virtual-pipeline-model-parallel-size", "2"),
                        ("--pipeline-model-parallel-size", "2"), ("--num-layers", "8")):
        assert base[base.index(flag) + 1] == value, flag
    assert "--mock-data" in base and "--slimpipe-attention-balance" not in base
    spec = build_balance_spec(configs, base, args.runs, 1, 2, "/o",
                              quiet={"threshold": 0.5, "max_wait": 120, "retries": 2})
    timed = [r for r in spec if r["kind"] == TIMED]
    plain, balanced = (c.name for c in configs)
    assert [r["config"] for r in timed] == [plain, balanced, balanced, plain, plain, balanced]
    assert [r["kind"] for r in spec] == [TIMED, TIMED, TIMELINE, TIMELINE] + [TIMED] * 4
    for r in spec:
        balance = "--slimpipe-attention-balance" in r["argv"]
        assert balance == (r["config"] == balanced)
        assert r["argv"][:len(base)] == base  # same model, data and seed
        assert r["quiet"]["threshold"] == 0.5
    tl = [r for r in spec if r["kind"] == TIMELINE]
    assert all(r["argv"][r["argv"].index("--timeline-file") + 1] == r["meta"]["timeline_file"]
               for r in tl)


def test_parse_args_rejects_bad_shapes():
    with pytest.raises(SystemExit):
        parse_args(["--pp", "1"])
    with pytest.raises(SystemExit):
        parse_args(["--num-layers", "6"])  # not divisible by pp x vp = 4


def test_plan_numbers():
    plan = plan_numbers(P, M, V, N, SliceCosts(gemm=1.0))
    assert plan["pairs"] == plan["forward_askers"] + plan["backward_askers"] >= 1
    assert plan["pairs"] == len(plan["pair_list"])
    assert 0 < plan["moved_fraction"] < 1 and plan["moved_chunks"] >= plan["pairs"]
    assert plan["predicted_ratio"] == pytest.approx(
        plan["makespan_unbalanced"] / plan["makespan"])
    assert plan["predicted_ratio"] > 1  # a pair is kept only if the model gets faster


def _timeline(per_chunk_s, gemm, partners_slower=1.0):
    """SlimPipe's recorded timeline with unit times from the cost model (seconds)."""
    costs = SliceCosts(gemm=gemm)

    def duration(rank, unit):
        scale = 1.0 if unit.is_forward else 2.0
        attention = 1.0 if unit.is_forward else 2.5
        return per_chunk_s * partners_slower * (scale * costs.gemm
                                                + attention * (unit.split + 0.5))

    sim = simulate(slimpipe_schedule(P, M, V, N), duration)
    return Timeline([[{"kind": t.unit.kind, "microbatch": t.unit.microbatch,
                       "split": t.unit.split, "chunk": t.unit.chunk, "start": t.start,
                       "end": t.end} for t in units] for units in sim.ranks], {})


def test_fit_recovers_the_cost_model():
    fit = fit_slice_costs(_timeline(0.01, gemm=3.0))
    assert fit["gemm_per_chunk"] == pytest.approx(3.0)
    assert fit["backward_attention_factor"] == pytest.approx(2.5)
    assert fit["forward_slope_s"] == pytest.approx(0.01)


def _fake_out(tmp_path, configs, losses_balanced):
    """What the runner writes for 2 rounds + 1 timeline run of each configuration."""
    records = []
    for k in range(2):
        for config, seconds in ((configs[0], 1.0), (configs[1], 0.9 + 0.05 * k)):
            losses = [5.0, 4.0, 3.0] if not config.attention_balance else losses_balanced
            records.append({"name": f"{config.name}#{k}", "config": config.name,
                            "kind": TIMED, "meta": {"round": k}, "foreign_cores": 0.1,
                            "iteration_seconds": [[9.0, seconds, seconds]] * P,
                            "losses": losses})
    for config, slower in ((configs[0], 1.0), (configs[1], 0.95)):
        path = str(tmp_path / f"timeline_{config.name}_0.json")
        write_timeline(path, _timeline(0.01, gemm=3.0, partners_slower=slower))
        records.append({"name": f"{config.name}:timeline#0", "config": config.name,
                        "kind": TIMELINE, "meta": {"round": 0, "timeline_file": path},
                        "iteration_seconds": [[9.0, 2.0]] * P, "losses": [5.0, 4.0]})
    return records


def _summary(tmp_path, records, configs):
    plan = plan_numbers(P, M, V, N, SliceCosts(gemm=6.0))
    return summarize_balance(configs, records, out_dir=str(tmp_path),
                             tokens_per_iteration=8192, warmup_iters=1, pp=P,
                             microbatches=M, vp=V, slices=N, plan=plan, disturbed_cores=0.5)


def test_report_from_fake_out(tmp_path):
    configs = build_configs(N)
    summary = _summary(tmp_path, _fake_out(tmp_path, configs, [5.0, 4.0, 3.0]), configs)
    plain, balanced = summary["runs"]
    assert plain["tokens_per_s"] == pytest.approx(8192 * 2 / 2.0)
    assert balanced["paired_ratio_runs"] == pytest.approx([1 / 0.9, 1 / 0.95])
    assert balanced["paired_ratio_median"] == pytest.approx((1 / 0.9 + 1 / 0.95) / 2)
    assert summary["losses_equal"] and plain["loss"] == balanced["loss"] == 3.0
    assert len(plain["bubble_fraction_per_stage"]) == P
    assert all(0 < b < 1 for b in plain["bubble_fraction_per_stage"])
    assert plain["order_mismatch"] is None and balanced["order_mismatch"] is None
    assert summary["measured_costs"]["gemm_per_chunk"] == pytest.approx(3.0)
    assert summary["measured_costs"]["predicted_ratio"] >= 1.0
    table = format_balance_report(summary)
    header, rule, row_plain, row_balanced = table.splitlines()[:4]
    assert header.count("|") == rule.count("|") == row_plain.count("|") == row_balanced.count("|")
    assert row_balanced.startswith("| SlimPipe n=8 chunked + attention balance |")
    assert "1.111 1.053" in row_balanced and "3.000000" in row_balanced
    assert "Losses equal" in table and "slimpipe_rank_units' order" in table
    assert f"{summary['plan']['pairs']} pairs" in table and "predicted makespan ratio" in table
    report = json_balance_report(summary, {"command": "x"})
    json.dumps(report)
    assert report["plan"]["pairs"] == summary["plan"]["pairs"] and report["losses_equal"]


def test_differing_losses_fail(tmp_path):
    configs = build_configs(N)
    summary = _summary(tmp_path, _fake_out(tmp_path, configs, [5.0, 4.0, 3.001]), configs)
    assert not summary["losses_equal"]
    assert "NOT EQUAL" in format_balance_report(summary)


def test_order_check_uses_slimpipe_order():
    timeline = _timeline(0.01, gemm=3.0)
    expected = slimpipe_schedule(P, M, V, N)
    assert order_mismatch(timeline, M, N, expected) is None
    # Seq1F1B's generator is not SlimPipe's order with virtual stages
    assert order_mismatch(timeline, M, N) is not None
    seq1f1b = simulate(seq1f1b_schedule(P, M, 4), lambda r, u: 1.0)
    seq1f1b_timeline = Timeline([[{"kind": t.unit.kind, "microbatch": t.unit.microbatch,
                                   "split": t.unit.split, "chunk": 0, "start": t.start,
                                   "end": t.end} for t in units] for units in seq1f1b.ranks])
    assert order_mismatch(seq1f1b_timeline, M, 4) is None  # the default is unchanged
    swapped = Timeline([list(timeline.ranks[0]), list(timeline.ranks[1])], {})
    swapped.ranks[1][0], swapped.ranks[1][1] = swapped.ranks[1][1], swapped.ranks[1][0]
    assert "rank 1 unit 0" in order_mismatch(swapped, M, N, expected)
