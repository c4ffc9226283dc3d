"""Event simulation of a pipeline schedule: per-unit start/end and memory over time.

Input: every rank's ordered unit list (from ``megatron.schedules``), a duration for
each unit, a delay for each point-to-point message and, optionally, the memory each
unit allocates and frees. Each rank runs its units in list order; a unit starts when
the rank is free and every unit it depends on has finished and its message arrived:

* forward ``(mb, split, chunk)`` on rank ``r`` needs the same forward on rank ``r - 1``;
  on rank 0 with ``chunk > 0`` it needs the forward of ``chunk - 1`` on rank ``p - 1``;
  split ``j > 0`` also needs split ``j - 1``'s forward on the same rank (K/V prefix);
* backward on rank ``r`` needs the same backward on rank ``r + 1``; on rank ``p - 1``
  with ``chunk < v - 1`` the backward of ``chunk + 1`` on rank 0; the very last stage
  needs its own forward; split ``j < s - 1`` also needs split ``j + 1``'s backward on the
  same rank (it deposits split ``j``'s K/V gradient).

Sends are asynchronous (a message waits at the receiver until it is used), which is
the standard model for pipeline timelines. ``partners`` pairs units of two ranks that
must run at the same time (SlimPipe's attention redistribution exchanges data inside
them): each starts when both ranks are ready for it. An order in which some unit waits for a
unit later in its own rank's list (or on a cycle across ranks) raises
``ScheduleDeadlock``.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megatron.schedules.units import BACKWARD, FORWARD, Unit


class ScheduleDeadlock(RuntimeError):
    """The unit lists cannot all run: some unit waits forever."""


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


def _key(unit: Unit, kind: str, split: int, chunk: int) -> Tuple[str, int, int, int]:
    return (kind, unit.microbatch, split, chunk)


def dependencies(
    rank: int, unit: Unit, pp_size: int, num_chunks: int, num_splits: int
) -> List[Tuple[int, Tuple[str, int, int, int]]]:
    """(rank, unit key) pairs that must finish before ``unit`` may start on ``rank``."""
    deps = []
    j, c = unit.split, unit.chunk
    if unit.kind == FORWARD:
        if rank > 0:
            deps.append((rank - 1, _key(unit, FORWARD, j, c)))
        elif c > 0:
            deps.append((pp_size - 1, _key(unit, FORWARD, j, c - 1)))
        if j > 0:
            deps.append((rank, _key(unit, FORWARD, j - 1, c)))
    else:
        if rank < pp_size - 1:
            deps.append((rank + 1, _key(unit, BACKWARD, j, c)))
        elif c < num_chunks - 1:
            deps.append((0, _key(unit, BACKWARD, j, c + 1)))
        else:
            deps.append((rank, _key(unit, FORWARD, j, c)))
        if j < num_splits - 1:
            deps.append((rank, _key(unit, BACKWARD, j + 1, c)))
    return deps


DurationFn = Callable[[int, Unit], float]
CommFn = Callable[[int, int, Unit], float]
MemoryFn = Callable[[int, Unit], MemoryEffect]


def simulate(
    schedule: Sequence[Sequence[Unit]],
    duration: DurationFn,
    comm: Optional[CommFn] = None,
    memory: Optional[MemoryFn] = None,
    partners: Optional[Dict[Tuple[int, Unit], Tuple[int, Unit]]] = None,
) -> SimResult:
    """Time every rank's unit list.

    ``duration(rank, unit)`` -> seconds; ``comm(src_rank, dst_rank, unit)`` -> seconds
    for the message that carries ``unit``'s output (activation for forwards, input
    gradient for backwards) between ranks (0 if omitted; messages inside a rank are
    free); ``memory(rank, unit)`` -> ``MemoryEffect`` (memory traces are built only
    when given); ``partners[(rank, unit)] = (peer_rank, peer_unit)`` (given for both
    sides) makes the two units start together, at the later of their ready times.
    """
    partners = partners or {}
    waiting: Dict[Tuple[int, Unit], float] = {}  # paired units ready, partner not yet
    pp_size = len(schedule)
    num_chunks = 1 + max((u.chunk for units in schedule for u in units), default=0)
    num_splits = 1 + max((u.split for units in schedule for u in units), default=0)
    finished: Dict[Tuple[int, Tuple[str, int, int, int]], float] = {}
    position = [0] * pp_size
    clock = [0.0] * pp_size
    timed: List[List[TimedUnit]] = [[] for _ in range(pp_size)]
    total = sum(len(units) for units in schedule)
    done = 0
    while done < total:
        progressed = False
        for rank in range(pp_size):
            units = schedule[rank]
            while position[rank] < len(units):
                unit = units[position[rank]]
                ready = clock[rank]
                blocked = False
                for dep_rank, key in dependencies(rank, unit, pp_size, num_chunks, num_splits):
                    end = finished.get((dep_rank, key))
                    if end is None:
                        blocked = True
                        break
                    if dep_rank != rank and comm is not None:
                        dep_unit = Unit(key[0], key[1], key[2], key[3])
                        end += comm(dep_rank, rank, dep_unit)
                    ready = max(ready, end)
                if blocked:
                    break
                partner = partners.get((rank, unit))
                if partner is None:
                    starts = [(rank, unit, ready)]
                elif partner in waiting:
                    start = max(ready, waiting.pop(partner))
                    starts = [(rank, unit, start), partner + (start,)]
                else:
                    waiting[(rank, unit)] = ready
                    break
                for run_rank, run_unit, start in starts:
                    end = start + duration(run_rank, run_unit)
                    key = (run_unit.kind, run_unit.microbatch, run_unit.split, run_unit.chunk)
                    if (run_rank, key) in finished:
                        raise ScheduleDeadlock(f"unit {run_unit} appears twice on rank {run_rank}")
                    finished[(run_rank, key)] = end
                    timed[run_rank].append(TimedUnit(run_rank, run_unit, start, end))
                    clock[run_rank] = end
                    position[run_rank] += 1
                    done += 1
                progressed = True
        if not progressed:
            stuck = {
                r: str(schedule[r][position[r]])
                for r in range(pp_size)
                if position[r] < len(schedule[r])
            }
            raise ScheduleDeadlock(f"schedule cannot proceed; next units per rank: {stuck}")
    traces = None
    if memory is not None:
        traces = [memory_trace(timed[r], memory) for r in range(pp_size)]
    return SimResult(timed, traces)


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
