"""Seq1F1B's unit order, and the 1F1B pattern every schedule here shares.

A schedule is, for every pipeline rank, an ordered list of compute units
(``megatron.schedules.actions.Unit``). The executor runs it (after
``megatron.schedules.lowering``), the planner times it and the tests check its
invariants: all of them read the lists built here, in ``interleaved`` and in
``slimpipe``, so each schedule's order is defined once.

Seq1F1B (arXiv 2406.03488) cuts every microbatch into ``s`` sequence splits and
runs Megatron's 1F1B over ``(microbatch, split)`` units:

* forwards run splits in order ``0..s-1`` (split ``j`` attends over the K/V of
  splits ``< j``), microbatches in order;
* backwards run splits in reverse order inside a microbatch (split ``j``'s
  backward produces the gradient for the K/V of splits ``< j``), microbatches
  first-in first-out;
* rank ``r`` runs ``min(p - r - 1 + s - 1, m * s)`` warm-up forwards, then
  alternates one forward with one backward, then drains the backwards.

With ``s = 1`` this is exactly megatron-core's non-interleaved 1F1B.
"""

from typing import List, Sequence

from megatron.schedules.actions import BACKWARD, FORWARD, Unit


def check_positive_shape(pp_size: int, num_microbatches: int, num_chunks: int,
                         num_items: int, items_flag: str = "--seq1f1b-splits") -> None:
    """Every count of a schedule is at least 1 (errors name the flag)."""
    if pp_size < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be >= 1, got {pp_size}")
    if num_chunks < 1:
        raise ValueError(f"number of virtual pipeline stages must be >= 1, got {num_chunks}")
    if num_microbatches < 1:
        raise ValueError(f"number of microbatches must be >= 1, got {num_microbatches}")
    if num_items < 1:
        raise ValueError(f"{items_flag} must be >= 1, got {num_items}")


def _check_shape(pp_size: int, num_microbatches: int, num_splits: int) -> None:
    check_positive_shape(pp_size, num_microbatches, 1, num_splits)


def in_flight_peak(units) -> int:
    """Most forward units whose backward has not run yet, over one rank's unit list."""
    alive = peak = 0
    for unit in units:
        alive += 1 if unit.is_forward else -1
        peak = max(peak, alive)
    return peak


def forward_order(num_microbatches: int, num_splits: int) -> List[Unit]:
    """Forward units in the order every rank runs them."""
    return [
        Unit(FORWARD, mb, split)
        for mb in range(num_microbatches)
        for split in range(num_splits)
    ]


def backward_order(num_microbatches: int, num_splits: int) -> List[Unit]:
    """Backward units in the order every rank runs them (splits reversed, microbatches FIFO)."""
    return [
        Unit(BACKWARD, mb, split)
        for mb in range(num_microbatches)
        for split in reversed(range(num_splits))
    ]


def num_warmup_units(rank: int, pp_size: int, num_microbatches: int, num_splits: int) -> int:
    """Forward units rank ``rank`` runs before its first backward."""
    _check_shape(pp_size, num_microbatches, num_splits)
    return min(pp_size - rank - 1 + num_splits - 1, num_microbatches * num_splits)


def seq1f1b_rank_units(
    rank: int, pp_size: int, num_microbatches: int, num_splits: int = 1
) -> List[Unit]:
    """Ordered compute units of one rank under Seq1F1B (1F1B when ``num_splits == 1``)."""
    if not 0 <= rank < pp_size:
        raise ValueError(f"rank {rank} outside pipeline of size {pp_size}")
    return one_forward_one_backward(
        forward_order(num_microbatches, num_splits), backward_order(num_microbatches, num_splits),
        num_warmup_units(rank, pp_size, num_microbatches, num_splits))


def one_forward_one_backward(forwards: Sequence[Unit], backwards: Sequence[Unit],
                             warmup: int) -> List[Unit]:
    """1F1B: ``warmup`` forwards, then one forward and one backward in turn, then the
    remaining backwards (every schedule here: Seq1F1B, interleaved, SlimPipe)."""
    units = list(forwards[:warmup])
    for forward, backward in zip(forwards[warmup:], backwards):
        units += [forward, backward]
    units += backwards[len(forwards) - warmup:]
    return units


def seq1f1b_schedule(
    pp_size: int, num_microbatches: int, num_splits: int = 1
) -> List[List[Unit]]:
    """Every rank's ordered compute units under Seq1F1B."""
    return [
        seq1f1b_rank_units(rank, pp_size, num_microbatches, num_splits)
        for rank in range(pp_size)
    ]


def forward_only_rank_units(num_microbatches: int, num_splits: int = 1) -> List[Unit]:
    """Evaluation: forwards only, in order."""
    _check_shape(1, num_microbatches, num_splits)
    return forward_order(num_microbatches, num_splits)
