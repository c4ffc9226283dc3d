"""A stop every rank decides alike (megatron/trainer/agreed_stop.py) reaches the user as
rank 0's line even when rank 0 is slow to print it: under torchrun, a rank that exited
first would have the launcher end rank 0 before its line was out (a failed job with no
reason)."""

import time

import pytest

from distributed import TINY_MODEL, kill_tree, one_error_line, start_pretrain

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)


def test_slow_rank_zero_still_says_why_the_job_stopped():
    # the model's vocabulary below the tokenizer's (200 ids): every rank stops alike once
    # the tokenizer is built, inside the process groups
    delay = 4.0
    proc = start_pretrain(TINY_MODEL + ["--global-batch-size", "4", "--train-iters", "2",
                                        "--padded-vocab-size", "100"],
                          world_size=2, script="tests/fault_hooks.py",
                          env={"FAULT_SLOW_STOP_LINE": str(delay)})
    started = time.time()
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        kill_tree(proc)
    assert proc.returncode != 0
    assert one_error_line(err).startswith(
        "error: --padded-vocab-size (100) is smaller than the tokenizer's vocabulary (200 "
        "tokens)"), err[-3000:]
    assert time.time() - started > delay  # the line came after rank 0's delay
