"""Per-microbatch K/V prefix cache for Seq1F1B split attention.

Split j of a microbatch attends over the keys/values of splits 0..j. Each
(microbatch, layer) owns ONE K and V buffer [n, b, g, d], grown split by split: split j
extends it in place to n = o_j + l_j positions, copies its own K/V into
buf[o_j : o_j + l_j] and attends over buf[:o_j + l_j]. A microbatch whose later splits
have not run yet holds only what its run splits wrote (a whole-sequence buffer from
split 0 on would hold the rest empty, at the stage's activation peak too).

Why not torch.cat(prefix, own)? Attention saves its key/value for backward, so every
split would keep its own concatenated copy alive: O(s) full copies. Here every split's
attention saves an alias of the same buffer instead. The alias is a fresh tensor on the
buffer's storage (`Tensor.set_`), so it has its own autograd version counter: later
splits writing further into the buffer do not invalidate what earlier splits saved
(they never write a region an earlier split read). Growing reallocates the buffer's
storage itself (`UntypedStorage.resize_`, which copies the filled prefix), so those
aliases read the new memory and their version counters stay as they were.

Gradients: backward runs splits s-1..0. Split j's attention yields a gradient for the
whole prefix buf[:o_j + l_j]; the part for positions < o_j is added into the entry's
gradient accumulator, and split j returns its own part plus what later splits left in
the accumulator for its positions. Split 0's backward frees the entry.

`split_causal_attention` picks the layout: this module's buffer, or `kv_chunks`'
per-split chunks. Both keep their entries in a `KVCacheStore` and reach it only
through its public methods, so dependencies point one way: kv_cache -> kv_chunks.
"""

from dataclasses import dataclass
from functools import partial

import torch

from megatron.seqsplit.attention_backends import AttentionCall, variant_kwargs
from megatron.seqsplit.attention_exchange import UnitExchange
from megatron.seqsplit.cpu_split_attention import (
    own_and_prefix_backward,
    own_and_prefix_forward,
    sink_gradient,
    with_sink,
)
from megatron.seqsplit.documents import key_documents
from megatron.seqsplit.kv_chunks import chunked_split_attention, whole_sequence_attention


def storage_id(tensor: torch.Tensor) -> int:
    """Identity of ``tensor``'s storage that a growing K/V buffer keeps (its data_ptr
    changes when the buffer grows; the storage object stays the same)."""
    return tensor.untyped_storage()._cdata


@dataclass
class _Entry:
    key: torch.Tensor  # [n, b, g, d]: n positions allocated so far
    value: torch.Tensor
    filled: int = 0  # positions written so far; split j needs filled >= o_j
    grad_key: torch.Tensor | None = None  # prefix gradients left by later splits
    grad_value: torch.Tensor | None = None

    def tensors(self):
        return [t for t in (self.key, self.value, self.grad_key, self.grad_value) if t is not None]


class KVCacheStore:
    """K/V prefix buffers keyed by (microbatch_id, layer_key); one per forward-backward pass.

    Entries are this module's full-sequence buffers or `kv_chunks`' per-split chunks
    (whichever the attention layer uses); the store only needs their `tensors()`.
    Layouts reach entries through `lookup`, `insert`, `release` and
    `release_after_last_forward`.

    `unit_exchange`: the attention-redistribution exchange of the pipeline unit being
    run (`attention_exchange.UnitExchange`); the executor sets it around each unit with
    ``unit_exchange.running(...)`` and the chunked layout's attention reads it.

    `forward_only`: when are entries freed after the last split's forward?
      None  - when that forward recorded no autograd graph (evaluation); otherwise by
              split 0's backward.
      True  - always (evaluation / forward_only schedules).
      False - never; only split 0's backward or `clear()` frees. Use this when layers
              are recomputed with a reentrant checkpoint, whose first forward runs
              under no_grad but whose backward still needs the cached prefix.
    """

    def __init__(self, forward_only: bool | None = None):
        self.forward_only = forward_only
        self._entries: dict = {}
        self.unit_exchange = UnitExchange()

    def num_entries(self) -> int:
        return len(self._entries)

    def cached_bytes(self) -> int:
        """Bytes held by K/V buffers (or chunks) and gradient accumulators of live entries."""
        return sum(t.numel() * t.element_size()
                   for e in self._entries.values() for t in e.tensors())

    def storage_ids(self) -> set:
        """`storage_id` of every live buffer (memory probes count them once)."""
        return {storage_id(t) for e in self._entries.values() for t in e.tensors()}

    def clear(self) -> None:
        self._entries.clear()

    def lookup(self, entry_id):
        """The entry of ``(microbatch_id, layer_key)``, or None."""
        return self._entries.get(entry_id)

    def insert(self, entry_id, entry):
        """Store a new entry; returns it."""
        self._entries[entry_id] = entry
        return entry

    def release(self, entry_id) -> None:
        """Free an entry (split 0's backward, or no backward will need it); no-op if gone."""
        self._entries.pop(entry_id, None)

    def release_after_last_forward(self, entry_id, split, tracked: bool) -> None:
        """After a split's forward: free the entry if this was the microbatch's last split
        and no backward will need it (``tracked``: the forward recorded autograd)."""
        free_now = self.forward_only if self.forward_only is not None else not tracked
        if free_now and split.split_index == split.num_splits - 1:
            self.release(entry_id)


def _buffer_entry(store: KVCacheStore, entry_id, split, key: torch.Tensor,
                  value: torch.Tensor, offset: int) -> _Entry:
    entry = store.lookup(entry_id)
    if entry is None:
        if split.split_index != 0:
            raise RuntimeError(
                f"no cached K/V for microbatch {split.microbatch_id}, layer {entry_id[1]}: "
                f"split {split.split_index} ran forward before split 0, or the entry was "
                "already freed (recomputing with a reentrant checkpoint needs "
                "KVCacheStore(forward_only=False))"
            )
        # keys and values at their own head sizes (MLA: query-key != value head size);
        # sized to split 0, grown by later splits (`_write_and_expose`)
        entry = store.insert(entry_id, _Entry(key.new_empty(key.shape),
                                              value.new_empty(value.shape)))
    if (tuple(key.shape[1:]) != tuple(entry.key.shape[1:])
            or tuple(value.shape[1:]) != tuple(entry.value.shape[1:])
            or offset > entry.filled):
        raise RuntimeError(
            f"split {split.split_index} of microbatch {split.microbatch_id} (offset "
            f"{offset}, K/V {tuple(key.shape)}) does not continue the cached prefix "
            f"({entry.filled} positions of {tuple(entry.key.shape)})"
        )
    return entry


def _alias(buf: torch.Tensor, length: int) -> torch.Tensor:
    """buf[:length] sharing storage but with its own autograd version counter."""
    size = (length,) + tuple(buf.shape[1:])
    out = torch.empty(0, dtype=buf.dtype, device=buf.device)
    return out.set_(buf.untyped_storage(), buf.storage_offset(), size, buf.stride())


def _grown(buf: torch.Tensor, length: int) -> torch.Tensor:
    """``buf`` extended in place to ``length`` positions: its storage is reallocated with
    the old contents copied, so every alias of it (what earlier splits saved) reads the
    new memory. Returns the buffer's new full view."""
    buf.untyped_storage().resize_(length * buf.stride(0) * buf.element_size())
    return _alias(buf, length)


def _write_and_expose(entry: _Entry, key, value, offset: int):
    end = offset + key.shape[0]
    if end > entry.key.shape[0]:
        entry.key, entry.value = _grown(entry.key, end), _grown(entry.value, end)
    with torch.no_grad():
        entry.key[offset:end].copy_(key)
        entry.value[offset:end].copy_(value)
    entry.filled = max(entry.filled, end)
    return _alias(entry.key, end), _alias(entry.value, end)


def _split_grad(grad, acc, offset: int, end: int):
    """Own-position gradient (plus accumulated later-split gradient); stash the prefix part.

    Backward runs a microbatch's splits last to first, so the first stash (the last
    split's, whose prefix is the longest) is a copy of its prefix gradient, sized to that
    prefix: no zero-filled full-sequence buffer, and every earlier split reads and adds
    within it."""
    return _split_grad_parts(grad[:offset], grad[offset:end], acc, offset, end, owned=False)


def _split_grad_parts(prefix, own, acc, offset: int, end: int, owned: bool = True):
    """`_split_grad` with the gradient's prefix part and own part given apart; ``owned``:
    ``prefix`` is a tensor of its own (not a view of a longer gradient), so the first
    stash can be that tensor instead of a copy."""
    if acc is not None:
        if end > acc.shape[0]:
            raise AssertionError(f"split [{offset}, {end}) runs backward after a split with a "
                                 f"shorter prefix ({acc.shape[0]}): splits must run backward "
                                 "last to first")
        own = (own + acc[offset:end]).to(own.dtype)
    if offset > 0:
        if acc is None:
            # Half precision gradients are summed over up to s splits: keep them in fp32.
            dtype = torch.float32 if prefix.element_size() < 4 else prefix.dtype
            acc = prefix.to(dtype=dtype, copy=not owned)
        else:
            acc[:offset] += prefix
    return own, acc


class _PrefixKV(torch.autograd.Function):
    """(own K, own V) -> (K prefix up to this split, V prefix); gradients via the entry."""

    @staticmethod
    def forward(ctx, key, value, entry, offset, on_first_split_done):
        ctx.entry, ctx.offset, ctx.end = entry, offset, offset + key.shape[0]
        ctx.on_first_split_done = on_first_split_done
        return _write_and_expose(entry, key, value, offset)

    @staticmethod
    def backward(ctx, grad_key, grad_value):
        entry, offset, end = ctx.entry, ctx.offset, ctx.end
        gk, entry.grad_key = _split_grad(grad_key, entry.grad_key, offset, end)
        gv, entry.grad_value = _split_grad(grad_value, entry.grad_value, offset, end)
        if offset == 0:
            ctx.on_first_split_done()
            entry.grad_key = entry.grad_value = None
        return gk, gv, None, None, None


def _to_bhld(x):  # megatron [l, b, h, d] -> kernel [b, h, l, d] (a view)
    return x.permute(1, 2, 0, 3)


def _from_bhld(x):  # kernel [b, h, l, d] -> megatron [l, b, h, d] (a view)
    return x.permute(2, 0, 1, 3)


def query_alone(query: torch.Tensor) -> torch.Tensor:
    """``query``, or a copy of it when it is a view of a larger tensor: with learned
    positions (no RoPE) the query is a view of the fused QKV projection's output, and a
    kernel (or the selective checkpoint) that saves it would keep that whole output alive
    (3x the query with MHA), while a split's K/V live in the cache. The copy's gradient
    flows back unchanged (bitwise the same results) and costs one query-sized copy."""
    if query.untyped_storage().nbytes() <= query.numel() * query.element_size():
        return query
    return query.clone()


def _runs_split_kernel_cpu(backend, query, key, dropout_p, window=None) -> bool:
    """Whether ``backend`` would run this split on the CPU split kernel (False for any
    callable that is not one of our attention backends)."""
    asks = getattr(backend, "runs_split_kernel_cpu", None)
    return asks is not None and asks(AttentionCall.of(_to_bhld(query), _to_bhld(key), None,
                                                      dropout_p, window))


class _CachedSplitAttention(torch.autograd.Function):
    """`_PrefixKV` and the CPU split kernel (`cpu_split_attention`: the own block causal,
    the prefix unmasked, merged by LSE) as one autograd node, for a split with a prefix
    and no packed documents on CPU.

    Apart, the kernel's backward builds the prefix-long K/V gradient (one ``cat`` of its
    two parts per split, layer and tensor) and `_PrefixKV` cuts it up again, copying the
    prefix part into the first stash. Here the prefix part goes straight to the entry's
    accumulators (the first stash IS the kernel's tensor) and the own part is returned:
    the same values, without those copies or the second node's Python. The saved tensors
    are the same aliases of the cache buffer (the activation memory is unchanged).
    Takes and returns kernel layout for the query, megatron layout for K/V."""

    @staticmethod
    def forward(ctx, q, key, value, entry, offset, softmax_scale, sink):
        k_all, v_all = _write_and_expose(entry, key, value, offset)
        k_all, v_all = _to_bhld(k_all), _to_bhld(v_all)
        out, lse = own_and_prefix_forward(q, k_all[:, :, :offset], v_all[:, :, :offset],
                                          k_all[:, :, offset:], v_all[:, :, offset:],
                                          softmax_scale)
        if sink is not None:  # attention sinks: one more part of the softmax, no value
            out, lse = with_sink(out, lse, sink)
        ctx.save_for_backward(q, k_all, v_all, out, lse, sink)
        ctx.entry, ctx.offset, ctx.end = entry, offset, offset + key.shape[0]
        ctx.softmax_scale = softmax_scale  # offset > 0: split 0's _PrefixKV frees the entry
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_all, v_all, out, lse, sink = ctx.saved_tensors
        entry, offset, end = ctx.entry, ctx.offset, ctx.end
        dsink = sink_gradient(grad_out, out, lse, sink) if ctx.needs_input_grad[6] else None
        dq, dk_prefix, dv_prefix, dk_own, dv_own = own_and_prefix_backward(
            grad_out, q, k_all[:, :, :offset], v_all[:, :, :offset], k_all[:, :, offset:],
            v_all[:, :, offset:], out, lse, ctx.softmax_scale)
        gk, entry.grad_key = _split_grad_parts(_from_bhld(dk_prefix), _from_bhld(dk_own),
                                               entry.grad_key, offset, end)
        gv, entry.grad_value = _split_grad_parts(_from_bhld(dv_prefix), _from_bhld(dv_own),
                                                 entry.grad_value, offset, end)
        return dq, gk, gv, None, None, None, dsink


from megatron.seqsplit.names import KV_CACHE_LAYOUTS  # noqa: E402,F401 - re-exported


def split_causal_attention(
    query, key, value, *, split, store, layer_key, backend, softmax_scale, dropout_p=0.0,
    kv_cache="buffer", window=None, sink=None,
):
    """Causal attention of one split over its microbatch's cached prefix.

    query [l, b, hq, d], key [l, b, g, d], value [l, b, g, dv] (RoPE applied, groups
    not expanded; dv != d for MLA); returns [l, b, hq, dv]. `split` has microbatch_id, split_index, num_splits, offset,
    length, seq_length and optionally document_ids [b, >= offset + length] (packed
    documents: per-document causal attention); None (or num_splits == 1) means
    attention over the given query/key/value alone, with `backend`.
    `kv_cache`: "buffer" (this module: one buffer grown split by split, `backend` attends over
    its prefix) or "chunked" (`kv_chunks`: per-split chunks merged by log-sum-exp).
    `window`: sliding-window attention, each query seeing at most `window` keys before it
    (the caches still hold the whole prefix).
    `split.context_parallel` (optional; `context_parallel.ContextParallel`): the split's
    K/V are gathered over the context-parallel ranks and its queries are this rank's part.
    `sink` [hq]: attention sinks' logits (``softmax_type`` off-by-one / learnable), or None.
    On CUDA no backend has sinks: there a split with sinks needs the chunked cache, and
    an unsplit call runs the chunked kernel over its one chunk.
    """
    context_parallel = getattr(split, "context_parallel", None)
    if context_parallel is not None:
        # the whole split's K/V on every context-parallel rank, kept in the buffer cache
        # (one split too); this rank's queries see the keys up to their own part's end
        # (context_parallel.py)
        key, value = context_parallel.gather(key), context_parallel.gather(value)
        visible = split.offset + split.length
    if split is None or (split.num_splits == 1 and context_parallel is None):
        if sink is not None and query.device.type == "cuda":
            if dropout_p > 0.0:
                raise ValueError("attention sinks have no attention dropout here: set "
                                 "--attention-dropout 0")
            if key_documents(split, key.shape[0], query.device) is not None:
                raise ValueError("attention sinks with packed documents on CUDA are not "
                                 "supported yet")
            out = whole_sequence_attention(_to_bhld(query), _to_bhld(key), _to_bhld(value),
                                           softmax_scale=softmax_scale, window=window,
                                           sink=sink)
            return _from_bhld(out).contiguous()
        k_all, v_all = key, value
    elif kv_cache == "chunked":
        if dropout_p > 0.0:
            raise ValueError("the chunked KV cache has no attention dropout: set "
                             "--attention-dropout 0 or use --seq1f1b-kv-cache buffer")
        return chunked_split_attention(query, key, value, split=split, store=store,
                                       layer_key=layer_key, softmax_scale=softmax_scale,
                                       window=window, sink=sink)
    elif kv_cache != "buffer":
        raise ValueError(f"unknown KV-cache layout {kv_cache!r}; use one of {KV_CACHE_LAYOUTS}")
    else:
        # the positions this split writes into the cache: with context parallelism the
        # whole split's (every rank's part), else the split's own
        offset, length = ((split.offset, split.length) if context_parallel is None
                          else (split.cache_offset, split.cache_length))
        if key.shape[0] != length or offset + length > split.seq_length:
            raise ValueError(
                f"split {split.split_index}: K/V length {key.shape[0]} does not match "
                f"length {length} at offset {offset} of {split.seq_length}"
            )
        entry_id = (split.microbatch_id, layer_key)
        entry = _buffer_entry(store, entry_id, split, key, value, offset)
        tracked = torch.is_grad_enabled() and (key.requires_grad or value.requires_grad)
        if tracked:  # K/V come from the cache: what is saved of q must not pin QKV's output
            query = query_alone(query)
        if (tracked and offset > 0 and context_parallel is None
                and value.shape[-1] == key.shape[-1]
                and key_documents(split, split.offset + split.length, query.device) is None
                and _runs_split_kernel_cpu(backend, query, key, dropout_p, window)):
            out = _CachedSplitAttention.apply(_to_bhld(query), key, value, entry, split.offset,
                                              softmax_scale, sink)
            store.release_after_last_forward(entry_id, split, tracked)
            return _from_bhld(out).contiguous()
        if tracked:
            release = partial(store.release, entry_id)
            k_all, v_all = _PrefixKV.apply(key, value, entry, offset, release)
        else:
            k_all, v_all = _write_and_expose(entry, key, value, offset)
        store.release_after_last_forward(entry_id, split, tracked)
        if context_parallel is not None:
            k_all, v_all = k_all[:visible], v_all[:visible]
    documents = key_documents(split, k_all.shape[0], query.device)
    v_dim = v_all.shape[-1]
    if v_dim != key.shape[-1]:
        # MLA: the value head is smaller than the query-key head, and the fused kernels
        # (torch's CPU and CUDA flash, flash-attn 2) need one head size. Zero columns
        # added to V give zero output columns and the same other columns, so the output
        # is cut back to v_dim; only this call's V copy is padded, not the cache
        v_all = torch.nn.functional.pad(v_all, (0, key.shape[-1] - v_dim))
    out = backend(
        _to_bhld(query), _to_bhld(k_all), _to_bhld(v_all),
        softmax_scale=softmax_scale, dropout_p=dropout_p, document_ids=documents,
        **variant_kwargs(window, sink),
    )
    return _from_bhld(out[..., :v_dim]).contiguous()
