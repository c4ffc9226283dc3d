"""SlimPipe flags: what they set, and each mistake named before any process group."""

import pytest

from megatron.trainer.arguments import ArgumentError, parse_args

# seq 64, 8 layers, 4 microbatches at world size 2 (pp=2)
GOOD = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--train-iters", "2", "--mock-data", "--vocab-size", "128",
        "--micro-batch-size", "1", "--global-batch-size", "4",
        "--pipeline-model-parallel-size", "2"]


def parse(extra, world_size=2):
    return parse_args(GOOD + extra, world_size=world_size, cuda_available=False)


def test_default_schedule_is_today_s():
    assert parse([]).pipeline_schedule == "1f1b"
    assert parse(["--seq1f1b-splits", "2"]).pipeline_schedule == "seq1f1b"
    args = parse(["--virtual-pipeline-model-parallel-size", "2"])
    assert args.pipeline_schedule == "1f1b" and args.slimpipe_slices is None


def test_slices_or_length():
    args = parse(["--pipeline-schedule", "slimpipe", "--slimpipe-slices", "4",
                  "--virtual-pipeline-model-parallel-size", "2"])
    assert (args.pipeline_schedule, args.slimpipe_slices, args.slimpipe_slice_length) == (
        "slimpipe", 4, 16)
    args = parse(["--slimpipe-slice-length", "8"])  # the flag implies the schedule
    assert (args.pipeline_schedule, args.slimpipe_slices, args.slimpipe_slice_length) == (
        "slimpipe", 8, 8)
    assert args.virtual_pipeline_model_parallel_size is None  # v = 1: Seq1F1B order


def test_any_number_of_microbatches():
    """A SlimPipe group is one microbatch: m < p and m mod p != 0 are fine."""
    for gbs in ("1", "3"):
        args = parse(["--slimpipe-slices", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                      "--global-batch-size", gbs])
        assert args.num_microbatches == int(gbs)
        assert args.virtual_pipeline_model_parallel_size == 4


@pytest.mark.parametrize("extra,world,flag", [
    (["--pipeline-schedule", "slimpipe"], 2, "--slimpipe-slices N"),
    (["--slimpipe-slices", "4", "--slimpipe-slice-length", "16"], 2, "not both"),
    (["--slimpipe-slices", "3"], 2, "--slimpipe-slices 3 must be a multiple of "
                                    "--pipeline-model-parallel-size 2"),
    (["--slimpipe-slices", "6"], 2, "--slimpipe-slices 6 does not divide --seq-length 64"),
    (["--slimpipe-slices", "0"], 2, "--slimpipe-slices must be >= 1"),
    (["--slimpipe-slice-length", "12"], 2, "--slimpipe-slice-length 12 does not divide"),
    (["--slimpipe-slice-length", "64"], 2, "gives 1 slices, not a multiple of "
                                           "--pipeline-model-parallel-size 2"),
    (["--slimpipe-slices", "4", "--seq1f1b-splits", "2"], 2, "--seq1f1b-splits 2 does not "
                                                             "combine"),
    (["--slimpipe-slices", "4", "--seq1f1b-balance-method", "uniform_comp"], 2,
     "--seq1f1b-balance-method uniform_comp"),
    (["--pipeline-schedule", "seq1f1b", "--slimpipe-slices", "4"], 2,
     "--slimpipe-slices belongs to --pipeline-schedule slimpipe"),
    (["--pipeline-schedule", "1f1b", "--seq1f1b-splits", "2"], 2, "--pipeline-schedule 1f1b"),
    (["--slimpipe-slices", "32", "--tensor-model-parallel-size", "2", "--sequence-parallel",
      "--seq1f1b-split-alignment", "4"], 4, "--seq1f1b-split-alignment"),
    (["--slimpipe-slices", "4", "--virtual-pipeline-model-parallel-size", "2",
      "--microbatch-group-size-per-virtual-pipeline-stage", "2"], 2,
     "--microbatch-group-size-per-virtual-pipeline-stage does not apply"),
    (["--slimpipe-slices", "4", "--transformer-impl", "transformer_engine"], 2,
     "--transformer-impl"),
])
def test_mistakes_name_the_flag(extra, world, flag):
    with pytest.raises(ArgumentError, match=flag):
        parse(extra, world_size=world)


def test_pp4_with_virtual_stages():
    args = parse_args(GOOD[:-2] + ["--pipeline-model-parallel-size", "4", "--slimpipe-slices",
                                   "8", "--virtual-pipeline-model-parallel-size", "2"],
                      world_size=4, cuda_available=False)
    assert (args.slimpipe_slices, args.virtual_pipeline_model_parallel_size) == (8, 2)


BALANCE = ["--slimpipe-slices", "4", "--seq1f1b-kv-cache", "chunked", "--attention-dropout", "0",
           "--slimpipe-attention-balance"]


def test_attention_balance_flag():
    assert parse(BALANCE).slimpipe_attention_balance
    assert not parse(BALANCE[:-1]).slimpipe_attention_balance


@pytest.mark.parametrize("extra, message", [
    (["--seq1f1b-splits", "2", "--slimpipe-attention-balance"], "belongs to --pipeline-schedule slimpipe"),
    (["--slimpipe-slices", "4", "--slimpipe-attention-balance"], "needs --seq1f1b-kv-cache chunked"),
])
def test_attention_balance_mistakes(extra, message):
    with pytest.raises(ArgumentError, match="--slimpipe-attention-balance") as err:
        parse(extra)
    assert message in str(err.value)


def test_attention_balance_exchange_cost():
    assert parse(BALANCE).slimpipe_attention_balance_exchange_cost == 0.0
    args = parse(BALANCE + ["--slimpipe-attention-balance-exchange-cost", "0.25"])
    assert args.slimpipe_attention_balance_exchange_cost == 0.25
    with pytest.raises(ArgumentError, match="--slimpipe-attention-balance-exchange-cost"):
        parse(BALANCE + ["--slimpipe-attention-balance-exchange-cost", "-1"])
