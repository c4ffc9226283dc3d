"""SlimPipe's attention workload redistribution as data (`--slimpipe-attention-balance`).

Uniform slices are unequal in attention work: slice ``j`` attends over ``j`` prefix
slices plus its own causal block, so with ``n`` slices the last one does about
``2 n`` times the attention of the first. Units that run at the same time on
different ranks therefore take different times and the pipeline waits for the slow
one. Redistribution pairs such units: the heavy unit (*asker*) hands its query slice
and the K/V of its first ``k`` prefix slices to the light unit's rank (*helper*),
which computes that part of the attention and returns the partial output with its
log-sum-exp (forward) or the gradients of the query and of those K/V chunks
(backward); the asker merges. Every layer of the two units does one such exchange,
so the two units run together.

This module decides *which* units pair and *how many* chunks move, for every rank,
from the SlimPipe unit lists alone (so every rank computes the same plan):

* unit times come from a relative cost model of uniform slices (``SliceCosts``:
  position-independent work per slice vs attention work per prefix chunk, from the
  model's FLOPs, and the exchange's communication as given by the user or the
  planner), run through the simulator (``megatron.schedules.simulate``) with paired
  units starting together;
* greedily, the heaviest unpaired unit with prefix chunks is paired with the lightest
  unpaired unit on another rank that overlaps it in time, moving the number of chunks
  that best evens the two; the pair is kept only if the simulated iteration gets
  shorter (or equally long with every unit finishing earlier in total);
* the executor lowers the unit lists on plain SlimPipe's timed run with the pairs
  starting together (``lowering.lower(times=...)``), so paired units meet
  without deadlock and every other message keeps its place; ``simulate`` verifies
  the lowered programs with the pairs as rendezvous.
"""

import bisect
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Dict, List, Optional, Sequence, Tuple

from megatron.schedules.actions import Unit
from megatron.schedules.lowering import lower
from megatron.schedules.simulate import ScheduleDeadlock, simulate
from megatron.schedules.slimpipe import slimpipe_rank_units
from megatron.seqsplit.attention_exchange import ASK, HELP
# Pairs tried per plan, each one simulation of the whole schedule: up to MAX_TRIALS,
# fewer for large schedules (SIMULATED_UNITS_BUDGET units simulated in all), never
# fewer than MIN_TRIALS. Deterministic, so every rank gets the same plan.
MAX_TRIALS, MIN_TRIALS, SIMULATED_UNITS_BUDGET = 1024, 64, 2_000_000

# Backward attention costs about 2.5x its forward (dQ, dK, dV and the recomputed
# scores); backward GEMMs 2x (input and weight gradients).
BACKWARD_GEMM_FACTOR = 2.0
BACKWARD_ATTENTION_FACTOR = 2.5


@dataclass(frozen=True)
class SliceCosts:
    """Relative time of one uniform slice's forward on one rank.

    ``gemm``: position-independent work (projections, MLP, norms), in units of the
    attention of one query slice over one full key slice (one *chunk*). Slice ``j``'s
    forward costs ``gemm + j + own_block``: ``j`` prefix chunks and its own causal block,
    ``l (l + 1) / 2`` of a chunk's ``l^2`` pairs (``ModelShape.causal_pairs``; 0.5 in the
    limit of long slices, the default). ``exchange``: time to send one K/V chunk to the paired rank, in the same
    units (``--slimpipe-attention-balance-exchange-cost``; 0: free); the query slice
    there and the partial output back cost ``query_exchange`` more per exchange, and a
    backward exchange twice a forward one (its gradients come back).
    """

    gemm: float
    exchange: float = 0.0
    query_exchange: float = 0.0
    own_block: float = 0.5

    @staticmethod
    def from_model(model, slice_length: int, exchange: float = 0.0) -> "SliceCosts":
        """From a ``megatron.model_shape.ModelShape``: a layer's linear FLOPs per token
        against its attention FLOPs per token and chunk of ``l`` keys (``l`` causal pairs).
        ``exchange`` is per K/V chunk (``2 g d`` values per token); the query slice and
        the output (``hq d`` values per token each) cost ``exchange hq / g``."""
        if exchange < 0:
            raise ValueError(f"the exchange cost must be >= 0, got {exchange}")
        linear = model.layer_flops_per_token()
        per_chunk = model.layer_flops_per_pair() * slice_length
        query = exchange * model.num_attention_heads / model.num_query_groups
        own_block = model.causal_pairs(slice_length) / slice_length**2
        return SliceCosts(gemm=linear / per_chunk, exchange=exchange, query_exchange=query,
                          own_block=own_block)


@dataclass(frozen=True)
class Offload:
    """One side of a pair: what a unit does for (or asks of) another rank's unit.

    ``asker`` is the unit whose attention is split (this rank's unit when ``role`` is
    ``ASK``, the peer's when ``HELP``); the helper computes its queries against the
    asker's prefix chunks ``0..num_chunks-1``, which lie entirely before the queries.
    """

    role: str
    peer: int  # pipeline rank on the other end
    peer_unit: Unit
    asker: Unit
    num_chunks: int


def _factors(unit: Unit) -> Tuple[float, float]:
    if unit.is_forward:
        return 1.0, 1.0
    return BACKWARD_GEMM_FACTOR, BACKWARD_ATTENTION_FACTOR


def unit_cost(unit: Unit, costs: SliceCosts) -> float:
    """Time of a unit without redistribution."""
    gemm, attention = _factors(unit)
    return gemm * costs.gemm + attention * (unit.split + costs.own_block)


def paired_cost(asker: Unit, helper: Unit, num_chunks: int, costs: SliceCosts) -> float:
    """Time of two paired units: they exchange in every layer, so both take the longer
    of the asker without the moved chunks and the helper with them."""
    _, asker_attention = _factors(asker)
    moved = num_chunks * asker_attention
    return (max(unit_cost(asker, costs) - moved, unit_cost(helper, costs) + moved)
            + exchange_cost(asker, num_chunks, costs))


def exchange_cost(asker: Unit, num_chunks: int, costs: SliceCosts) -> float:
    """Communication of one pair in the plan's units (the partners wait for it)."""
    per_direction = costs.query_exchange + num_chunks * costs.exchange
    return per_direction if asker.is_forward else 2 * per_direction


def _best_num_chunks(asker: Unit, helper: Unit, costs: SliceCosts) -> int:
    _, asker_attention = _factors(asker)
    gap = unit_cost(asker, costs) - unit_cost(helper, costs)
    return max(0, min(asker.split, round(gap / (2 * asker_attention))))


@dataclass(frozen=True)
class BalancedSchedule:
    """SlimPipe's unit lists with the redistribution pairs and their timeline."""

    units: Tuple[Tuple[Unit, ...], ...]  # per rank, SlimPipe's order (unchanged)
    offloads: Tuple[Dict[Unit, Offload], ...]  # per rank: unit -> its side of a pair
    start: Dict[Tuple[int, Unit], float]
    end: Dict[Tuple[int, Unit], float]
    makespan: float
    makespan_unbalanced: float
    costs: SliceCosts  # the cost model the pairs were chosen with

    def partners(self) -> Dict[Tuple[int, Unit], Tuple[int, Unit]]:
        return {(rank, unit): (o.peer, o.peer_unit)
                for rank, offloads in enumerate(self.offloads) for unit, o in offloads.items()}


def _simulate(units, pairs: Dict[Tuple[int, Unit], Tuple[int, Unit, Unit, int]], costs):
    """pairs[(rank, unit)] = (peer, peer_unit, asker, num_chunks), both sides."""

    def duration(rank, unit):
        pair = pairs.get((rank, unit))
        if pair is None:
            return unit_cost(unit, costs)
        _, peer_unit, asker, k = pair
        return paired_cost(asker, peer_unit if asker == unit else unit, k, costs)

    partners = {key: (peer, peer_unit) for key, (peer, peer_unit, _, _) in pairs.items()}
    return simulate(units, duration, partners=partners)


def _objective(sim) -> Tuple[float, float]:
    # shorter iteration first; at equal length, every unit finishing earlier in total
    return (round(sim.makespan, 9), sum(t.end for timed in sim.ranks for t in timed))


def default_trials(units: Sequence[Sequence[Unit]]) -> int:
    total = sum(len(rank_units) for rank_units in units)
    return max(MIN_TRIALS, min(MAX_TRIALS, SIMULATED_UNITS_BUDGET // max(total, 1)))


def balance_units(units: Sequence[Sequence[Unit]], costs: SliceCosts,
                  max_trials: Optional[int] = None) -> BalancedSchedule:
    """Pair units of ``units`` (every rank's list) greedily; see the module doc.

    Each trial simulates the whole schedule with one more pair and keeps the pair only
    if the objective improves, so the plan is never slower than no pairing in the cost
    model. ``max_trials`` bounds the work (default: ``default_trials``; deterministic, so
    every rank gets the same plan).
    """
    units = tuple(tuple(rank_units) for rank_units in units)
    if max_trials is None:
        max_trials = default_trials(units)
    pairs: Dict[Tuple[int, Unit], Tuple[int, Unit, Unit, int]] = {}
    sim = _simulate(units, pairs, costs)
    unbalanced = sim.makespan
    best = _objective(sim)
    tried = set()
    for _ in range(max_trials):
        candidate = _next_candidate(sim, pairs, tried, costs)
        if candidate is None:
            break
        (rank_a, asker), (rank_h, helper), k = candidate
        tried.add((rank_a, asker))
        trial = dict(pairs)
        trial[(rank_a, asker)] = (rank_h, helper, asker, k)
        trial[(rank_h, helper)] = (rank_a, asker, asker, k)
        try:
            trial_sim = _simulate(units, trial, costs)
        except ScheduleDeadlock:
            continue
        if _objective(trial_sim) < best:
            pairs, sim, best = trial, trial_sim, _objective(trial_sim)
    offloads: List[Dict[Unit, Offload]] = [{} for _ in units]
    for (rank, unit), (peer, peer_unit, asker, k) in pairs.items():
        role = ASK if unit == asker else HELP
        offloads[rank][unit] = Offload(role, peer, peer_unit, asker, k)
    start = {(t.rank, t.unit): t.start for timed in sim.ranks for t in timed}
    end = {(t.rank, t.unit): t.end for timed in sim.ranks for t in timed}
    # read-only: plans are cached and shared by every caller
    return BalancedSchedule(units, tuple(MappingProxyType(o) for o in offloads),
                            MappingProxyType(start), MappingProxyType(end), sim.makespan,
                            unbalanced, costs)


def _next_candidate(sim, pairs, tried, costs):
    """The heaviest untried, unpaired unit with prefix chunks and the lightest unpaired
    unit of another rank overlapping it in time, if moving chunks evens them."""
    timed = [t for rank_timed in sim.ranks for t in rank_timed
             if (t.rank, t.unit) not in pairs]
    askers = sorted((t for t in timed if t.unit.split > 0 and (t.rank, t.unit) not in tried),
                    key=lambda t: (-unit_cost(t.unit, costs), t.start, t.rank))
    by_rank = [sorted((t for t in timed if t.rank == r), key=lambda t: t.start)
               for r in range(len(sim.ranks))]
    for a in askers:
        overlapping = [t for r, rank_timed in enumerate(by_rank) if r != a.rank
                       for t in _overlapping(rank_timed, a.start, a.end)]
        if not overlapping:
            continue
        h = min(overlapping, key=lambda t: (unit_cost(t.unit, costs), t.start, t.rank))
        k = _best_num_chunks(a.unit, h.unit, costs)
        if k >= 1:
            return (a.rank, a.unit), (h.rank, h.unit), k
        tried.add((a.rank, a.unit))
    return None


def _overlapping(rank_timed, begin, finish):
    """Units of one rank (sorted by start) that overlap [begin, finish)."""
    starts = [t.start for t in rank_timed]
    i = max(0, bisect.bisect_right(starts, begin) - 1)
    out = []
    while i < len(rank_timed) and rank_timed[i].start < finish - 1e-9:
        if rank_timed[i].end > begin + 1e-9:
            out.append(rank_timed[i])
        i += 1
    return out


@lru_cache(maxsize=32)
def balanced_slimpipe(pp_size: int, num_microbatches: int, num_chunks: int, num_slices: int,
                      costs: SliceCosts) -> BalancedSchedule:
    """SlimPipe's schedule with attention redistribution pairs."""
    units = [slimpipe_rank_units(r, pp_size, num_microbatches, num_chunks, num_slices)
             for r in range(pp_size)]
    return balance_units(units, costs)


@lru_cache(maxsize=32)
def checked_balanced_programs(pp_size: int, num_microbatches: int, num_chunks: int,
                              num_slices: int, costs: SliceCosts):
    """(every rank's lowered program, the balanced schedule), checked by
    ``simulate`` with the pairs as rendezvous."""
    plan = balanced_slimpipe(pp_size, num_microbatches, num_chunks, num_slices, costs)
    # Lower on the timed run plain SlimPipe is lowered on (forward 1, backward 2), with
    # the pairs starting together: messages stay where they are without balancing
    # (lowering on the cost model's timeline moved them and made ranks wait longer for
    # each other, measured), and a rendezvous is only ever added, never reordered around.
    # Whether pairs can meet depends on the orders, not the durations, so this cannot
    # fail where the plan's simulation did not.
    sim = simulate(plan.units, partners=plan.partners())
    start = {(t.rank, t.unit): t.start for timed in sim.ranks for t in timed}
    end = {(t.rank, t.unit): t.end for timed in sim.ranks for t in timed}
    programs = tuple(tuple(p) for p in lower(plan.units, num_chunks, times=(start, end)))
    simulate(programs, partners=plan.partners())
    return programs, plan


def moved_fraction(plan: BalancedSchedule) -> Optional[float]:
    """Share of all attention work (in chunk units, backward weighted) that moves."""
    total = moved = 0.0
    for rank_units, offloads in zip(plan.units, plan.offloads):
        for unit in rank_units:
            _, attention = _factors(unit)
            total += attention * (unit.split + plan.costs.own_block)
            o = offloads.get(unit)
            if o is not None and o.role == ASK:
                moved += attention * o.num_chunks
    return moved / total if total else None


def describe(plan: BalancedSchedule) -> str:
    """One line for the training log."""
    pairs = sum(len(o) for o in plan.offloads) // 2
    moved = moved_fraction(plan) or 0.0
    return (f"attention balance: {pairs} pairs, {100 * moved:.1f}% of the attention work "
            f"moved, iteration {plan.makespan_unbalanced / plan.makespan:.3f}x shorter in "
            "the plan's cost model")
