"""--padded-vocab-size as Megatron-LM: the model's vocabulary as given instead of the
tokenizer's padded size. Refused below the tokenizer's size (Megatron-LM does not check,
and its embedding lookup then fails on a token id past the table) and unless divisible by
the TP size. In-process; the trained run under Seq1F1B splits (vocabulary 210) is in
tests/test_model_flags_exactness.py."""


import pytest

from megatron.trainer.arguments import ArgumentErrors, parse_args
from megatron.trainer.checkpointing import MODEL_SHAPE_FLAGS
from megatron.trainer.model import vocab_size_of_model

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--train-iters", "1", "--mock-data", "--vocab-size", "128",
        "--micro-batch-size", "1", "--global-batch-size", "2"]


def args_of(*flags, world_size=1):
    return parse_args(BASE + list(flags), world_size=world_size, cuda_available=False,
                      check_files=False)


def test_given_size_replaces_the_padded_tokenizer_size():
    assert vocab_size_of_model(args_of(), 129) == 256  # 129 padded to a multiple of 128
    assert vocab_size_of_model(args_of("--padded-vocab-size", "130"), 129) == 130
    assert vocab_size_of_model(args_of("--padded-vocab-size", "129"), 129) == 129
    assert "padded_vocab_size" in MODEL_SHAPE_FLAGS  # a checkpoint loads into its size only


def test_smaller_than_the_tokenizer_is_one_error_line():
    with pytest.raises(SystemExit) as stop:
        vocab_size_of_model(args_of("--padded-vocab-size", "100"), 129)
    assert str(stop.value) == (
        "error: --padded-vocab-size (100) is smaller than the tokenizer's vocabulary (129 "
        "tokens): token ids past it would index beyond the embedding; give at least 129 or "
        "drop the flag")


def test_must_divide_over_tensor_parallel_ranks():
    with pytest.raises(ArgumentErrors) as error:
        args_of("--padded-vocab-size", "131", "--tensor-model-parallel-size", "2",
                world_size=2)
    assert error.value.problems == [
        "--padded-vocab-size (131) must be a positive multiple of "
        "--tensor-model-parallel-size (2): each TP rank holds an equal slice of the "
        "vocabulary"]
    assert args_of("--padded-vocab-size", "130", "--tensor-model-parallel-size", "2",
                   world_size=2).padded_vocab_size == 130
