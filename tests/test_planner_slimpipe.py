"""The planner knows SlimPipe: --schedule slimpipe with --slimpipe-slices and virtual stages."""

import json

import pytest

from megatron.planner.cli import config_from_args, parse, main
from megatron.planner.predict import PlanError, predict
from megatron.schedules.simulate import simulate
from megatron.schedules.slimpipe import slimpipe_schedule

BASE = ["--model", "7B", "--seq-length", "65536", "--tensor-model-parallel-size", "8",
        "--pipeline-model-parallel-size", "4", "--global-batch-size", "4"]


def plan(extra):
    return predict(config_from_args(parse(BASE + extra)))


@pytest.mark.parametrize("v,n", [(1, 4), (1, 8), (2, 4), (2, 16), (4, 8)])
def test_stage0_in_flight_units(v, n):
    flags = ["--schedule", "slimpipe", "--slimpipe-slices", str(n)]
    if v > 1:
        flags += ["--virtual-pipeline-model-parallel-size", str(v)]
    pred = plan(flags)
    p = 4
    held = v * n + 2 * (p - 1) if v > 1 else n + p - 1
    assert pred.stages[0]["in_flight_units_peak"] == held
    assert pred.splits == n and pred.split_lengths == [65536 // n] * n
    assert pred.config.parallel.num_chunks == v


def test_slimpipe_holds_less_than_seq1f1b_and_1f1b():
    slim = plan(["--slimpipe-slices", "16", "--virtual-pipeline-model-parallel-size", "2"])
    seq = plan(["--seq1f1b-splits", "4"])
    base = plan(["--schedule", "1f1b"])
    assert slim.config.schedule == "slimpipe"  # implied by the flag
    acts = [r.stages[0]["activations"] for r in (slim, seq, base)]
    assert acts[0] < acts[1] < acts[2]


def test_slice_length_is_the_same_as_slices():
    a = plan(["--slimpipe-slices", "8", "--num-layers-per-virtual-pipeline-stage", "4"])
    b = plan(["--slimpipe-slice-length", "8192", "--virtual-pipeline-model-parallel-size", "2"])
    assert a.pipeline_time_s == b.pipeline_time_s and a.stages == b.stages


def test_matches_the_generator():
    pred = plan(["--slimpipe-slices", "8", "--virtual-pipeline-model-parallel-size", "2"])
    assert [[t.unit for t in units] for units in pred.sim.ranks] == slimpipe_schedule(4, 4, 2, 8)
    # equal unit costs: the bubble of an interleaved pipeline over v m n items
    sim = simulate(slimpipe_schedule(4, 4, 2, 8), lambda r, u: 1.0)
    assert 0 < sim.bubble_fraction() < 0.2


@pytest.mark.parametrize("extra,message", [
    (["--schedule", "slimpipe"], "--slimpipe-slices N"),
    (["--slimpipe-slices", "6"], "multiple of --pipeline-model-parallel-size 4"),
    (["--slimpipe-slices", "12"], "does not divide --seq-length"),
    (["--slimpipe-slice-length", "1000"], "does not divide --seq-length"),
    (["--slimpipe-slices", "8", "--slimpipe-slice-length", "8192"], "not both"),
    (["--slimpipe-slices", "8", "--seq1f1b-splits", "4"], "--seq1f1b-splits"),
    (["--schedule", "seq1f1b", "--slimpipe-slices", "8"], "needs --schedule slimpipe"),
    (["--slimpipe-slices", "8", "--seq1f1b-balance-method", "uniform_comp"], "uniform"),
    (["--slimpipe-slices", "8", "--virtual-pipeline-model-parallel-size", "2",
      "--microbatch-group-size-per-virtual-pipeline-stage", "4"], "does not apply"),
])
def test_mistakes_name_the_flag(extra, message):
    with pytest.raises(PlanError, match=message):
        plan(extra)


def test_cli_report_json_and_timeline(tmp_path, capsys):
    timeline = tmp_path / "slimpipe.json"
    png, memory_png = tmp_path / "slimpipe.png", tmp_path / "memory.png"
    assert main(BASE + ["--slimpipe-slices", "8", "--virtual-pipeline-model-parallel-size", "2",
                        "--timeline-json", str(timeline), "--timeline-png", str(png),
                        "--memory-png", str(memory_png)]) == 0
    out = capsys.readouterr().out
    assert "schedule: slimpipe, 8 uniform slices of 8192 tokens, 2 virtual stage(s)" in out
    data = json.loads(timeline.read_text())
    assert data["meta"]["schedule"] == "slimpipe" and data["meta"]["splits"] == 8
    assert {e["chunk"] for e in data["ranks"][0]} == {0, 1}
    assert png.stat().st_size > 0 and memory_png.stat().st_size > 0
    assert main(BASE + ["--slimpipe-slices", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schedule"] == "slimpipe"


def test_auto_slices_pick_the_smallest_count_that_fits():
    """--slimpipe-slices auto: the first slice count (multiples of PP) whose reserved
    estimate fits; every smaller count tried does not fit."""
    from megatron.planner.cli import config_from_args, parse

    argv = ["--model", "7B", "--seq-length", "262144", "--tensor-model-parallel-size", "8",
            "--sequence-parallel", "--pipeline-model-parallel-size", "4",
            "--global-batch-size", "4", "--slimpipe-slices", "auto", "--bf16"]
    pred = predict(config_from_args(parse(argv)))
    tried = pred.auto_candidates
    assert not pred.oom and tried[-1]["splits"] == pred.splits > 4
    assert all(c["oom"] for c in tried[:-1]) and len(tried) >= 2
    assert [c["splits"] for c in tried] == sorted(c["splits"] for c in tried)
