"""Flag mistakes are reported before torch and megatron-core load (issue 30 pt 9): the
early check (arguments.early_problems) finds them without those imports, and never
finds a problem the full check would not."""

import os
import subprocess
import sys

import pytest

from distributed import ROOT, TINY_MODEL
from megatron.trainer.arguments import ArgumentErrors, early_problems, parse_args

PP2 = TINY_MODEL + ["--global-batch-size", "4", "--pipeline-model-parallel-size", "2"]

# (world size, argv): valid command lines of the suites' kinds, and mistaken ones
CASES = [
    (2, PP2 + ["--train-iters", "3", "--seq1f1b-splits", "2"]),
    (4, PP2 + ["--train-iters", "3", "--virtual-pipeline-model-parallel-size", "2",
               "--pipeline-schedule", "slimpipe", "--slimpipe-slices", "4",
               "--slimpipe-attention-balance", "--seq1f1b-kv-cache", "chunked"]),
    (4, TINY_MODEL + ["--global-batch-size", "4", "--train-iters", "3",
                      "--tensor-model-parallel-size", "2", "--sequence-parallel",
                      "--use-distributed-optimizer", "--recompute-granularity", "selective"]),
    (2, PP2 + ["--train-iters", "3", "--bf16", "--lr", "-1", "--bogus-flag", "3",
               "--seq1f1b-splits", "0", "--exit-signal", "SIGNOPE"]),
    (1, PP2 + ["--train-iters", "3", "--seq1f1b-kv-cache", "chunked", "--attention-dropout",
               "0.1", "--save", "x"]),
]


@pytest.mark.parametrize("world_size, argv", CASES)
def test_early_problems_are_the_full_checks_problems(monkeypatch, world_size, argv):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    early = early_problems(argv)
    try:
        parse_args(argv, world_size=world_size, cuda_available=False, check_files=False)
        full = []
    except ArgumentErrors as error:
        full = error.problems
    assert set(early) <= set(full), set(early) - set(full)
    # on this CPU build of torch the device checks run early too: nothing is left
    assert early == full


@pytest.mark.distributed
def test_flag_error_comes_before_torch_loads():
    """pretrain_gpt.py with bad flags: every problem, exit 2, and neither torch nor
    megatron-core was imported (what made a flag error take up to a minute)."""
    probe = ("import atexit, runpy, sys\n"
             "atexit.register(lambda: print('loaded:', 'torch' in sys.modules,"
             " 'megatron.core' in sys.modules))\n"
             "sys.argv = ['pretrain_gpt.py'] + sys.argv[1:]\n"
             "runpy.run_path('pretrain_gpt.py', run_name='__main__')\n")
    argv = CASES[3][1]
    proc = subprocess.run([sys.executable, "-c", probe, *argv], cwd=ROOT,
                          env=dict(os.environ, RANK="0", WORLD_SIZE="2"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 5 and "Traceback" not in proc.stderr, proc.stderr
    assert any("--bogus-flag" in e for e in errors) and any("--bf16" in e for e in errors)
    assert any("--exit-signal" in e and "SIGNOPE" in e for e in errors), errors
    assert proc.stdout.strip().endswith("loaded: False False"), proc.stdout
