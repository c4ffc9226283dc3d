"""--override-ckpt-iteration N (as Megatron-LM): a resumed checkpoint continues as if saved
at iteration N, reading the data from that iteration's samples on, while its weights,
optimizer state and learning-rate schedule stay the checkpoint's; the flag's misuses stop
with one line."""

import re

import pytest

import distributed
from distributed import TINY_MODEL
from megatron.core import dist_checkpointing
from megatron.trainer.arguments import ArgumentErrors, parse_args

ITERATION = re.compile(r"iteration +(\d+)/ +\d+ \| consumed samples: +(\d+) \|.*"
                       r"lm loss: ([0-9.eE+-]+)")
GBS = 2


def lines(proc):
    """(iteration, consumed samples, lm loss as printed) of each iteration line."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [(int(i), int(c), loss) for i, c, loss in ITERATION.findall(proc.stdout)]


# a learning rate of 0: the weights never move, so an iteration's loss says which samples
# it read; every run has the same --train-iters (the schedules' length), stopped earlier by
# --exit-interval
FROZEN = TINY_MODEL + ["--global-batch-size", str(GBS), "--micro-batch-size", "1",
                       "--train-iters", "7"]
FROZEN[FROZEN.index("--lr") + 1] = "0"


@pytest.mark.distributed
def test_rewound_checkpoint_replays_the_data_and_keeps_its_schedule(tmp_path):
    ckpt = tmp_path / "ckpt"
    save = ["--save", str(ckpt), "--save-interval", "2"]
    straight = lines(distributed.pretrain(FROZEN + save))
    assert [i for i, _, _ in straight] == [1, 2, 3, 4, 5, 6, 7]
    losses = {i: loss for i, _, loss in straight}
    assert len(set(losses.values())) == 7  # each iteration's samples give another loss

    # iteration 4's checkpoint resumed as iteration 2's: iterations 3-5 read again
    rewound = distributed.pretrain(FROZEN + ["--exit-interval", "5", "--load", str(ckpt),
                                             "--ckpt-step", "4", "--override-ckpt-iteration",
                                             "2"] + save)
    assert lines(rewound) == [(i, i * GBS, losses[i]) for i in (3, 4, 5)]
    assert (f"--override-ckpt-iteration 2: resuming as at iteration 2 (consumed samples "
            f"{2 * GBS}; the checkpoint's: iteration 4, {4 * GBS} samples)") in rewound.stdout
    # the saves at 4 and (the last) 5 land among the newer checkpoints: named beforehand
    assert (f"warning: --override-ckpt-iteration 2: iter_0000004, iter_0000006, "
            f"iter_0000007 in --save {ckpt} are newer") in rewound.stdout
    # the checkpoint's learning-rate schedule went on from its 4 steps: 4 + 3 of them
    saved = dist_checkpointing.load_common_state_dict(str(ckpt / "iter_0000005"))
    assert (saved["iteration"], saved["consumed_samples"]) == (5, 5 * GBS)
    assert saved["opt_param_scheduler"]["num_steps"] == 7 * GBS
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "5"

    # skipping ahead past iterations 5 and 6: iteration 7 reads its own samples
    ahead = lines(distributed.pretrain(FROZEN + ["--load", str(ckpt),
                                                 "--override-ckpt-iteration", "6"]))
    assert ahead == [(7, 7 * GBS, losses[7])]


@pytest.mark.distributed
def test_misuses_stop_with_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    saved = distributed.pretrain(FROZEN + ["--exit-interval", "1", "--save", str(ckpt),
                                           "--save-interval", "1"])
    assert saved.returncode == 0, saved.stderr[-3000:]
    other_batch = list(FROZEN)
    other_batch[other_batch.index("--global-batch-size") + 1] = "4"
    proc = distributed.pretrain(other_batch + ["--load", str(ckpt),
                                               "--override-ckpt-iteration", "0"])
    assert proc.returncode != 0
    assert distributed.one_error_line(proc.stderr) == (
        f"error: --override-ckpt-iteration 0: --load {ckpt / 'iter_0000001'} was saved with "
        f"--global-batch-size 2, this run has 4: the samples of iteration 0 would not be the "
        f"ones that run read; use its global batch size")

    empty = tmp_path / "empty"
    proc = distributed.pretrain(FROZEN + ["--load", str(empty),
                                          "--override-ckpt-iteration", "1"])
    assert proc.returncode != 0
    assert distributed.one_error_line(proc.stderr) == (
        f"error: --override-ckpt-iteration 1: --load {empty} holds no checkpoint "
        f"(latest_checkpointed_iteration.txt missing), so there is nothing to resume at "
        f"iteration 1: check the path, or drop the flag to start from random")

    proc = distributed.pretrain(FROZEN + ["--load", str(empty),
                                          "--pretrained-checkpoint", str(ckpt),
                                          "--override-ckpt-iteration", "1"])
    assert proc.returncode != 0
    assert "--pretrained-checkpoint starts at iteration 0 with the weights only" in (
        distributed.one_error_line(proc.stderr))


@pytest.mark.parametrize("extra, message", [
    (["--override-ckpt-iteration", "-1", "--load", "x"],
     "--override-ckpt-iteration must be >= 0, got -1"),
    (["--override-ckpt-iteration", "3"],
     "--override-ckpt-iteration 3 sets the iteration of the checkpoint this run resumes: "
     "give --load DIR"),
    (["--override-ckpt-iteration", "3", "--load", "x", "--finetune"],
     "--override-ckpt-iteration 3 and --finetune contradict each other (--finetune starts "
     "at iteration 0 with the weights only, as in Megatron-LM): keep one"),
])
def test_flag_errors(extra, message):
    with pytest.raises(ArgumentErrors) as errors:
        parse_args(FROZEN + extra, world_size=1,
                   cuda_available=False, check_files=False)
    assert message in str(errors.value)


def test_the_samples_of_n_iterations_follow_a_growing_batch(monkeypatch):
    """Under --step-batch-size-schedule the samples before iteration N are those of each
    iteration's batch in force (Megatron-LM multiplies N by the last batch size)."""
    from argparse import Namespace

    from megatron.trainer import checkpointing

    monkeypatch.setattr(checkpointing, "_rank", lambda: 1)  # prints nothing
    args = Namespace(micro_batch_size=1, data_parallel_size=2, global_batch_size=4,
                     rampup_batch_size=None, step_batch_schedule=[(0, 2), (6, 4)])
    state = {"iteration": 9, "consumed_samples": 30}
    # batches 2, 2, 2 (6 samples reach the threshold), then 4
    assert checkpointing._overridden_position(args, state, 4) == (4, 10)
    assert checkpointing._overridden_position(args, state, 0) == (0, 0)
