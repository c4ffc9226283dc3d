"""Point-to-point messages of a pipeline with model chunks (virtual stages), and a check.

With ``v`` chunks per rank, chunk ``c`` of rank ``r`` is global stage ``c p + r``:
a forward's output goes to global stage ``+1`` (rank ``r + 1``, or rank 0's next
chunk from the last rank) and a backward's input gradient to global stage ``-1``.
So on a ring of ``p`` ranks activations always flow to the next rank and gradients
to the previous one; with ``p = 2`` both directions share one pair of ranks.

``lower_chunked`` turns every rank's ordered compute units into a program of units
and *batches* of sends and receives, each batch posted as one ``batch_isend_irecv``
call (its ops progress together, as one NCCL group). Why not megatron-core's
interleaved pairing: with splits, messages have several shapes and the paired
receives of one call would need two; and a simple "send my output, receive my next
input" rule deadlocks for interleaved orders (``check_rendezvous`` finds it).

``check_rendezvous`` executes all programs with the strictest semantics a backend
may have: blocking rendezvous per batch and FIFO matching per directed pair of
ranks (NCCL matches the k-th send from A to B with the k-th receive at B from A,
whatever the message is meant to be). It raises if the programs deadlock, if a
receive would get another unit's message, or if a unit runs before its inputs. The
executor checks its programs with it once per shape before running anything.
"""

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple, Union

from megatron.schedules.units import BACKWARD, FORWARD, Unit

SEND, RECV = "send", "recv"


@dataclass(frozen=True)
class Message:
    """One op of a batch: send or receive the tensor that ``unit`` consumes.

    ``unit`` is always the *consuming* unit (on the receiving rank), so a send and
    its matching receive carry equal ``Message.unit`` and ``Message.kind`` differs.
    ``peer`` is the rank in the pipeline group on the other end.
    """

    kind: str  # SEND or RECV
    peer: int
    unit: Unit


Batch = Tuple[Message, ...]
Action = Union[Unit, Batch]


def _global_stage(rank: int, chunk: int, pp_size: int) -> int:
    return chunk * pp_size + rank


def _rank_chunk(stage: int, pp_size: int) -> Tuple[int, int]:
    return stage % pp_size, stage // pp_size


def producer(unit: Unit, rank: int, pp_size: int, num_chunks: int) -> Optional[Tuple[int, Unit]]:
    """(rank, unit) whose output ``unit`` on ``rank`` consumes; None when it reads data."""
    stage = _global_stage(rank, unit.chunk, pp_size)
    source = stage - 1 if unit.is_forward else stage + 1
    if not 0 <= source < pp_size * num_chunks:
        return None
    src_rank, src_chunk = _rank_chunk(source, pp_size)
    return src_rank, Unit(unit.kind, unit.microbatch, unit.split, src_chunk)


def consumer(unit: Unit, rank: int, pp_size: int, num_chunks: int) -> Optional[Tuple[int, Unit]]:
    """(rank, unit) that consumes the output of ``unit`` on ``rank``; None at the ends."""
    stage = _global_stage(rank, unit.chunk, pp_size)
    target = stage + 1 if unit.is_forward else stage - 1
    if not 0 <= target < pp_size * num_chunks:
        return None
    dst_rank, dst_chunk = _rank_chunk(target, pp_size)
    return dst_rank, Unit(unit.kind, unit.microbatch, unit.split, dst_chunk)


def unit_start_times(units_per_rank: Sequence[Sequence[Unit]], num_chunks: int,
                     forward_cost: float = 1.0, backward_cost: float = 2.0):
    """Start and end time of every unit when each rank runs its list in order, a unit
    starts once its input exists, and messages take no time. Raises on deadlock."""
    pp_size = len(units_per_rank)
    start, end = {}, {}
    next_index = [0] * pp_size
    free_at = [0.0] * pp_size
    remaining = sum(len(u) for u in units_per_rank)
    while remaining:
        progressed = False
        for rank in range(pp_size):
            while next_index[rank] < len(units_per_rank[rank]):
                unit = units_per_rank[rank][next_index[rank]]
                source = producer(unit, rank, pp_size, num_chunks)
                if source is not None and source not in end:
                    break
                begin = max(free_at[rank], end[source] if source is not None else 0.0)
                start[(rank, unit)] = begin
                end[(rank, unit)] = free_at[rank] = begin + (
                    forward_cost if unit.is_forward else backward_cost)
                next_index[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = {r: str(units_per_rank[r][i]) for r, i in enumerate(next_index)
                       if i < len(units_per_rank[r])}
            raise AssertionError(f"schedule cannot run: ranks wait for each other at {blocked}")
    return start, end


def lower_chunked(units_per_rank: Sequence[Sequence[Unit]], num_chunks: int,
                  times=None) -> List[List[Action]]:
    """Every rank's units with the batches that feed them (see module doc).

    All events (units and messages) are put in one global order taken from a timed
    run (``unit_start_times``): a message right when its producer ends, before any unit
    that starts at that moment. Each rank's program is its projection of that order,
    with consecutive messages posted as one batch. Deadlock cannot happen: the earliest
    unfinished event always has both of its ranks posted on it (every earlier event of
    theirs is finished, and a batch only holds consecutive events). FIFO order per pair
    of ranks holds because both ends see their messages in the one global order.

    ``times`` = ``(start, end)`` dicts keyed by ``(rank, unit)`` replaces the timed run
    (any execution in which every unit starts after its input's producer ended will do;
    units that must run together, see ``check_rendezvous``'s ``partners``, start at the
    same time in it, so neither waits for an event ordered after the other).
    """
    pp_size = len(units_per_rank)
    start, end = times if times is not None else unit_start_times(units_per_rank, num_chunks)
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


def _dependencies_met(rank, unit, done, received, pp_size, num_chunks, num_splits):
    """Why ``unit`` cannot run yet on ``rank`` (None when it can)."""
    if producer(unit, rank, pp_size, num_chunks) is not None and unit not in received[rank]:
        return f"{unit} on rank {rank} runs before its input arrived"
    if unit.is_forward:
        if unit.split > 0 and Unit(FORWARD, unit.microbatch, unit.split - 1, unit.chunk) \
                not in done[rank]:
            return f"{unit} on rank {rank} runs before the K/V of its previous split"
    else:
        if Unit(FORWARD, unit.microbatch, unit.split, unit.chunk) not in done[rank]:
            return f"{unit} on rank {rank} runs before its forward"
        if unit.split < num_splits - 1 and Unit(
                BACKWARD, unit.microbatch, unit.split + 1, unit.chunk) not in done[rank]:
            return f"{unit} on rank {rank} runs before the later split's K/V gradient"
    return None


def check_rendezvous(programs: Sequence[Sequence[Action]], num_chunks: int,
                     num_splits: int, partners=None) -> List[Tuple[int, Unit]]:
    """Run the ranks' programs with blocking batched rendezvous; return the global unit
    order. Raises ``AssertionError`` on deadlock, a FIFO mismatch or a broken dependency.

    ``partners[(rank, unit)] = (peer, peer_unit)`` (both sides given): the two units
    exchange data while they run, so neither runs before the other rank reached its side.
    """
    partners = partners or {}
    arrived = set()  # (rank, unit) at a paired unit whose partner has not arrived
    pp_size = len(programs)
    position = [0] * pp_size
    # ops of each rank's posted batch not yet matched: [message, channel, index in channel]
    pending: List[Optional[list]] = [None] * pp_size
    done = [set() for _ in range(pp_size)]
    received = [set() for _ in range(pp_size)]
    posted = {}  # (SEND|RECV, src, dst) -> ops posted so far on that directed channel
    order = []

    def post(rank, batch):
        pending[rank] = []
        for msg in batch:
            channel = (rank, msg.peer) if msg.kind == SEND else (msg.peer, rank)
            index = posted.get((msg.kind,) + channel, 0)
            posted[(msg.kind,) + channel] = index + 1
            pending[rank].append([msg, channel, index])
            if msg.kind == SEND:  # the tensor exists once the producing unit ran
                source = producer(msg.unit, msg.peer, pp_size, num_chunks)
                assert source is not None and source[1] in done[rank], \
                    f"rank {rank} sends {msg.unit}'s input before computing it"

    while True:
        progressed = False
        for rank in range(pp_size):
            while position[rank] < len(programs[rank]):
                action = programs[rank][position[rank]]
                if isinstance(action, Unit):
                    problem = _dependencies_met(rank, action, done, received, pp_size,
                                                num_chunks, num_splits)
                    assert problem is None, problem
                    partner = partners.get((rank, action))
                    if partner is not None and partner not in arrived:
                        arrived.add((rank, action))
                        break
                    runs = [(rank, action)] + ([partner] if partner is not None else [])
                    arrived.discard(partner)
                    for run_rank, run_unit in runs:
                        done[run_rank].add(run_unit)
                        order.append((run_rank, run_unit))
                        position[run_rank] += 1
                    progressed = True
                    continue
                if pending[rank] is None:
                    post(rank, action)
                if pending[rank]:
                    break
                pending[rank] = None
                position[rank] += 1
                progressed = True
        for rank in range(pp_size):
            for op in [op for op in (pending[rank] or []) if op[0].kind == SEND]:
                msg, channel, index = op
                match = [other for other in (pending[msg.peer] or [])
                         if other[0].kind == RECV and other[1:] == [channel, index]]
                if not match:
                    continue
                assert match[0][0].unit == msg.unit, (
                    f"FIFO mismatch on {rank}->{msg.peer}: send for {msg.unit} would be "
                    f"received as {match[0][0].unit}")
                pending[rank].remove(op)
                pending[msg.peer].remove(match[0])
                received[msg.peer].add(msg.unit)
                progressed = True
        if all(position[r] == len(programs[r]) for r in range(pp_size)):
            return order
        if not progressed:
            stuck = {r: [op[0] for op in pending[r]] if pending[r] is not None
                     else f"waits at {programs[r][position[r]]} for its partner"
                     for r in range(pp_size) if position[r] < len(programs[r])}
            raise AssertionError(f"deadlock: {stuck}")


@lru_cache(maxsize=64)
def checked_chunked_programs(pp_size: int, num_microbatches: int, num_chunks: int,
                             num_splits: int, group_size: Optional[int] = None,
                             forward_only: bool = False,
                             schedule: str = "interleaved") -> Tuple[Tuple[Action, ...], ...]:
    """Every rank's lowered program, checked by ``check_rendezvous``.

    ``schedule``: ``"interleaved"`` (``megatron.schedules.interleaved``, with
    ``group_size``) or ``"slimpipe"`` (``megatron.schedules.slimpipe``, ``num_splits``
    slices; ``group_size`` is ignored: a group is one microbatch).
    """
    from megatron.schedules.interleaved import interleaved_forward_only_units, interleaved_rank_units
    from megatron.schedules.slimpipe import slimpipe_forward_only_units, slimpipe_rank_units

    if schedule == "slimpipe":
        if forward_only:
            units = [slimpipe_forward_only_units(num_microbatches, num_chunks,
                                                 num_splits)] * pp_size
        else:
            units = [slimpipe_rank_units(r, pp_size, num_microbatches, num_chunks, num_splits)
                     for r in range(pp_size)]
    elif schedule != "interleaved":
        raise ValueError(f"unknown chunked schedule {schedule!r}")
    elif forward_only:
        units = [interleaved_forward_only_units(num_microbatches, num_chunks, num_splits,
                                                pp_size, group_size)] * pp_size
    else:
        units = [interleaved_rank_units(r, pp_size, num_microbatches, num_chunks, group_size,
                                        num_splits) for r in range(pp_size)]
    programs = tuple(tuple(program) for program in lower_chunked(units, num_chunks))
    check_rendezvous(programs, num_chunks, num_splits)
    return programs
