"""Recorded timelines: the JSON format shared by the simulator, the executor and the drawing.

Format (times in seconds, from any common origin; ``chunk`` is the virtual stage)::

    {
      "ranks": [
        [{"kind": "F", "microbatch": 0, "split": 0, "chunk": 0, "start": 0.0, "end": 0.012},
         {"kind": "B", ...}, ...],          # pipeline rank 0, in execution order
        [...],                              # pipeline rank 1
        ...
      ],
      "meta": {"source": "simulated" | "recorded", "schedule": "seq1f1b", ...}
    }

``kind`` is ``"F"`` (forward) or ``"B"`` (backward). Optional record keys: ``wait``
(seconds inside the unit spent waiting, e.g. for the partner of a SlimPipe attention
redistribution pair; counted as bubble), ``role`` (``"ask"`` / ``"help"``) and
``peer`` (the partner's pipeline rank) for paired units. ``meta`` is free-form (a training run's
also holds ``stage_layers``, the layers of each pipeline rank); the drawing reads ``title``, ``schedule``, ``pp``, ``microbatches`` and ``splits`` when
present. ``to_chrome_trace`` converts a timeline to the Chrome trace event format
(``chrome://tracing``, Perfetto): one process per pipeline rank, complete events in
microseconds.

Recording in the executor::

    recorder = TimelineRecorder(rank=pp_rank, sync=torch.cuda.synchronize)
    recorder.reset()                      # at the start of the iteration to record
    with recorder.record(unit):           # around each unit's forward / backward
        ...
    # or pass it as an observer: on_unit_start(rank, unit) / on_unit_end(rank, unit)
    recorder.gather_and_write(path, group=pp_group)   # collective; rank 0 writes
"""

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence

KEYS = ("kind", "microbatch", "split", "chunk", "start", "end")


class TraceFormatError(ValueError):
    """A timeline file that does not follow the format above."""


@dataclass
class Timeline:
    """Per-rank lists of unit records (dicts with ``KEYS``) plus free-form meta."""

    ranks: List[List[Dict]]
    meta: Dict = field(default_factory=dict)

    @property
    def pp_size(self) -> int:
        return len(self.ranks)

    @property
    def span(self) -> float:
        starts = [e["start"] for r in self.ranks for e in r]
        ends = [e["end"] for r in self.ranks for e in r]
        return (max(ends) - min(starts)) if ends else 0.0

    def to_dict(self) -> Dict:
        return {"ranks": self.ranks, "meta": self.meta}

    def bubble_fraction(self) -> float:
        """Idle share: 1 - (unit time less its ``wait``) / (ranks x span)."""
        span = self.span
        if span <= 0:
            return 0.0
        busy = sum(e["end"] - e["start"] - e.get("wait", 0.0) for r in self.ranks for e in r)
        return 1.0 - busy / (self.pp_size * span)


def record(kind: str, microbatch: int, split: int, chunk: int, start: float, end: float) -> Dict:
    return {
        "kind": kind,
        "microbatch": int(microbatch),
        "split": int(split),
        "chunk": int(chunk),
        "start": float(start),
        "end": float(end),
    }


def from_simulation(sim, meta: Optional[Dict] = None, extra: Optional[Dict] = None) -> Timeline:
    """Timeline of a ``simulate.SimResult``; ``extra[(rank, unit)]`` adds optional
    record keys (``wait``, ``role``, ``peer``) to that unit's record."""
    extra = extra or {}
    ranks = [
        [
            dict(record(t.unit.kind, t.unit.microbatch, t.unit.split, t.unit.chunk, t.start, t.end),
                 **extra.get((t.rank, t.unit), {}))
            for t in rank_units
        ]
        for rank_units in sim.ranks
    ]
    return Timeline(ranks, dict({"source": "simulated"}, **(meta or {})))


def validate(data) -> Timeline:
    """Check a decoded JSON object and return it as a ``Timeline``."""
    if not isinstance(data, dict) or not isinstance(data.get("ranks"), list):
        raise TraceFormatError('a timeline is a JSON object with a "ranks" list')
    ranks = []
    for r, events in enumerate(data["ranks"]):
        if not isinstance(events, list):
            raise TraceFormatError(f"ranks[{r}] must be a list of unit records")
        out = []
        for i, e in enumerate(events):
            if not isinstance(e, dict):
                raise TraceFormatError(f"ranks[{r}][{i}] must be an object")
            missing = [k for k in KEYS if k not in e]
            if missing:
                raise TraceFormatError(f"ranks[{r}][{i}] lacks {', '.join(missing)}")
            if e["kind"] not in ("F", "B"):
                raise TraceFormatError(f"ranks[{r}][{i}].kind must be 'F' or 'B', got {e['kind']!r}")
            if float(e["end"]) < float(e["start"]):
                raise TraceFormatError(f"ranks[{r}][{i}] ends before it starts")
            out.append(dict(e, **record(*(e[k] for k in KEYS))))
        ranks.append(out)
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        raise TraceFormatError('"meta" must be an object')
    return Timeline(ranks, meta)


def _create_parent(path: str) -> None:
    """A `--timeline-file runs/x/t.json` whose folder does not exist yet is created, as
    Megatron-LM does for its output paths, rather than failing after training."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def write_timeline(path: str, timeline: Timeline) -> None:
    _create_parent(path)
    with open(path, "w") as f:
        json.dump(timeline.to_dict(), f, indent=1)


def read_timeline(path: str) -> Timeline:
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as err:
            raise TraceFormatError(f"{path} is not JSON: {err}") from None
    return validate(data)


def to_chrome_trace(timeline: Timeline) -> Dict:
    """Chrome trace event format: one process per rank, one complete event per unit."""
    events = []
    origin = min((e["start"] for r in timeline.ranks for e in r), default=0.0)
    for rank, units in enumerate(timeline.ranks):
        events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
             "args": {"name": f"pipeline rank {rank}"}}
        )
        for e in units:
            name = f"{e['kind']}{e['microbatch']}.{e['split']}"
            if e["chunk"]:
                name += f"c{e['chunk']}"
            events.append(
                {
                    "name": name,
                    "cat": "forward" if e["kind"] == "F" else "backward",
                    "ph": "X",
                    "pid": rank,
                    "tid": 0,
                    "ts": (e["start"] - origin) * 1e6,
                    "dur": (e["end"] - e["start"]) * 1e6,
                    "args": {k: e[k] for k in ("microbatch", "split", "chunk", "role", "peer", "wait")
                             if k in e},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": timeline.meta}


def write_chrome_trace(path: str, timeline: Timeline) -> None:
    _create_parent(path)
    with open(path, "w") as f:
        json.dump(to_chrome_trace(timeline), f)


def chrome_trace_path(path: str) -> str:
    """``run.json`` -> ``run.chrome.json`` (where the executor writes the Chrome trace)."""
    return (path[:-5] if path.endswith(".json") else path) + ".chrome.json"


class TimelineRecorder:
    """Records the start and end of each unit on one pipeline rank.

    Times come from ``clock`` (default ``time.time``: one wall clock shared by the
    processes of a host and, up to NTP skew, across hosts), so ranks recorded in
    different processes line up; ``gather_and_write`` shifts them so the earliest
    unit of any rank starts at 0. ``sync`` (e.g. ``torch.cuda.synchronize``) is
    called before reading the clock so that a unit's GPU work lies inside its
    interval; it removes compute/communication overlap, so use it for timeline runs.
    """

    def __init__(self, rank: int = 0, sync: Optional[Callable[[], None]] = None,
                 clock: Callable[[], float] = time.time):
        self.rank, self.sync, self.clock = rank, sync, clock
        self.events: List[Dict] = []
        self._open = None

    def _now(self) -> float:
        if self.sync is not None:
            self.sync()
        return self.clock()

    def start(self) -> None:
        """Kept for symmetry with ``reset``; recording needs no explicit start."""

    def reset(self) -> None:
        """Forget recorded units (e.g. at each iteration start, so that the written
        timeline holds one iteration)."""
        self.events = []
        self._open = None

    @contextmanager
    def record(self, unit):
        """Time ``unit`` (anything with kind, microbatch, split, chunk)."""
        begin = self._now()
        try:
            yield
        finally:
            self.events.append(
                record(unit.kind, unit.microbatch, getattr(unit, "split", 0),
                       getattr(unit, "chunk", 0), begin, self._now())
            )

    # Observer interface of the executor (ScheduleSettings.observers):
    # on_unit_start(rank, unit) / on_unit_end(rank, unit).
    def on_unit_start(self, rank, unit) -> None:
        self._open = (unit, self._now())

    def on_unit_end(self, rank, unit) -> None:
        opened = self._open
        if opened is None or opened[0] != unit:
            raise RuntimeError(f"on_unit_end({unit}) without a matching on_unit_start")
        self._open = None
        self.events.append(
            record(unit.kind, unit.microbatch, getattr(unit, "split", 0),
                   getattr(unit, "chunk", 0), opened[1], self._now())
        )

    def add(self, kind, microbatch, split, chunk, start, end) -> None:
        self.events.append(record(kind, microbatch, split, chunk, start, end))

    def gather_and_write(self, path: str, group=None, meta: Optional[Dict] = None,
                         chrome: bool = True) -> Optional[Timeline]:
        """Collective over the pipeline group: rank 0 of ``group`` writes the timeline
        (and, with ``chrome``, ``chrome_trace_path(path)``). Without torch.distributed
        (or with one process) this rank's events are written as rank ``self.rank``.
        Times are shifted so that the earliest recorded start is 0."""
        try:
            import torch.distributed as dist

            distributed = dist.is_available() and dist.is_initialized()
        except ImportError:  # pragma: no cover
            distributed = False
        if distributed:
            gathered = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, (self.rank, self.events), group=group)
            if dist.get_rank(group) != 0:
                return None
        else:
            gathered = [(self.rank, self.events)]
        timeline = Timeline(shift_to_zero(merge_ranks(gathered)),
                            dict({"source": "recorded"}, **(meta or {})))
        write_timeline(path, timeline)
        if chrome:
            write_chrome_trace(chrome_trace_path(path), timeline)
        return timeline


def shift_to_zero(ranks: List[List[Dict]]) -> List[List[Dict]]:
    """The same records with times relative to the earliest start."""
    origin = min((e["start"] for r in ranks for e in r), default=0.0)
    return [[dict(e, start=e["start"] - origin, end=e["end"] - origin) for e in r] for r in ranks]


def merge_ranks(per_rank: Iterable) -> List[List[Dict]]:
    """``[(rank, events), ...]`` -> ``ranks`` list indexed by rank (missing ranks empty)."""
    items = list(per_rank)
    size = 1 + max((r for r, _ in items), default=-1)
    ranks: List[List[Dict]] = [[] for _ in range(size)]
    for r, events in items:
        ranks[r] = sorted(events, key=lambda e: e["start"])
    return ranks


def per_rank_files_to_timeline(paths: Sequence[str], meta: Optional[Dict] = None) -> Timeline:
    """Merge per-rank files (each a Timeline with one non-empty rank or a plain list)."""
    items = []
    for i, path in enumerate(paths):
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, list):
            items.append((i, data))
        else:
            tl = validate(data)
            for r, events in enumerate(tl.ranks):
                if events:
                    items.append((r, events))
    return Timeline(merge_ranks(items), dict(meta or {}))
