"""The pipeline schedule as data.

A schedule is, for every pipeline rank, an ordered list of compute units
``(kind, microbatch, split, chunk)``. The executor runs it, the planner times it,
the drawing code draws it and the tests check its invariants: all of them read
the lists built here, so there is exactly one definition of each schedule.

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

from dataclasses import dataclass
from typing import List, Tuple

FORWARD = "F"
BACKWARD = "B"


@dataclass(frozen=True, order=True)
class Unit:
    """One forward or backward pass of one split of one microbatch on one model chunk."""

    kind: str
    microbatch: int
    split: int = 0
    chunk: int = 0

    @property
    def is_forward(self) -> bool:
        return self.kind == FORWARD

    def __str__(self) -> str:
        chunk = f"c{self.chunk}" if self.chunk else ""
        return f"{self.kind}{self.microbatch}.{self.split}{chunk}"


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
    forwards = forward_order(num_microbatches, num_splits)
    backwards = backward_order(num_microbatches, num_splits)
    warmup = num_warmup_units(rank, pp_size, num_microbatches, num_splits)
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


# --------------------------------------------------------------------------------------
# Lowering to point-to-point communication, paired the way megatron-core's 1F1B pairs it.
# --------------------------------------------------------------------------------------

SEND_FORWARD = "send_forward"
RECV_FORWARD = "recv_forward"
SEND_BACKWARD = "send_backward"
RECV_BACKWARD = "recv_backward"


@dataclass(frozen=True)
class CommOp:
    """One point-to-point message: what it does and which unit's tensor it carries."""

    op: str
    unit: Unit


# A communication step is a tuple of CommOps posted together (one batched p2p call).
CommStep = Tuple[CommOp, ...]


def lower_to_actions(
    units: List[Unit], rank: int, pp_size: int, forward_only: bool = False,
    num_warmup: int = None,
):
    """Interleave a rank's compute units with the p2p steps that feed them.

    The pairing is megatron-core's 1F1B: in the steady phase a forward's output is
    sent together with the receive of the next backward's gradient
    (``send_forward_recv_backward``) and a backward's input gradient together with
    the next forward's input (``send_backward_recv_forward``). Both neighbours post
    matching pairs, so blocking batched p2p (NCCL) cannot deadlock. Returns a list
    whose items are either a ``Unit`` (compute) or a ``CommStep`` (non-empty tuple).
    """
    first, last = rank == 0, rank == pp_size - 1

    def step(*ops):
        kept = tuple(
            op
            for op in ops
            if op is not None
            and not (first and op.op in (RECV_FORWARD, SEND_BACKWARD))
            and not (last and op.op in (SEND_FORWARD, RECV_BACKWARD))
        )
        return [kept] if kept else []

    forwards = [u for u in units if u.is_forward]
    backwards = [u for u in units if not u.is_forward]
    if forward_only:
        actions = []
        for unit in forwards:
            actions += step(CommOp(RECV_FORWARD, unit))
            actions.append(unit)
            actions += step(CommOp(SEND_FORWARD, unit))
        return actions

    # The warm-up count must be given: it cannot be read off the unit list, whose first
    # steady forward also precedes the first backward (and W warm-up forwards + 1 steady
    # pair looks exactly like W + 1 warm-up forwards, yet pairs its messages differently).
    if num_warmup is None:
        raise ValueError("lower_to_actions needs num_warmup for a training schedule")
    warmup = num_warmup
    steady = len(forwards) - warmup
    actions = []
    for unit in forwards[:warmup]:
        actions += step(CommOp(RECV_FORWARD, unit))
        actions.append(unit)
        actions += step(CommOp(SEND_FORWARD, unit))
    if steady > 0:
        actions += step(CommOp(RECV_FORWARD, forwards[warmup]))
    for i in range(steady):
        forward, backward = forwards[warmup + i], backwards[i]
        actions.append(forward)
        actions += step(CommOp(SEND_FORWARD, forward), CommOp(RECV_BACKWARD, backward))
        actions.append(backward)
        if i == steady - 1:
            actions += step(CommOp(SEND_BACKWARD, backward))
        else:
            actions += step(
                CommOp(SEND_BACKWARD, backward),
                CommOp(RECV_FORWARD, forwards[warmup + i + 1]),
            )
    for backward in backwards[steady:]:
        actions += step(CommOp(RECV_BACKWARD, backward))
        actions.append(backward)
        actions += step(CommOp(SEND_BACKWARD, backward))
    return actions


def seq1f1b_rank_actions(
    rank: int,
    pp_size: int,
    num_microbatches: int,
    num_splits: int = 1,
    forward_only: bool = False,
):
    """Compute units and p2p steps of one rank, in execution order."""
    if forward_only:
        units = forward_only_rank_units(num_microbatches, num_splits)
    else:
        units = seq1f1b_rank_units(rank, pp_size, num_microbatches, num_splits)
    warmup = (None if forward_only
              else num_warmup_units(rank, pp_size, num_microbatches, num_splits))
    return lower_to_actions(units, rank, pp_size, forward_only=forward_only, num_warmup=warmup)
