"""A distributed-optimizer checkpoint saved from model chunks with several DDP buckets
(--overlap-grad-reduce, as Megatron-LM's llama example runs) reloads exactly.

megatron-core's ``fully_reshardable`` save gathers each grad buffer's state without the
padding at the end of its buckets but cuts the parameters out of it at their padded
offsets: every parameter after a chunk's first bucket was saved with shifted main weights
and Adam moments, and the load copied them into the model (differences up to 1.0 on the
first pipeline stage). megatron/trainer/checkpointing.py puts the buckets back at their
offsets before the save cuts. A checkpoint saved before that correction loads with a
printed warning naming --no-load-optim, which then resumes from its (right) weights.

dp 2 x pp 2, Seq1F1B with 4 splits, 4 processes, buckets of 2000 parameters
(tests/overlap_runner.py), so the first stage's chunk has several.
"""

import glob
import json
import os
import subprocess
import sys

import pytest

from distributed import ROOT, TINY_MODEL, _free_port, assert_params_close

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

FLAGS = TINY_MODEL + ["--micro-batch-size", "1", "--global-batch-size", "8",
                      "--pipeline-model-parallel-size", "2", "--seq1f1b-splits", "4",
                      "--use-distributed-optimizer", "--train-iters", "4"]
OGR = ["--overlap-grad-reduce"]
SMALL_BUCKETS = 2000  # parameters per DDP bucket: the first stage's chunk gets several
WARNING = "warning: --load {}: the optimizer state's main weights of"


def _launch(tmp_path, runs):
    """distributed.run_configs through tests/overlap_runner.py, with the printed output."""
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps(runs))
    cmd = [sys.executable, "-u", os.path.join(ROOT, "tests", "overlap_runner.py"), "--nproc", "4",
           str(spec), str(out)]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    # data-parallel ranks > 0 hold no optimizer state to save; megatron-core warned on
    # every save that their common state differed from rank 0's (checkpointing.py)
    assert "common state dict differs" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_checkpoint_saved_with_several_buckets_reloads_exactly(tmp_path):
    ckpt, legacy = str(tmp_path / "ckpt"), str(tmp_path / "legacy")
    save = ["--save-interval", "2", "--exit-interval", "2"]
    runs = [
        {"name": "straight", "argv": FLAGS + OGR, "params": True,
         "bucket_size": SMALL_BUCKETS},
        {"name": "saved", "argv": FLAGS + OGR + ["--save", ckpt] + save,
         "params": True, "bucket_size": SMALL_BUCKETS},
        # no further step: the parameters it ends with are the ones it loaded; one bucket
        # per chunk (megatron-core's default size), so the load cannot repeat the save's
        # mistake and hide it
        {"name": "loaded", "argv": FLAGS + ["--load", ckpt, "--train-iters", "2",
                                            "--use-checkpoint-opt_param-scheduler"],
         "params": True, "bucket_size": None},
        # resumed with several buckets again: the uninterrupted run's last two steps
        {"name": "resumed", "argv": FLAGS + OGR + ["--load", ckpt], "params": True,
         "bucket_size": SMALL_BUCKETS},
        # saved as before the correction: its optimizer state is wrong, its weights right
        {"name": "legacy_saved", "argv": FLAGS + OGR + ["--save", legacy] + save,
         "bucket_size": SMALL_BUCKETS, "legacy_distopt_save": True},
        {"name": "legacy_loaded", "argv": FLAGS + ["--load", legacy, "--train-iters", "2",
                                                   "--use-checkpoint-opt_param-scheduler"],
         "params": True, "bucket_size": None},
        {"name": "legacy_weights", "argv": FLAGS + ["--load", legacy, "--train-iters", "2",
                                                    "--no-load-optim"],
         "params": True, "bucket_size": None},
    ]
    results, printed = _launch(tmp_path, runs)
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

    # the old checkpoint: a warning (once), whose advice gives back the saved weights
    assert printed.count("warning: --load ") == 1, printed[-3000:]
    assert WARNING.format(legacy) in printed and "--no-load-optim" in printed
    assert_params_close(results["legacy_weights"]["params"], saved["params"], rtol=0, atol=0)
    with pytest.raises(AssertionError):  # what it warns about
        assert_params_close(results["legacy_loaded"]["params"], saved["params"], rtol=0,
                            atol=0)


def test_averaging_in_the_collective_trains_as_dividing_first(tmp_path):
    """--ddp-average-in-collective (Megatron-LM's): the data-parallel reduction averages
    (ReduceOp.AVG over gloo here) instead of each rank dividing first; plain and
    distributed optimizer, the losses, grad norms and parameters of dividing first."""
    from distributed import assert_close_series, run_configs
    from megatron.trainer.arguments import parse_args
    from megatron.trainer.training import ddp_config_of

    flagged = parse_args(TINY_MODEL + ["--global-batch-size", "4", "--train-iters", "3",
                                       "--ddp-average-in-collective"], world_size=2)
    assert ddp_config_of(flagged).average_in_collective
    assert not ddp_config_of(parse_args(TINY_MODEL + ["--global-batch-size", "4",
                                                      "--train-iters", "3"], world_size=2)
                             ).average_in_collective
    base = TINY_MODEL + ["--global-batch-size", "4", "--train-iters", "3"]
    runs = run_configs(tmp_path, 2, [
        {"name": f"{kind}_{mode}", "params": True,
         "argv": base + flags + (["--ddp-average-in-collective"] if mode == "avg" else [])}
        for kind, flags in (("plain", []), ("distopt", ["--use-distributed-optimizer"]))
        for mode in ("div", "avg")])
    for kind in ("plain", "distopt"):
        divided, averaged = runs[f"{kind}_div"], runs[f"{kind}_avg"]
        assert len(divided["losses"]) == 3
        for key in ("losses", "grad_norms"):
            assert_close_series(averaged[key], divided[key], 1e-6, f"{kind} {key}")
        assert_params_close(averaged["params"], divided["params"])
