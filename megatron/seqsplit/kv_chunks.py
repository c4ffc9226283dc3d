"""Chunked K/V prefix cache (`--seq1f1b-kv-cache chunked`): no prefix is ever concatenated.

The default cache (`kv_cache.py`) copies every split's K/V into one buffer per
(microbatch, layer), grown split by split (its prefix copied at each growth), and runs
the attention kernel over the buffer's prefix. Here
each split's K/V stays a chunk of its own, and split `j` attends over chunks `0..j`
with `lse_attention`: partial softmaxes per chunk merged by log-sum-exp, recomputed
chunk by chunk in backward. So

* K/V memory is the same as the buffer's, allocated split by split, without the buffer's
  prefix copy when it grows;
* attention saves the split's query, output and LSE and no mask: the fully visible
  prefix chunks need none and the own chunk's causal mask is rebuilt when used.

Gradients follow the buffer cache's scheme: split `j`'s backward yields gradients for
chunks `< j`, added into per-chunk accumulators of the entry; split `c` returns its own
chunk's gradient plus what later splits left for it; split 0's backward frees the entry.
Recomputation (a checkpoint re-running split `j`'s forward) rewrites chunk `j` with the
same values, never a second chunk.

The kernel is `lse_attention`: exact on every device. On CUDA fp16/bf16 with flash-attn
installed its forward runs flash-attn's public `flash_attn_func(..., return_attn_probs=True)`
per chunk, which returns each partial's LSE; backward (and every path with packed
documents) is plain PyTorch matmuls over the chunks, since only a flash-attn backward
taking an external LSE is private. So on GPU the backward trades speed for the chunked
layout. No attention dropout.

Sliding windows (``window``) skip the chunks before a query block's windows and mask the
rest in the kernel; attention sinks (``sink``) join the merged softmax as
`cpu_split_attention.with_sink` does, so the backward over the chunks, given the joined
output and LSE, stays exact. ``whole_sequence_attention`` runs the same kernel over one
chunk for unsplit calls that need it (sinks on CUDA).
"""

from dataclasses import dataclass, field
from functools import partial

import torch

from megatron.seqsplit import attention_exchange
from megatron.seqsplit.cpu_split_attention import sink_gradient, with_sink
from megatron.seqsplit.documents import key_documents
from megatron.seqsplit.lse_attention import (
    DEFAULT_MAX_BLOCK_ELEMENTS,
    lse_attention_backward,
    lse_attention_forward,
    lse_attention_partial,
    merge_partials,
    stat_dtype,
)


@dataclass
class _ChunkEntry:
    keys: dict = field(default_factory=dict)  # split index -> [b, g, l, d]
    values: dict = field(default_factory=dict)
    grad_keys: dict = field(default_factory=dict)  # split index -> gradient left by later splits
    grad_values: dict = field(default_factory=dict)

    def tensors(self):
        return [*self.keys.values(), *self.values.values(),
                *self.grad_keys.values(), *self.grad_values.values()]


def _entry(store, entry_id, split) -> _ChunkEntry:
    entry = store.lookup(entry_id)
    if entry is None:
        if split.split_index != 0:
            raise RuntimeError(
                f"no cached K/V chunks for microbatch {split.microbatch_id}, layer "
                f"{entry_id[1]}: split {split.split_index} ran forward before split 0, or the "
                "entry was already freed")
        entry = store.insert(entry_id, _ChunkEntry())
    if not isinstance(entry, _ChunkEntry):
        raise RuntimeError(f"KV-cache entry {entry_id} is a buffer entry, not chunks: one "
                           "model mixes --seq1f1b-kv-cache layouts")
    missing = [c for c in range(split.split_index) if c not in entry.keys]
    if missing:
        raise RuntimeError(f"split {split.split_index} of microbatch {split.microbatch_id} "
                           f"needs the K/V chunks of splits {missing}, which have not run")
    return entry


def _own_copy(tensor):
    """``tensor`` [l, b, g, d] as a new [b, g, l, d] tensor, always a copy: with b = g = 1
    the permuted view is already contiguous and ``contiguous()`` would return it, sharing
    the caller's storage, which megatron-core's MLA up-projection recomputation
    (--recompute-modules mla_up_proj) frees after core attention, before the next split
    reads the chunk."""
    return tensor.detach().permute(1, 2, 0, 3).clone(memory_format=torch.contiguous_format)


def _store_own(entry: _ChunkEntry, split_index: int, key, value, visible=None):
    """Keep this split's K/V as chunk `split_index`; return chunks 0..split_index, the
    last one cut to its first ``visible`` positions (context parallelism: the chunk is
    the whole split's, this rank's queries end inside it)."""
    # [l, b, g, d] -> [b, g, l, d]: one compact copy of the split's own K/V (it also stops
    # the chunk from pinning the fused QKV projection output it may be a view of)
    entry.keys[split_index] = _own_copy(key)
    entry.values[split_index] = _own_copy(value)
    chunks = range(split_index + 1)
    keys = [entry.keys[c] for c in chunks]
    values = [entry.values[c] for c in chunks]
    if visible is not None:
        keys[-1], values[-1] = keys[-1][:, :, :visible], values[-1][:, :, :visible]
    return keys, values


def _whole_chunk(grad, length):
    """The gradient of a chunk's first positions, zero-padded to the chunk's ``length``
    (the positions no query of this rank saw)."""
    missing = length - grad.shape[2]
    return grad if missing == 0 else torch.nn.functional.pad(grad, (0, 0, 0, missing))


def _accumulate(grads: dict, index: int, grad):
    if index in grads:
        grads[index] += grad
    else:
        grads[index] = grad


def _local_kwargs(kwargs, keys, num_moved):
    """The asker's own part: chunks num_moved..j, whose positions start at 0 for the
    kernel, so the document ids drop the moved chunks' positions."""
    documents = kwargs["document_ids"]
    if documents is None:
        return kwargs
    moved = sum(key.shape[2] for key in keys[:num_moved])
    return dict(kwargs, document_ids=documents[:, moved:])


def _serve(exchange, q, keys, kwargs):
    attention_exchange.serve(exchange, q, keys[0], softmax_scale=kwargs["softmax_scale"],
                             documents=kwargs["document_ids"])


def _attend(exchange, q, keys, values, kwargs):
    """Forward over chunks 0..j; with an exchange, serve the peer first (helper) or have
    it compute the first chunks while this rank does the rest (asker)."""
    if exchange is None:
        return lse_attention_forward(q, keys, values, **kwargs)
    if exchange.role == attention_exchange.HELP:
        _serve(exchange, q, keys, kwargs)
        return lse_attention_forward(q, keys, values, **kwargs)
    k = exchange.num_chunks
    pending = attention_exchange.ask_forward(exchange, q, keys[:k], values[:k],
                                             kwargs["document_ids"])
    out, lse = lse_attention_partial(q, keys[k:], values[k:], **_local_kwargs(kwargs, keys, k))
    remote_out, remote_lse = pending.wait()
    out, lse = merge_partials(out, lse, remote_out, remote_lse)
    return out.to(q.dtype), lse


def _attend_backward(exchange, grad_out, q, out, lse, keys, values, kwargs):
    """Backward over chunks 0..j, sharing the work as `_attend` does."""
    if exchange is not None and exchange.role == attention_exchange.HELP:
        _serve(exchange, q, keys, kwargs)
    if exchange is None or exchange.role == attention_exchange.HELP:
        return lse_attention_backward(grad_out, q, out, lse, keys, values, **kwargs)
    k = exchange.num_chunks
    pending = attention_exchange.ask_backward(exchange, grad_out, q, out, lse,
                                              keys[:k], values[:k], kwargs["document_ids"])
    dq, dks, dvs = lse_attention_backward(
        grad_out, q, out, lse, keys[k:], values[k:],
        dq_dtype=stat_dtype(q.dtype),
        **_local_kwargs(kwargs, keys, k))
    remote_dq, remote_dks, remote_dvs = attention_exchange.split_backward_result(
        exchange, pending.wait())
    return (dq + remote_dq).to(q.dtype), list(remote_dks) + dks, list(remote_dvs) + dvs


class _ChunkedSplitAttention(torch.autograd.Function):
    """(query [l, b, hq, d], own key/value [l, b, g, d]) -> context [l, b, hq, d]."""

    @staticmethod
    def forward(ctx, query, key, value, entry, split_index, softmax_scale, documents,
                on_first_split_done, max_block_elements, store, window, sink, visible):
        keys, values = _store_own(entry, split_index, key, value, visible)
        ctx.kwargs = _kernel_kwargs(softmax_scale, documents, max_block_elements, window)
        out, lse = _attend(store.unit_exchange.current(True), query.permute(1, 2, 0, 3),
                           keys, values, ctx.kwargs)
        if sink is not None:  # one more part of the softmax, with no value
            out, lse = with_sink(out, lse, sink)
        # saved and returned in Megatron's [l, b, h, d] layout: the output projection keeps
        # this same storage, not a second copy. The query is copied so a view of the fused
        # QKV output does not keep K and V alive twice (they are in the chunks)
        out = out.permute(2, 0, 1, 3).contiguous()
        ctx.save_for_backward(query.contiguous(), out, lse, sink)
        ctx.entry, ctx.split_index, ctx.chunks = entry, split_index, (keys, values)
        ctx.unit_exchange = store.unit_exchange  # at backward time: the backward unit's
        ctx.on_first_split_done = on_first_split_done
        ctx.kv_dtype = key.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, out, lse, sink = ctx.saved_tensors
        keys, values = ctx.chunks
        entry, j = ctx.entry, ctx.split_index
        bhld = (1, 2, 0, 3)  # [l, b, h, d] -> the kernel's [b, h, l, d]
        dsink = (sink_gradient(grad_out.permute(bhld), out.permute(bhld), lse, sink)
                 if ctx.needs_input_grad[11] else None)
        dq, dks, dvs = _attend_backward(ctx.unit_exchange.current(False),
                                        grad_out.permute(bhld), query.permute(bhld),
                                        out.permute(bhld), lse, keys, values, ctx.kwargs)
        for c in range(j):  # prefix chunks: their own splits' backwards return these
            _accumulate(entry.grad_keys, c, dks[c])
            _accumulate(entry.grad_values, c, dvs[c])
        length = entry.keys[j].shape[2]  # under CP: the whole split, beyond the queries
        dk = _whole_chunk(dks[j], length) + entry.grad_keys.pop(j, 0)
        dv = _whole_chunk(dvs[j], length) + entry.grad_values.pop(j, 0)
        if j == 0:
            ctx.on_first_split_done()
        ctx.chunks = None

        def megatron_layout(x):  # [b, h, l, d] -> [l, b, h, d]
            return x.permute(2, 0, 1, 3).to(ctx.kv_dtype)

        return (dq.permute(2, 0, 1, 3), megatron_layout(dk), megatron_layout(dv),
                None, None, None, None, None, None, None, None, dsink, None)


def _kernel_kwargs(softmax_scale, documents, max_block_elements, window):
    kwargs = dict(softmax_scale=softmax_scale, document_ids=documents,
                  max_block_elements=max_block_elements)
    if window is not None:  # only when set: the attention exchange's kernels take none
        kwargs["window"] = window
    return kwargs


class _WholeSequenceAttention(torch.autograd.Function):
    """``lse_attention`` over one chunk (the queries are the last of the keys), with
    sliding windows and sinks: kernel layout [b, h, l, d] in and out."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, window, sink):
        ctx.kwargs = _kernel_kwargs(softmax_scale, None, DEFAULT_MAX_BLOCK_ELEMENTS, window)
        out, lse = lse_attention_forward(q, [k], [v], **ctx.kwargs)
        if sink is not None:
            out, lse = with_sink(out, lse, sink)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dq, (dk,), (dv,) = lse_attention_backward(grad_out, q, out, lse, [k], [v],
                                                  **ctx.kwargs)
        dsink = sink_gradient(grad_out, out, lse, sink) if ctx.needs_input_grad[5] else None
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, dsink


def whole_sequence_attention(q, k, v, *, softmax_scale, window=None, sink=None):
    """Causal attention of q [b, hq, l, d] over k/v [b, g, l, d] through the chunked
    kernel (exact on every device), with a sliding ``window`` and attention ``sink``."""
    return _WholeSequenceAttention.apply(q, k, v, softmax_scale, window, sink)


def chunked_split_attention(query, key, value, *, split, store, layer_key, softmax_scale,
                            max_block_elements=DEFAULT_MAX_BLOCK_ELEMENTS, window=None,
                            sink=None):
    """Split attention over the microbatch's K/V chunks; same contract as
    `kv_cache.split_causal_attention` (query [l, b, hq, d], key/value [l, b, g, d],
    returns [l, b, hq, d]) for a split with `num_splits > 1` or a context-parallel part
    (`split.context_parallel`: key/value are then the whole split's, gathered over the
    ranks, and the query is this rank's part: the chunk holds the whole split, the
    part's queries see it up to their own end). `store`: a `kv_cache.KVCacheStore`, used
    through its public methods and `unit_exchange` (the running unit's attention
    exchange)."""
    context_parallel = getattr(split, "context_parallel", None)
    offset, length = ((split.offset, split.length) if context_parallel is None
                      else (split.cache_offset, split.cache_length))
    if key.shape[0] != length or offset + length > split.seq_length:
        raise ValueError(
            f"split {split.split_index}: K/V length {key.shape[0]} does not match "
            f"length {length} at offset {offset} of {split.seq_length}")
    visible = None if context_parallel is None else split.offset + split.length - offset
    entry_id = (split.microbatch_id, layer_key)
    entry = _entry(store, entry_id, split)
    documents = key_documents(split, split.offset + split.length, query.device)
    if (window is not None or sink is not None) and (
            documents is not None or store.unit_exchange.current(True) is not None):
        raise ValueError("sliding windows and attention sinks in the chunked KV cache: not "
                         "with packed documents or SlimPipe's attention exchange yet")
    tracked = torch.is_grad_enabled() and any(
        t.requires_grad for t in (query, key, value))
    if tracked:
        release = partial(store.release, entry_id)
        out = _ChunkedSplitAttention.apply(
            query, key, value, entry, split.split_index, softmax_scale, documents, release,
            max_block_elements, store, window, sink, visible)
    else:
        keys, values = _store_own(entry, split.split_index, key, value, visible)
        out, lse = _attend(store.unit_exchange.current(True), query.permute(1, 2, 0, 3),
                           keys, values, _kernel_kwargs(softmax_scale, documents,
                                                        max_block_elements, window))
        if sink is not None:
            out, _ = with_sink(out, lse, sink)
        out = out.permute(2, 0, 1, 3).contiguous()
    store.release_after_last_forward(entry_id, split, tracked)
    return out  # [l, b, hq, d]
