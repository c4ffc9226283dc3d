"""Interleaved (virtual-stage) 1F1B as data: the order megatron-core 0.16.1 runs.

Every pipeline rank holds ``v`` model chunks (virtual stages): rank ``r`` holds chunks
that are global stages ``r, r + p, ..., r + (v - 1) p``. A microbatch goes forward
through chunk 0 of ranks ``0..p-1``, then chunk 1 of ranks ``0..p-1``, and so on;
backward runs the reverse path.

This module reproduces the unit order of
``megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_with_interleaving``
(non-overlapped communication, no MoE overlap):

* the *schedule table* (``get_schedule_table``) cuts the microbatches into groups of
  ``microbatch_group_size_per_vp_stage`` (``G``, default ``p``); inside a group every
  chunk runs all the group's microbatches before the next chunk starts. The ``k``-th
  forward runs ``table[k]``; the ``k``-th backward runs the microbatch of ``table[k]``
  on chunk ``v - 1 - chunk(table[k])``;
* rank ``r`` runs ``min(2 (p - r - 1) + (v - 1) G, v m)`` warm-up forwards
  (``get_pp_rank_microbatches``), then alternates one forward and one backward, then
  drains the backwards;
* ``G`` must lie in ``[p, m]`` and ``m mod G`` must be 0 or at least ``p``
  (megatron-core raises otherwise).

It is written over *items* rather than microbatches so that interleaved Seq1F1B can
reuse it: an item is a ``(microbatch, split)`` pair. Forward items of a microbatch
run in split order ``0..s-1``, backward items in reverse split order (split ``j``'s
backward yields the K/V gradient of splits ``< j``). With ``s`` splits the group holds
``G`` microbatches (``G s`` items) and warm-up grows by ``s - 1`` items, the forwards a
rank needs before the last split of the first microbatch reaches its last chunk:
``min(2 (p - r - 1) + (v - 1) G s + s - 1, v m s)``. With ``s = 1`` every number
above is megatron-core's. The executor runs these lists (``s = 1`` included) through
``megatron.schedules.lowering``; their completeness and freedom from deadlock are
checked by the simulator (``megatron.schedules.simulate``: timing and rendezvous) and
their tests.
"""

from typing import List, Optional, Tuple

from megatron.schedules.actions import BACKWARD, FORWARD, Unit
from megatron.schedules.seq1f1b import check_positive_shape, one_forward_one_backward

Item = Tuple[int, int]  # (microbatch, split)


def default_group_size(pp_size: int, group_size: Optional[int] = None) -> int:
    """megatron-core's ``microbatch_group_size_per_vp_stage``: ``p`` unless given."""
    return pp_size if group_size is None else group_size


def check_interleaved_shape(
    pp_size: int,
    num_microbatches: int,
    num_chunks: int,
    group_size: Optional[int] = None,
    num_splits: int = 1,
) -> int:
    """Validate an interleaved shape the way megatron-core does; return the group size."""
    check_positive_shape(pp_size, num_microbatches, num_chunks, num_splits, "--seq1f1b-splits")
    group = default_group_size(pp_size, group_size)
    if group > num_microbatches or group < pp_size:
        raise ValueError(
            f"interleaved 1F1B needs microbatch_group_size_per_vp_stage in "
            f"[p={pp_size}, m={num_microbatches}], got {group}: use at least "
            f"{pp_size} microbatches per iteration (--global-batch-size / "
            f"(--micro-batch-size * data-parallel size) >= {pp_size})"
        )
    final = num_microbatches % group
    if 0 < final < pp_size:
        raise ValueError(
            f"interleaved 1F1B: the number of microbatches m={num_microbatches} modulo the "
            f"group size {group} is {final}; megatron-core requires 0 or >= p={pp_size}. "
            f"Use a number of microbatches (--global-batch-size / (--micro-batch-size x "
            f"data-parallel size)) that is a multiple of {group}."
        )
    return group


def schedule_table(
    num_microbatches: int, num_chunks: int, group_size: int, num_splits: int = 1
) -> List[Tuple[int, int, int]]:
    """``(microbatch, split, chunk)`` of the k-th forward, as megatron-core's table.

    With ``num_splits == 1`` this equals ``get_schedule_table`` with a split of 0.
    """
    table = []
    for first in range(0, num_microbatches, group_size):
        last = num_microbatches if first + group_size >= num_microbatches else first + group_size
        for chunk in range(num_chunks):
            for mb in range(first, last):
                for split in range(num_splits):
                    table.append((mb, split, chunk))
    return table


def num_interleaved_warmup(
    rank: int,
    pp_size: int,
    num_microbatches: int,
    num_chunks: int,
    group_size: Optional[int] = None,
    num_splits: int = 1,
) -> int:
    """Forward units rank ``rank`` runs before its first backward.

    ``s = 1``: megatron-core's ``get_pp_rank_microbatches`` (training, pp > 1),
    ``min(2 (p - r - 1) + (v - 1) G, v m)``.
    """
    group = default_group_size(pp_size, group_size)
    total = num_chunks * num_microbatches * num_splits
    if pp_size == 1:
        # megatron-core runs forward_backward_no_pipelining for p == 1.
        return 0
    warmup = 2 * (pp_size - rank - 1) + (num_chunks - 1) * group * num_splits
    warmup += num_splits - 1
    return min(warmup, total)


def interleaved_rank_units(
    rank: int,
    pp_size: int,
    num_microbatches: int,
    num_chunks: int,
    group_size: Optional[int] = None,
    num_splits: int = 1,
) -> List[Unit]:
    """Ordered compute units of one rank under interleaved 1F1B (with optional splits)."""
    if not 0 <= rank < pp_size:
        raise ValueError(f"rank {rank} outside pipeline of size {pp_size}")
    group = check_interleaved_shape(
        pp_size, num_microbatches, num_chunks, group_size, num_splits
    )
    if pp_size == 1:
        # No pipelining: forward and backward of each unit back to back (megatron-core's
        # forward_backward_no_pipelining runs the whole model per microbatch; with one
        # rank holding every chunk the unit order below is the equivalent per chunk).
        units = []
        for mb in range(num_microbatches):
            for split in range(num_splits):
                units += [Unit(FORWARD, mb, split, c) for c in range(num_chunks)]
            for split in reversed(range(num_splits)):
                units += [Unit(BACKWARD, mb, split, c) for c in reversed(range(num_chunks))]
        return units
    return table_rank_units(rank, pp_size, num_microbatches, num_chunks, group, num_splits)


def table_rank_units(
    rank: int,
    pp_size: int,
    num_microbatches: int,
    num_chunks: int,
    group: int,
    num_splits: int,
) -> List[Unit]:
    """The interleaved order over items for a checked shape (``pp_size >= 2``).

    Shared by interleaved (Seq1F1B) and SlimPipe (``megatron.schedules.slimpipe``,
    whose group is one microbatch): the ``k``-th forward runs ``table[k]``, the
    ``k``-th backward mirrors it, warm-up as ``num_interleaved_warmup``.
    """
    table = schedule_table(num_microbatches, num_chunks, group, num_splits)
    forwards = [Unit(FORWARD, mb, split, chunk) for mb, split, chunk in table]
    # The k-th backward mirrors the k-th table entry: chunk reversed, splits of each
    # microbatch reversed (for s = 1 this is exactly megatron-core's lookup).
    backwards = []
    for k, (mb, split, chunk) in enumerate(table):
        backwards.append(Unit(BACKWARD, mb, num_splits - 1 - split, num_chunks - 1 - chunk))
    warmup = num_interleaved_warmup(
        rank, pp_size, num_microbatches, num_chunks, group, num_splits
    )
    return one_forward_one_backward(forwards, backwards, warmup)


def interleaved_schedule(
    pp_size: int,
    num_microbatches: int,
    num_chunks: int,
    group_size: Optional[int] = None,
    num_splits: int = 1,
) -> List[List[Unit]]:
    """Every rank's ordered compute units under interleaved 1F1B."""
    return [
        interleaved_rank_units(
            rank, pp_size, num_microbatches, num_chunks, group_size, num_splits
        )
        for rank in range(pp_size)
    ]


def interleaved_forward_only_units(
    num_microbatches: int,
    num_chunks: int,
    num_splits: int = 1,
    pp_size: int = 1,
    group_size: Optional[int] = None,
) -> List[Unit]:
    """Evaluation: every rank runs the forwards in schedule-table order."""
    group = min(default_group_size(pp_size, group_size), num_microbatches)
    table = schedule_table(num_microbatches, num_chunks, group, num_splits)
    return [Unit(FORWARD, mb, split, chunk) for mb, split, chunk in table]
