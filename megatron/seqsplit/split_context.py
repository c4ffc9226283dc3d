"""The one object that tells the model which part of which microbatch it is running.

A ``SplitContext`` travels explicitly from the executor, through the user's
``forward_step``, into ``GPTModel.forward(packed_seq_params=...)``, and from there
(megatron-core already threads ``packed_seq_params`` through the block, the layers
and activation recomputation) down to core attention. No global counters.
"""

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megatron.core.packed_seq_params import PackedSeqParams


# What must use a split for a forward to be exact: the core attention (attends over the
# cached K/V prefix of the earlier splits) and the model's positions (RoPE at the
# split's absolute offset). SplitCausalAttention and SeqSplitGPTModel mark them.
CONSUMERS = ("attention", "positions")


@dataclass
class SplitContext(PackedSeqParams):
    """Split ``split_index`` of microbatch ``microbatch_id``: tokens [offset, offset + length).

    It subclasses ``PackedSeqParams`` only to ride megatron-core's existing plumbing;
    ``qkv_format`` stays ``"sbhd"`` so megatron-core's packed-sequence code paths
    stay off. ``max_seqlen_q`` is the split's own length, which is what
    megatron-core's RoPE sizing reads.
    """

    microbatch_id: int = 0
    split_index: int = 0
    num_splits: int = 1
    offset: int = 0
    length: int = 0
    seq_length: int = 0
    kv_store: Optional[Any] = None  # megatron.seqsplit.kv_cache.KVCacheStore
    routing_stats: Optional[Any] = None  # megatron.seqsplit.moe.RoutingStatistics
    # [b, >= offset + length] document index of every token up to this split's end
    # (--reset-attention-mask); None means one causal sequence per row
    document_ids: Optional[torch.Tensor] = None
    # the whole microbatch this split is cut from (the executor's MicrobatchSlicer sets
    # it): multi-token prediction reads the tokens and labels past the split's end
    microbatch: Optional[dict] = None
    rolls: Optional[Any] = None  # megatron.seqsplit.mtp.SplitRolls during an MTP forward
    # --context-parallel-size > 1 (megatron.seqsplit.context_parallel.ContextParallel):
    # [offset, offset + length) is then this rank's part of the split, and attention
    # gathers the whole split's K/V (cache_offset, cache_length) over the ranks
    context_parallel: Optional[Any] = None
    # which split-aware parts ran on this split during its forward (CONSUMERS): a
    # model that never saw the split attends within it only, and trains on wrong
    # gradients, so the executor refuses a forward that leaves one out
    consumed: set = field(default_factory=set)

    def __post_init__(self):
        self.qkv_format = "sbhd"
        self.max_seqlen_q = self.length
        self.max_seqlen_kv = self.length

    @property
    def is_first(self) -> bool:
        return self.split_index == 0

    @property
    def is_last(self) -> bool:
        return self.split_index == self.num_splits - 1

    @property
    def cache_offset(self) -> int:
        """Where the split's K/V start in the K/V cache: the whole split's start (every
        context-parallel rank's part), ``offset`` without context parallelism."""
        if self.context_parallel is None:
            return self.offset
        return self.offset - self.context_parallel.rank * self.length

    @property
    def cache_length(self) -> int:
        """How many positions of K/V the split writes into the cache (all ranks' parts)."""
        if self.context_parallel is None:
            return self.length
        return self.length * self.context_parallel.size

    def mark_consumed(self, part: str) -> None:
        """Called by a split-aware part of the model (one of ``CONSUMERS``) that used
        this split during the forward."""
        if part not in CONSUMERS:
            raise ValueError(f"unknown split consumer {part!r}; expected one of {CONSUMERS}")
        self.consumed.add(part)

    def missing_consumers(self) -> tuple:
        """The parts of ``CONSUMERS`` that have not used this split (empty when all have)."""
        return tuple(part for part in CONSUMERS if part not in self.consumed)


def slice_batch(batch: dict, offset: int, length: int, seq_length: int) -> dict:
    """One split of a microbatch: every per-token tensor cut to [offset, offset + length).

    Tokens and labels are sliced in tandem (labels were shifted by the dataset before
    slicing, so the split's last label is the next split's first token). A dense
    ``[b, 1, L, L]`` attention mask keeps the split's query rows and every key column
    up to the split's end.
    """
    out = {}
    for key, value in batch.items():
        if key == "document_ids":  # keys of the whole prefix are needed, not just the split's
            out[key] = value[:, :offset + length]
        elif not torch.is_tensor(value):
            out[key] = value
        elif value.dim() == 4 and value.shape[-1] == seq_length and value.shape[-2] == seq_length:
            out[key] = value[:, :, offset:offset + length, :offset + length]
        elif value.dim() >= 2 and value.shape[1] == seq_length:
            out[key] = value[:, offset:offset + length].contiguous()
        else:
            out[key] = value
    return out
