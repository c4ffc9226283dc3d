"""tools/bench.py and tools/bench_stage_gpu.py: the logic without processes, and one tiny
end-to-end run of each (pp=2 over gloo; one stage on CPU in fp32)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.benchmarks.pipeline import (  # noqa: E402
    MEMORY,
    TIMED,
    TIMELINE,
    BenchConfig,
    build_configs,
    build_spec,
    check_targets,
    format_report,
    ideal_split_span,
    json_report,
    memory_path,
    proportional_split_span,
    replay,
    stage_bubbles,
    summarize,
    timeline_path,
)
from megatron.schedules.timeline import Timeline, write_timeline  # noqa: E402
from megatron.schedules.seq1f1b import seq1f1b_schedule  # noqa: E402

from distributed import _free_port  # noqa: E402

ISSUE_KEYS = {"schedule", "splits", "balance_method", "tokens_per_s", "bubble_fraction",
              "stage0_activation_peak_bytes", "loss"}


def test_configs_and_spec_alternate():
    configs = build_configs([1, 2, 4], ["average", "uniform_comp"])
    names = [c.name for c in configs]
    assert names == [
        "1f1b", "seq1f1b_s2_average", "seq1f1b_s2_uniform_comp",
        "seq1f1b_s4_average", "seq1f1b_s4_uniform_comp"]
    spec = build_spec(configs, ["--x"], runs=3, warmup_iters=2, timed_iters=3, out_dir="/o",
                      timeline_runs=2, quiet={"threshold": 0.5})
    timed = [r for r in spec if r["kind"] == TIMED]
    # every round runs every configuration once, the order rotating from round to round
    assert [r["config"] for r in timed] == names + names[1:] + names[:1] + names[2:] + names[:2]
    assert [r["meta"]["round"] for r in timed] == [0] * 5 + [1] * 5 + [2] * 5
    for r in timed:
        argv = r["argv"]
        assert argv[argv.index("--train-iters") + 1] == "5"
        assert "--timeline-file" not in argv and "--activation-memory-file" not in argv
        assert r["quiet"] == {"threshold": 0.5}
    s4 = next(r for r in timed if r["config"] == "seq1f1b_s4_uniform_comp")["argv"]
    assert s4[s4.index("--seq1f1b-splits") + 1] == "4"
    assert s4[s4.index("--seq1f1b-balance-method") + 1] == "uniform_comp"
    assert "--seq1f1b-splits" not in timed[0]["argv"]
    kinds = [r["kind"] for r in spec]
    assert kinds.count(TIMELINE) == 2 * len(configs) and kinds.count(MEMORY) == len(configs)
    # timeline runs follow their round's timed runs; memory runs come last, unthrottled
    assert kinds[:10] == [TIMED] * 5 + [TIMELINE] * 5
    assert kinds[-5:] == [MEMORY] * 5 and all("quiet" not in r for r in spec[-5:])
    tl = next(r for r in spec if r["kind"] == TIMELINE)
    assert tl["argv"][tl["argv"].index("--train-iters") + 1] == "3"  # warm-up + recorded
    assert tl["argv"][tl["argv"].index("--timeline-file") + 1] == tl["meta"]["timeline_file"]


def test_interleaved_spec_runs_every_configuration_in_one_run_per_round():
    configs = build_configs([4], ["average", "uniform_comp"])
    spec = build_spec(configs, ["--x"], runs=2, warmup_iters=1, timed_iters=2, out_dir="/o",
                      timeline_runs=1, interleave=True, quiet={"threshold": 0.5})
    timed = [r for r in spec if r["kind"] == TIMED]
    assert [r["name"] for r in timed] == ["interleaved#0", "interleaved#1"]
    # one run per round, trained on the 1F1B flags; the schedule comes from each entry
    for k, run in enumerate(timed):
        assert run["argv"] == ["--x", "--train-iters", "9", "--log-interval", "9"]
        assert run["meta"] == {"round": k} and run["quiet"] == {"threshold": 0.5}
        assert [e["config"] for e in run["interleave"]] == [
            c.name for c in configs[k:] + configs[:k]]
    assert timed[0]["interleave"][2]["schedule"] == {
        "seq1f1b_splits": 4, "balance_method": "uniform_comp", "schedule": None}
    assert timed[0]["interleave"][0]["schedule"]["seq1f1b_splits"] == 1
    # the instrumented runs stay one configuration each
    assert [r["kind"] for r in spec].count(TIMELINE) == 3


def test_interleaving_refuses_no_warmup(capsys):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import bench

    with pytest.raises(SystemExit):
        bench.parse_args(["--warmup-iters", "0"])
    assert "--warmup-iters 0 would time the run's slow first iteration" in capsys.readouterr().err
    assert bench.parse_args(["--warmup-iters", "0", "--no-interleave"]).warmup_iters == 0


def test_interleaved_schedules_rotate_per_cycle_and_split_per_configuration(monkeypatch):
    from megatron.benchmarks import runner

    built = []

    def get_func(**kwargs):  # stands in for the trainer's get_forward_backward_func
        built.append(kwargs)
        return lambda **call: ("ran", kwargs["seq1f1b_splits"], kwargs["balance_method"])

    calls = []

    def train_step(func):  # the trainer calls the schedule once per iteration
        calls.append(func())

    monkeypatch.setattr(runner.training, "get_forward_backward_func", get_func)
    monkeypatch.setattr(runner.training, "train_step", train_step)
    entries = [{"config": c.name, "schedule": c.schedule_keywords()}
               for c in build_configs([4], ["average", "uniform_comp"])]
    ran = []
    with runner.interleaved_schedules(entries, ran):
        func = runner.training.get_forward_backward_func(seq1f1b_splits=1,
                                                         balance_method="average", schedule=None)
        for _ in range(6):
            runner.training.train_step(func)
    assert runner.training.train_step is train_step  # restored
    assert [b["seq1f1b_splits"] for b in built] == [1, 4, 4]
    a, u = "seq1f1b_s4_average", "seq1f1b_s4_uniform_comp"
    assert ran == ["1f1b", a, u, a, u, "1f1b"]  # cycle 1 starts one later
    assert calls == [("ran", 1, "average"), ("ran", 4, "average"), ("ran", 4, "uniform_comp"),
                     ("ran", 4, "average"), ("ran", 4, "uniform_comp"), ("ran", 1, "average")]
    # two ranks' (durations, losses, runtimes, ran) -> one record per configuration
    run = {"kind": TIMED, "meta": {"round": 3}, "interleave": entries}
    gathered = [([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [], ["megatron-core", "executor", "executor"],
                 ran), ([1, 2, 3, 4, 5, 6], [7.0] * 6, [], ran)]
    records = runner.split_interleaved(run, gathered)
    assert [(r["name"], r["config"], r["runtime"]) for r in records] == [
        ("1f1b#3", "1f1b", "megatron-core"), (f"{a}#3", a, "executor"),
        (f"{u}#3", u, "executor")]
    assert records[0]["iteration_seconds"] == [[0.1, 0.6], [1, 6]]
    assert records[2]["iteration_seconds"] == [[0.3, 0.5], [3, 5]]
    assert all(r["meta"] == {"round": 3, "interleaved": True} for r in records)


def _timeline(p, m, s, f, b, gap=0.0):
    """A timeline of the schedule with fixed unit times (optionally a gap before each unit)."""
    from megatron.schedules.simulate import simulate

    sim = simulate(seq1f1b_schedule(p, m, s), lambda r, u: f / s if u.is_forward else b / s,
                   comm=lambda a, c, u: gap)
    return Timeline([[{"kind": t.unit.kind, "microbatch": t.unit.microbatch,
                       "split": t.unit.split, "chunk": 0, "start": t.start, "end": t.end}
                      for t in units] for units in sim.ranks], {})


def _unequal_timeline(p, m, s, f, b, weights, scale):
    """Seq1F1B with split j's units weights[j] (summing to 1) of the microbatch's f / b,
    every unit then ``scale`` times longer."""
    from megatron.schedules.simulate import simulate

    sim = simulate(seq1f1b_schedule(p, m, s),
                   lambda r, u: scale * weights[u.split] * (f if u.is_forward else b))
    return Timeline([[{"kind": t.unit.kind, "microbatch": t.unit.microbatch,
                       "split": t.unit.split, "chunk": 0, "start": t.start, "end": t.end}
                      for t in units] for units in sim.ranks], {})


def test_split_overhead_parts_unequal_and_longer_units():
    """The split overhead's two parts: unequal splits (average's later splits cost more)
    and units longer in all than 1F1B's; scaling every unit by 1.5 is all 'longer'."""
    p, m, s = 2, 4, 4
    base = _timeline(p, m, 1, 0.1, 0.3)
    weights = [0.1, 0.2, 0.3, 0.4]
    unequal = _unequal_timeline(p, m, s, 0.1, 0.3, weights, 1.0)
    longer = _unequal_timeline(p, m, s, 0.1, 0.3, weights, 1.5)
    ideal = ideal_split_span(base, m, s)
    assert proportional_split_span(base, unequal) == pytest.approx(unequal.span)
    assert proportional_split_span(base, longer) == pytest.approx(unequal.span)
    assert unequal.span / ideal > 1.05  # unequal units stretch the pipeline
    assert replay(longer, m, s).makespan / proportional_split_span(base, longer) == \
        pytest.approx(1.5)
    # equal splits: nothing is unequal
    equal = _timeline(p, m, s, 0.1, 0.3)
    assert proportional_split_span(base, equal) == pytest.approx(ideal)


def test_summarize_and_json(tmp_path):
    p, m = 2, 4
    configs = [BenchConfig(), BenchConfig(4, "average")]
    records = []
    timed_runtime = {configs[0].name: "megatron-core", configs[1].name: "executor"}
    for config, seconds, peak in ((configs[0], 1.0, 1000), (configs[1], 0.8, 600)):
        for round_index in range(3):
            records.append({"config": config.name, "kind": TIMED,
                            "runtime": timed_runtime[config.name],
                            "iteration_seconds": [[9.0, seconds + 0.01 * round_index, seconds]] * 2,
                            "losses": [5.0, 4.0, 3.0]})
        splits = config.splits
        write_timeline(timeline_path(str(tmp_path), config), _timeline(p, m, splits, 0.1, 0.3))
        records.append({"config": config.name, "kind": TIMELINE, "runtime": "executor",
                        "iteration_seconds": [[9.0, 2.0]] * 2, "losses": [5.0, 4.0]})
        with open(memory_path(str(tmp_path), config), "w") as handle:
            json.dump({"stages": [{"activation_peak_bytes": peak},
                                  {"activation_peak_bytes": peak // 2}]}, handle)
        records.append({"config": config.name, "kind": MEMORY, "runtime": "executor",
                        "iteration_seconds": [[9.0, 2.0]] * 2, "losses": [5.0, 4.0]})
    summary = summarize(configs, records, out_dir=str(tmp_path), tokens_per_iteration=1000,
                        warmup_iters=1, microbatches=m)
    base, seq = summary["runs"]
    # two timed iterations per run, median of the 3 runs
    assert base["tokens_per_s"] == pytest.approx(2000 / 2.01)
    assert seq["tokens_per_s_ratio"] == pytest.approx(2.01 / 1.61)
    assert seq["paired_ratio_median"] == pytest.approx(2.01 / 1.61)
    # bubble of equal stages: (p-1)/(ms+p-1)
    assert base["bubble_fraction"] == pytest.approx(1 / 5)
    assert seq["bubble_fraction"] == pytest.approx(1 / 17)
    assert len(seq["bubble_fraction_per_stage"]) == p
    assert seq["stage0_activation_ratio"] == pytest.approx(0.6)
    assert seq["worst_stage_activation_peak_bytes"] == 600
    assert seq["compute_ratio_per_stage"] == pytest.approx([1.0, 1.0])
    # free communication: the replay reproduces the span
    assert seq["communication_wait_s"] == pytest.approx(0.0, abs=1e-9)
    # equal splits of equal units: the gain is the bubble's, (m + p - 1) / (m + (p - 1) / s)
    assert seq["schedule_gain"] == pytest.approx(5 / 4.25)
    assert seq["split_overhead"] == pytest.approx(1.0)
    assert seq["unequal_units_factor"] == pytest.approx(1.0)
    assert seq["longer_units_factor"] == pytest.approx(1.0)
    assert seq["order_mismatch"] is None and base["order_mismatch"] is None
    assert summary["losses_equal"]
    report = json_report(summary, {"command": "x"})
    assert all(ISSUE_KEYS <= set(run) for run in report["runs"])
    assert report["runs"][0]["schedule"] == "1f1b" and report["runs"][1]["splits"] == 4
    json.dumps(report)
    table = format_report(summary)
    assert "Seq1F1B s=4 average" in table and "Final losses equal" in table
    # every 1F1B figure names its runtime: tokens/s megatron-core's, bubble and memory ours
    assert (base["runtime"], base["timeline_runtime"], base["memory_runtime"]) == (
        "megatron-core", "executor", "executor")
    assert report["runs"][0]["runtime"] == "megatron-core"
    assert "| 1F1B | megatron-core; executor |" in table
    assert "| Seq1F1B s=4 average | executor |" in table
    assert "1F1B's tokens/s come from megatron-core, its bubble, timelines and memory " \
           "from executor" in table
    (target,) = check_targets(summary)
    assert target["speed_met"] and target["memory_met"]
    assert (target["runtime"], target["baseline_runtime"]) == ("executor", "megatron-core")
    # a differing loss is reported
    records[0]["losses"] = [5.0, 4.0, 3.1]
    bad = summarize(configs, records, out_dir=str(tmp_path), tokens_per_iteration=1000,
                    warmup_iters=1, microbatches=m)
    assert not bad["losses_equal"] and "NOT EQUAL" in format_report(bad)


def test_stage_bubbles_with_communication_gaps():
    tl = _timeline(2, 4, 1, 0.1, 0.3, gap=0.05)
    bubbles = stage_bubbles(tl)
    assert all(0 < b < 1 for b in bubbles)
    assert tl.bubble_fraction() == pytest.approx(sum(bubbles) / 2)


def _env():
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")


@pytest.mark.distributed
def test_bench_end_to_end(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench.py"), "--num-layers", "2",
           "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
           "--vocab-size", "128", "--splits", "2", "--balance-methods", "uniform_comp",
           "--runs", "2", "--timeline-runs", "1", "--warmup-iters", "1", "--timed-iters", "1",
           "--out-dir", str(tmp_path / "runs"), "--json", str(out),
           "--picture", str(tmp_path / "t.png"),
           # below the ephemeral range: the tool's own pick (any free port) can be taken by
           # the tests running beside before torchrun binds it
           "--master-port", str(_free_port())]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| Seq1F1B s=2 uniform_comp |" in proc.stdout
    data = json.loads(out.read_text())
    assert [(r["schedule"], r["splits"]) for r in data["runs"]] == [("1f1b", 1), ("seq1f1b", 2)]
    # the runner records the runtime: observers move 1F1B's instrumented runs to ours
    assert [(r["runtime"], r["timeline_runtime"], r["memory_runtime"]) for r in data["runs"]] \
        == [("megatron-core", "executor", "executor"), ("executor",) * 3]
    assert "| 1F1B | megatron-core; executor |" in proc.stdout
    # the timed iterations ran interleaved: one run per round, split per configuration
    records = json.loads((tmp_path / "runs" / "records.json").read_text())
    timed = [r for r in records if r["kind"] == TIMED]
    assert [r["name"] for r in timed] == ["1f1b#0", "seq1f1b_s2_uniform_comp#0",
                                          "seq1f1b_s2_uniform_comp#1", "1f1b#1"]
    assert all(r["meta"]["interleaved"] and len(r["iteration_seconds"][0]) == 2 for r in timed)
    for run in data["runs"]:
        assert ISSUE_KEYS <= set(run)
        assert run["tokens_per_s"] > 0 and 0 <= run["bubble_fraction"] < 1
        assert run["stage0_activation_peak_bytes"] > 0 and len(run["tokens_per_s_runs"]) == 2
    assert data["losses_equal"]
    assert data["runs"][0]["loss"] == pytest.approx(data["runs"][1]["loss"], rel=1e-5)
    assert (tmp_path / "t.png").stat().st_size > 0
    assert (tmp_path / "runs" / "timeline_seq1f1b_s2_uniform_comp.png").exists()


@pytest.mark.distributed
def test_stage_emulation_tiny_cpu(tmp_path):
    out = tmp_path / "stage.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench_stage_gpu.py"), "--tiny",
           "--device", "cpu", "--splits", "1", "4", "--balance-methods", "average",
           "--iters", "1", "--json", str(out), "--profile-ops", "3"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # per rank, the 3 operators whose time moved most under splits
    assert proc.stdout.count("Seq1F1B s=4 average vs 1F1B (self ms") == 2
    assert proc.stdout.count("\n| `") == 6
    data = json.loads(out.read_text())
    assert data["runtime"].startswith("executor")  # 1F1B too: the training executor
    runs = {(r["rank"], r["splits"]): r for r in data["stage_runs"]}
    assert set(runs) == {(0, 1), (0, 4), (1, 1), (1, 4)}
    for r in runs.values():
        assert not r["oom"] and r["activation_peak_bytes"] > 0
        assert len(r["forward_s"]) == len(r["backward_s"]) == r["splits"]
    # stage 0 of pp=2 holds 2 microbatches under 1F1B, (s + p - 1)/s = 1.25 under s=4
    assert runs[(0, 4)]["activation_peak_bytes"] < 0.8 * runs[(0, 1)]["activation_peak_bytes"]
    # the whole pipeline predicted from the measured unit times, for both schedules (which
    # bubble is smaller depends on those times: at this toy size host overhead dominates a
    # unit, and tests assert no timing)
    preds = {(p["splits"], p.get("without_split_overhead", False)): p
             for p in data["predictions"]}
    assert set(preds) == {(1, False), (4, False), (4, True)}
    assert all(0 <= p["bubble_fraction"] < 1 for p in preds.values())
    assert "Whole pipeline predicted" in proc.stdout
    # the bound: split units scaled to 1F1B's compute keep each rank's busy time at 1F1B's
    assert preds[4, True]["busy_per_rank_s"] == pytest.approx(preds[1, False]["busy_per_rank_s"])
    assert "Seq1F1B s=4 average, units scaled to 1F1B's compute (no split overhead)" \
        in proc.stdout


def test_kv_cache_layout_comparison_tiny():
    """tools/bench_kv_cache.py's measurement: exact layouts; the buffer layout holds no
    more than the chunked one."""
    import torch

    from megatron.benchmarks.kv_cache_layouts import compare_layouts

    rows = {r["layout"]: r for r in compare_layouts(
        seq=96, heads=4, groups=2, head_dim=8, splits=3, repeats=1, dtype=torch.float64)}
    assert set(rows) == {"unsplit", "buffer", "chunked"}
    assert all(r["max_abs_diff_vs_unsplit"] < 1e-10 for r in rows.values())
    # on CPU the buffer layout's split attention keeps no mask (cpu_split_attention), its
    # K/V grow split by split, and it saves a split's query, not the whole sequence's
    # that the harness's split query is a view of (kv_cache.query_alone): since
    # 2026-11-28 it holds less than the chunked layout (76800 against 83968 bytes here)
    assert rows["buffer"]["peak_bytes"] <= rows["chunked"]["peak_bytes"]
    assert all(r["median_s"] > 0 for r in rows.values())


def test_bench_attention_masks_prints_every_variant(capsys):
    """tools/bench_attention_masks.py at a toy size: one row per attention variant."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "tools", "bench_attention_masks.py")
    spec = importlib.util.spec_from_file_location("bench_attention_masks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--seq-length", "64", "--splits", "2", "--repeats", "1", "--clock", "cpu"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0][2:] for row in rows[1:]] == ["unsplit", "ours", "vector mask", "dense", "no mask"]


def test_op_cpu_times_count_forward_and_backward_operators():
    """--clock cpu's per-operator profile: every aten operator of forward and backward
    is counted and CPU-timed."""
    import torch

    from megatron.benchmarks.op_clock import OpCpuTimes

    a = torch.randn(256, 256, requires_grad=True)
    with OpCpuTimes() as timer:
        out = (a @ a).sum() + torch.ones(()).add_(1)
        out.backward()
    assert timer.calls["aten::mm"] == 3  # forward, and a's two gradients
    assert timer.calls["aten::add_"] >= 1 and timer.calls["aten::sum"] == 1
    assert timer.seconds["aten::mm"] > 0


def test_grad_accum_counts_only_adds_into_the_gradient_buffer():
    """tools/bench_grad_accum.py counts (and times) the adds whose destination is a DDP
    gradient buffer (main_grad views), not other in-place adds."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from bench_grad_accum import MainGradAdds

    buffer = torch.zeros(12)
    w = torch.nn.Parameter(torch.randn(3, 2))
    w.main_grad = buffer[:6].view(3, 2)
    other = torch.zeros(3, 2)
    x = torch.randn(5, 3)
    with MainGradAdds({buffer.untyped_storage().data_ptr()}) as adds:
        for _ in range(4):  # four backward units, as four splits
            (x @ w).sum().backward()
            w.main_grad.add_(w.grad)  # DDP's post-hook
            other.add_(w.grad)  # not into the buffer: not counted
            w.grad = None
    assert adds.count == 4 and adds.seconds >= 0
    torch.testing.assert_close(w.main_grad, 4 * x.sum(0)[:, None].expand(3, 2))


def test_host_overhead_rotates_and_divides_by_units():
    """tools/bench_host_overhead.py's measurement: every schedule once per round in a
    rotating order after one warm-up, CPU time per unit."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import bench_host_overhead

    order = []
    runs = {name: (units, lambda name=name: order.append(name))
            for name, units in (("a", 2), ("b", 8))}
    per_unit = bench_host_overhead.measure(runs, rounds=3, iters=2)
    assert order == ["a", "b"] + ["a"] * 2 + ["b"] * 2 + ["b"] * 2 + ["a"] * 2 + ["a"] * 2 + ["b"] * 2
    assert {k: len(v) for k, v in per_unit.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for v in per_unit.values() for t in v)


# tools/bench_memory.py's probed stage peaks (bytes, stages 0..p-1), 2026-11-28: its
# default command (pp=4, 8 microbatches of 2048 tokens) and the throughput benchmark's
# shape (--pp 2 --microbatches 4 --splits 4, both balance methods), and some of their
# variants
PROBED_PEAKS = [
    ([], 1, [155648000, 116686848, 77791232, 52570112]),
    ([], 2, [90996736, 73596928, 56246272, 52578304]),
    ([], 4, [67067904, 58343424, 49668096, 54675456]),
    ([], 8, [55103488, 50716672, 46379008, 55724032]),
    (["--pp", "2", "--microbatches", "4"], 4, [99368960, 95668224]),
    (["--pp", "2", "--microbatches", "4", "--extra", "--seq1f1b-balance-method",
      "uniform_comp"], 4, [107400992, 108466454]),
    # selective recomputation (the split kernel's checkpoint); learned positions, whose
    # query is a view of the fused QKV output (kv_cache.query_alone), with and without it
    (["--extra", "--recompute-granularity", "selective"], 4,
     [66953216, 58245120, 49586176, 54609920]),
    (["--pp", "2", "--microbatches", "4", "--extra", "--position-embedding-type",
      "learned_absolute"], 4, [96780288, 93571072]),
    (["--pp", "2", "--microbatches", "4", "--extra", "--recompute-granularity", "selective",
      "--position-embedding-type", "learned_absolute"], 4, [96616448, 93440000]),
    # packed documents: SDPA's per-split mask on CPU (1F1B l x l, Seq1F1B its own block)
    (["--pp", "2", "--microbatches", "4", "--extra", "--reset-attention-mask",
      "--reset-position-ids", "--eod-mask-loss"], 1, [189169664, 108242944]),
    (["--pp", "2", "--microbatches", "4", "--extra", "--reset-attention-mask",
      "--reset-position-ids", "--eod-mask-loss"], 4, [104611840, 99862528]),
    # ... and none kept when selective recomputation checkpoints the kernel
    (["--pp", "2", "--microbatches", "4", "--extra", "--reset-attention-mask",
      "--reset-position-ids", "--eod-mask-loss", "--recompute-granularity", "selective"], 4,
     [99221504, 95553536]),
]


@pytest.mark.parametrize("flags, splits, probed", PROBED_PEAKS)
def test_bench_memory_plans_what_the_probe_measured(flags, splits, probed):
    """tools/bench_memory.py's "planned" column (the planner on the tool's own command
    line) at the benchmark shapes: within 0.1% of every stage's probed peak (the probe
    ran in the tool; the docs' tables quote these runs)."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import bench_memory

    args = bench_memory.build_parser().parse_args(flags)
    planned = bench_memory.planned_peaks(
        args, bench_memory.model_flags(args, ["--seq1f1b-splits", str(splits)]))
    assert len(planned) == len(probed)
    for stage, (plan, measured) in enumerate(zip(planned, probed)):
        assert abs(plan / measured - 1) < 1e-3, f"stage {stage}: planned {plan}, probed {measured}"


def test_bench_memory_stops_on_a_refused_flag_before_any_run():
    """A configuration the planner refuses ends the tool with one line naming the
    reason, before a training run is started (planned_peaks runs first in measure)."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import bench_memory

    args = bench_memory.build_parser().parse_args(["--extra", "--seq1f1b-balance-method", "nope"])
    with pytest.raises(SystemExit) as stop:
        bench_memory.measure(args, "/nonexistent", "s2", ["--seq1f1b-splits", "2"])
    assert "the planner refuses" in str(stop.value) and "--seq1f1b-balance-method" in str(stop.value)
