"""Tests for megatron.seqsplit.split_lengths: split lengths, balancing and validation."""

import pytest

from megatron.model_shape import ModelShape
from megatron.seqsplit.split_lengths import (
    SplitPlanError,
    plan_splits,
    split_flops,
    split_offsets,
)


def gpt(layers, hidden, heads):
    """Shapes of the Seq1F1B paper: FFN = 4h with GeLU, GPT-2 vocabulary, MHA."""
    return ModelShape(layers, hidden, heads, heads, 4 * hidden, False, 50257)


SHAPES = {
    "1.3B": gpt(24, 2048, 16),
    "2.7B": gpt(32, 2560, 32),
    "7B": gpt(32, 4096, 32),
    "13B": gpt(40, 5120, 40),
    "30B": gpt(64, 6144, 64),
    "llama2-7B": ModelShape(32, 4096, 32, 32, 11008, True, 32000),
    "llama2-70B-gqa": ModelShape(80, 8192, 64, 8, 28672, True, 32000),
}
SMALL = ModelShape(2, 64, 4, 2, 160, True, 100)


@pytest.mark.parametrize("method", ["average", "uniform_comp"])
@pytest.mark.parametrize("seq_length,num_splits,alignment", [
    (1, 1, 1), (7, 7, 1), (100, 3, 1), (1000, 7, 8), (4096, 4, 128), (16384, 8, 64),
])
def test_lengths_sum_and_alignment(method, seq_length, num_splits, alignment):
    lengths = plan_splits(seq_length, num_splits, method, alignment=alignment, model=SMALL)
    assert len(lengths) == num_splits
    assert sum(lengths) == seq_length
    assert all(l > 0 and l % alignment == 0 for l in lengths)


@pytest.mark.parametrize("method", ["average", "uniform_comp"])
def test_single_split_is_whole_sequence(method):
    assert plan_splits(4096, 1, method, model=SMALL) == [4096]


def test_average_remainder_goes_to_first_splits():
    assert plan_splits(12, 4) == [3, 3, 3, 3]
    assert plan_splits(10, 4) == [3, 3, 2, 2]
    # Remainder counted in alignment units: 13 units of 4 over 5 splits.
    assert plan_splits(52, 5, alignment=4) == [12, 12, 12, 8, 8]


def test_offsets():
    assert split_offsets([4, 3, 2]) == [0, 4, 7]
    assert split_offsets([]) == []


@pytest.mark.parametrize("kwargs,flag", [
    (dict(seq_length=64, num_splits=0), "--seq1f1b-splits"),
    (dict(seq_length=64, num_splits=-2), "--seq1f1b-splits"),
    (dict(seq_length=100, num_splits=2, alignment=16), "--seq-length"),
    (dict(seq_length=64, num_splits=5, alignment=16), "--seq1f1b-splits"),
    (dict(seq_length=4, num_splits=5), "--seq1f1b-splits"),
    (dict(seq_length=64, num_splits=2, method="flops"), "--seq1f1b-balance-method"),
    (dict(seq_length=64, num_splits=2, method="uniform_comp"), "--seq1f1b-balance-method"),
])
def test_errors_name_the_flag(kwargs, flag):
    with pytest.raises(SplitPlanError, match=flag):
        plan_splits(**kwargs)


def test_error_lists_methods():
    with pytest.raises(SplitPlanError, match="average, uniform_comp"):
        plan_splits(64, 2, "even")


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("seq_length", [16384, 32768, 65536, 131072])
@pytest.mark.parametrize("num_splits", [2, 4, 8])
def test_uniform_comp_balances_published_shapes(name, seq_length, num_splits):
    model = SHAPES[name]
    lengths = plan_splits(seq_length, num_splits, "uniform_comp", model=model)
    assert sum(lengths) == seq_length
    assert lengths == sorted(lengths, reverse=True)  # earlier splits are longer
    flops = split_flops(lengths, model)
    mean = sum(flops) / len(flops)
    assert max(abs(f - mean) for f in flops) <= 0.01 * mean
    # Equal lengths are visibly unbalanced at these lengths: the planner matters.
    even = split_flops(plan_splits(seq_length, num_splits), model)
    assert max(even) / min(even) > 1.01


def test_uniform_comp_with_alignment_stays_balanced():
    model = SHAPES["7B"]
    lengths = plan_splits(131072, 8, "uniform_comp", alignment=128, model=model)
    assert all(l % 128 == 0 for l in lengths) and sum(lengths) == 131072
    flops = split_flops(lengths, model)
    mean = sum(flops) / len(flops)
    assert max(abs(f - mean) for f in flops) <= 0.01 * mean


def brute_force_flops(lengths, model):
    """Sum per-token costs: the token at position t attends over t + 1 keys."""
    h, d = model.hidden_size, model.head_dim
    hq, g, ffn = model.num_attention_heads, model.num_query_groups, model.ffn_hidden_size
    macs_linear = h * hq * d + 2 * h * g * d + hq * d * h + (3 if model.swiglu else 2) * h * ffn
    out, t = [], 0
    for length in lengths:
        total = 0.0
        for _ in range(length):
            per_layer = 2 * macs_linear + 2 * (hq * d * (t + 1)) * 2  # QK^T + AV
            total += model.num_layers * per_layer + 2 * h * model.vocab_size
            t += 1
        out.append(total)
    return out


@pytest.mark.parametrize("lengths", [[1], [5, 3, 1, 1], [17, 9, 6]])
def test_split_flops_matches_brute_force(lengths):
    for model in (SMALL, ModelShape(3, 48, 6, 6, 96, False, 50, kv_channels=16)):
        assert split_flops(lengths, model) == pytest.approx(brute_force_flops(lengths, model))


def test_uniform_comp_against_brute_force_small():
    lengths = plan_splits(512, 4, "uniform_comp", model=SMALL)
    flops = brute_force_flops(lengths, SMALL)
    mean = sum(flops) / len(flops)
    assert max(abs(f - mean) for f in flops) <= 0.01 * mean
    assert lengths == sorted(lengths, reverse=True)
