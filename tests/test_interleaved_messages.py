"""The interleaved (virtual-stage) programs: units in the generator's order, messages
that cannot deadlock or cross, checked without launching a process."""

import itertools

import pytest

from megatron.schedules.interleaved import (
    interleaved_forward_only_units,
    interleaved_rank_units,
    num_interleaved_warmup,
)
from megatron.schedules.actions import BACKWARD, FORWARD, RECV, SEND, Message, Unit
from megatron.schedules.lowering import checked_programs, lower
from megatron.schedules.simulate import ScheduleDeadlock, ScheduleError, simulate

SHAPES = [
    (p, v, s, m)
    for p, v, s in itertools.product((2, 3, 4), (2, 3, 4), (1, 2, 3, 4))
    for m in (p, 2 * p, 3 * p)
]
# megatron-core's microbatch groups larger than p allow m that is not a multiple of p
GROUPED = [(2, 2, 2, 5, 3), (2, 3, 3, 7, 4), (4, 2, 2, 9, 5), (3, 2, 4, 11, 4)]


def _units_of(program):
    return [a for a in program if isinstance(a, Unit)]


@pytest.mark.parametrize("p,v,s,m", SHAPES)
def test_programs_run_the_generator_order_without_deadlock(p, v, s, m):
    programs = checked_programs(p, m, v, s)  # raises on deadlock / FIFO mismatch
    for rank, program in enumerate(programs):
        expected = interleaved_rank_units(rank, p, m, v, num_splits=s)
        assert _units_of(program) == expected
        assert len(set(expected)) == len(expected) == 2 * m * s * v


@pytest.mark.parametrize("p,v,s,m,group", GROUPED)
def test_group_sizes_larger_than_p(p, v, s, m, group):
    programs = checked_programs(p, m, v, s, group)
    for rank, program in enumerate(programs):
        assert _units_of(program) == interleaved_rank_units(rank, p, m, v, group, s)


@pytest.mark.parametrize("p,v,s,m", SHAPES[::5])
def test_forward_only_programs(p, v, s, m):
    programs = checked_programs(p, m, v, s, forward_only=True)
    for program in programs:
        units = _units_of(program)
        assert units == interleaved_forward_only_units(m, v, s, p)
        assert all(u.is_forward for u in units) and len(units) == m * s * v


@pytest.mark.parametrize("p,v,s,m", [(2, 2, 2, 4), (4, 2, 3, 8), (3, 3, 2, 6)])
def test_every_message_is_sent_once_and_received_once(p, v, s, m):
    programs = checked_programs(p, m, v, s)
    sends, recvs = [], []
    for rank, program in enumerate(programs):
        for action in program:
            if isinstance(action, tuple):
                for msg in action:
                    (sends if msg.kind == SEND else recvs).append(
                        (rank, msg.peer, msg.unit) if msg.kind == SEND
                        else (msg.peer, rank, msg.unit))
    assert sorted(sends, key=str) == sorted(recvs, key=str)
    # every unit that is not on the first/last global stage gets exactly one input
    assert len(recvs) == 2 * m * s * (p * v - 1)
    assert len(set(recvs)) == len(recvs)


def test_warmup_grows_by_splits_minus_one():
    for p, v, m in ((2, 2, 4), (4, 2, 8), (4, 4, 8)):
        for s in (1, 2, 4):
            for rank in range(p):
                assert num_interleaved_warmup(rank, p, m, v, num_splits=s) == min(
                    2 * (p - rank - 1) + (v - 1) * p * s + s - 1, v * m * s)


def test_checker_finds_a_deadlock():
    """The simple rule "after a unit, send its output and receive the next unit's
    input" deadlocks for interleaved orders; the checker must say so."""
    p, v, s, m = 2, 2, 2, 4
    units = [interleaved_rank_units(r, p, m, v, num_splits=s) for r in range(p)]
    from megatron.schedules.actions import consumer, producer

    programs = []
    for rank, rank_units in enumerate(units):
        program = []
        for i, unit in enumerate(rank_units):
            if i == 0 and producer(unit, rank, p, v):
                program.append((Message(RECV, producer(unit, rank, p, v)[0], unit),))
            program.append(unit)
            batch = []
            target = consumer(unit, rank, p, v)
            if target:
                batch.append(Message(SEND, target[0], target[1]))
            if i + 1 < len(rank_units):
                nxt = rank_units[i + 1]
                source = producer(nxt, rank, p, v)
                if source:
                    batch.append(Message(RECV, source[0], nxt))
            if batch:
                program.append(tuple(batch))
        programs.append(program)
    with pytest.raises(ScheduleDeadlock, match="deadlock"):
        simulate(programs)


def test_checker_finds_crossed_messages():
    """Two activations sent to one rank in one order and received in the other."""
    p, v, s, m = 2, 2, 1, 2
    programs = [list(prog) for prog in lower(
        [interleaved_rank_units(r, p, m, v) for r in range(p)], v)]
    # rank 1 receives its first two activations labelled the other way round
    a, b = Unit(FORWARD, 0, 0, 0), Unit(FORWARD, 1, 0, 0)
    relabel = {a: b, b: a}
    programs[1] = [tuple(Message(x.kind, x.peer, relabel.get(x.unit, x.unit))
                         if x.kind == RECV else x for x in action)
                   if isinstance(action, tuple) else action for action in programs[1]]
    with pytest.raises(ScheduleError, match="FIFO mismatch"):
        simulate(programs)


def test_checker_finds_a_unit_before_its_input():
    p, v, s, m = 2, 2, 2, 2
    programs = [list(prog) for prog in lower(
        [interleaved_rank_units(r, p, m, v, num_splits=s) for r in range(p)], v)]
    # rank 1 runs its second forward split before the first one
    units = [i for i, a in enumerate(programs[1]) if a in (Unit(FORWARD, 0, 0, 0),
                                                            Unit(FORWARD, 0, 1, 0))]
    i, j = units
    programs[1][i], programs[1][j] = programs[1][j], programs[1][i]
    with pytest.raises(ScheduleError):
        simulate(programs)


def test_backward_runs_splits_in_reverse_and_chunks_in_reverse():
    units = interleaved_rank_units(0, 2, 4, 2, num_splits=3)
    backwards = [u for u in units if u.kind == BACKWARD and u.microbatch == 0]
    assert [(u.chunk, u.split) for u in backwards] == [
        (1, 2), (1, 1), (1, 0), (0, 2), (0, 1), (0, 0)]


def test_planner_names_interleaved_seq1f1b():
    from megatron.planner.cli import build_parser, config_from_args
    from megatron.planner.predict import PlanError, predict

    flags = ["--model", "7B", "--seq-length", "32768", "--tensor-model-parallel-size", "8",
             "--pipeline-model-parallel-size", "4", "--global-batch-size", "8",
             "--seq1f1b-splits", "4"]
    vp = ["--num-layers-per-virtual-pipeline-stage", "4"]
    named = predict(config_from_args(build_parser().parse_args(
        flags + vp + ["--schedule", "interleaved-seq1f1b"])))
    implied = predict(config_from_args(build_parser().parse_args(flags + vp)))
    plain = predict(config_from_args(build_parser().parse_args(flags)))
    assert named.pipeline_time_s == implied.pipeline_time_s
    assert named.bubble_fraction < plain.bubble_fraction  # interleaving shrinks the bubble
    with pytest.raises(PlanError, match="virtual"):
        config_from_args(build_parser().parse_args(flags + ["--schedule", "interleaved-seq1f1b"]))
