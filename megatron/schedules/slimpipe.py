"""SlimPipe (arXiv 2504.14519) as data: uniform slices over interleaved model chunks.

Every microbatch is cut into ``n`` equal **slices** (the executor's sequence splits
with the ``average`` plan), every rank holds ``v`` model chunks, and the schedule is
the interleaved order of ``megatron.schedules.interleaved`` with a *group of one
microbatch*:

* forward table: for each microbatch, for each chunk ``0..v-1``, slices ``0..n-1``;
* the ``k``-th backward mirrors the ``k``-th table entry (chunk ``v - 1 - c``, slice
  ``n - 1 - j``), so inside a microbatch backward is the exact reverse of forward;
* rank ``r`` runs ``min(2 (p - r - 1) + (v - 1) n + n - 1, v m n)`` warm-up forwards,
  then alternates one forward with one backward, then drains: the last rank finishes
  microbatch 0's forwards and then pairs microbatch 1's forwards with microbatch 0's
  backwards.

Stage 0 therefore holds at most ``v n + 2 (p - 1)`` slice-chunk units, i.e.
``(n v + 2 (p - 1)) / (n v)`` of one microbatch's activations on that rank (``m >= 2``;
with one microbatch it holds the whole one). megatron-core's interleaved group rule
(``G >= p`` microbatches per group) becomes ``n >= p`` slices; the flags ask for ``n``
a multiple of ``p``, as the paper does. Any number of microbatches ``m >= 1`` works
(a group is one microbatch, so there is no ``m mod G`` rule).

With ``v = 1`` (no virtual stages) SlimPipe is Seq1F1B with ``s = n`` equal splits:
the unit order is ``seq1f1b_rank_units`` (warm-up ``p - r - 1 + n - 1``, stage 0 holds
``n + p - 1`` slices).
"""

from typing import List

from megatron.schedules.interleaved import (
    num_interleaved_warmup,
    schedule_table,
    table_rank_units,
)
from megatron.schedules.actions import FORWARD, Unit
from megatron.schedules.seq1f1b import check_positive_shape, num_warmup_units, seq1f1b_rank_units


def check_slimpipe_shape(pp_size: int, num_microbatches: int, num_chunks: int,
                         num_slices: int) -> None:
    """Raise ``ValueError`` (naming the flag) for a shape SlimPipe cannot run."""
    check_positive_shape(pp_size, num_microbatches, num_chunks, num_slices, "--slimpipe-slices")
    if num_chunks > 1 and pp_size < 2:
        raise ValueError("virtual pipeline stages need --pipeline-model-parallel-size >= 2")
    if num_chunks > 1 and num_slices < pp_size:
        raise ValueError(
            f"SlimPipe with virtual stages needs at least p={pp_size} slices per microbatch "
            f"(interleaving runs a group of >= p items per chunk), got "
            f"--slimpipe-slices {num_slices}; use a multiple of {pp_size}")


def num_slimpipe_warmup(rank: int, pp_size: int, num_microbatches: int, num_chunks: int,
                        num_slices: int) -> int:
    """Forward units rank ``rank`` runs before its first backward."""
    check_slimpipe_shape(pp_size, num_microbatches, num_chunks, num_slices)
    if num_chunks == 1:
        return num_warmup_units(rank, pp_size, num_microbatches, num_slices)
    # 2 (p - r - 1) + (v - 1) n + n - 1, capped at v m n
    return num_interleaved_warmup(rank, pp_size, num_microbatches, num_chunks, 1, num_slices)


def slimpipe_rank_units(rank: int, pp_size: int, num_microbatches: int, num_chunks: int,
                        num_slices: int) -> List[Unit]:
    """Ordered compute units of one rank under SlimPipe."""
    if not 0 <= rank < pp_size:
        raise ValueError(f"rank {rank} outside pipeline of size {pp_size}")
    check_slimpipe_shape(pp_size, num_microbatches, num_chunks, num_slices)
    if num_chunks == 1:
        return seq1f1b_rank_units(rank, pp_size, num_microbatches, num_slices)
    # the interleaved order with a group of one microbatch (n >= p items)
    return table_rank_units(rank, pp_size, num_microbatches, num_chunks, 1, num_slices)


def slimpipe_schedule(pp_size: int, num_microbatches: int, num_chunks: int,
                      num_slices: int) -> List[List[Unit]]:
    """Every rank's ordered compute units under SlimPipe."""
    return [slimpipe_rank_units(rank, pp_size, num_microbatches, num_chunks, num_slices)
            for rank in range(pp_size)]


def slimpipe_forward_only_units(num_microbatches: int, num_chunks: int,
                                num_slices: int) -> List[Unit]:
    """Evaluation: every rank runs the forwards in table order (microbatch, chunk, slice)."""
    table = schedule_table(num_microbatches, num_chunks, 1, num_slices)
    return [Unit(FORWARD, mb, split, chunk) for mb, split, chunk in table]
