"""Invariants of the schedule generator, checked without launching a process."""

import itertools

import pytest

from megatron.schedules.units import (
    BACKWARD,
    FORWARD,
    RECV_BACKWARD,
    RECV_FORWARD,
    SEND_BACKWARD,
    SEND_FORWARD,
    Unit,
    num_warmup_units,
    seq1f1b_rank_actions,
    seq1f1b_schedule,
)

SHAPES = [
    (p, m, s)
    for p in (1, 2, 3, 4, 8)
    for m in (1, 2, 3, 5, 7, 8)
    for s in (1, 2, 3, 4, 8)
]


def run_rendezvous(pp_size, num_microbatches, num_splits, forward_only=False):
    """Run every rank's actions with blocking, matched sends and receives.

    A communication step's ops are posted together; an op completes only when the
    neighbour has posted the matching op in its current step (rendezvous, as
    blocking NCCL p2p). Compute units assert their dependencies. Returns the order
    in which compute units ran globally; raises on deadlock or a broken dependency.
    """
    programs = [
        seq1f1b_rank_actions(r, pp_size, num_microbatches, num_splits, forward_only)
        for r in range(pp_size)
    ]
    position = [0] * pp_size
    pending = [None] * pp_size  # ops of the current step not yet completed
    done = [set() for _ in range(pp_size)]  # computed units per rank
    received = [set() for _ in range(pp_size)]  # (op, unit) receives completed

    def peer_and_match(rank, op):
        if op.op == SEND_FORWARD:
            return rank + 1, RECV_FORWARD
        if op.op == RECV_FORWARD:
            return rank - 1, SEND_FORWARD
        if op.op == SEND_BACKWARD:
            return rank - 1, RECV_BACKWARD
        return rank + 1, SEND_BACKWARD

    def check_compute(rank, unit):
        if unit.kind == FORWARD:
            if rank > 0:
                assert (RECV_FORWARD, unit) in received[rank], f"{unit} on {rank} lacks input"
            if unit.split > 0:
                assert Unit(FORWARD, unit.microbatch, unit.split - 1) in done[rank]
        else:
            assert Unit(FORWARD, unit.microbatch, unit.split) in done[rank]
            if rank < pp_size - 1:
                assert (RECV_BACKWARD, unit) in received[rank], f"{unit} on {rank} lacks grad"
            if unit.split < num_splits - 1:
                # later splits' backward deposits this split's K/V gradient
                assert Unit(BACKWARD, unit.microbatch, unit.split + 1) in done[rank]

    order = []
    while True:
        progressed = False
        for rank in range(pp_size):
            # advance through compute units and finished steps
            while position[rank] < len(programs[rank]):
                action = programs[rank][position[rank]]
                if isinstance(action, Unit):
                    check_compute(rank, action)
                    done[rank].add(action)
                    order.append((rank, action))
                    position[rank] += 1
                    progressed = True
                    continue
                if pending[rank] is None:
                    for op in action:
                        if op.op in (SEND_FORWARD, SEND_BACKWARD):
                            assert op.unit in done[rank], f"send of uncomputed {op.unit}"
                    pending[rank] = list(action)
                if pending[rank]:
                    break
                pending[rank] = None
                position[rank] += 1
                progressed = True
        # complete matched pairs among posted ops
        for rank in range(pp_size):
            for op in list(pending[rank] or []):
                peer, want = peer_and_match(rank, op)
                assert 0 <= peer < pp_size, f"rank {rank} talks to missing rank {peer}"
                match = [o for o in (pending[peer] or []) if o.op == want]
                if match:
                    other = match[0]
                    # channels are FIFO: the message must carry the unit expected
                    assert other.unit == op.unit, f"{op} on {rank} paired with {other}"
                    pending[rank].remove(op)
                    pending[peer].remove(other)
                    for r, o in ((rank, op), (peer, other)):
                        if o.op in (RECV_FORWARD, RECV_BACKWARD):
                            received[r].add((o.op, o.unit))
                    progressed = True
        if all(position[r] == len(programs[r]) for r in range(pp_size)):
            return order
        if not progressed:
            stuck = {r: pending[r] for r in range(pp_size) if position[r] < len(programs[r])}
            raise AssertionError(f"deadlock: {stuck}")


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
    """The executor's action list computes the units in the generator's order."""
    for rank, units in enumerate(seq1f1b_schedule(p, m, s)):
        actions = seq1f1b_rank_actions(rank, p, m, s)
        assert [a for a in actions if isinstance(a, Unit)] == units


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

    from megatron.schedules.seq1f1b import merge_split_reports

    reports = [(1, {"lm loss": torch.tensor([2.0, 3.0])}), (0, {"lm loss": torch.tensor([1.0, 2.0])}),
               (1, {"lm loss": torch.tensor([4.0, 5.0])}), (0, {"lm loss": torch.tensor([0.5, 1.0])})]
    merged = merge_split_reports(reports)
    assert [m["lm loss"].tolist() for m in merged] == [[1.5, 3.0], [6.0, 8.0]]
    assert reports[1][1]["lm loss"].tolist() == [1.0, 2.0]  # the inputs are left alone
