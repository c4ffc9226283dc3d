"""The planner knows --slimpipe-attention-balance: it simulates SlimPipe's attention
redistribution pairs with its own costs and reports the bubble they remove."""

import json

import pytest

from megatron.schedules import timeline as trace
from megatron.planner.cli import config_from_args, parse, main
from megatron.planner.predict import PlanError, predict
from megatron.schedules.attention_balance import moved_fraction
from megatron.schedules.actions import BACKWARD, FORWARD, Unit

# 7B at 128K tokens, 8 slices of 16K, TP 2 (the four pipeline ranks share a node)
LONG = ["--model", "7B", "--seq-length", "131072", "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--pipeline-model-parallel-size", "4", "--global-batch-size", "4",
        "--schedule", "slimpipe", "--slimpipe-slices", "8", "--gpu", "h200"]
BALANCE = ["--slimpipe-attention-balance"]


def plan(args):
    return predict(config_from_args(parse(args)))


@pytest.fixture(scope="module")
def long_pair():
    # balance needs the chunked KV cache (its default with the flag); plain SlimPipe with it
    return plan(LONG + BALANCE), plan(LONG + ["--seq1f1b-kv-cache", "chunked"])


def test_balance_needs_the_chunked_cache():
    with pytest.raises(PlanError, match="--seq1f1b-kv-cache chunked"):
        plan(LONG + BALANCE + ["--kv-cache-layout", "buffer"])


@pytest.mark.parametrize("extra", [
    [],
    ["--schedule", "1f1b"],
    ["--schedule", "seq1f1b", "--seq1f1b-splits", "4"],
    ["--num-layers-per-virtual-pipeline-stage", "3"],
])
def test_refused_without_slimpipe(extra):
    base = ["--model", "1.3B", "--seq-length", "4096", "--pipeline-model-parallel-size", "4"]
    with pytest.raises(PlanError, match="--slimpipe-attention-balance (needs --schedule|belongs to "
                       "--pipeline-schedule) slimpipe"):
        plan(base + extra + BALANCE)


def test_refused_by_predict_too(long_pair):
    from dataclasses import replace

    config = replace(long_pair[0].config, schedule="seq1f1b", splits=4)
    with pytest.raises(PlanError, match="--slimpipe-attention-balance"):
        predict(config)


def test_balance_shortens_the_pipeline(long_pair):
    balanced, plain = long_pair
    ab = balanced.attention_balance
    assert plain.attention_balance is None
    assert ab["pairs"] > 0 and ab["paired_units"] == 2 * ab["pairs"] == len(balanced.pair_waits)
    assert ab["units"] == sum(len(units) for units in balanced.sim.ranks)
    # the unbalanced numbers are the plain SlimPipe prediction
    assert ab["pipeline_time_s_unbalanced"] == plain.pipeline_time_s
    assert ab["bubble_fraction_unbalanced"] == round(plain.bubble_fraction, 5)
    # balanced is what the prediction reports, and not slower
    assert balanced.pipeline_time_s == ab["pipeline_time_s"] <= plain.pipeline_time_s
    assert balanced.bubble_fraction == ab["bubble_fraction"] < ab["bubble_fraction_unbalanced"]
    # the same compute over both pipeline times: (1 - bubble) x time is unchanged
    work = (1 - ab["bubble_fraction"]) * ab["pipeline_time_s"]
    assert work == pytest.approx((1 - plain.bubble_fraction) * plain.pipeline_time_s, rel=1e-4)
    # the planner's moved share agrees with the plan's own (slice cost units)
    assert 0 < ab["moved_attention_fraction"] < 1
    assert ab["moved_attention_fraction"] == pytest.approx(moved_fraction(balanced.balance_plan),
                                                           rel=1e-3)
    assert ab["exchange_time_s"] > 0
    # memory is unchanged: the helper keeps nothing after an exchange
    assert balanced.stages == plain.stages


def test_paired_units_run_together(long_pair):
    balanced, _ = long_pair
    timed = {(t.rank, t.unit): t for units in balanced.sim.ranks for t in units}
    partners = balanced.balance_plan.partners()
    assert len(partners) == balanced.attention_balance["paired_units"]
    for key, peer in partners.items():
        assert key[0] != peer[0]
        assert timed[key].start == timed[peer].start
        assert timed[key].end == pytest.approx(timed[peer].end, abs=1e-12)
        assert partners[peer] == key
        assert balanced.pair_waits[key] >= 0
    # unpaired units keep their time
    cost = balanced.cost
    for key, t in timed.items():
        if key not in partners:
            assert t.duration == pytest.approx(cost.unit_time(*key), rel=1e-12)


def test_exchange_and_moved_costs(long_pair):
    cost = long_pair[0].cost
    f7, b7 = Unit(FORWARD, 0, 7), Unit(BACKWARD, 0, 7)
    # all 7 prefix chunks of slice 7: 7 l^2 of 7 l^2 + l (l + 1) / 2 causal pairs
    l = 16384
    assert cost.moved_attention_share(f7, 7) == pytest.approx(7 * l / (7 * l + (l + 1) / 2))
    attention = cost.forward_time_parts(0, f7)["attention"]
    assert cost.moved_attention_time(0, b7, 3) == pytest.approx(
        2.5 * cost.moved_attention_time(0, f7, 3)) == pytest.approx(
        2.5 * attention * 3 * l / (7 * l + (l + 1) / 2))
    one, four = cost.exchange_time(0, 1, f7, 1), cost.exchange_time(0, 1, f7, 4)
    assert 0 < one < four < cost.exchange_time(0, 1, b7, 4)
    assert cost.pipeline_link_bw(0, 3) == cost.gpu.nvlink_bw  # TP 2 x PP 4: one node


def test_cli_report_json_and_timelines(tmp_path, capsys):
    png, timeline = tmp_path / "balance.png", tmp_path / "balance.json"
    assert main(LONG + BALANCE + ["--timeline-png", str(png), "--timeline-json",
                                  str(timeline)]) == 0
    out = capsys.readouterr().out
    assert "attention balance" in out and "without balance" in out and "with balance" in out
    assert "slimpipe, 8 uniform slices of 16384 tokens, 1 virtual stage(s), attention balance" in out
    assert png.stat().st_size > 0
    tl = trace.read_timeline(str(timeline))
    paired = [e for r in tl.ranks for e in r if "peer" in e]
    assert paired and {e["role"] for e in paired} == {"ask", "help"}
    assert all(e["wait"] >= 0 for e in paired)
    ab = tl.meta["attention_balance"]
    assert len(paired) == ab["paired_units"]
    # the timeline's bubble counts the waits inside pairs as idle, like the report
    assert tl.bubble_fraction() == pytest.approx(ab["bubble_fraction"], abs=1e-4)

    assert main(LONG + BALANCE + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["slimpipe_attention_balance"] is True
    assert set(data["attention_balance"]) == {
        "pairs", "paired_units", "units", "moved_attention_fraction", "exchange_time_s",
        "exchange_cost", "bubble_fraction", "pipeline_time_s", "bubble_fraction_unbalanced",
        "pipeline_time_s_unbalanced"}
    assert data["bubble_fraction"] == data["attention_balance"]["bubble_fraction"]
    assert data["pipeline_time_s"] == data["attention_balance"]["pipeline_time_s"]

    assert main(LONG + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["slimpipe_attention_balance"] is False and "attention_balance" not in data


def test_report_says_when_balancing_is_slower(capsys):
    # TP 8 puts every pipeline rank on its own node: the exchanges cross the network
    args = ["--model", "7B", "--seq-length", "65536", "--tensor-model-parallel-size", "8",
            "--pipeline-model-parallel-size", "4", "--global-batch-size", "4",
            "--slimpipe-slices", "8"] + BALANCE
    assert main(args) == 0
    out = capsys.readouterr().out
    pred = plan(args)
    ab = pred.attention_balance
    slower = ab["pipeline_time_s"] > ab["pipeline_time_s_unbalanced"]
    assert ("(slower:" in out) == slower


def test_exchange_cost_keeps_slow_links_from_slowing_the_pipeline():
    """TP 8 puts every pipeline rank on its own node: the derived exchange cost (a K/V
    chunk over the network vs its attention) is high, so the plan makes no pair that
    does not pay and the pipeline is not slower than without balancing."""
    cross_node = ["--model", "7B", "--seq-length", "65536", "--tensor-model-parallel-size",
                  "8", "--pipeline-model-parallel-size", "4", "--global-batch-size", "4",
                  "--schedule", "slimpipe", "--slimpipe-slices", "16",
                  "--virtual-pipeline-model-parallel-size", "2"] + BALANCE
    ab = plan(cross_node).attention_balance
    assert ab["exchange_cost"] > 1.0  # a chunk's transfer outlasts its attention
    assert ab["pipeline_time_s"] <= ab["pipeline_time_s_unbalanced"] * (1 + 1e-9)
    within_node = plan(LONG + BALANCE).attention_balance
    assert within_node["exchange_cost"] < ab["exchange_cost"] and within_node["pairs"] > 0


def test_exchange_cost_can_be_given():
    """The value training takes (--slimpipe-attention-balance-exchange-cost) can be
    given to the planner too; a prohibitive one makes no pairs."""
    free = plan(LONG + BALANCE + ["--slimpipe-attention-balance-exchange-cost", "0"])
    costly = plan(LONG + BALANCE + ["--slimpipe-attention-balance-exchange-cost", "100"])
    assert free.attention_balance["exchange_cost"] == 0
    assert free.attention_balance["pairs"] > 0 and costly.attention_balance["pairs"] == 0
