"""Checkpoints: a resumed run prints the losses of an uninterrupted one, with the plain and
the distributed optimizer, into the same or another parallel layout; bad loads fail clearly."""


import pytest

import distributed
from distributed import TINY_MODEL, assert_close_series, assert_params_close, run_configs

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

# dropout on: resuming must restore the RNG streams too, not just weights and Adam state
FLAGS = [f for f in TINY_MODEL] + [
    "--global-batch-size", "4", "--micro-batch-size", "1", "--train-iters", "6",
    "--pipeline-model-parallel-size", "2", "--lr-decay-style", "cosine",
]
FLAGS[FLAGS.index("--hidden-dropout") + 1] = "0.1"
FLAGS[FLAGS.index("--attention-dropout") + 1] = "0.1"
# evaluation at iterations 2, 4 and 6: the resumed run must read the same validation samples
FLAGS[FLAGS.index("--eval-iters") + 1] = "1"
FLAGS += ["--eval-interval", "2"]


def test_resume_equals_uninterrupted(tmp_path):
    ckpt = tmp_path / "ckpt"
    results = run_configs(tmp_path, 2, [
        {"name": "straight", "argv": FLAGS},
        {"name": "first_half", "argv": FLAGS + ["--save", str(ckpt), "--save-interval", "3",
                                                "--exit-interval", "3"]},
        {"name": "second_half", "argv": FLAGS + ["--load", str(ckpt)]},
    ])
    straight = results["straight"]["losses"]
    assert len(straight) == 6 and len(results["first_half"]["losses"]) == 3
    assert_close_series(results["first_half"]["losses"], straight[:3], 1e-6, "before save")
    assert_close_series(results["second_half"]["losses"], straight[3:], 1e-6, "after resume")
    valid = results["straight"]["validation_losses"]
    assert len(valid) == 3 and len(results["second_half"]["validation_losses"]) == 2
    assert_close_series(results["second_half"]["validation_losses"], valid[1:], 1e-6,
                        "validation after resume")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"


# dropout off: the resharded runs draw other RNG streams, yet must match the same losses
DISTOPT = TINY_MODEL + [
    "--global-batch-size", "4", "--micro-batch-size", "1", "--train-iters", "6",
    "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.01",
    "--use-distributed-optimizer",
]
PP2_SPLITS2 = ["--pipeline-model-parallel-size", "2", "--seq1f1b-splits", "2"]


def test_distributed_optimizer_resumes_and_reshards(tmp_path):
    """Saved by dp 2 x pp 2 (Seq1F1B, 2 splits) with the distributed optimizer; resumed in
    the same layout, in dp 1 x pp 2, in tp 2 and in one process: every one continues
    the uninterrupted run's losses and ends with its parameters. A checkpoint saved before
    the first step (--train-iters 0: no Adam state yet, which megatron-core's distributed
    optimizer cannot describe; its zeros filled in) resumes into the whole run."""
    ckpt, zero = tmp_path / "ckpt", tmp_path / "zero"
    resume = DISTOPT + ["--load", str(ckpt)]
    results = run_configs(tmp_path, 4, [
        {"name": "straight", "argv": DISTOPT + PP2_SPLITS2, "params": True},
        {"name": "first_half", "argv": DISTOPT + PP2_SPLITS2 + [
            "--save", str(ckpt), "--save-interval", "3", "--exit-interval", "3"]},
        {"name": "dp2_pp2", "argv": resume + PP2_SPLITS2, "params": True},
        {"name": "zero", "argv": DISTOPT + PP2_SPLITS2 + [
            "--train-iters", "0", "--save", str(zero), "--save-interval", "1"]},
        {"name": "from_zero", "argv": DISTOPT + PP2_SPLITS2 + [
            "--load", str(zero), "--override-opt_param-scheduler"], "params": True},
    ])
    results.update(run_configs(tmp_path, 2, [
        {"name": "dp1_pp2", "argv": resume + PP2_SPLITS2, "params": True},
        {"name": "tp2", "argv": resume + ["--tensor-model-parallel-size", "2"],
         "params": True},
    ]))
    results.update(run_configs(tmp_path, 1, [
        {"name": "pp1", "argv": resume, "params": True},
    ]))
    straight = results["straight"]
    assert len(straight["losses"]) == 6 and len(set(straight["losses"])) == 6
    assert_close_series(results["first_half"]["losses"], straight["losses"][:3], 1e-6,
                        "before save")
    assert_close_series(results["from_zero"]["losses"], straight["losses"], 1e-6, "from 0")
    assert_params_close(results["from_zero"]["params"], straight["params"])
    for name, rtol in (("dp2_pp2", 1e-6), ("dp1_pp2", 1e-5), ("tp2", 1e-5), ("pp1", 1e-5)):
        assert_close_series(results[name]["losses"], straight["losses"][3:], rtol,
                            f"{name} after resume")
        assert_params_close(results[name]["params"], straight["params"])


def _pretrain(tmp_path, argv):
    return distributed.pretrain(argv)


def test_bad_checkpoints_are_clear_errors(tmp_path):
    base = [f for f in TINY_MODEL] + ["--global-batch-size", "2", "--train-iters", "1"]
    # (an empty --load warns and starts from random, as Megatron-LM:
    # tests/test_checkpoint_schedule.py; --exit-on-missing-checkpoint makes it an error)
    missing = _pretrain(tmp_path, base + ["--load", str(tmp_path / "nowhere"),
                                          "--exit-on-missing-checkpoint"])
    assert missing.returncode != 0
    assert "--load" in missing.stderr and "no such directory" in missing.stderr

    ckpt = tmp_path / "small"
    saved = _pretrain(tmp_path, base + ["--save", str(ckpt), "--save-interval", "1000"])
    assert saved.returncode == 0, saved.stderr[-2000:]
    other = list(base)
    other[other.index("--hidden-size") + 1] = "64"
    mismatch = _pretrain(tmp_path, other + ["--load", str(ckpt), "--squared-relu"])
    assert mismatch.returncode != 0
    assert "--hidden-size saved 32, now 64" in mismatch.stderr, mismatch.stderr[-2000:]
    assert "--squared-relu saved False, now True" in mismatch.stderr  # math flags too

    # a Megatron-LM checkpoint of --ckpt-format torch: not damaged, another format, and
    # Megatron-LM's own conversion named
    legacy = tmp_path / "legacy"
    (legacy / "iter_0000002" / "mp_rank_00").mkdir(parents=True)
    import torch

    torch.save({"iteration": 2, "model": {}}, legacy / "iter_0000002" / "mp_rank_00" /
               "model_optim_rng.pt")
    (legacy / "latest_checkpointed_iteration.txt").write_text("2")
    refused = _pretrain(tmp_path, base + ["--load", str(legacy)])
    assert refused.returncode != 0
    assert distributed.one_error_line(refused.stderr) == (
        f"error: --load {legacy / 'iter_0000002'} is a Megatron-LM checkpoint in the legacy "
        f"torch format (mp_rank_00/model_optim_rng.pt), which is not read here (torch_dist "
        f"only): convert it with Megatron-LM's pretrain_gpt.py and this run's model flags "
        f"plus --ckpt-format torch --load {legacy} --ckpt-convert-format torch_dist "
        f"--ckpt-convert-save NEW, then --load NEW/torch_dist here")
