"""--decrease-batch-size-if-needed (as Megatron-LM): a global batch that is not a multiple of
--micro-batch-size x data-parallel size trains on the largest multiple below it, the rest
of each batch counted as skipped samples; a job relaunched on fewer data-parallel ranks
goes on from its checkpoint, and back on ranks that divide the batch it trains on the whole
batch again. Without the flag such a batch stops before any work, naming it."""

import re

import pytest

import distributed
from distributed import TINY_MODEL, assert_close_series, assert_params_close, run_configs
from megatron.trainer.arguments import ArgumentErrors, parse_args

# a constant learning rate: the schedule counts the samples trained, which differ between a
# decreased batch of 4 and a batch of 3 only in the warm-up and decay
FLAGS = TINY_MODEL + ["--micro-batch-size", "1", "--lr-warmup-iters", "0",
                      "--lr-decay-style", "constant"]
FLAGS[FLAGS.index("--lr") + 1] = "1e-2"
LINE = re.compile(r"iteration +(\d+)/ +\d+ \| consumed samples: +(\d+) \|"
                  r"(?: skipped samples: +(\d+) \|)?.*global batch size: +(\d+) \|")


@pytest.mark.distributed
def test_a_decreased_batch_trains_as_the_multiple_below(tmp_path):
    """dp 3: a global batch of 4 with the flag trains exactly as a batch of 3."""
    results = run_configs(tmp_path, 3, [
        {"name": "decreased", "argv": FLAGS + ["--global-batch-size", "4", "--train-iters", "3",
                                               "--decrease-batch-size-if-needed"],
         "params": True},
        {"name": "multiple", "argv": FLAGS + ["--global-batch-size", "3", "--train-iters", "3"],
         "params": True},
    ])
    decreased, multiple = results["decreased"], results["multiple"]
    assert len(multiple["losses"]) == 3
    assert_close_series(decreased["losses"], multiple["losses"], 1e-6, "loss")
    assert_close_series(decreased["grad_norms"], multiple["grad_norms"], 1e-6, "grad norm")
    assert_params_close(decreased["params"], multiple["params"])


def _torchrun(world_size, argv):
    proc = distributed.start_pretrain(argv, world_size=world_size)
    stdout, stderr = proc.communicate(timeout=300)
    return proc.returncode, stdout, stderr


@pytest.mark.distributed
def test_a_job_relaunched_on_fewer_ranks_goes_on_and_back(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = FLAGS + ["--global-batch-size", "4", "--train-iters", "6", "--save", str(ckpt),
                   "--save-interval", "100", "--load", str(ckpt)]
    code, out, err = _torchrun(2, run + ["--exit-interval", "2"])  # dp 2: batches of 4
    assert code == 0, err[-3000:]
    assert [m[:3] for m in LINE.findall(out)] == [("1", "4", ""), ("2", "8", "")]

    # dp 3 without the flag: one line before any work
    code, out, err = _torchrun(3, run)
    assert code != 0 and not LINE.search(out)
    assert ("error: --global-batch-size (4) must be divisible by --micro-batch-size (1) x "
            "data-parallel size (3); use a multiple of 3 (or --decrease-batch-size-if-needed "
            "to train on the largest multiple below it, as Megatron-LM)") in err, err[-3000:]

    # dp 3 with it: batches of 3, one sample of each counted as skipped, evaluation on
    # batches of 3 too
    code, out, err = _torchrun(3, run + ["--decrease-batch-size-if-needed", "--exit-interval",
                                         "4", "--eval-iters", "1", "--eval-interval", "4"])
    assert code == 0, err[-3000:]
    assert ("note: --decrease-batch-size-if-needed: --global-batch-size 4 is not a multiple "
            "of --micro-batch-size (1) x data-parallel size (3): its iterations train on 3 "
            "samples, and the 1 left out of each are counted as skipped samples") in out + err
    assert LINE.findall(out) == [("3", "11", "1", "3"), ("4", "14", "2", "3")]
    assert "validation loss at iteration 4" in out

    # back on dp 2: whole batches of 4 again; the count of skipped samples goes on
    code, out, err = _torchrun(2, run)
    assert code == 0, err[-3000:]
    assert LINE.findall(out) == [("5", "18", "2", "4"), ("6", "22", "2", "4")]


@pytest.mark.parametrize("flags, message", [
    (["--global-batch-size", "2"],
     "--decrease-batch-size-if-needed: --global-batch-size (2) is below --micro-batch-size "
     "(1) x data-parallel size (3), so not one microbatch per data-parallel rank is left"),
    (["--global-batch-size", "4", "--eval-global-batch-size", "4"],
     "--eval-global-batch-size (4) must be divisible by --eval-micro-batch-size (1) x "
     "data-parallel size (3)"),
])
def test_what_cannot_be_decreased_is_named(flags, message):
    with pytest.raises(ArgumentErrors) as errors:
        parse_args(FLAGS + ["--train-iters", "2", "--decrease-batch-size-if-needed"] + flags,
                   world_size=3, cuda_available=False, check_files=False)
    assert message in str(errors.value)


def test_evaluation_reads_the_decreased_batch_by_default():
    """Megatron-LM's default evaluation batch is --global-batch-size, which it then asserts
    divisible (so its flag stops there); here it is the batch that trains."""
    args = parse_args(FLAGS + ["--train-iters", "2", "--global-batch-size", "4",
                               "--decrease-batch-size-if-needed"],
                      world_size=3, cuda_available=False, check_files=False)
    assert (args.global_batch_size, args.num_microbatches) == (4, 1)
    assert args.eval_global_batch_size == 3


@pytest.mark.parametrize("schedule, expected", [
    # ramp 3, 6, 9 over 12 samples at dp 2: each batch rounded down to even
    (["--global-batch-size", "9", "--rampup-batch-size", "3", "3", "12"],
     [(3, 1), (3, 1), (3, 1), (6, 3), (9, 4), (9, 4)]),
    (["--step-batch-size-schedule", "0:3 480:5"],  # thresholds in tokens (seq 48)
     [(3, 1), (3, 1), (3, 1), (3, 1), (3, 1), (5, 2)]),
])
def test_growing_batches_are_rounded_down_one_by_one(monkeypatch, schedule, expected):
    """(the batch as given, microbatches per rank) of the first six iterations at dp 2;
    the samples each consumes (2 x microbatches) move the ramp and the schedule on. The
    same on megatron-core 0.16 (its ramp-up calculator) and 0.19 (its step schedule, which
    refuses to round: the rounding is done here)."""
    import torch

    from megatron.trainer.data import GlobalBatchSizes

    args = parse_args(FLAGS + ["--train-samples", "40", "--decrease-batch-size-if-needed"]
                      + schedule, world_size=2, cuda_available=False, check_files=False)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    batches = GlobalBatchSizes(args)
    consumed, seen = 0, []
    for _ in expected:
        seen.append((batches.batch_at(consumed), batches.microbatches_at(consumed)))
        consumed += seen[-1][1] * batches.unit
    assert seen == expected
