"""Interleaved 1F1B generator against megatron-core 0.16.1's own tables and counts."""

import itertools
from types import SimpleNamespace

import pytest

from megatron.schedules.simulate import simulate
from megatron.schedules.interleaved import (
    check_interleaved_shape,
    interleaved_schedule,
    num_interleaved_warmup,
    schedule_table,
)
from megatron.schedules.actions import BACKWARD, FORWARD, Unit

mcore = pytest.importorskip("megatron.core.pipeline_parallel.schedules")


def valid_shapes():
    out = []
    for p, v, m in itertools.product((2, 3, 4, 8), (2, 3, 4), (2, 3, 4, 5, 6, 8, 12, 16)):
        try:
            check_interleaved_shape(p, m, v)
        except ValueError:
            continue
        out.append((p, v, m))
    return out


SHAPES = valid_shapes()


def mcore_warmup(rank, p, m, v, group):
    comm = SimpleNamespace(
        pp_group=SimpleNamespace(size=lambda: p, rank=lambda: rank),
        virtual_pipeline_model_parallel_size=v,
    )
    total, _, warmup, remaining = mcore.get_pp_rank_microbatches(
        m, v, group, forward_only=False, p2p_communicator=comm
    )
    assert total == v * m and warmup + remaining == total
    return warmup


def mcore_order(rank, p, m, v, group):
    """The unit order forward_backward_pipelining_with_interleaving runs, from its tables."""
    table = mcore.get_schedule_table(m, v, group)
    warmup = mcore_warmup(rank, p, m, v, group)
    total = v * m
    forwards = [Unit(FORWARD, mb, 0, c) for mb, c in table]
    # backward k: chunk v - 1 - chunk(table[k]); microbatches leave each chunk FIFO
    popped = [0] * v
    per_chunk = [[mb for mb, c in table if c == chunk] for chunk in range(v)]
    backwards = []
    for k in range(total):
        chunk = v - 1 - table[k][1]
        backwards.append(Unit(BACKWARD, per_chunk[chunk][popped[chunk]], 0, chunk))
        popped[chunk] += 1
    order = forwards[:warmup]
    for k in range(total - warmup):
        order += [forwards[k + warmup], backwards[k]]
    order += backwards[total - warmup:]
    return order


@pytest.mark.parametrize("p,v,m", SHAPES)
def test_warmup_counts_match_megatron_core(p, v, m):
    for rank in range(p):
        assert num_interleaved_warmup(rank, p, m, v) == mcore_warmup(rank, p, m, v, p)


@pytest.mark.parametrize("p,v,m", SHAPES)
def test_table_and_order_match_megatron_core(p, v, m):
    assert [(mb, c) for mb, _, c in schedule_table(m, v, p)] == mcore.get_schedule_table(m, v, p)
    schedule = interleaved_schedule(p, m, v)
    for rank in range(p):
        assert schedule[rank] == mcore_order(rank, p, m, v, p)


@pytest.mark.parametrize("group", [4, 5, 6])
def test_custom_group_size_matches_megatron_core(group):
    p, v, m = 4, 2, 12
    if 0 < m % group < p:
        with pytest.raises(ValueError):
            interleaved_schedule(p, m, v, group)
        return
    for rank in range(p):
        assert num_interleaved_warmup(rank, p, m, v, group) == mcore_warmup(rank, p, m, v, group)
        assert interleaved_schedule(p, m, v, group)[rank] == mcore_order(rank, p, m, v, group)


@pytest.mark.parametrize("p,v,m", SHAPES)
def test_equal_costs_bubble_is_interleaved_formula(p, v, m):
    result = simulate(interleaved_schedule(p, m, v), lambda r, u: 1.0 / v)
    assert result.bubble_fraction() == pytest.approx((p - 1) / (v * m + p - 1))


def test_rejects_what_megatron_core_rejects():
    with pytest.raises(ValueError, match="microbatch_group_size_per_vp_stage"):
        interleaved_schedule(4, 3, 2)  # m < p
    with pytest.raises(ValueError, match="modulo"):
        interleaved_schedule(4, 6, 2)  # 6 % 4 = 2 < 4


@pytest.mark.parametrize(
    "p,v,m,s", [(2, 2, 2, 2), (4, 2, 4, 2), (4, 2, 8, 3), (3, 3, 6, 4), (4, 4, 8, 2), (8, 2, 8, 4)]
)
def test_split_variant_complete_and_deadlock_free(p, v, m, s):
    schedule = interleaved_schedule(p, m, v, num_splits=s)
    expected = {
        Unit(kind, mb, j, c)
        for kind in (FORWARD, BACKWARD) for mb in range(m) for j in range(s) for c in range(v)
    }
    for units in schedule:
        assert len(units) == len(expected) and set(units) == expected
    result = simulate(schedule, lambda r, u: 1.0 / (v * s))
    # splits shrink the bubble like Seq1F1B does for 1F1B
    assert result.bubble_fraction() == pytest.approx((p - 1) / (v * m * s + p - 1))
