"""Context parallelism under sequence splits (``--context-parallel-size``).

The context-parallel ranks of a pipeline stage run the same units at the same time, each
on an equal contiguous part of every split: with ``c`` ranks, rank ``r`` runs positions
``[o + r l / c, o + (r + 1) l / c)`` of split ``[o, o + l)``. To the model a part is a
split like any other (its RoPE offset, its slice of the batch, its loss), except in
attention: the split's keys and values are all-gathered over the ranks and written into
the K/V cache whole, and a part's queries attend over the cache up to their own end (the
earlier splits, the earlier ranks' parts of this split, and their own part causally).
Queries are then the last positions of the keys they see, which is what every attention
kernel here takes, so no kernel changes.

Backward mirrors it: the K/V gradient of the whole split (this rank's queries' share,
plus what later splits left in the cache's accumulator) is reduce-scattered, summing
every rank's share, and each rank keeps its own part's.

Contiguous parts make later ranks' queries attend over a longer prefix within each
split; across ``s`` splits that difference is one part per split against the whole
prefix, so it shrinks as splits are added (megatron-core's zigzag order, which balances
one unsplit sequence, is not used).
"""

import contextlib
from dataclasses import dataclass
from typing import Any

from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place among the context-parallel ranks."""

    group: Any  # torch.distributed.ProcessGroup
    size: int
    rank: int

    @classmethod
    def from_parallel_state(cls):
        """The context-parallel group megatron-core's parallel state holds, or None when
        it has one rank (or parallel state is not initialised)."""
        group = parallel_state.get_context_parallel_group(check_initialized=False)
        if group is None or group.size() == 1:
            return None
        return cls(group=group, size=group.size(), rank=group.rank())

    def part(self, offset: int, length: int) -> tuple:
        """(offset, length) of this rank's part of the split [offset, offset + length)."""
        if length % self.size:
            raise ValueError(f"a split of {length} positions cannot be divided over "
                             f"{self.size} context-parallel ranks: give split lengths that "
                             f"are multiples of {self.size} (--seq1f1b-split-alignment)")
        part = length // self.size
        return offset + self.rank * part, part

    def gather(self, tensor):
        """[l / c, ...] of every rank -> [l, ...] in rank order (backward: the gradient
        summed over the ranks, each keeping its own part's)."""
        return gather_from_sequence_parallel_region(tensor.contiguous(),
                                                    tensor_parallel_output_grad=True,
                                                    group=self.group)


class _OneRank:
    """A context-parallel group of one rank, as a rotary embedding's constructor reads it
    (given None it takes megatron-core's parallel state's group)."""

    @staticmethod
    def size():
        return 1

    @staticmethod
    def rank():
        return 0


@contextlib.contextmanager
def rotary_embeddings_without_context_parallel(module):
    """Inside, the rotary embeddings ``module`` (megatron-core's GPT model or MLA module)
    builds get no context-parallel group: each rank's part takes its positions from the
    split (see the module docstring), never megatron-core's zigzag slice, which YaRN would
    already take of its cos/sin table while it is built."""
    originals = {name: getattr(module, name)
                 for name in ("RotaryEmbedding", "YarnRotaryEmbedding") if hasattr(module, name)}

    def built_without_cp(cls):
        def build(*args, **kwargs):
            rotary = cls(*args, **{**kwargs, "cp_group": _OneRank()})
            rotary.cp_group = None  # its forward then slices nothing either
            return rotary
        return build

    for name, cls in originals.items():
        setattr(module, name, built_without_cp(cls))
    try:
        yield
    finally:
        for name, cls in originals.items():
            setattr(module, name, cls)
