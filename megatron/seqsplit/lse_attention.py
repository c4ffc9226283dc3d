"""Exact causal attention over a list of K/V chunks, merged by log-sum-exp (pure PyTorch).

The keys of one split are the concatenation of chunks ``c = 0..n-1`` (chunk ``c`` holds
key positions ``[start_c, start_c + l_c)``); the ``lq`` queries are the last ``lq`` of
the ``lk`` keys (bottom-right causal), optionally restricted to their own document.
Nothing is concatenated: every chunk contributes a partial softmax, and partials merge
by their log-sum-exp (LSE):

    lse = logaddexp(lse_a, lse_b),  out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

Backward is the flash-attention recurrence over the same chunks, with the merged output
and LSE: ``P_c = exp(S_c - lse)``, ``dS_c = P_c (dO V_c^T - rowsum(dO * O))``, so the
gradient of every chunk is exact without ever holding the full ``lq x lk`` scores. Only
``q``, the output and the LSE are needed from the forward; scores are recomputed per
chunk and per block of queries (``max_block_elements`` bounds their transient size), and
no mask is ever saved. Fully masked chunks are skipped.

Layouts: q [b, hq, lq, d]; chunks [b, g, l_c, d] with hq % g == 0 (GQA reads the groups,
never expanded heads); document_ids [b, lk] or None. Scores and softmax statistics are
float32 for half inputs (float64 stays float64); matmuls run in the input dtype.
"""

from typing import Sequence

import torch

DEFAULT_MAX_BLOCK_ELEMENTS = 1 << 26  # transient scores per (query block, chunk): 256 MiB fp32


def stat_dtype(dtype):
    """Dtype of scores and softmax statistics for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _query_blocks(q, chunk_lengths, max_block_elements):
    """Query row ranges whose scores against the longest chunk stay under the bound."""
    b, hq, lq, _ = q.shape
    per_row = b * hq * max(chunk_lengths)
    rows = max(1, min(lq, max_block_elements // max(per_row, 1)))
    return [(i, min(i + rows, lq)) for i in range(0, lq, rows)]


def _allowed(q_first, n, start, length, document_ids, device):
    """Visibility of keys [start, start+length) for queries at positions q_first..+n.

    Returns None (everything visible), False (nothing visible) or a bool tensor
    broadcastable to the scores [b, g, r, n, length].
    """
    causal_all = start + length - 1 <= q_first
    if causal_all and document_ids is None:
        return None
    if start > q_first + n - 1:
        return False
    q_pos = torch.arange(q_first, q_first + n, device=device)
    k_pos = torch.arange(start, start + length, device=device)
    allowed = (k_pos[None, :] <= q_pos[:, None])[None, None, None]  # [1, 1, 1, n, l]
    if document_ids is not None:
        docs_q = document_ids[:, q_first:q_first + n]
        docs_k = document_ids[:, start:start + length]
        same = docs_q[:, :, None] == docs_k[:, None, :]  # [b, n, l]
        allowed = allowed & same[:, None, None]
    if not bool(allowed.any()):
        return False
    return allowed


class _Chunks:
    """Key/value chunks with their positions; shared by forward and backward."""

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]):
        if len(keys) != len(values) or not keys:
            raise ValueError("need one value chunk per key chunk, and at least one chunk")
        self.keys, self.values = list(keys), list(values)
        self.starts, start = [], 0
        for k, v in zip(self.keys, self.values):
            if k.shape != v.shape or k.dim() != 4:
                raise ValueError(f"key/value chunks must be [b, g, l, d] alike; got {k.shape}, {v.shape}")
            self.starts.append(start)
            start += k.shape[2]
        self.total = start

    def lengths(self):
        return [k.shape[2] for k in self.keys]


def _check(q, chunks: _Chunks, document_ids, query_start):
    b, hq, lq, d = q.shape
    k0 = chunks.keys[0]
    if k0.shape[0] != b or k0.shape[3] != d or hq % k0.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not match K/V chunks {tuple(k0.shape)}")
    if query_start is None and lq > chunks.total:
        raise ValueError(f"{lq} queries but only {chunks.total} keys")
    if query_start is not None and query_start < 0:
        raise ValueError(f"query_start must be >= 0, got {query_start}")
    # documents of every position up to the last query (the keys' when the queries are
    # the last keys; with query_start, also the positions between the keys and queries)
    positions = chunks.total if query_start is None else max(chunks.total, query_start + lq)
    if document_ids is not None and tuple(document_ids.shape) != (b, positions):
        raise ValueError(f"document_ids must be [b, positions] = [{b}, {positions}], "
                         f"got {tuple(document_ids.shape)}")


def _scores(q_rows, key, allowed, shape5):
    """Scores [b, g, r, n, l] of pre-scaled query rows, in the statistics dtype; masked
    entries are -inf. A fresh tensor, so callers may work on it in place."""
    s = torch.matmul(q_rows, key.transpose(-1, -2)).view(*shape5, key.shape[2])
    s = s.to(stat_dtype(q_rows.dtype))
    if allowed is not None:
        s.masked_fill_(~allowed, float("-inf"))
    return s


def lse_attention_forward(q, keys, values, *, softmax_scale, document_ids=None,
                          query_start=None, max_block_elements=DEFAULT_MAX_BLOCK_ELEMENTS):
    """(out [b, hq, lq, d] in q's dtype, lse [b, hq, lq] in the statistics dtype)."""
    out, lse = lse_attention_partial(q, keys, values, softmax_scale=softmax_scale,
                                     document_ids=document_ids, query_start=query_start,
                                     max_block_elements=max_block_elements)
    return out.to(q.dtype), lse


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Attention over the union of two disjoint key sets from the partials over each
    (outputs [b, h, l, d] and LSEs [b, h, l] in the statistics dtype)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.clamp_min(torch.finfo(lse.dtype).min)[..., None]
    out = out_a * torch.exp(lse_a[..., None] - safe) + out_b * torch.exp(lse_b[..., None] - safe)
    return out, lse


def lse_attention_partial(q, keys, values, *, softmax_scale, document_ids=None,
                          query_start=None, max_block_elements=DEFAULT_MAX_BLOCK_ELEMENTS):
    """Like ``lse_attention_forward`` but the output stays in the statistics dtype, to be
    merged with other partials (``merge_partials``).

    ``query_start``: position of the first query among the chunks' keys; default
    ``lk - lq`` (the queries are the last keys). A query block placed after every key
    (``query_start >= lk``) sees all of them: a prefix computed apart from its queries
    (with ``document_ids`` [b, query_start + lq], only the keys of its own document).
    """
    chunks = _Chunks(keys, values)
    _check(q, chunks, document_ids, query_start)
    b, hq, lq, d = q.shape
    g = chunks.keys[0].shape[1]
    r = hq // g
    stat = stat_dtype(q.dtype)
    q5 = q.reshape(b, g, r, lq, d) * softmax_scale  # scaled once, not every score
    out = torch.zeros(b, g, r, lq, d, dtype=stat, device=q.device)
    lse = torch.full((b, g, r, lq), float("-inf"), dtype=stat, device=q.device)
    first = chunks.total - lq if query_start is None else query_start
    tiny = torch.finfo(stat).min
    for i0, i1 in _query_blocks(q, chunks.lengths(), max_block_elements):
        n = i1 - i0
        q_rows = q5[:, :, :, i0:i1].reshape(b, g, r * n, d)
        acc_out, acc_lse = out[:, :, :, i0:i1], lse[:, :, :, i0:i1]
        for key, value, start in zip(chunks.keys, chunks.values, chunks.starts):
            allowed = _allowed(first + i0, n, start, key.shape[2], document_ids, q.device)
            if allowed is False:
                continue
            s = _scores(q_rows, key, allowed, (b, g, r, n))
            row_max = s.amax(dim=-1, keepdim=True).clamp_min_(tiny)  # finite for empty rows
            probs = s.sub_(row_max).exp_()  # unnormalised, in place
            row_sum = probs.sum(dim=-1)
            part = torch.matmul(probs.to(value.dtype).view(b, g, r * n, -1), value)
            part = part.view(b, g, r, n, d).to(stat) / row_sum.clamp_min(torch.finfo(stat).tiny)[..., None]
            part_lse = row_max[..., 0] + row_sum.log()  # -inf where a row sees nothing here
            new_lse = torch.logaddexp(acc_lse, part_lse)
            safe = new_lse.clamp_min(tiny)[..., None]
            acc_out.mul_(torch.exp(acc_lse[..., None] - safe)).add_(
                part * torch.exp(part_lse[..., None] - safe))
            acc_lse.copy_(new_lse)
    return out.view(b, hq, lq, d), lse.view(b, hq, lq)


def lse_attention_backward(grad_out, q, out, lse, keys, values, *, softmax_scale,
                           document_ids=None, query_start=None,
                           max_block_elements=DEFAULT_MAX_BLOCK_ELEMENTS, dq_dtype=None):
    """(dq, [dk_c], [dv_c]) for the merged attention; chunk grads in stat dtype, dq in
    ``dq_dtype`` (default q's dtype; the statistics dtype to add partials exactly).
    ``out`` and ``lse`` are the merged output and LSE over *all* keys the queries see,
    also when ``keys`` are only some of them (``query_start`` as in the forward)."""
    chunks = _Chunks(keys, values)
    _check(q, chunks, document_ids, query_start)
    b, hq, lq, d = q.shape
    g = chunks.keys[0].shape[1]
    r = hq // g
    stat = stat_dtype(q.dtype)
    q5 = q.reshape(b, g, r, lq, d) * softmax_scale
    do5 = grad_out.reshape(b, g, r, lq, d)
    lse5 = lse.reshape(b, g, r, lq)
    delta = (grad_out.to(stat) * out.to(stat)).sum(-1).reshape(b, g, r, lq)
    dq = torch.zeros(b, g, r, lq, d, dtype=stat, device=q.device)
    dks = [torch.zeros(k.shape, dtype=stat, device=k.device) for k in chunks.keys]
    dvs = [torch.zeros(v.shape, dtype=stat, device=v.device) for v in chunks.values]
    first = chunks.total - lq if query_start is None else query_start
    for i0, i1 in _query_blocks(q, chunks.lengths(), max_block_elements):
        n = i1 - i0
        q_rows = q5[:, :, :, i0:i1].reshape(b, g, r * n, d)
        do_rows = do5[:, :, :, i0:i1].reshape(b, g, r * n, d)
        row_lse = lse5[:, :, :, i0:i1, None]
        row_delta = delta[:, :, :, i0:i1, None]
        for c, (key, value, start) in enumerate(zip(chunks.keys, chunks.values, chunks.starts)):
            allowed = _allowed(first + i0, n, start, key.shape[2], document_ids, q.device)
            if allowed is False:
                continue
            probs = _scores(q_rows, key, allowed, (b, g, r, n)).sub_(row_lse).exp_()
            probs_rows = probs.view(b, g, r * n, -1)
            dvs[c] += torch.matmul(probs_rows.transpose(-1, -2).to(do_rows.dtype), do_rows).to(stat)
            dp = torch.matmul(do_rows, value.transpose(-1, -2)).view(b, g, r, n, -1).to(stat)
            ds = dp.sub_(row_delta).mul_(probs).view(b, g, r * n, -1)  # dS / scale
            ds_in = ds.to(q.dtype)
            dq[:, :, :, i0:i1] += torch.matmul(ds_in, key).view(b, g, r, n, d).to(stat)
            dks[c] += torch.matmul(ds_in.transpose(-1, -2), q_rows).to(stat)  # q_rows is scaled
    dq.mul_(softmax_scale)
    return dq.view(b, hq, lq, d).to(dq_dtype or q.dtype), dks, dvs


__all__ = ["stat_dtype", "lse_attention_forward", "lse_attention_partial", "lse_attention_backward",
           "merge_partials", "DEFAULT_MAX_BLOCK_ELEMENTS"]
