"""The one pipeline simulator: every rank runs its program in order, and the result
says when each unit starts and ends, the memory over time, or why the programs cannot
run. The planner, attention balancing, the lowering pass, the executor's deadlock
check, the timeline pictures and the tests all use it.

A unit starts when its rank is free and everything it depends on (``dependencies``)
is done:

* forward ``(mb, split, chunk)`` needs the same forward of the previous global stage
  (rank ``r - 1``, or rank ``p - 1``'s previous chunk from rank 0); split ``j > 0``
  also needs split ``j - 1``'s forward on the same rank (its K/V prefix);
* backward needs the same backward of the next global stage (none on the last stage)
  and its own forward; split ``j < s - 1`` also needs split ``j + 1``'s backward on the
  same rank (it deposits split ``j``'s K/V gradient).

Two kinds of program:

* **unit lists** (a schedule before lowering): a unit's input from another rank
  arrives ``comm`` seconds after its producer ends -- sends are asynchronous, the
  standard model for pipeline timelines (planner, attention balancing, lowering);
* **lowered programs** (``megatron.schedules.lowering``: units and batches of
  messages): tensors move only in batches, under the strictest semantics a backend
  may have. A batch blocks until every op in it met its peer's matching op
  (rendezvous), matched first-in first-out per directed pair of ranks (NCCL matches
  the k-th send from A to B with the k-th receive at B from A, whatever it is meant to
  carry). A unit whose input has not arrived, a send of a tensor not yet computed and
  a receive that would get another unit's message raise ``ScheduleError``.

``partners`` pairs units of two ranks that must run at the same time (SlimPipe's
attention redistribution exchanges data inside them): both start when both ranks are
ready. Programs that wait forever raise ``ScheduleDeadlock``, naming each rank's next
action. ``duration`` defaults to forward 1, backward 2.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megatron.schedules.actions import (
    BACKWARD, FORWARD, RECV, SEND, Action, Unit, format_action, producer)


class ScheduleError(RuntimeError):
    """Programs that cannot run as written: a unit before its input or its K/V, a
    send before its tensor exists, a receive that would get another unit's message."""


class ScheduleDeadlock(ScheduleError):
    """The programs cannot all run: some rank waits forever."""


@dataclass(frozen=True)
class TimedUnit:
    """One unit as it ran (or would run) on one rank; times in seconds."""

    rank: int
    unit: Unit
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class MemoryEffect:
    """Bytes a unit changes on its rank.

    ``at_start`` is added when the unit starts and ``at_end`` when it ends (negative
    to free). ``transient`` is live only while the unit runs. Each field may be a
    dict of named components (e.g. ``{"activations": x, "kv_cache": y}``).
    """

    at_start: Dict[str, float] = field(default_factory=dict)
    at_end: Dict[str, float] = field(default_factory=dict)
    transient: Dict[str, float] = field(default_factory=dict)


@dataclass
class MemoryTrace:
    """Piecewise-constant dynamic memory of one rank: value ``totals[i]`` from ``times[i]``."""

    times: List[float]
    totals: List[float]
    components: Dict[str, List[float]]

    def peak(self) -> Tuple[float, float, Dict[str, float]]:
        """(peak bytes, time of the peak, component bytes at that time)."""
        if not self.totals:
            return 0.0, 0.0, {}
        i = max(range(len(self.totals)), key=lambda k: self.totals[k])
        return self.totals[i], self.times[i], {k: v[i] for k, v in self.components.items()}


@dataclass
class SimResult:
    """Timed units per rank, with bubble and memory summaries."""

    ranks: List[List[TimedUnit]]
    memory: Optional[List[MemoryTrace]] = None

    @property
    def makespan(self) -> float:
        ends = [t.end for units in self.ranks for t in units]
        starts = [t.start for units in self.ranks for t in units]
        return (max(ends) - min(starts)) if ends else 0.0

    def busy(self, rank: int) -> float:
        return sum(t.duration for t in self.ranks[rank])

    def bubble_fraction(self) -> float:
        """Idle share of the pipeline: 1 - (busy time summed over ranks) / (p * makespan)."""
        span = self.makespan
        if span <= 0:
            return 0.0
        busy = sum(self.busy(r) for r in range(len(self.ranks)))
        return 1.0 - busy / (len(self.ranks) * span)

    def in_flight_peak(self, rank: int) -> int:
        """Most units whose forward started and whose backward has not ended."""
        events = []
        for t in self.ranks[rank]:
            if t.unit.kind == FORWARD:
                events.append((t.start, 1))
            else:
                events.append((t.end, -1))
        # at equal times free before allocating
        events.sort(key=lambda e: (e[0], e[1]))
        alive = peak = 0
        for _, delta in events:
            alive += delta
            peak = max(peak, alive)
        return peak




def dependencies(rank: int, unit: Unit, pp_size: int, num_chunks: int,
                 num_splits: int) -> List[Tuple[int, Unit]]:
    """(rank, unit) pairs that must finish before ``unit`` may start on ``rank``: its
    input's producer on another rank (if any) first, then those on its own rank."""
    deps = []
    source = producer(unit, rank, pp_size, num_chunks)
    if source is not None:
        deps.append(source)
    mb, j, c = unit.microbatch, unit.split, unit.chunk
    if unit.is_forward:
        if j > 0:
            deps.append((rank, Unit(FORWARD, mb, j - 1, c)))
    else:
        deps.append((rank, Unit(FORWARD, mb, j, c)))
        if j < num_splits - 1:
            deps.append((rank, Unit(BACKWARD, mb, j + 1, c)))
    return deps


DurationFn = Callable[[int, Unit], float]
CommFn = Callable[[int, int, Unit], float]
MemoryFn = Callable[[int, Unit], MemoryEffect]


def default_duration(rank: int, unit: Unit) -> float:
    """Forward 1, backward 2: the relative cost used where no cost model is given."""
    return 1.0 if unit.is_forward else 2.0


def simulate(
    programs: Sequence[Sequence[Action]],
    duration: Optional[DurationFn] = None,
    comm: Optional[CommFn] = None,
    memory: Optional[MemoryFn] = None,
    partners: Optional[Dict[Tuple[int, Unit], Tuple[int, Unit]]] = None,
) -> SimResult:
    """Run every rank's program (a unit list or a lowered program; see module doc).

    ``duration(rank, unit)`` -> seconds (default ``default_duration``);
    ``comm(src_rank, dst_rank, unit)`` -> seconds for the message that carries
    ``unit``'s output between ranks (0 if omitted); ``memory(rank, unit)`` ->
    ``MemoryEffect`` (memory traces are built only when given);
    ``partners[(rank, unit)] = (peer_rank, peer_unit)`` (given for both sides) makes
    the two units start together, at the later of their ready times.
    """
    timed = _Simulation(programs, duration or default_duration, comm, partners or {}).run()
    traces = None
    if memory is not None:
        traces = [memory_trace(rank_timed, memory) for rank_timed in timed]
    return SimResult(timed, traces)


class _Simulation:
    """One run of ``simulate``: each rank's position, clock and posted batch."""

    def __init__(self, programs, duration, comm, partners):
        self.programs = programs
        self.duration, self.comm, self.partners = duration, comm, partners
        self.pp_size = len(programs)
        units = [a for program in programs for a in program if isinstance(a, Unit)]
        self.num_chunks = 1 + max((u.chunk for u in units), default=0)
        self.num_splits = 1 + max((u.split for u in units), default=0)
        self.lowered = len(units) < sum(len(program) for program in programs)
        self.position = [0] * self.pp_size
        self.clock = [0.0] * self.pp_size
        self.timed: List[List[TimedUnit]] = [[] for _ in range(self.pp_size)]
        self.finished: Dict[Tuple[int, Unit], float] = {}  # (rank, unit) -> end
        self.arrived: Dict[Tuple[int, Unit], float] = {}  # lowered: (rank, unit) -> input
        self.waiting: Dict[Tuple[int, Unit], float] = {}  # paired unit ready, partner not
        self.pending: List[Optional[list]] = [None] * self.pp_size  # unmatched posted ops
        self.posted: Dict[Tuple[str, int, int], int] = {}  # ops so far per channel

    def run(self) -> List[List[TimedUnit]]:
        while True:
            progressed = False
            for rank in range(self.pp_size):
                program = self.programs[rank]
                while self.position[rank] < len(program):
                    action = program[self.position[rank]]
                    step = self._unit if isinstance(action, Unit) else self._batch
                    if not step(rank, action):
                        break
                    progressed = True
            progressed = self._match_messages() or progressed
            if all(self.position[r] == len(p) for r, p in enumerate(self.programs)):
                return self.timed
            if not progressed:
                raise ScheduleDeadlock(f"deadlock: the programs cannot proceed; next action "
                                       f"per rank: {self._next_actions()}")

    def _unit(self, rank: int, unit: Unit) -> bool:
        """Start ``unit`` (and its partner) if it can; False when it must wait."""
        ready = self.clock[rank]
        for dep_rank, dep in dependencies(rank, unit, self.pp_size, self.num_chunks,
                                          self.num_splits):
            if dep_rank == rank:
                if (rank, dep) not in self.finished:
                    raise ScheduleDeadlock(f"{unit} on rank {rank} runs before {dep}, which "
                                           "its rank runs later or never")
            elif self.lowered:
                if (rank, unit) not in self.arrived:
                    raise ScheduleError(f"{unit} on rank {rank} runs before its input arrived")
                ready = max(ready, self.arrived[(rank, unit)])
            elif (dep_rank, dep) not in self.finished:
                return False
            else:
                delay = self.comm(dep_rank, rank, dep) if self.comm is not None else 0.0
                ready = max(ready, self.finished[(dep_rank, dep)] + delay)
        partner = self.partners.get((rank, unit))
        if partner is None:
            starts = [(rank, unit, ready)]
        elif partner in self.waiting:
            start = max(ready, self.waiting.pop(partner))
            starts = [(rank, unit, start), partner + (start,)]
        else:
            self.waiting[(rank, unit)] = ready
            return False
        for run_rank, run_unit, start in starts:
            if (run_rank, run_unit) in self.finished:
                raise ScheduleDeadlock(f"unit {run_unit} appears twice on rank {run_rank}")
            end = start + self.duration(run_rank, run_unit)
            self.finished[(run_rank, run_unit)] = self.clock[run_rank] = end
            self.timed[run_rank].append(TimedUnit(run_rank, run_unit, start, end))
            self.position[run_rank] += 1
        return True

    def _batch(self, rank: int, batch) -> bool:
        """Post ``batch`` once; done (True) when every op in it has been matched."""
        if self.pending[rank] is None:
            self.pending[rank] = [self._post(rank, message) for message in batch]
        if self.pending[rank]:
            return False
        self.pending[rank] = None
        self.position[rank] += 1
        return True

    def _post(self, rank: int, message) -> list:
        channel = (rank, message.peer) if message.kind == SEND else (message.peer, rank)
        key = (message.kind,) + channel
        index = self.posted.get(key, 0)
        self.posted[key] = index + 1
        if message.kind == SEND:  # the tensor exists once the producing unit ran
            source = producer(message.unit, message.peer, self.pp_size, self.num_chunks)
            if source is None or source[0] != rank or (rank, source[1]) not in self.finished:
                raise ScheduleError(f"rank {rank} sends {message.unit}'s input before "
                                    "computing it")
        return [message, channel, index]

    def _match_messages(self) -> bool:
        """Complete every send whose receive is posted (FIFO per channel)."""
        progressed = False
        for rank in range(self.pp_size):
            for op in [op for op in (self.pending[rank] or []) if op[0].kind == SEND]:
                message, channel, index = op
                peer = message.peer
                match = next((other for other in (self.pending[peer] or [])
                              if other[0].kind == RECV and other[1:] == [channel, index]),
                             None)
                if match is None:
                    continue
                if match[0].unit != message.unit:
                    raise ScheduleError(f"FIFO mismatch on {rank}->{peer}: send for "
                                        f"{message.unit} would be received as {match[0].unit}")
                self.pending[rank].remove(op)
                self.pending[peer].remove(match)
                delay = 0.0
                if self.comm is not None:  # the message carries its producer's output
                    source = producer(message.unit, peer, self.pp_size, self.num_chunks)[1]
                    delay = self.comm(rank, peer, source)
                arrival = max(self.clock[rank], self.clock[peer]) + delay
                self.arrived[(peer, message.unit)] = arrival
                self.clock[rank] = self.clock[peer] = arrival
                progressed = True
        return progressed

    def _next_actions(self) -> Dict[int, str]:
        stuck = {}
        for rank, program in enumerate(self.programs):
            if self.position[rank] == len(program):
                continue
            action = program[self.position[rank]]
            if self.pending[rank]:
                stuck[rank] = "waits in " + format_action(tuple(op[0] for op in self.pending[rank]))
            elif (rank, action) in self.waiting:
                stuck[rank] = f"waits at {action} for its partner"
            else:
                stuck[rank] = format_action(action)
        return stuck


def memory_trace(timed: Sequence[TimedUnit], memory: MemoryFn) -> MemoryTrace:
    """Dynamic memory of one rank over time from its timed units."""
    events: List[Tuple[float, int, Dict[str, float]]] = []
    for order, t in enumerate(timed):
        effect = memory(t.rank, t.unit)
        start = dict(effect.at_start)
        for k, v in effect.transient.items():
            start[k] = start.get(k, 0.0) + v
        end = dict(effect.at_end)
        for k, v in effect.transient.items():
            end[k] = end.get(k, 0.0) - v
        # units on one rank do not overlap: an end at time T precedes a start at T
        events.append((t.start, 2 * order + 1, start))
        events.append((t.end, 2 * order + 2, end))
    events.sort(key=lambda e: (e[0], e[1]))
    names = sorted({k for _, _, delta in events for k in delta})
    current = {k: 0.0 for k in names}
    times, totals = [0.0], [0.0]
    comps = {k: [0.0] for k in names}
    for time, _, delta in events:
        for k, v in delta.items():
            current[k] += v
        if time == times[-1] and len(times) > 1 and sum(current.values()) >= totals[-1]:
            # same instant (one unit ends as the next starts): keep the later, larger value
            times.pop(), totals.pop()
            for k in names:
                comps[k].pop()
        times.append(time)
        totals.append(sum(current.values()))
        for k in names:
            comps[k].append(current[k])
    return MemoryTrace(times, totals, comps)
