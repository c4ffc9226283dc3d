"""tools/demo_table.py: the CPU demo's table comes from the runs' files, and the demo
fails loudly when a schedule's losses differ from 1F1B's.

The runs are fabricated: a log with iteration, validation and [summary] lines, a
timeline JSON and a probe JSON, with known values."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "demo_table.py"


def _iteration_line(iteration, loss, tokens_per_s):
    return (f" iteration {iteration:8d}/{3:8d} | consumed samples: {8 * iteration:12d} |"
            f" elapsed time per iteration (ms): 10.0 | learning rate: 3.000000e-04 |"
            f" global batch size:     8 | lm loss: {loss:.6g} | grad norm: 1.5 |"
            f" tokens/s: {tokens_per_s} | TFLOP/s per device: 0.0100 |"
            f" activation peak per pipeline stage (GB): 0.010 0.005 |")


def write_run(runs, name, losses, tokens_per_s, rank1_start, peaks, validation=5.0,
              speeds=None, restarts=()):
    """One fabricated run: ``rank1_start`` sets the timeline's bubble (units last 1 s);
    ``speeds``: each iteration line's tokens/s (default: 999 each; the [summary] line
    says ``tokens_per_s``); ``restarts``: iterations a new process (a resume) logs first."""
    speeds = speeds or [999.0] * len(losses)
    iteration_lines = []
    for i, (loss, speed) in enumerate(zip(losses, speeds)):
        if i + 1 in restarts:
            iteration_lines.append("> setup done in 0.9s: tp=1 pp=2 dp=1 microbatches=8")
        iteration_lines.append(_iteration_line(i + 1, loss, speed))
    lines = ["W some warning", "> setup done in 1.0s: tp=1 pp=2 dp=1 microbatches=8",
             *iteration_lines,
             f" validation loss at iteration 3 | lm loss value: {validation:.6g} | lm loss PPL: 1 |",
             f"[summary] iterations: 3 (skipped 0) | time: 1.0s | ms/iteration: 10.0 | "
             f"final lm loss: {losses[-1]:.6g} | tokens/s: {tokens_per_s} | "
             f"activation peak per pipeline stage (GB): 0.010 0.005"]
    (runs / f"{name}.log").write_text("\n".join(lines) + "\n")
    unit = {"kind": "F", "microbatch": 0, "split": 0, "chunk": 0}
    timeline = {"ranks": [[dict(unit, start=0.0, end=1.0)],
                          [dict(unit, start=rank1_start, end=rank1_start + 1.0)]],
                "meta": {"source": "recorded"}}
    (runs / f"timeline_{name}.json").write_text(json.dumps(timeline))
    stages = [{"activation_peak_bytes": p, "samples": [], "sample_times": []} for p in peaks]
    (runs / f"memory_{name}.json").write_text(json.dumps({"stages": stages}))


def table(runs, *names):
    return subprocess.run([sys.executable, str(TOOL), str(runs), *names], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def rows(stdout):
    """{schedule: [cells]} of the printed Markdown table."""
    out = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and not line.startswith("| schedule"):
            out[cells[0]] = cells[1:]
    return out


@pytest.mark.distributed
def test_figures_and_ratios_come_from_the_files(tmp_path):
    # tokens/s: the median of the iterations after the first (warm-up), not the
    # [summary] line's mean over all of them
    write_run(tmp_path, "1f1b", [7.0, 6.5, 6.0], 700.0, 1.0, [4 * 2**20, 2 * 2**20],
              speeds=[100.0, 900.0, 1100.0])
    write_run(tmp_path, "seq1f1b_s4", [7.0, 6.5, 6.0], 900.0, 0.5, [2 * 2**20, 3 * 2**20],
              speeds=[50.0, 1400.0, 1600.0])
    result = table(tmp_path, "1f1b", "seq1f1b_s4")
    assert result.returncode == 0, result.stderr
    got = rows(result.stdout)
    assert got["1f1b"] == ["1000 (1.00)", "50.0%", "4.0 MiB (1.00)", "4.0 MiB (1.00)", "6", "yes"]
    # bubble: 1 - 2 busy seconds / (2 ranks x 1.5 s)
    assert got["seq1f1b_s4"] == ["1500 (1.50)", "33.3%", "2.0 MiB (0.50)", "3.0 MiB (0.75)",
                                 "6", "yes"]
    assert "say nothing about GPU speed" in result.stdout.splitlines()[-1]

    # other files, other figures: nothing is a constant
    write_run(tmp_path, "seq1f1b_s4", [7.0, 6.5, 6.0], 500.0, 0.0, [4 * 2**20, 8 * 2**20],
              speeds=[5000.0, 500.0, 500.0])
    got = rows(table(tmp_path, "1f1b", "seq1f1b_s4").stdout)
    assert got["seq1f1b_s4"][:4] == ["500 (0.50)", "0.0%", "4.0 MiB (1.00)", "8.0 MiB (2.00)"]

    # a log of two processes (a resumed run): each process's first iteration is a warm-up
    write_run(tmp_path, "seq1f1b_s4", [7.0, 6.5, 6.0, 5.5, 5.0], 500.0, 0.0, [4, 8],
              speeds=[10.0, 1400.0, 20.0, 1500.0, 1600.0], restarts=(3,))
    got = rows(table(tmp_path, "1f1b", "seq1f1b_s4").stdout)
    assert got["seq1f1b_s4"][0] == "1500 (1.50)"

    # a run of one iteration has no iteration after the warm-up: the [summary] line's
    write_run(tmp_path, "1f1b", [7.0], 800.0, 1.0, [4, 2], speeds=[10.0])
    write_run(tmp_path, "seq1f1b_s4", [7.0], 1200.0, 1.0, [4, 2], speeds=[20.0])
    got = rows(table(tmp_path, "1f1b", "seq1f1b_s4").stdout)
    assert got["1f1b"][0] == "800 (1.00)" and got["seq1f1b_s4"][0] == "1200 (1.50)"


@pytest.mark.distributed
def test_differing_losses_fail_with_one_clear_line(tmp_path):
    write_run(tmp_path, "1f1b", [7.0, 6.5, 6.0], 1000.0, 1.0, [4, 2])
    write_run(tmp_path, "slimpipe_n4", [7.0, 6.51, 6.0], 1000.0, 1.0, [4, 2])
    result = table(tmp_path, "1f1b", "slimpipe_n4")
    assert result.returncode == 1
    assert rows(result.stdout)["slimpipe_n4"][-1] == "NO"
    assert ("error: slimpipe_n4's losses differ from 1f1b's: relative difference 0.00154 "
            "at train iteration 2 (tolerance 1e-05)") in result.stderr


@pytest.mark.distributed
def test_validation_loss_counts_and_tiny_differences_pass(tmp_path):
    write_run(tmp_path, "1f1b", [7.0, 6.5, 6.0], 1000.0, 1.0, [4, 2])
    write_run(tmp_path, "seq1f1b_s4", [7.00001, 6.5, 6.0], 1000.0, 1.0, [4, 2])  # 1.4e-6
    assert table(tmp_path, "1f1b", "seq1f1b_s4").returncode == 0
    write_run(tmp_path, "seq1f1b_s4", [7.0, 6.5, 6.0], 1000.0, 1.0, [4, 2], validation=5.1)
    result = table(tmp_path, "1f1b", "seq1f1b_s4")
    assert result.returncode == 1 and "at valid iteration 3" in result.stderr


@pytest.mark.distributed
def test_a_run_that_did_not_finish_is_named(tmp_path):
    write_run(tmp_path, "1f1b", [7.0, 6.5, 6.0], 1000.0, 1.0, [4, 2])
    write_run(tmp_path, "seq1f1b_s4", [7.0, 6.5, 6.0], 1000.0, 1.0, [4, 2])
    log = tmp_path / "seq1f1b_s4.log"
    log.write_text("".join(line for line in log.read_text().splitlines(True)
                           if "[summary]" not in line))
    result = table(tmp_path, "1f1b", "seq1f1b_s4")
    assert result.returncode == 2
    assert "seq1f1b_s4.log has no [summary] line" in result.stderr


def test_cpu_memory_column_says_what_it_measures():
    import torch

    from megatron.trainer import metrics

    class Probe:
        peak_bytes = 12345

    if torch.cuda.is_available():
        assert metrics.memory_label([Probe()]) == metrics.GPU_MEMORY
        return
    assert metrics.memory_label([]) == "peak resident set per pipeline stage (GB)"
    assert metrics.memory_label([object(), Probe()]) == "activation peak per pipeline stage (GB)"
    assert metrics.peak_memory_bytes([Probe()]) == 12345
    line = metrics.format_iteration_line(1, 2, 8, 1.0, 1e-4, 8, 7.0, None, 1.0, 1.0,
                                         [0.5, 0.25], metrics.memory_label([Probe()]))
    assert line.endswith(" activation peak per pipeline stage (GB): 0.500 0.250 |")
