"""--iterations-to-skip as Megatron-LM: the listed iterations read their batch and train
on nothing (no step, the learning rate not advanced), so the next iteration trains on
the batch after it. With learning rate 0 the parameters never move and each iteration's
loss is its batch's: a run skipping iteration 2 reports iterations 1 and 3 of the plain
run, in one process, across pipeline stages with Seq1F1B splits and with virtual stages
(every chunk that reads batches skips them)."""

import re

import pytest

from distributed import TINY_MODEL, assert_close_series, init_run, pretrain, run_configs

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

FROZEN = TINY_MODEL + ["--global-batch-size", "2", "--train-iters", "3", "--lr", "0",
                       "--lr-warmup-iters", "0"]
SKIP = ["--iterations-to-skip", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run from one iteration-0 checkpoint (the layouts would initialise otherwise)."""
    tmp = tmp_path_factory.mktemp("skip")
    init, start = init_run("init", tmp / "init", FROZEN)
    base = FROZEN + start
    out = run_configs(tmp, 1, [init, {"name": "plain", "argv": base},
                               {"name": "skip", "argv": base + SKIP}])
    out.update(run_configs(tmp, 2, [
        {"name": "skip_pp2_s2", "argv": base + SKIP + PP2 + ["--seq1f1b-splits", "2"]},
        {"name": "skip_pp2_vp2", "argv": base + SKIP + PP2 + [
            "--virtual-pipeline-model-parallel-size", "2"]}]))
    return out


def test_a_skipped_iteration_reads_its_batch_and_trains_on_none(runs):
    plain = runs["plain"]["losses"]
    assert len(plain) == 3 and abs(plain[1] - plain[2]) > 1e-3 * plain[2]  # batches differ
    for name in ("skip", "skip_pp2_s2", "skip_pp2_vp2"):
        assert_close_series(runs[name]["losses"], [plain[0], plain[2]], 1e-5, name)


def test_the_skip_is_reported(tmp_path):
    run = pretrain(FROZEN + SKIP)
    assert run.returncode == 0, run.stderr[-3000:]
    assert ("iteration        2/       3 skipped (--iterations-to-skip): its 2 samples were "
            "read, not trained on") in run.stdout
    # as Megatron-LM, the iteration lines after it count them as skipped samples
    assert re.search(r"iteration +3/ +3 \| consumed samples: +6 \| skipped samples: +2 \|",
                     run.stdout), run.stdout[-3000:]


def test_iterations_count_from_one():
    from megatron.trainer.arguments import ArgumentErrors, parse_args

    with pytest.raises(ArgumentErrors) as error:
        parse_args(FROZEN + ["--iterations-to-skip", "0", "3"], world_size=1,
                   cuda_available=False, check_files=False)
    assert "--iterations-to-skip counts iterations from 1, got [0]" in error.value.problems
