"""Issue 22, acceptance point 3: on a one-GPU machine the suite's multi-rank tests run on
gloo/CPU (child processes see no GPU) and its CUDA tests on the device (tests/conftest.py)."""

import shutil
import subprocess
import sys

import pytest
import torch


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
