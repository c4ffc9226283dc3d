"""Issue 22, acceptance point 3: on a one-GPU machine the suite's multi-rank tests run on
gloo/CPU (child processes see no GPU) and its CUDA tests on the device (tests/conftest.py).

Issue 27: tools/gpu_checks.sh itself (the test_gpu_checks_* tests, on CPU, with a stand-in
for python3 that answers the heavy commands at once): `first` runs install, tests, train
(fp32 verdict before the packed-documents run) and kv within its time budget, skips with
the reason what would not fit, and leaves one tarball and one summary whose result column
is filled for every kind of run."""

import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.distributed
def test_child_processes_see_no_gpu():
    probe = "import os, torch; print(repr(os.environ['CUDA_VISIBLE_DEVICES']), torch.cuda.is_available())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert out == ["''", "False"]


def _gpus_on_this_machine():
    if shutil.which("nvidia-smi") is None:
        return 0
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return sum(line.startswith("GPU ") for line in listing.splitlines())


@pytest.mark.skipif(_gpus_on_this_machine() == 0, reason="no GPU on this machine")
def test_this_process_keeps_its_gpus():
    assert torch.cuda.is_available() and torch.cuda.device_count() == _gpus_on_this_machine()
    assert torch.ones(1, device="cuda").item() == 1.0


# --- tools/gpu_checks.sh, on CPU with a stand-in python3 ------------------------------------

FAKE_PYTHON = r"""
import json, os, sys, time
argv = sys.argv[1:]
line = " ".join(argv)
if argv[:1] == ["-"]:  # the script's inline Python: the environment, comparisons, results
    code = sys.stdin.read()
    if "platform.python_version()" in code:
        print("python (stand-in) torch (stand-in) cuda None device none")
        sys.exit(0)
    sys.argv = argv
    exec(compile(code, "<stdin>", "exec"), {"__name__": "__main__"})
elif "offline_install.py" in line:
    print("installed megatron-core 0.19.2 (stand-in)", file=sys.stderr)
    print("")
elif argv[:2] == ["-m", "pytest"]:
    print("12 passed, 3 skipped in 1.00s")
elif argv[:2] == ["-m", "torch.distributed.run"]:
    drift = float(os.environ.get("FAKE_DRIFT", "0")) if "chunked" in argv else 0.0
    bf16 = 1e-3 * ("--bf16" in argv and argv[argv.index("--seq1f1b-splits") + 1] == "4")
    for i, (loss, norm) in enumerate([(7.06782, 0.880439), (7.04249, 1.30592), (7.0391, 0.96)]):
        print(f" iteration {i + 1}/3 | lm loss: {loss * (1 + drift + bf16):.6g} | "
              f"grad norm: {norm:.6g} |")
    print("[summary] iterations: 3 (skipped 0) | time: 0.5s | ms/iteration: 158.9 | "
          "final lm loss: 7.0391 | tokens/s: 3222.7")
elif "bench_kv_cache.py" in line:
    rows = [{"layout": "unsplit", "splits": 1, "time_vs_unsplit": 1.0, "peak_vs_unsplit": 1.0,
             "max_abs_diff_vs_unsplit": 0.0}]
    for s in (2, 4, 8):
        for layout, t, p in (("buffer", 1.1, 0.7), ("chunked", 1.3, 0.5)):
            rows.append({"layout": layout, "splits": s, "time_vs_unsplit": t,
                         "peak_vs_unsplit": p / s, "max_abs_diff_vs_unsplit": 2e-3})
    print("| s | layout | median ms | ... |")
    json.dump({"rows": rows}, open(argv[argv.index("--json") + 1], "w"))
elif "bench_stage_gpu.py" in line:
    preds = [{"splits": 1, "balance_method": "average", "tokens_per_s": 1000.0}]
    runs = [{"rank": 0, "splits": 1, "balance_method": "average", "oom": False,
             "activation_peak_bytes": 100}]
    for s in (2, 4, 8):
        for m, f in (("average", 1.0), ("uniform_comp", 1.1)):
            preds.append({"splits": s, "balance_method": m, "tokens_per_s": 1000.0 * f})
            runs.append({"rank": 0, "splits": s, "balance_method": m, "oom": s == 8,
                         "activation_peak_bytes": 100 // s})
    json.dump({"predictions": preds, "stage_runs": runs},
              open(argv[argv.index("--json") + 1], "w"))
else:
    sys.exit(f"stand-in python3: unexpected command {line}")
"""


def _gpu_checks(tmp_path, *phases, budget=None, **env):
    """bash tools/gpu_checks.sh PHASES with the stand-in python3; (process, output folder)."""
    fake = tmp_path / "python3"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'fake.py'} \"$@\"\n")
    fake.chmod(0o755)
    (tmp_path / "fake.py").write_text(FAKE_PYTHON)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(fake), "GPU_CHECKS_OUT": str(out),
           "TMPDIR": str(tmp_path), **env}
    if budget is not None:
        env["GPU_CHECKS_BUDGET_S"] = str(budget)
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_checks.sh"), *phases],
                          capture_output=True, text=True, env=env, timeout=300)
    return proc, out


def _rows(summary):
    """{run: (exit, seconds, result)} from the summary's table."""
    rows = {}
    for line in summary.splitlines():
        if not line.startswith("|"):  # (the indented environment block may hold a '|':
            continue                  # the commit subject)
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("run", "---"):
            rows[cells[0]] = tuple(cells[1:])
    return rows


@pytest.mark.distributed
def test_gpu_checks_first_leaves_one_tarball_and_one_summary(tmp_path):
    proc, out = _gpu_checks(tmp_path, "first")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(os.listdir(out)) == ["gpu_checks_logs.tar.gz", "summary.md"]
    summary = (out / "summary.md").read_text()
    assert summary in proc.stdout  # the summary to paste is printed too
    assert "python (stand-in)" in summary  # the environment
    rows = _rows(summary)
    runs = ["install", "tests", "train_fp32_s1", "train_fp32_s4_buffer", "train_fp32_s4_chunked",
            "train_fp32_verdict", "train_bf16_s1", "train_bf16_s4_buffer",
            "train_bf16_s4_chunked", "train_bf16_side_by_side", "train_bf16_s4_documents_gqa",
            "kv_cache_16384", "kv_cache_32768"]
    assert list(rows) == runs
    assert all(rows[run][0] == "0" and rows[run][2] for run in runs), rows
    assert rows["tests"][2] == "12 passed, 3 skipped in 1.00s"
    assert rows["train_fp32_s1"][2] == "ms/iteration 158.9, final lm loss 7.0391, tokens/s 3222.7"
    assert rows["train_fp32_verdict"][2].startswith("fp32 within 1e-5: yes")
    assert "largest relative difference s4_buffer 1.0e-03" in rows["train_bf16_side_by_side"][2]
    assert rows["kv_cache_16384"][2] == (
        "vs unsplit at s=2/4/8: buffer time 1.10/1.10/1.10 peak 0.35/0.17/0.09; "
        "chunked time 1.30/1.30/1.30 peak 0.25/0.12/0.06; max abs diff 2.0e-03")
    # the fp32 verdict is printed before the packed-documents (and any bf16) run starts
    verdict = proc.stdout.index("fp32 within 1e-5: yes")
    assert verdict < proc.stdout.index("### train_bf16_s1")
    assert verdict < proc.stdout.index("### train_bf16_s4_documents_gqa")
    with tarfile.open(out / "gpu_checks_logs.tar.gz") as tar:
        names = {os.path.normpath(name) for name in tar.getnames()}
    assert {f"{run}.log" for run in runs if "verdict" not in run and "side" not in run} <= names
    assert {"environment.txt", "summary.md", "train_summary.txt", "kv_cache_16384.json",
            "kv_cache_32768.json"} <= names
    assert not [p for p in os.listdir(tmp_path) if p.startswith("gpu_checks.")]  # no leftovers


@pytest.mark.distributed
def test_gpu_checks_skips_with_the_reason_what_the_budget_cannot_fit(tmp_path):
    # 130 s less the 15 s reserve leaves under the 120 s the 32k kv run needs
    proc, out = _gpu_checks(tmp_path, "first", budget=130)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _rows((out / "summary.md").read_text())
    assert rows["train_bf16_s4_documents_gqa"][0] == "0" and rows["kv_cache_16384"][0] == "0"
    exit_, seconds, result = rows["kv_cache_32768"]
    assert (exit_, seconds) == ("skipped", "0")
    assert re.fullmatch(r"skipped: \d+ s of the 130 s budget left, it needs about 120 s", result)
    assert "(1 skipped)" in proc.stdout
    # with no room for anything, every run is a stated skip and the two files still come
    proc, out = _gpu_checks(tmp_path, "first", budget=40)
    rows = _rows((out / "summary.md").read_text())
    assert sorted(os.listdir(out)) == ["gpu_checks_logs.tar.gz", "summary.md"]
    assert rows["tests"][0] == rows["train_fp32_s1"][0] == rows["kv_cache_16384"][0] == "skipped"
    exit_, seconds, result = rows["train_fp32_verdict"]
    assert exit_ == "skipped" and seconds.isdigit()  # its seconds: the machine's load, not asserted
    assert result == ("fp32: not compared, train_fp32_s1 train_fp32_s4_buffer "
                      "train_fp32_s4_chunked skipped (budget)")


@pytest.mark.distributed
def test_gpu_checks_fp32_disagreement_fails_the_run(tmp_path):
    proc, out = _gpu_checks(tmp_path, "train", FAKE_DRIFT="1e-4")
    assert proc.returncode == 1
    rows = _rows((out / "summary.md").read_text())
    assert rows["train_fp32_verdict"][0] == "1"
    assert rows["train_fp32_verdict"][2].startswith("fp32 within 1e-5: NO s4_chunked")
    assert "all runs: FAILED" in proc.stdout


@pytest.mark.distributed
def test_gpu_checks_stage_result_column(tmp_path):
    proc, out = _gpu_checks(tmp_path, "stage16")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _rows((out / "summary.md").read_text())
    assert rows["stage_7B_16k_pp4"] == ("0", rows["stage_7B_16k_pp4"][1], (
        "vs 1F1B (average/uniform_comp): predicted tokens/s s=2 1.00/1.10, s=4 1.00/1.10, "
        "s=8 1.00/1.10; rank 0 act. peak s=2 0.50/0.50, s=4 0.25/0.25, s=8 OOM/OOM"))
