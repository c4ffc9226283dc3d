"""--padded-vocab-size as Megatron-LM: the model's vocabulary as given instead of the
tokenizer's padded size. Refused below the tokenizer's size (Megatron-LM does not check,
and its embedding lookup then fails on a token id past the table), by the trainer and the
planner, and unless divisible by the TP size. The planner (tools/plan.py) sizes the model
the trainer builds, with the flag, without it and with --make-vocab-size-divisible-by
(one rule: megatron.model_shape.pad_vocab_size). In-process; the trained run under
Seq1F1B splits (vocabulary 210) is in tests/test_model_flags_exactness.py."""


import pytest

from megatron.trainer.arguments import ArgumentErrors, parse_args
from megatron.trainer.checkpointing import MODEL_SHAPE_FLAGS
from megatron.trainer.model import vocab_size_of_model

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--train-iters", "1", "--mock-data", "--vocab-size", "129",
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


def test_the_planner_refuses_it_below_the_tokenizer_too():
    from megatron.planner.cli import config_from_args, parse
    from megatron.planner.predict import PlanError

    with pytest.raises(PlanError) as stop:  # NullTokenizer: --vocab-size 129
        config_from_args(parse(BASE + ["--padded-vocab-size", "128", "--gpu", "cpu"]))
    assert str(stop.value) == (
        "--padded-vocab-size (128) is smaller than the tokenizer's vocabulary (129 tokens): "
        "token ids past it would index beyond the embedding; give at least 129 or drop the "
        "flag")


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


# --- the planner sizes the model the trainer builds -------------------------------------

PLANNED = {  # case -> flags after BASE (tied embeddings unless untied)
    "padded_by_tokenizer": [],
    "padded_vocab_size": ["--padded-vocab-size", "203", "--untie-embeddings-and-output-weights"],
    "divisible_by_64": ["--make-vocab-size-divisible-by", "64"],
}


def test_planner_sizes_the_vocabulary_the_trainer_builds(monkeypatch):
    """For each case: the model the trainer builds (one stage, in this process over a
    one-rank gloo group) has the planner's parameter count, total and on the GPU whose
    weights, gradients and optimizer state it prices (the embedding and output layer),
    and the planner's logits width is the built output layer's. The vocabulary widths
    differ between the cases (256, 203, 192), so a planner ignoring --padded-vocab-size
    or --make-vocab-size-divisible-by fails; so did one counting a tied output layer
    twice at PP = 1."""
    import torch

    from megatron import cpu_support
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.dataprep.tokenizer import build_tokenizer
    from megatron.planner.cli import config_from_args, parse
    from megatron.planner.predict import predict
    from megatron.trainer.model import gpt_model_provider, transformer_config_from_args

    model_flags = ["--vocab-size", "190", "--disable-bias-linear", "--transformer-impl",
                   "local", "--max-position-embeddings", "16"]  # biases: ModelShape omits them
    # left as found for the tests after this one in the process: the RNG tracker, the
    # CPU generator, the CPU patches, the process group and parallel state (below)
    monkeypatch.setattr(mp_random, "_CUDA_RNG_STATE_TRACKER", None)
    monkeypatch.setattr(mp_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False)
    widths = {}
    with cpu_support.patched(), torch.random.fork_rng(devices=[]):
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                             rank=0, world_size=1)
        try:
            parallel_state.initialize_model_parallel()
            mp_random.model_parallel_cuda_manual_seed(1)
            for case, flags in PLANNED.items():
                argv = BASE + model_flags + flags
                args = args_of(*(model_flags + flags))
                tokenizer = build_tokenizer("NullTokenizer", vocab_size=args.vocab_size)
                args.padded_vocab_size = vocab_size_of_model(args, tokenizer.vocab_size)
                model = gpt_model_provider(args, transformer_config_from_args(args))
                built = sum(p.numel() for p in model.parameters())
                cost = predict(config_from_args(parse(argv + ["--gpu", "cpu",
                                                               "--world-size", "1"]))).cost
                widths[case] = cost.vocab
                # the logits' width (the output layer's, its weight the embedding's if tied)
                assert cost.vocab == model.output_layer.output_size == (
                    model.embedding.word_embeddings.weight.shape[0]), case
                assert cost.shape.parameter_count() == built, case
                assert cost.rank_params(0) == built, case  # weights, gradients, optimizer
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
    assert widths == {"padded_by_tokenizer": 256, "padded_vocab_size": 203,
                      "divisible_by_64": 192}


@pytest.mark.parametrize("spelling", ["--no-pad-vocab-size", "--disable-pad-vocab-size"])
def test_no_padding_keeps_the_tokenizers_size(spelling):
    """--no-pad-vocab-size (Megatron-LM 0.19's, and its --disable- spelling): the model's
    vocabulary is the tokenizer's as it is, in the trainer and the planner; one that does
    not divide over the TP ranks stops with one line (megatron-core's vocab-parallel
    embedding would stop at the model build)."""
    from megatron.planner.cli import config_from_args, parse
    from megatron.planner.predict import PlanError

    assert vocab_size_of_model(args_of(spelling), 129) == 129
    assert vocab_size_of_model(args_of(spelling, "--padded-vocab-size", "130"), 129) == 130
    tp2 = args_of(spelling, "--tensor-model-parallel-size", "2", world_size=2)
    assert vocab_size_of_model(tp2, 130) == 130
    with pytest.raises(SystemExit) as stop:
        vocab_size_of_model(tp2, 129)
    assert str(stop.value) == (
        "error: --no-pad-vocab-size: the tokenizer's vocabulary (129 tokens) does not divide "
        "over --tensor-model-parallel-size (2), whose ranks each hold an equal slice of it; "
        "drop --no-pad-vocab-size or give --padded-vocab-size")
    # the planner: NullTokenizer's --vocab-size 129, not padded
    planned = config_from_args(parse(BASE + [spelling, "--gpu", "cpu"]))
    assert planned.model.padded_vocab_size(1) == 129
    with pytest.raises(PlanError, match="--no-pad-vocab-size: the tokenizer's vocabulary"):
        config_from_args(parse(BASE + [spelling, "--tensor-model-parallel-size", "2",
                                       "--world-size", "2", "--gpu", "cpu"]))
