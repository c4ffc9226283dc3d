"""Invariants of the schedule generator, checked without launching a process."""

import itertools

import pytest

from megatron.schedules.actions import (
    BACKWARD,
    FORWARD,
    Unit,
    format_program,
    parse_program,
    units_of,
)
from megatron.schedules.lowering import checked_programs
from megatron.schedules.seq1f1b import num_warmup_units, seq1f1b_schedule
from megatron.schedules.simulate import simulate

SHAPES = [
    (p, m, s)
    for p in (1, 2, 3, 4, 8)
    for m in (1, 2, 3, 5, 7, 8)
    for s in (1, 2, 3, 4, 8)
]


def run_rendezvous(pp_size, num_microbatches, num_splits, forward_only=False):
    """The executor's lowered programs of every rank, run by the simulator with
    blocking, matched sends and receives (it raises on deadlock, a crossed message or a
    broken dependency); returns the timed units."""
    programs = checked_programs(pp_size, num_microbatches, 1, num_splits, None, forward_only,
                                "seq1f1b")
    return [t for timed in simulate(programs).ranks for t in timed]


@pytest.mark.parametrize("p,m,s", SHAPES)
def test_every_unit_once_and_no_deadlock(p, m, s):
    schedule = seq1f1b_schedule(p, m, s)
    expected = {
        Unit(kind, mb, split)
        for kind in (FORWARD, BACKWARD)
        for mb in range(m)
        for split in range(s)
    }
    for rank_units in schedule:
        assert len(rank_units) == 2 * m * s
        assert set(rank_units) == expected
    order = run_rendezvous(p, m, s)
    assert len(order) == 2 * m * s * p


@pytest.mark.parametrize("p,m,s", SHAPES)
def test_actions_run_exactly_the_generators_unit_order(p, m, s):
    """The executor's program computes the units in the generator's order."""
    programs = checked_programs(p, m, 1, s, None, False, "seq1f1b")
    for rank, units in enumerate(seq1f1b_schedule(p, m, s)):
        assert units_of(programs[rank]) == units
        # the printed form is exact: it parses back to the same program
        assert parse_program(format_program(programs[rank])) == list(programs[rank])


@pytest.mark.parametrize("p,m,s", SHAPES)
def test_forward_only_runs_every_forward_in_order(p, m, s):
    order = run_rendezvous(p, m, s, forward_only=True)
    assert len(order) == m * s * p


@pytest.mark.parametrize("p,m,s", SHAPES)
def test_orders_and_warmup(p, m, s):
    for rank, units in enumerate(seq1f1b_schedule(p, m, s)):
        forwards = [u for u in units if u.kind == FORWARD]
        backwards = [u for u in units if u.kind == BACKWARD]
        assert forwards == [Unit(FORWARD, mb, j) for mb in range(m) for j in range(s)]
        assert backwards == [
            Unit(BACKWARD, mb, j) for mb in range(m) for j in reversed(range(s))
        ]
        warmup = min(p - rank - 1 + s - 1, m * s)
        assert num_warmup_units(rank, p, m, s) == warmup
        first_backward = next(i for i, u in enumerate(units) if u.kind == BACKWARD)
        # warm-up forwards, then (when forwards remain) one steady forward
        assert first_backward == min(warmup + 1, m * s)


def in_flight_peak(units):
    alive, peak = set(), 0
    for unit in units:
        if unit.kind == FORWARD:
            alive.add((unit.microbatch, unit.split))
        else:
            alive.discard((unit.microbatch, unit.split))
        peak = max(peak, len(alive))
    return peak


@pytest.mark.parametrize("p,m,s", SHAPES)
def test_stage0_in_flight_peak(p, m, s):
    stage0 = seq1f1b_schedule(p, m, s)[0]
    assert in_flight_peak(stage0) == min(s + p - 1, m * s)


@pytest.mark.parametrize("p,m", list(itertools.product((1, 2, 4, 8), (1, 3, 4, 9))))
def test_one_split_is_megatron_1f1b(p, m):
    """s = 1: megatron-core's warm-up count min(p - r - 1, m), then strict alternation."""
    for rank, units in enumerate(seq1f1b_schedule(p, m, 1)):
        warmup = min(p - rank - 1, m)
        assert all(u.kind == FORWARD for u in units[:warmup])
        steady = units[warmup: warmup + 2 * (m - warmup)]
        assert [u.kind for u in steady] == [FORWARD, BACKWARD] * (m - warmup)
        assert all(u.kind == BACKWARD for u in units[warmup + 2 * (m - warmup):])


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="--seq1f1b-splits"):
        seq1f1b_schedule(2, 2, 0)
    with pytest.raises(ValueError):
        seq1f1b_schedule(2, 0, 2)


def test_split_reports_merge_per_microbatch():
    """The executor returns one loss report per microbatch (megatron-core's return value):
    its splits' (loss sum, token count) pairs added, in microbatch order."""
    import torch

    from megatron.schedules.executor import merge_split_reports

    reports = [(1, {"lm loss": torch.tensor([2.0, 3.0])}), (0, {"lm loss": torch.tensor([1.0, 2.0])}),
               (1, {"lm loss": torch.tensor([4.0, 5.0])}), (0, {"lm loss": torch.tensor([0.5, 1.0])})]
    merged = merge_split_reports(reports)
    assert [m["lm loss"].tolist() for m in merged] == [[1.5, 3.0], [6.0, 8.0]]
    assert reports[1][1]["lm loss"].tolist() == [1.0, 2.0]  # the inputs are left alone


def test_actions_print_compactly_and_parse_back():
    from megatron.schedules.actions import RECV, SEND, Message, format_program

    program = [Unit(FORWARD, 3, 1), (Message(SEND, 1, Unit(FORWARD, 3, 1)),
                                     Message(RECV, 1, Unit(BACKWARD, 2, 0, 1))),
               Unit(BACKWARD, 2, 0, 1)]
    text = format_program(program)
    assert text == "F3.1 [S1:F3.1 R1:B2.0c1] B2.0c1"
    assert parse_program(text) == program
    for bad in ("X1.0", "F1", "[S1:F0.0", "[Q1:F0.0]"):
        with pytest.raises(ValueError):
            parse_program(bad)
