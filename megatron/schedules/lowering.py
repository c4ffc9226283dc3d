"""The one lowering pass: every rank's compute units -> a program of units and batches.

``lower`` adds, for every unit whose output another rank consumes, a send on its rank
and the matching receive on the consumer's rank (``megatron.schedules.actions``:
activations go to the next global stage, gradients to the previous one). Each run of
consecutive messages of a rank becomes one ``Batch``, posted as one
``batch_isend_irecv`` (its ops progress together, as one NCCL group), so every message
keeps its own shape: splits may differ in length.

Why not megatron-core's pairing (``send_forward_recv_backward`` and friends): with
splits, messages have several shapes and the paired receives of one call would need
two; and a simple "send my output, receive my next input" rule deadlocks for
interleaved orders. ``checked_programs`` therefore lowers every schedule here
(Seq1F1B, interleaved, SlimPipe; training and forward-only) with this one pass and
checks the result with the simulator's rendezvous semantics before anything runs.
"""

from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

from megatron.schedules.actions import RECV, SEND, Action, Message, Unit, consumer
from megatron.schedules import registry
from megatron.schedules.simulate import simulate

Times = Tuple[Dict[Tuple[int, Unit], float], Dict[Tuple[int, Unit], float]]
Program = Tuple[Action, ...]


def lower(units_per_rank: Sequence[Sequence[Unit]], num_chunks: int,
          times: Optional[Times] = None) -> List[List[Action]]:
    """Every rank's units with the batches that feed them.

    All events (units and messages) are put in one global order taken from a timed
    run (``simulate`` with its default durations): a message right when its producer
    ends, before any unit that starts at that moment. Each rank's program is its
    projection of that order, with consecutive messages posted as one batch. Deadlock
    cannot happen: the earliest unfinished event always has both of its ranks posted on
    it (every earlier event of theirs is finished, and a batch only holds consecutive
    events). FIFO order per pair of ranks holds because both ends see their messages in
    the one global order.

    ``times`` = ``(start, end)`` dicts keyed by ``(rank, unit)`` replaces the timed run
    (any execution in which every unit starts after its input's producer ended will do;
    units that must run together, see ``simulate``'s ``partners``, start at the same
    time in it, so neither waits for an event ordered after the other).
    """
    pp_size = len(units_per_rank)
    if times is None:
        timed = simulate(units_per_rank).ranks
        times = ({(t.rank, t.unit): t.start for rank_timed in timed for t in rank_timed},
                 {(t.rank, t.unit): t.end for rank_timed in timed for t in rank_timed})
    start, end = times
    events = [[] for _ in range(pp_size)]  # (key, action) per rank
    for rank, units in enumerate(units_per_rank):
        for index, unit in enumerate(units):
            events[rank].append(((start[(rank, unit)], 1, rank, index), unit))
            target = consumer(unit, rank, pp_size, num_chunks)
            if target is not None:
                key = (end[(rank, unit)], 0, rank, index)
                events[rank].append((key, Message(SEND, target[0], target[1])))
                events[target[0]].append((key, Message(RECV, rank, target[1])))
    programs = []
    for rank_events in events:
        program: List[Action] = []
        batch: List[Message] = []
        for _, action in sorted(rank_events, key=lambda e: e[0]):
            if isinstance(action, Message):
                batch.append(action)
                continue
            if batch:
                program.append(tuple(batch))
                batch = []
            program.append(action)
        if batch:
            program.append(tuple(batch))
        programs.append(program)
    return programs


def schedule_units(schedule: str, pp_size: int, num_microbatches: int, num_chunks: int,
                   num_splits: int, group_size: Optional[int] = None,
                   forward_only: bool = False) -> List[List[Unit]]:
    """Every rank's compute units of a named schedule (``registry.rank_units``: 1f1b,
    seq1f1b, slimpipe; virtual stages run the interleaved order)."""
    return registry.rank_units(schedule, pp_size, num_microbatches, num_chunks, num_splits,
                               group_size, forward_only)


@lru_cache(maxsize=64)
def checked_programs(pp_size: int, num_microbatches: int, num_chunks: int, num_splits: int,
                     group_size: Optional[int] = None, forward_only: bool = False,
                     schedule: str = "seq1f1b") -> Tuple[Program, ...]:
    """Every rank's lowered program of a named schedule (``schedule_units``), checked
    by ``simulate``: raises ``ScheduleError`` if it could deadlock or cross messages."""
    units = schedule_units(schedule, pp_size, num_microbatches, num_chunks, num_splits,
                           group_size, forward_only)
    programs = tuple(tuple(program) for program in lower(units, num_chunks))
    simulate(programs)
    return programs
