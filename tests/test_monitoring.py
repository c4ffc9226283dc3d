"""Megatron-LM's observability flags in real training processes (megatron/trainer/monitoring.py):
timers at levels 1 and 2, TensorBoard scalars at their intervals, the profiler's steps and
ranks, --log-throughput, manual garbage collection and wandb (offline).

Three launches: torchrun pp=2 Seq1F1B with every reporting flag on (our executor), one
process running three configurations in turn under tests/gc_probe.py (megatron-core's own
schedule; one of them with no flag at all, the control every check compares against), and
the wandb run."""

import glob
import json
import math
import os
import re
import struct
import subprocess
import sys

import pytest

from distributed import (ROOT, TINY_MODEL, _single_process_env, kill_tree, one_error_line,
                         start_pretrain)

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

# 4 iterations, a log line every 2, validation at 3
SHORT = TINY_MODEL + ["--train-iters", "4", "--log-interval", "2", "--eval-interval", "3",
                      "--eval-iters", "1", "--micro-batch-size", "1", "--num-workers", "0"]
LEVEL_1 = {"forward-backward", "all-grads-sync", "optimizer", "optimizer-inner-step"}
LEVEL_2 = {"forward-compute", "backward-compute", "forward-send", "forward-recv",
           "backward-send", "backward-recv"}
TIMER_LINE = re.compile(r"^\s+(\S+) \.+: \(?([\d.]+)(?:, ([\d.]+)\))?$")
THROUGHPUT = re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \|")


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """pp=2, Seq1F1B s=2: timers at level 2, TensorBoard every 2 iterations with timers and
    validation perplexity, throughput, the profiler on rank 1 for iterations 2 and 3."""
    tb = tmp_path_factory.mktemp("observed") / "tb"
    argv = SHORT + ["--global-batch-size", "2", "--pipeline-model-parallel-size", "2",
                    "--seq1f1b-splits", "2", "--timing-log-level", "2", "--log-throughput",
                    "--tensorboard-dir", str(tb), "--tensorboard-log-interval", "2",
                    "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                    "--profile", "--profile-step-start", "1", "--profile-step-end", "3",
                    "--profile-ranks", "1",
                    # issue 28's logging flags (their values across layouts:
                    # tests/test_logging_norms.py)
                    "--log-params-norm", "--log-num-zeros-in-grad",
                    "--log-world-size-to-tensorboard", "--no-log-loss-scale-to-tensorboard",
                    "--tensorboard-queue-size", "3", "--log-memory-to-tensorboard",
                    "--logging-level", "30"]
    proc = start_pretrain(argv, world_size=2)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return {"stdout": stdout, "tb": tb}


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """One process, pp=1 (megatron-core's schedule), one microbatch per iteration:
    manual gc every 2 iterations, with collection around evaluation and timers at level 1
    'max', and without it and timers at level 2 'all'; and the control run with none of
    the flags."""
    directory = tmp_path_factory.mktemp("probed")
    base = SHORT + ["--global-batch-size", "1"]
    spec = {"manual_gc": base + ["--manual-gc", "--manual-gc-interval", "2",
                                 "--timing-log-level", "1", "--timing-log-option", "max"],
            "manual_gc_no_eval": base + ["--manual-gc", "--manual-gc-interval", "2",
                                         "--no-manual-gc-eval", "--timing-log-level", "2",
                                         "--timing-log-option", "all"],
            "control": base}
    (directory / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gc_probe.py"),
                           str(directory / "spec.json"), str(directory / "out.json")],
                          cwd=ROOT, env=_single_process_env(), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    outputs = dict(re.findall(r"=== run (\w+)\n(.*?)(?==== run|\Z)", proc.stdout, re.S))
    return json.loads((directory / "out.json").read_text()), outputs


def timer_blocks(stdout):
    """{timer: [value per printed block]} (the max for 'minmax', the value for 'max')."""
    timers = {}
    for line in stdout.splitlines():
        match = TIMER_LINE.match(line)
        if match:
            value = match.group(3) or match.group(2)
            timers.setdefault(match.group(1), []).append(float(value))
    return timers


def scalars(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def test_timers_levels_1_and_2_print_real_times(observed, probed):
    stdout = observed["stdout"]
    assert stdout.count("(min, max) time across ranks (ms):") == 2  # iterations 2 and 4
    timers = timer_blocks(stdout)
    for name in LEVEL_1 | LEVEL_2:
        assert len(timers.get(name, [])) == 2 and min(timers[name]) > 0, (name, timers)
    # the schedule's time holds its compute
    assert timers["forward-backward"][0] > timers["backward-compute"][0]

    # level 1 with megatron-core's schedule, 'max': no level-2 timer
    _, outputs = probed
    level_1 = timer_blocks(outputs["manual_gc"])
    assert outputs["manual_gc"].count("max time across ranks (ms):") == 2
    for name in LEVEL_1:
        assert len(level_1.get(name, [])) == 2 and min(level_1[name]) > 0, (name, level_1)
    assert not LEVEL_2 & set(level_1), level_1
    # level 2 with megatron-core's schedule, 'all': one value per rank
    every_rank = outputs["manual_gc_no_eval"]
    assert every_rank.count("times across ranks (ms):") == 2
    for name in ("forward-backward", "forward-compute", "backward-compute"):
        values = re.findall(rf"\n  {name}:\n     rank  0: ([\d.]+)", every_rank)
        assert len(values) == 2 and min(map(float, values)) > 0, (name, every_rank[-3000:])
    assert "time across ranks" not in outputs["control"]


def test_throughput_only_with_the_flag(observed, probed):
    values = [float(v) for v in THROUGHPUT.findall(observed["stdout"])]
    assert len(values) == 2 and min(values) > 0, observed["stdout"][-2000:]
    _, outputs = probed
    assert " iteration        4/" in outputs["control"]
    assert "TFLOP/s" not in outputs["control"]
    assert "params norm" not in outputs["control"] and "num zeros" not in outputs["control"]


def test_tensorboard_scalars_at_their_intervals(observed):
    tags = scalars(observed["tb"])
    # per-iteration scalars every --tensorboard-log-interval (2) iterations
    assert [step for step, _ in tags["lm loss"]] == [2, 4]
    assert [step for step, _ in tags["learning-rate"]] == [2, 4]
    # timers (max over ranks, seconds per iteration) every --log-interval (2)
    for name in ("forward-backward", "optimizer", "forward-compute", "backward-compute"):
        points = tags[f"{name}-time"]
        assert [step for step, _ in points] == [2, 4] and min(v for _, v in points) > 0, name
    assert [step for step, _ in tags["iteration-time"]] == [2, 4]
    assert [step for step, _ in tags["throughput"]] == [2, 4]
    # validation perplexity at the evaluation (iteration 3), exp of the printed loss, and
    # at Megatron-LM's evaluation after the last iteration (4; the test set's is not logged)
    printed = float(re.search(r"validation loss at iteration 3 \| lm loss value: ([\d.]+)",
                              observed["stdout"]).group(1))
    final = float(re.search(r"validation loss at iteration 4 on validation set \| lm loss "
                            r"value: ([\d.]+)", observed["stdout"]).group(1))
    (step, ppl), (final_step, final_ppl) = tags["lm loss validation ppl"]
    assert step == 3 and ppl == pytest.approx(math.exp(printed), rel=1e-4)
    assert final_step == 4 and final_ppl == pytest.approx(math.exp(final), rel=1e-4)


PARAMS_NORM = re.compile(r"grad norm: [\d.e+-]+ \| num zeros: (\d+) \| params norm: ([\d.e+-]+) \|")


def test_megatron_lm_logging_flags(observed):
    """Megatron-LM's fields after the grad norm and its TensorBoard tags: num-zeros,
    params-norm and world-size (with 'vs samples'), no loss-scale; on CPU the memory
    scalars are noted as not reported."""
    stdout = observed["stdout"]
    fields = PARAMS_NORM.findall(stdout)
    assert len(fields) == 2, stdout[-3000:]  # iterations 2 and 4 (--log-interval 2)
    tags = scalars(observed["tb"])
    for name in ("num-zeros", "params-norm", "world-size"):
        assert [step for step, _ in tags[name]] == [2, 4], name
        assert len(tags[f"{name} vs samples"]) == 2, name
    assert [v for _, v in tags["world-size"]] == [2, 2]
    # the printed values are those written (iterations 2 and 4)
    assert [int(z) for z, _ in fields] == [int(v) for _, v in tags["num-zeros"]]
    for (_, printed), (_, written) in zip(fields, tags["params-norm"]):
        assert float(printed) == pytest.approx(written, rel=1e-5)
    assert float(fields[0][1]) != float(fields[1][1])  # the steps move the parameters
    assert "loss-scale" not in tags and "loss-scale vs samples" not in tags
    assert not any(tag.startswith("mem-") for tag in tags)
    assert "note: --log-memory-to-tensorboard reports the CUDA allocator's memory" in stdout
    assert "has no effect here" not in stdout  # none of them is a no-op any more


def test_profile_traces_the_chosen_steps_on_the_chosen_ranks(observed):
    traces = glob.glob(str(observed["tb"] / "*.pt.trace.json"))
    assert [os.path.basename(t).split(".")[0] for t in traces] == ["rank1"], traces
    with open(traces[0]) as f:
        events = json.load(f)["traceEvents"]
    spans = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("name", "").startswith("iteration ")}
    # --profile-step-start 1 --profile-step-end 3: iterations 2 and 3, as Megatron-LM
    assert sorted(spans) == ["iteration 2", "iteration 3"]
    # with the model's matrix products inside each
    products = [e["ts"] for e in events if e.get("name") == "aten::mm"]
    for name, (start, end) in spans.items():
        assert any(start <= ts <= end for ts in products), name


def test_manual_gc_collects_at_the_interval_and_around_evaluation(probed):
    results, _ = probed
    # (generation, forward_step calls so far); one microbatch per iteration, validation
    # at iteration 3 (one forward): at the start, after 2, before evaluation (3), after
    # it (generation 0), after 4; then around the evaluations after training (validation
    # set, test set: one forward each)
    gc_run = results["manual_gc"]
    assert gc_run["collections"] == [[2, 0], [2, 2], [2, 3], [0, 4], [2, 5],
                                     [2, 5], [0, 6], [2, 6], [0, 7]]
    assert gc_run["gc_enabled_in_forward"] == [False]
    assert gc_run["gc_enabled_after"] is True  # restored for what the process does next
    no_eval = results["manual_gc_no_eval"]
    assert no_eval["collections"] == [[2, 0], [2, 2], [2, 5]]
    control = results["control"]
    assert control["collections"] == [] and control["gc_enabled_in_forward"] == [True]


def wandb_history(path):
    """The scalars of an offline wandb run file: {key: [(step, value)]}. The file is a
    LevelDB-style log (32 KiB blocks of chunks: crc32, length, type) of protobuf records."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    position, block, pending, history = 7, 32768, b"", {}
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # full/first, middle/last
        if kind not in (1, 4):
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                history.setdefault(key, []).append((record.history.step.num,
                                                    json.loads(item.value_json)))
    return history


def test_wandb_missing_is_one_error_before_any_work(tmp_path):
    (tmp_path / "wandb.py").write_text("raise ImportError('wandb hidden by the test')\n")
    env = dict(_single_process_env(), PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "pretrain_gpt.py"] + SHORT + [
        "--global-batch-size", "1", "--wandb-project", "p", "--wandb-exp-name", "e"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--wandb-project needs the wandb package" in one_error_line(proc.stderr)
    assert " iteration " not in proc.stdout and "setup done" not in proc.stdout


def test_wandb_logs_the_tensorboard_scalars_offline(tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    argv = SHORT + ["--global-batch-size", "1", "--timing-log-level", "1",
                    "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                    "--wandb-project", "monitoring-test", "--wandb-exp-name", "offline",
                    "--wandb-save-dir", str(tmp_path / "wandb"), "--wandb-entity", "seq1f1b-team"]
    env = dict(_single_process_env(), WANDB_MODE="offline", WANDB_SILENT="true")
    proc = subprocess.run([sys.executable, "pretrain_gpt.py"] + argv, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [run_file] = glob.glob(str(tmp_path / "wandb" / "wandb" / "offline-run-*" / "*.wandb"))
    history = wandb_history(run_file)
    assert [step for step, _ in history["lm loss"]] == [1, 2, 3, 4]
    assert [step for step, _ in history["forward-backward-time"]] == [2, 4]
    assert [step for step, _ in history["lm loss validation ppl"]] == [3, 4]
    # --wandb-entity reaches wandb.init: the run record carries it
    assert b"seq1f1b-team" in open(run_file, "rb").read()
