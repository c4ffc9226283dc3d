"""megatron.model_shape: one model shape and one FLOP count for every reader.

The causal pair convention is checked by counting pairs; the readers (training metrics,
the planner's units, the split solver, SlimPipe's slice costs) are checked against one
another on the same shape.
"""

from dataclasses import replace

import pytest

from megatron.model_shape import ModelShape, pad_vocab_size
from megatron.planner.costs import CostModel, Parallel
from megatron.planner.gpus import get_gpu
from megatron.planner.predict import PlanConfig, build_schedule
from megatron.schedules.attention_balance import SliceCosts
from megatron.seqsplit.split_lengths import plan_splits, split_flops, split_offsets
from megatron.trainer.arguments import parse_args
from megatron.trainer.metrics import model_flops_per_iteration

GPT = ModelShape(4, 64, 4, 4, 256, False, 1000, name="gpt")  # the memory fields' defaults
LLAMA = ModelShape(4, 96, 6, 2, 160, True, 1000, kv_channels=8, name="llama",
                   add_bias_linear=False, hidden_dropout=False, normalization="RMSNorm",
                   untie_embeddings=False, position_embedding_type="learned_absolute",
                   attention_dropout=True, vocab_divisible_by=64)


def brute_force_pairs(length, offset=0):
    """(query, key) pairs with the key at or before the query, queries in the span."""
    return sum(1 for q in range(offset, offset + length) for k in range(offset + length)
               if k <= q)


@pytest.mark.parametrize("seq", [1, 2, 3])
def test_a_causal_sequence_has_s_s_plus_1_over_2_pairs(seq):
    assert brute_force_pairs(seq) == seq * (seq + 1) // 2 == ModelShape.causal_pairs(seq)


@pytest.mark.parametrize("lengths", [[1, 1, 1], [2, 1], [1, 3, 2], [4, 1, 2, 3]])
def test_split_pairs_add_up_to_the_sequence(lengths):
    offsets = split_offsets(lengths)
    for length, offset in zip(lengths, offsets):
        assert ModelShape.causal_pairs(length, offset) == brute_force_pairs(length, offset)
        assert ModelShape.causal_pairs(length, offset) == (
            length * offset + length * (length + 1) / 2)
    total = sum(ModelShape.causal_pairs(l, o) for l, o in zip(lengths, offsets))
    assert total == ModelShape.causal_pairs(sum(lengths))


def flags(shape, extra=()):
    """The Megatron-LM flag line of ``shape`` (the trainer's parser reads it)."""
    argv = ["--num-layers", str(shape.num_layers), "--hidden-size", str(shape.hidden_size),
            "--num-attention-heads", str(shape.num_attention_heads),
            "--ffn-hidden-size", str(shape.ffn_hidden_size),
            "--vocab-size", str(shape.vocab_size),
            "--make-vocab-size-divisible-by", str(shape.vocab_divisible_by),
            "--normalization", shape.normalization,
            "--position-embedding-type", shape.position_embedding_type,
            "--hidden-dropout", "0.1" if shape.hidden_dropout else "0",
            "--attention-dropout", "0.1" if shape.attention_dropout else "0",
            "--seq-length", "64", "--max-position-embeddings", "64", "--train-iters", "1",
            "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4"]
    if shape.num_query_groups != shape.num_attention_heads:
        argv += ["--group-query-attention", "--num-query-groups", str(shape.num_query_groups)]
    if shape.kv_channels:
        argv += ["--kv-channels", str(shape.kv_channels)]
    argv += ["--swiglu"] if shape.swiglu else []
    argv += [] if shape.add_bias_linear else ["--disable-bias-linear"]
    argv += ["--untie-embeddings-and-output-weights"] if shape.untie_embeddings else []
    return argv + list(extra)


@pytest.mark.parametrize("shape", [GPT, LLAMA], ids=lambda s: s.name)
def test_from_args_round_trip(shape):
    args = parse_args(flags(shape), world_size=1, cuda_available=False)
    # the learned position table's rows come from the command line
    shape = replace(shape, max_position_embeddings=args.max_position_embeddings)
    assert ModelShape.from_args(args, vocab_size=shape.vocab_size, name=shape.name) == shape
    # by default the output layer's width: the vocabulary the trainer padded
    with pytest.raises(ValueError, match="padded_vocab_size"):
        ModelShape.from_args(args)
    args.padded_vocab_size = pad_vocab_size(shape.vocab_size, 1, shape.vocab_divisible_by)
    built = ModelShape.from_args(args, name=shape.name)
    # (--padded-vocab-size's field: the trainer's width, so padding it again keeps it)
    assert built == replace(shape, vocab_size=shape.padded_vocab_size(), padded_vocab=1024)
    assert built.vocab_size == built.padded_vocab_size(2) == 1024


def test_padded_vocabulary_as_megatron():
    for vocab, tp, divisible, padded in ((1000, 1, 128, 1024), (1000, 4, 128, 1024),
                                         (50257, 8, 128, 51200), (1024, 2, 64, 1024),
                                         (1, 3, 7, 21), (1025, 1, 128, 1152)):
        shape = replace(GPT, vocab_size=vocab, vocab_divisible_by=divisible)
        assert shape.padded_vocab_size(tp) == pad_vocab_size(vocab, tp, divisible) == padded
        # --padded-vocab-size: as given, at any TP size (the trainer checks it divides)
        given = replace(shape, padded_vocab=vocab + 3)
        assert given.padded_vocab_size(tp) == vocab + 3


def iteration_by_hand(shape, seq, sequences):
    """Forward + backward FLOPs written out: 3x (linear per token x S + 4 hq d x pairs)."""
    h, d, hq, g = shape.hidden_size, shape.head_dim, shape.num_attention_heads, \
        shape.num_query_groups
    per_layer = (2 * h * hq * d * 2 + 2 * h * g * d * 2
                 + 2 * h * shape.ffn_hidden_size * (3 if shape.swiglu else 2))
    linear = shape.num_layers * per_layer + 2 * h * shape.vocab_size
    attention = shape.num_layers * 4 * hq * d * seq * (seq + 1) / 2
    return 3 * sequences * (linear * seq + attention)


@pytest.mark.parametrize("shape", [GPT, LLAMA], ids=lambda s: s.name)
def test_training_metrics_count_the_shapes_iteration(shape):
    args = parse_args(flags(shape), world_size=1, cuda_available=False)
    args.padded_vocab_size = pad_vocab_size(shape.vocab_size, 1, shape.vocab_divisible_by)
    padded = ModelShape.from_args(args)
    expected = iteration_by_hand(padded, args.seq_length, args.global_batch_size)
    assert model_flops_per_iteration(args) == pytest.approx(expected, rel=1e-12)
    assert padded.iteration_flops(args.seq_length, args.global_batch_size) == pytest.approx(
        expected, rel=1e-12)
    # S^2 pairs (Narayanan et al.): the same linear part, twice the S^2 / 2 attention
    full = padded.iteration_flops(args.seq_length, args.global_batch_size, causal=False)
    linear = 3 * args.global_batch_size * args.seq_length * padded.linear_flops_per_token()
    attention = expected - linear
    assert full - linear == pytest.approx(attention * 2 * args.seq_length / (args.seq_length + 1))


@pytest.mark.parametrize("shape", [GPT, LLAMA], ids=lambda s: s.name)
@pytest.mark.parametrize("chunks", [1, 2])
def test_planner_units_split_solver_and_metrics_agree(shape, chunks):
    """The planner's per-GPU unit FLOPs, summed over every forward unit of the schedule
    on every GPU, are the iteration's forward FLOPs that training reports; per split
    they are the split solver's FLOPs."""
    tp, pp, dp, mbs, gbs, seq, splits = 2, 2, 2, 2, 16, 96, 3
    par = Parallel(tp=tp, pp=pp, dp=dp, num_chunks=chunks, micro_batch_size=mbs,
                   global_batch_size=gbs)
    padded = replace(shape, vocab_size=shape.padded_vocab_size(tp))
    lengths = plan_splits(seq, splits, "uniform_comp", model=padded)
    cost = CostModel(shape, par, get_gpu("a100-80g"), seq, lengths)
    assert cost.shape == padded
    schedule = build_schedule(PlanConfig(shape, seq, par, "seq1f1b", splits), splits)
    per_split = [0.0] * splits
    total = 0.0
    for rank, units in enumerate(schedule):
        for unit in units:
            if unit.is_forward:
                flops = sum(cost.unit_flops(rank, unit).values()) * tp * dp
                total += flops
                if unit.microbatch == 0:
                    per_split[unit.split] += flops / (mbs * dp)
    assert per_split == pytest.approx(split_flops(lengths, padded), rel=1e-12)
    assert 3 * total == pytest.approx(padded.iteration_flops(seq, gbs), rel=1e-12)

    args = parse_args(flags(shape, ["--tensor-model-parallel-size", str(tp),
                                    "--pipeline-model-parallel-size", str(pp),
                                    "--seq-length", str(seq), "--max-position-embeddings",
                                    str(seq), "--micro-batch-size", str(mbs),
                                    "--global-batch-size", str(gbs)]),
                      world_size=tp * pp * dp, cuda_available=True)
    args.padded_vocab_size = pad_vocab_size(shape.vocab_size, tp, shape.vocab_divisible_by)
    assert 3 * total == pytest.approx(model_flops_per_iteration(args), rel=1e-12)


@pytest.mark.parametrize("shape", [GPT, LLAMA], ids=lambda s: s.name)
def test_linear_flops_are_two_per_weight(shape):
    """The FLOP count and the planner's parameter count describe the same layers."""
    cost = CostModel(shape, Parallel(tp=2), get_gpu("a100-80g"), 64, [64])
    assert shape.layer_flops_per_token() == 2 * 2 * cost.layer_params()["linear"]
    assert shape.lm_head_flops_per_token() == 2 * shape.hidden_size * shape.vocab_size


@pytest.mark.parametrize("shape", [GPT, LLAMA], ids=lambda s: s.name)
def test_slice_costs_are_the_planners_ratio(shape):
    """SlimPipe's ``gemm`` (linear work in units of one slice's attention over one full
    key slice) is the planner's GEMM FLOPs over its attention FLOPs per l x l chunk."""
    slices, l = 4, 16
    cost = CostModel(shape, Parallel(pp=2), get_gpu("a100-80g"), slices * l, [l] * slices)
    costs = SliceCosts.from_model(shape, l)
    schedule = build_schedule(PlanConfig(shape, slices * l, Parallel(pp=2), "seq1f1b", slices),
                              slices)
    forward = sorted((u for u in schedule[0] if u.is_forward), key=lambda u: u.split)
    assert [u.split for u in forward] == list(range(slices))
    for j, unit in enumerate(forward):
        fl = cost.unit_flops(0, unit)  # rank 0 of 2: no LM head
        per_chunk = fl["attention"] * l * l / ModelShape.causal_pairs(l, j * l)
        assert costs.gemm == pytest.approx(fl["gemm"] / per_chunk, rel=1e-12)


def test_throughput_field_keeps_three_significant_digits_below_one():
    # a slow iteration of a tiny CPU model is under 1e-4 TFLOP/s: never printed as 0
    from megatron.trainer.metrics import format_throughput
    assert format_throughput(123.456) == " throughput per GPU (TFLOP/s/GPU): 123.5 |"
    assert format_throughput(0.0123) == " throughput per GPU (TFLOP/s/GPU): 0.0123 |"
    assert format_throughput(3.21e-5) == " throughput per GPU (TFLOP/s/GPU): 0.0000321 |"
