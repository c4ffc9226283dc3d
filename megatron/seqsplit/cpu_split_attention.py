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

With packed documents (contiguous runs of positions), the own block takes the split's
per-document causal mask, ``lq x lq`` at most; of the prefix, only the queries of the
document that began before the split see keys, all of that document's earlier keys and
nothing else: per batch row, an unmasked rectangle (``prefix_visibility``), run as its
own mask-free call and merged into those rows.
"""

import torch

_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def split_causal_attention_cpu(q, k, v, softmax_scale):
    """q [b, hq, lq, d], k/v [b, g, lk, d] (hq % g == 0, lq < lk) on CPU -> [b, hq, lq, d].

    The queries are the last ``lq`` positions of the keys; no dropout."""
    if not q.shape[2] < k.shape[2]:
        raise ValueError(f"a split has a prefix: need lq < lk, got {q.shape[2]} and {k.shape[2]}")
    return _SplitCausal.apply(q, k, v, softmax_scale)


def split_document_attention_cpu(q, k, v, softmax_scale, own_bias, prefix_rows):
    """As ``split_causal_attention_cpu`` with packed documents: ``own_bias`` the additive
    per-document causal mask of the own block [b, 1, lq, lq]; ``prefix_rows``, per batch
    row, (rows, first_key) from ``prefix_visibility``."""
    if not q.shape[2] < k.shape[2]:
        raise ValueError(f"a split has a prefix: need lq < lk, got {q.shape[2]} and {k.shape[2]}")
    return _SplitDocuments.apply(q, k, v, softmax_scale, own_bias, tuple(prefix_rows))


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


class _SplitCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale):
        prefix = k.shape[2] - q.shape[2]
        own = _flash_forward(q, k[:, :, prefix:], v[:, :, prefix:], 0.0, True, scale=softmax_scale)
        before = _flash_forward(q, k[:, :, :prefix], v[:, :, :prefix], 0.0, False,
                                scale=softmax_scale)
        out, lse = _merge(*own, *before)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale = softmax_scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        prefix = k.shape[2] - q.shape[2]
        grad_out = grad_out.contiguous() if grad_out.stride(-1) != 1 else grad_out
        dq_own, dk_own, dv_own = _flash_backward(
            grad_out, q, k[:, :, prefix:], v[:, :, prefix:], out, lse, 0.0, True,
            scale=ctx.softmax_scale)
        dq_prefix, dk_prefix, dv_prefix = _flash_backward(
            grad_out, q, k[:, :, :prefix], v[:, :, :prefix], out, lse, 0.0, False,
            scale=ctx.softmax_scale)
        return (dq_own + dq_prefix, torch.cat([dk_prefix, dk_own], dim=2),
                torch.cat([dv_prefix, dv_own], dim=2), None)


class _SplitDocuments(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, own_bias, prefix_rows):
        prefix = k.shape[2] - q.shape[2]
        out, lse = _flash_forward(q, k[:, :, prefix:], v[:, :, prefix:], 0.0, False,
                                  attn_mask=own_bias, scale=softmax_scale)
        for j, (rows, first) in enumerate(prefix_rows):
            if rows:
                part = (j, slice(None), slice(0, rows))
                before = _flash_forward(q[j:j + 1, :, :rows], k[j:j + 1, :, first:prefix],
                                        v[j:j + 1, :, first:prefix], 0.0, False,
                                        scale=softmax_scale)
                merged_out, merged_lse = _merge(out[part][None], lse[part][None], *before)
                out[part], lse[part] = merged_out[0], merged_lse[0]
        ctx.save_for_backward(q, k, v, out, lse, own_bias)
        ctx.softmax_scale, ctx.prefix_rows = softmax_scale, prefix_rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, own_bias = ctx.saved_tensors
        prefix = k.shape[2] - q.shape[2]
        grad_out = grad_out.contiguous() if grad_out.stride(-1) != 1 else grad_out
        dq, dk_own, dv_own = _flash_backward(
            grad_out, q, k[:, :, prefix:], v[:, :, prefix:], out, lse, 0.0, False,
            attn_mask=own_bias, scale=ctx.softmax_scale)
        dk, dv = k.new_zeros(k.shape), v.new_zeros(v.shape)
        dk[:, :, prefix:], dv[:, :, prefix:] = dk_own, dv_own
        for j, (rows, first) in enumerate(ctx.prefix_rows):
            if rows:
                rows_of = lambda t: t[j:j + 1, :, :rows]  # noqa: E731 - the row's queries
                dq_prefix, dk_prefix, dv_prefix = _flash_backward(
                    rows_of(grad_out), rows_of(q), k[j:j + 1, :, first:prefix],
                    v[j:j + 1, :, first:prefix], rows_of(out), lse[j:j + 1, :, :rows], 0.0,
                    False, scale=ctx.softmax_scale)
                dq[j:j + 1, :, :rows] += dq_prefix
                dk[j:j + 1, :, first:prefix], dv[j:j + 1, :, first:prefix] = dk_prefix, dv_prefix
        return dq, dk, dv, None, None, None
