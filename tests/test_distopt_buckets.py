"""A distributed-optimizer checkpoint saved from model chunks with several DDP buckets
(--overlap-grad-reduce, as Megatron-LM's llama example runs) reloads exactly.

megatron-core's ``fully_reshardable`` save gathers each grad buffer's state without the
padding at the end of its buckets but cuts the parameters out of it at their padded
offsets: every parameter after a chunk's first bucket was saved with shifted main weights
and Adam moments, and the load copied them into the model (differences up to 1.0 on the
first pipeline stage). megatron/trainer/checkpointing.py puts the buckets back at their
offsets before the save cuts.

dp 2 x pp 2, Seq1F1B with 4 splits, 4 processes, buckets of 2000 parameters
(tests/overlap_runner.py), so the first stage's chunk has several.
"""

import glob
import json
import os

import pytest

import distributed
from distributed import TINY_MODEL, assert_params_close, run_configs

FLAGS = TINY_MODEL + ["--micro-batch-size", "1", "--global-batch-size", "8",
                      "--pipeline-model-parallel-size", "2", "--seq1f1b-splits", "4",
                      "--use-distributed-optimizer", "--train-iters", "4"]
OGR = ["--overlap-grad-reduce"]
SMALL_BUCKETS = 2000  # parameters per DDP bucket: the first stage's chunk gets several


def test_checkpoint_saved_with_several_buckets_reloads_exactly(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    runs = [
        {"name": "straight", "argv": FLAGS + OGR, "params": True,
         "bucket_size": SMALL_BUCKETS},
        {"name": "saved", "argv": FLAGS + OGR + ["--save", ckpt, "--save-interval", "2",
                                                  "--exit-interval", "2"],
         "params": True, "bucket_size": SMALL_BUCKETS},
        # no further step: the parameters it ends with are the ones it loaded; one bucket
        # per chunk (megatron-core's default size), so the load cannot repeat the save's
        # mistake and hide it
        {"name": "loaded", "argv": FLAGS + ["--load", ckpt, "--train-iters", "2"],
         "params": True, "bucket_size": None},
        # resumed with several buckets again: the uninterrupted run's last two steps
        {"name": "resumed", "argv": FLAGS + OGR + ["--load", ckpt], "params": True,
         "bucket_size": SMALL_BUCKETS},
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(distributed, "RUNNER",
                      os.path.join(distributed.ROOT, "tests", "overlap_runner.py"))
        results = run_configs(tmp_path, 4, runs)
    # per rank, per run, per iteration, per chunk: [reductions started early, buckets]
    records = [json.load(open(path)) for path in sorted(glob.glob(str(tmp_path / "*.rank*.json")))]
    assert len(records) == 4
    assert max(chunk[1] for by_run in records for iteration in by_run["saved"]
               for chunk in iteration) > 1, "the saving run must have several buckets"

    straight, saved = results["straight"], results["saved"]
    assert len(straight["losses"]) == 4 and len(saved["losses"]) == 2
    assert saved["losses"] == straight["losses"][:2]
    assert results["loaded"]["losses"] == []
    assert_params_close(results["loaded"]["params"], saved["params"], rtol=0, atol=0)
    assert results["resumed"]["losses"] == straight["losses"][2:]
    assert_params_close(results["resumed"]["params"], straight["params"], rtol=0, atol=0)
