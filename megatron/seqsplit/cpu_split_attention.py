"""A split's causal attention on CPU without a mask: two mask-free kernels merged by LSE.

A split's ``lq`` queries are the last ``lq`` of its ``lk`` keys (bottom-right causal).
Given as one masked call, torch's CPU SDPA either builds the ``lq x lk`` mask and runs its
math path (1.2x the forward of the flash kernel) or needs a strided mask vector
(``attention_backends._bottom_right_causal_cpu``). But the keys fall in two parts that
need no mask at all:

* the split's own block, the last ``lq`` keys: plain causal attention (``is_causal``:
  top-left and bottom-right alignment coincide for a square block);
* the prefix, the ``lk - lq`` keys before it: every query sees all of them.

Each part runs torch's fused CPU flash kernel, which returns its log-sum-exp (LSE); the
parts merge exactly:

    lse = logaddexp(lse_own, lse_prefix),
    out = exp(lse_own - lse) out_own + exp(lse_prefix - lse) out_prefix

Backward is the flash recurrence of each part with the merged output and LSE
(``P = exp(S - lse)``, ``dS = P (dO V^T - rowsum(dO * O))``): the fused backward kernel
computes each part's gradients exactly when given those. Saved for backward: q, k, v
(views of what the caller keeps anyway), the merged output and its LSE; no mask.
No dropout: the kernel draws its own mask per call (callers route dropout elsewhere).

Attention sinks (``softmax_type`` off-by-one or learnable, gpt-oss): a per-head logit
``sink`` joins every query's softmax with no value, megatron-core's ``SoftmaxOne``. It
merges like one more part with a zero output: ``lse' = logaddexp(lse, sink)``,
``out' = exp(lse - lse') out``. The fused backward given ``out'`` and ``lse'`` is then
exact for q, k and v (the sink's column has no value, so it adds nothing to
``rowsum(dO * O')``), and the sink's own gradient is ``-sum_i exp(sink - lse'_i)
rowsum(dO_i * O'_i)`` (``sink_gradient``).

With packed documents (contiguous runs of positions), the own block takes the split's
per-document causal mask, ``lq x lq`` at most; of the prefix, only the queries of the
document that began before the split see keys, all of that document's earlier keys and
nothing else: per batch row, an unmasked rectangle (``prefix_visibility``), run as its
own mask-free call and merged into those rows.
"""

import torch

_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def split_causal_attention_cpu(q, k, v, softmax_scale, sink=None):
    """q [b, hq, lq, d], k/v [b, g, lk, d] (hq % g == 0, lq < lk) on CPU -> [b, hq, lq, d].

    The queries are the last ``lq`` positions of the keys; no dropout; ``sink`` [hq]: the
    attention sinks' logits, or None."""
    if not q.shape[2] < k.shape[2]:
        raise ValueError(f"a split has a prefix: need lq < lk, got {q.shape[2]} and {k.shape[2]}")
    # every query sees the whole prefix: one part, all batch rows and queries from key 0
    return _SplitAttention.apply(q, k, v, softmax_scale, None, None, sink)


def split_document_attention_cpu(q, k, v, softmax_scale, own_bias, prefix_rows, sink=None):
    """As ``split_causal_attention_cpu`` with packed documents: ``own_bias`` the additive
    per-document causal mask of the own block [b, 1, lq, lq]; ``prefix_rows``, per batch
    row, (rows, first_key) from ``prefix_visibility``."""
    if not q.shape[2] < k.shape[2]:
        raise ValueError(f"a split has a prefix: need lq < lk, got {q.shape[2]} and {k.shape[2]}")
    return _SplitAttention.apply(q, k, v, softmax_scale, own_bias, tuple(prefix_rows), sink)


def masked_attention_cpu(q, k, v, softmax_scale, sink, *, is_causal=False, attn_mask=None):
    """One fused CPU call (``is_causal`` or ``attn_mask``, as SDPA takes them) with
    attention sinks: what SDPA would compute plus the sink in every row's softmax."""
    return _MaskedSinkAttention.apply(q, k, v, softmax_scale, sink, is_causal, attn_mask)


def with_sink(out, lse, sink):
    """``out`` [b, hq, lq, d] and ``lse`` [b, hq, lq] with the sink logits [hq] joined to
    every row's softmax: (out', lse'), out' rounded once to ``out``'s dtype."""
    lse_all = torch.logaddexp(lse, sink.to(lse.dtype).view(1, -1, 1))
    weight = torch.exp(lse - lse_all).unsqueeze(-1)
    return (out.to(lse.dtype) * weight).to(out.dtype), lse_all


def sink_gradient(grad_out, out, lse, sink):
    """The sinks' gradient [hq] from the output's gradient, given the output and LSE
    with the sink joined (``with_sink``)."""
    rows = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # rowsum(dO * O')
    p_sink = torch.exp(sink.to(lse.dtype).view(1, -1, 1) - lse)
    return -(rows * p_sink).sum(dim=(0, 2)).to(sink.dtype)


class _MaskedSinkAttention(torch.autograd.Function):
    """The fused CPU kernel with a sink: forward, then the sink joined; backward, the
    fused backward with the joined output and LSE."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, sink, is_causal, attn_mask):
        out, lse = _flash_forward(q, k, v, 0.0, is_causal, attn_mask=attn_mask,
                                  scale=softmax_scale)[:2]
        out, lse = with_sink(out, lse, sink)
        ctx.save_for_backward(q, k, v, out, lse, sink, attn_mask)
        ctx.softmax_scale, ctx.is_causal = softmax_scale, is_causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sink, attn_mask = ctx.saved_tensors
        grad_out = grad_out.contiguous() if grad_out.stride(-1) != 1 else grad_out
        dq, dk, dv = _flash_backward(grad_out, q, k, v, out, lse, 0.0, ctx.is_causal,
                                     attn_mask=attn_mask, scale=ctx.softmax_scale)
        dsink = sink_gradient(grad_out, out, lse, sink) if ctx.needs_input_grad[4] else None
        return dq, dk, dv, None, dsink, None, None


def prefix_visibility(document_ids, q_length):
    """Per batch row of ``document_ids`` [b, lk] (contiguous runs), (rows, first_key): the
    first ``rows`` of the last ``q_length`` positions (the document open at the split's
    start) see the prefix keys [first_key, lk - q_length); (0, lk - q_length) when the
    split starts a document. One host sync."""
    offset = document_ids.shape[1] - q_length
    in_first = document_ids == document_ids[:, offset:offset + 1]
    rows = in_first[:, offset:].sum(dim=1)
    first_key = in_first[:, :offset + 1].int().argmax(dim=1)
    return tuple((rows_j, first_j) if first_j < offset else (0, offset)
                 for rows_j, first_j in torch.stack([rows, first_key], dim=1).tolist())


def _merge(out_own, lse_own, out_prefix, lse_prefix):
    lse = torch.logaddexp(lse_own, lse_prefix)  # float32 (float64 for float64 inputs)
    weight_own = torch.exp(lse_own - lse).unsqueeze(-1)
    weight_prefix = torch.exp(lse_prefix - lse).unsqueeze(-1)
    # in the statistics' dtype, rounded once to the inputs' (as the fused kernel does)
    out = out_own.to(lse.dtype) * weight_own + out_prefix.to(lse.dtype) * weight_prefix
    return out.to(out_own.dtype), lse


def own_and_prefix_forward(q, k_prefix, v_prefix, k_own, v_own, softmax_scale):
    """The own block (causal) and the whole prefix (unmasked), merged: (out, lse)."""
    out, lse = _flash_forward(q, k_own, v_own, 0.0, True, scale=softmax_scale)[:2]
    return _merge(out, lse, *_flash_forward(q, k_prefix, v_prefix, 0.0, False,
                                            scale=softmax_scale)[:2])


def own_and_prefix_backward(grad_out, q, k_prefix, v_prefix, k_own, v_own, out, lse,
                            softmax_scale):
    """Each part's fused backward with the merged ``out`` and ``lse``: (dq, dk_prefix,
    dv_prefix, dk_own, dv_own), the prefix's and the own block's K/V gradients apart."""
    grad_out = grad_out.contiguous() if grad_out.stride(-1) != 1 else grad_out
    dq, dk_own, dv_own = _flash_backward(grad_out, q, k_own, v_own, out, lse, 0.0, True,
                                         scale=softmax_scale)
    dq_prefix, dk_prefix, dv_prefix = _flash_backward(grad_out, q, k_prefix, v_prefix, out,
                                                      lse, 0.0, False, scale=softmax_scale)
    return dq.add_(dq_prefix), dk_prefix, dv_prefix, dk_own, dv_own


def _document_prefix_parts(prefix_rows):
    """(batch rows, query count, first key) of each unmasked prefix call with documents:
    per batch row, the queries of the document open at the split's start. (Without
    documents the one prefix call covers every row, query and prefix key.)"""
    return [(slice(j, j + 1), rows, first) for j, (rows, first) in enumerate(prefix_rows) if rows]


class _SplitAttention(torch.autograd.Function):
    """The own block (causal, or ``own_bias`` with documents) and the unmasked prefix
    parts, merged by LSE; backward runs each part's fused backward with the merged
    output and LSE."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, own_bias, prefix_rows, sink):
        prefix = k.shape[2] - q.shape[2]
        if prefix_rows is None:  # one part, every row: the merge is the result, no copy back
            out, lse = own_and_prefix_forward(q, k[:, :, :prefix], v[:, :, :prefix],
                                              k[:, :, prefix:], v[:, :, prefix:], softmax_scale)
        else:
            out, lse = _flash_forward(q, k[:, :, prefix:], v[:, :, prefix:], 0.0, False,
                                      attn_mask=own_bias, scale=softmax_scale)[:2]
        for batch, rows, first in _document_prefix_parts(prefix_rows or ()):
            part = (batch, slice(None), slice(0, rows))
            before = _flash_forward(q[part], k[batch, :, first:prefix], v[batch, :, first:prefix],
                                    0.0, False, scale=softmax_scale)
            out[part], lse[part] = _merge(out[part], lse[part], *before)
        if sink is not None:
            out, lse = with_sink(out, lse, sink)
        ctx.save_for_backward(q, k, v, out, lse, own_bias, sink)
        ctx.softmax_scale, ctx.prefix_rows = softmax_scale, prefix_rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, own_bias, sink = ctx.saved_tensors
        prefix = k.shape[2] - q.shape[2]
        dsink = sink_gradient(grad_out, out, lse, sink) if ctx.needs_input_grad[6] else None
        if ctx.prefix_rows is None:  # the prefix part covers every key before the block
            dq, dk_prefix, dv_prefix, dk_own, dv_own = own_and_prefix_backward(
                grad_out, q, k[:, :, :prefix], v[:, :, :prefix], k[:, :, prefix:],
                v[:, :, prefix:], out, lse, ctx.softmax_scale)
            # one copy of each part into the prefix-long gradient, no zero fill
            return (dq, torch.cat([dk_prefix, dk_own], dim=2),
                    torch.cat([dv_prefix, dv_own], dim=2), None, None, None, dsink)
        grad_out = grad_out.contiguous() if grad_out.stride(-1) != 1 else grad_out
        dq, dk_own, dv_own = _flash_backward(
            grad_out, q, k[:, :, prefix:], v[:, :, prefix:], out, lse, 0.0, False,
            attn_mask=own_bias, scale=ctx.softmax_scale)
        # with documents, keys no query sees get no gradient: zeros
        dk, dv = k.new_zeros(k.shape), v.new_zeros(v.shape)
        dk[:, :, prefix:], dv[:, :, prefix:] = dk_own, dv_own
        for batch, rows, first in _document_prefix_parts(ctx.prefix_rows):
            part = (batch, slice(None), slice(0, rows))
            dq_prefix, dk_prefix, dv_prefix = _flash_backward(
                grad_out[part], q[part], k[batch, :, first:prefix], v[batch, :, first:prefix],
                out[part], lse[part], 0.0, False, scale=ctx.softmax_scale)
            dq[part] += dq_prefix
            dk[batch, :, first:prefix], dv[batch, :, first:prefix] = dk_prefix, dv_prefix
        return dq, dk, dv, None, None, None, dsink
