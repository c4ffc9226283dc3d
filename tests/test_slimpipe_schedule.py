"""The SlimPipe generator's invariants, checked without launching a process."""

import itertools

import pytest

from megatron.schedules.actions import BACKWARD, FORWARD, Unit
from megatron.schedules.lowering import checked_programs
from megatron.schedules.seq1f1b import in_flight_peak, seq1f1b_rank_units
from megatron.schedules.simulate import ScheduleError, simulate
from megatron.schedules.slimpipe import (
    check_slimpipe_shape,
    num_slimpipe_warmup,
    slimpipe_forward_only_units,
    slimpipe_rank_units,
    slimpipe_schedule,
)

# n a multiple of p as the flags ask, plus n >= p that is not (the generator allows it)
SHAPES = [
    (p, v, n, m)
    for p, v in itertools.product((2, 3, 4), (2, 3, 4))
    for n in sorted({p, 2 * p, p + 1})
    for m in (1, 2, 3, 5)
]


def _units_of(program):
    return [a for a in program if isinstance(a, Unit)]


@pytest.mark.parametrize("p,v,n,m", SHAPES)
def test_every_unit_once_and_messages_cannot_deadlock(p, v, n, m):
    programs = checked_programs(p, m, v, n, schedule="slimpipe")  # raises on deadlock
    expected = {Unit(kind, mb, j, c) for kind in (FORWARD, BACKWARD)
                for mb in range(m) for j in range(n) for c in range(v)}
    for rank, program in enumerate(programs):
        units = slimpipe_rank_units(rank, p, m, v, n)
        assert _units_of(program) == units
        assert len(units) == len(expected) and set(units) == expected


@pytest.mark.parametrize("p,v,n,m", SHAPES)
def test_backward_is_the_exact_reverse_of_forward_within_a_microbatch(p, v, n, m):
    for rank in range(p):
        units = slimpipe_rank_units(rank, p, m, v, n)
        for mb in range(m):
            forwards = [(u.chunk, u.split) for u in units if u.is_forward and u.microbatch == mb]
            backwards = [(u.chunk, u.split) for u in units
                         if not u.is_forward and u.microbatch == mb]
            assert forwards == [(c, j) for c in range(v) for j in range(n)]
            assert backwards == forwards[::-1]
        # microbatches enter and leave first-in first-out
        first_f = [next(i for i, u in enumerate(units) if u.is_forward and u.microbatch == mb)
                   for mb in range(m)]
        first_b = [next(i for i, u in enumerate(units) if not u.is_forward
                        and u.microbatch == mb) for mb in range(m)]
        assert first_f == sorted(first_f) and first_b == sorted(first_b)


@pytest.mark.parametrize("p,v,n,m", SHAPES)
def test_stage0_holds_nv_plus_2p_minus_2_slices(p, v, n, m):
    units = slimpipe_rank_units(0, p, m, v, n)
    expected = v * n + 2 * (p - 1) if m >= 2 else v * n
    assert in_flight_peak(units) == expected
    # the simulator (units wait for their inputs) agrees
    assert simulate(slimpipe_schedule(p, m, v, n), lambda r, u: 1.0).in_flight_peak(0) == expected
    # as a share of one microbatch (v n slice-chunk units on this rank)
    if m >= 2:
        assert expected / (v * n) == pytest.approx((n * v + 2 * (p - 1)) / (n * v))


@pytest.mark.parametrize("p,v,n,m", SHAPES)
def test_warmup_counts(p, v, n, m):
    for rank in range(p):
        warmup = min(2 * (p - rank - 1) + (v - 1) * n + n - 1, v * m * n)
        assert num_slimpipe_warmup(rank, p, m, v, n) == warmup
        units = slimpipe_rank_units(rank, p, m, v, n)
        first_backward = next(i for i, u in enumerate(units) if not u.is_forward)
        assert first_backward == min(warmup + 1, v * m * n)


def test_last_rank_pairs_the_next_microbatch_forwards_with_the_current_backwards():
    p, v, n, m = 4, 2, 4, 3
    units = slimpipe_rank_units(p - 1, p, m, v, n)
    warmup = v * n - 1  # all of microbatch 0's forwards but the last
    assert all(u.is_forward and u.microbatch == 0 for u in units[:warmup])
    steady = units[warmup:warmup + 2 * v * n]
    assert [u.kind for u in steady] == [FORWARD, BACKWARD] * (v * n)
    assert steady[0] == Unit(FORWARD, 0, n - 1, v - 1)
    assert steady[1] == Unit(BACKWARD, 0, n - 1, v - 1)
    assert {u.microbatch for u in steady[2::2]} == {1}
    assert {u.microbatch for u in steady[1::2]} == {0}


def test_forward_table_is_microbatch_then_chunk_then_slice():
    """The interleaved table with a group of one microbatch (megatron-core's is G >= p
    microbatches per group, chunk-major inside the group)."""
    for rank in range(4):
        forwards = [u for u in slimpipe_rank_units(rank, 4, 3, 2, 4) if u.is_forward]
        assert forwards == [Unit(FORWARD, mb, j, c) for mb in range(3) for c in range(2)
                            for j in range(4)]


@pytest.mark.parametrize("p,n,m", [(2, 2, 1), (2, 4, 3), (4, 4, 2), (4, 8, 5)])
def test_without_virtual_stages_it_is_seq1f1b_with_n_splits(p, n, m):
    for rank in range(p):
        assert slimpipe_rank_units(rank, p, m, 1, n) == seq1f1b_rank_units(rank, p, m, n)
    assert in_flight_peak(slimpipe_rank_units(0, p, m, 1, n)) == min(n + p - 1, m * n)


@pytest.mark.parametrize("p,v,n,m", SHAPES[::7])
def test_forward_only_programs(p, v, n, m):
    programs = checked_programs(p, m, v, n, forward_only=True, schedule="slimpipe")
    for program in programs:
        units = _units_of(program)
        assert units == slimpipe_forward_only_units(m, v, n)
        assert all(u.is_forward for u in units) and len(units) == m * n * v


def test_checker_rejects_a_non_reversed_backward():
    """Sanity of the check itself: running a microbatch's backward slices in forward
    order breaks the K/V-gradient dependency and the rendezvous check says so."""
    from megatron.schedules.lowering import lower

    p, v, n, m = 2, 2, 2, 2
    units = [list(slimpipe_rank_units(r, p, m, v, n)) for r in range(p)]
    swapped = []
    for rank_units in units:
        a = rank_units.index(Unit(BACKWARD, 0, 1, 0))
        b = rank_units.index(Unit(BACKWARD, 0, 0, 0))
        rank_units[a], rank_units[b] = rank_units[b], rank_units[a]
        swapped.append(rank_units)
    with pytest.raises(ScheduleError):
        simulate(lower(swapped, v))


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="at least p=4 slices"):
        check_slimpipe_shape(4, 2, 2, 3)
    with pytest.raises(ValueError, match="pipeline-model-parallel-size >= 2"):
        check_slimpipe_shape(1, 2, 2, 2)
    with pytest.raises(ValueError, match="--slimpipe-slices"):
        check_slimpipe_shape(2, 2, 2, 0)
    with pytest.raises(ValueError, match="microbatches"):
        slimpipe_rank_units(0, 2, 0, 2, 2)
    check_slimpipe_shape(4, 1, 1, 3)  # v = 1: Seq1F1B, any slice count
