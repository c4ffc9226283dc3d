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

Layouts: q [b, hq, lq, d]; key chunks [b, g, l_c, d], value chunks [b, g, l_c, dv] (dv = d but
for MLA) with hq % g == 0 (GQA reads the groups,
never expanded heads); document_ids [b, lk] or None. Scores and softmax statistics are
float32 for half inputs (float64 stays float64). Matmuls take half inputs (P and dS
rounded to half, as flash-attn does) and keep their products in the statistics dtype.
"""

import functools
import importlib
import weakref
from typing import Sequence

import torch

from megatron.seqsplit.documents import visible_key_ranges

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


def _allowed(q_first, n, start, length, document_ids, device, window=None):
    """Visibility of keys [start, start+length) for queries at positions q_first..+n
    (with ``window``, each query sees at most ``window`` keys before itself).

    Returns None (everything visible), False (nothing visible) or a bool tensor
    broadcastable to the scores [b, g, r, n, length].
    """
    if start > q_first + n - 1:
        return False
    if window is not None and start + length - 1 < q_first - window:
        return False  # before the earliest query's window
    in_window = window is None or start >= q_first + n - 1 - window
    if start + length - 1 <= q_first and document_ids is None and in_window:
        return None
    q_pos = torch.arange(q_first, q_first + n, device=device)
    k_pos = torch.arange(start, start + length, device=device)
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] >= q_pos[:, None] - window
    allowed = visible[None, None, None]  # [1, 1, 1, n, l]
    if document_ids is not None:
        docs_q = document_ids[:, q_first:q_first + n]
        docs_k = document_ids[:, start:start + length]
        same = docs_q[:, :, None] == docs_k[:, None, :]  # [b, n, l]
        allowed = allowed & same[:, None, None]
    return allowed  # (blocks that see nothing of a chunk were skipped: `_visible_pairs`)


class _PerTensorMemo:
    """tensor -> dict, each entry living as long as its tensor (a WeakKeyDictionary
    would compare tensors with ==, which is elementwise)."""

    def __init__(self):
        self._entries = {}  # id(tensor) -> (weak reference, dict)

    def get(self, tensor) -> dict:
        entry = self._entries.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            key = id(tensor)
            entry = (weakref.ref(tensor, lambda _, key=key: self._entries.pop(key, None)), {})
            self._entries[key] = entry
        return entry[1]


# document ids -> {(query blocks, key ranges): visibility}; an entry lives as long as
# the split's id tensor, which every layer's forward and backward share
_VISIBILITY = _PerTensorMemo()


def _visible_pairs(document_ids, first, blocks, chunks):
    """[block][chunk] -> whether the block's queries see any key of the chunk, or None
    without documents (positions alone decide then, with no host sync). With documents
    one host sync per split, not per (block, chunk) and layer."""
    if document_ids is None:
        return None
    key = (first, tuple(blocks), tuple(zip(chunks.starts, chunks.lengths())))
    memo = _VISIBILITY.get(document_ids)
    if key not in memo:
        memo[key] = visible_key_ranges(
            document_ids, [(first + i0, first + i1) for i0, i1 in blocks],
            [(start, start + length) for start, length in key[2]])
    return memo[key]


class _Chunks:
    """Key/value chunks with their positions; shared by forward and backward."""

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]):
        if len(keys) != len(values) or not keys:
            raise ValueError("need one value chunk per key chunk, and at least one chunk")
        self.keys, self.values = list(keys), list(values)
        self.starts, start = [], 0
        for k, v in zip(self.keys, self.values):
            if k.shape[:3] != v.shape[:3] or k.dim() != 4 or v.dim() != 4:
                raise ValueError(f"key/value chunks must be [b, g, l, d] and [b, g, l, dv]; "
                                 f"got {k.shape}, {v.shape}")
            self.starts.append(start)
            start += k.shape[2]
        self.total = start

    def lengths(self):
        return [k.shape[2] for k in self.keys]

    @property
    def value_dim(self):  # MLA's value head size differs from the query-key one
        return self.values[0].shape[3]


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


_FP32_OUTPUT_BMM = {}  # device -> whether torch.bmm(half, half, out_dtype=fp32) runs there


def _fp32_output_bmm(device) -> bool:
    """Whether this torch has a half x half -> fp32 batched matmul on ``device`` (CUDA
    in torch >= 2.8; CPU has none). Tried once per device on a tiny input."""
    if device not in _FP32_OUTPUT_BMM:
        tiny = torch.ones(1, 1, 1, dtype=torch.bfloat16, device=device)
        try:
            torch.bmm(tiny, tiny, out_dtype=torch.float32)
            _FP32_OUTPUT_BMM[device] = True
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUTPUT_BMM[device] = False
    return _FP32_OUTPUT_BMM[device]


def _matmul_stat(a, b):
    """a @ b ([..., m, k] @ [..., k, n]) in the statistics dtype, half inputs included.

    A half matmul rounds its fp32 accumulator to half before we could cast it; flash-
    attn keeps its products in fp32 (only P and dS are rounded to half, as the callers
    do), and so do we: with an fp32-output half matmul where torch has one, else on fp32
    copies (half values are exact in fp32 and in TF32, so the result is the same
    fp32-accumulated product). The copies are transient, one (query block, chunk) at a
    time."""
    stat = stat_dtype(a.dtype)
    if a.dtype == stat:
        return torch.matmul(a, b)
    if _fp32_output_bmm(a.device):
        out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]),
                        out_dtype=stat)
        return out.view(*a.shape[:-1], b.shape[-1])
    return torch.matmul(a.to(stat), b.to(stat))


def _scores(q_rows, key, allowed, shape5, softmax_scale):
    """Scaled scores [b, g, r, n, l] of query rows (q's dtype), in the statistics dtype
    (scaled there: a half pre-scaled query would round); masked entries are -inf. A
    fresh tensor, so callers may work on it in place."""
    s = _matmul_stat(q_rows, key.transpose(-1, -2)).view(*shape5, key.shape[2])
    s.mul_(softmax_scale)
    if allowed is not None:
        s.masked_fill_(~allowed, float("-inf"))
    return s


AUTO = "auto"  # flash_forward: flash-attn's kernel when it can run, else this module's
FLASH_MAX_HEAD_DIM = 256  # flash-attn 2's largest head dimension


@functools.lru_cache(maxsize=None)
def _installed_flash_attn_func():
    """flash-attn's public ``flash_attn_func`` when flash-attn >= 2.1 imports, else None.

    Its ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)``: the LSE
    [b, h, lq] (fp32, natural log of the scaled scores) is public, which is all a
    chunk's partial needs (``S_dmask`` is only filled with dropout, which we never
    ask for). Only a backward that takes an external LSE is private, so backward stays
    this module's recomputation over the chunks."""
    try:
        module = importlib.import_module("flash_attn")
        version = tuple(int(p) for p in module.__version__.split(".")[:2])
    except Exception:  # not installed, a broken build, or an odd version string
        return None
    return module.flash_attn_func if version >= (2, 1) else None


def installed_flash_forward(q):
    """flash-attn's forward for ``q``'s device, dtype and head dim, or None."""
    if (q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16)
            or q.shape[-1] > FLASH_MAX_HEAD_DIM):
        return None
    return _installed_flash_attn_func()


def _flash_causal_flags(first, lq, chunks):
    """Per chunk, the ``causal`` flag under which flash-attn computes it exactly for the
    queries at positions first..first+lq-1, or None when some chunk has no such flag.

    False: every query sees every key of the chunk. True: flash's bottom-right causal
    mask is ours, i.e. the chunk ends with the queries, and it is at least as long as
    them (flash gives a row that sees no key an LSE of +inf, which would not merge)."""
    flags = []
    for start, length in zip(chunks.starts, chunks.lengths()):
        if start + length - 1 <= first:
            flags.append(False)
        elif start + length == first + lq and length >= lq:
            flags.append(True)
        else:
            return None
    return flags


def _flash_partial(flash, q, chunks, causal_flags, softmax_scale):
    """Partials of flash-attn's forward over every chunk, merged by LSE; no graph (the
    backward is this module's)."""
    stat = stat_dtype(q.dtype)
    out = lse = None
    with torch.no_grad():
        for key, value, causal in zip(chunks.keys, chunks.values, causal_flags):
            part, part_lse, _ = flash(  # flash-attn's layout is [b, l, h, d]: views
                q.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                softmax_scale=softmax_scale, causal=causal, return_attn_probs=True)
            part, part_lse = part.transpose(1, 2).to(stat), part_lse.to(stat)
            out, lse = ((part, part_lse) if out is None
                        else merge_partials(out, lse, part, part_lse))
    return out, lse


def lse_attention_forward(q, keys, values, *, softmax_scale, document_ids=None,
                          query_start=None, max_block_elements=DEFAULT_MAX_BLOCK_ELEMENTS,
                          flash_forward=AUTO, window=None):
    """(out [b, hq, lq, d] in q's dtype, lse [b, hq, lq] in the statistics dtype)."""
    out, lse = lse_attention_partial(q, keys, values, softmax_scale=softmax_scale,
                                     document_ids=document_ids, query_start=query_start,
                                     max_block_elements=max_block_elements,
                                     flash_forward=flash_forward, window=window)
    return out.to(q.dtype), lse


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Attention over the union of two disjoint key sets from the partials over each
    (outputs [b, h, l, d] and LSEs [b, h, l] in the statistics dtype)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.clamp_min(torch.finfo(lse.dtype).min)[..., None]
    out = out_a * torch.exp(lse_a[..., None] - safe) + out_b * torch.exp(lse_b[..., None] - safe)
    return out, lse


def lse_attention_partial(q, keys, values, *, softmax_scale, document_ids=None,
                          query_start=None, max_block_elements=DEFAULT_MAX_BLOCK_ELEMENTS,
                          flash_forward=AUTO, window=None):
    """Like ``lse_attention_forward`` but the output stays in the statistics dtype, to be
    merged with other partials (``merge_partials``).

    ``query_start``: position of the first query among the chunks' keys; default
    ``lk - lq`` (the queries are the last keys). A query block placed after every key
    (``query_start >= lk``) sees all of them: a prefix computed apart from its queries
    (with ``document_ids`` [b, query_start + lq], only the keys of its own document).

    ``flash_forward``: flash-attn's ``flash_attn_func`` (or a stand-in with its
    signature) computes each chunk's partial and LSE where it can (no documents, every
    query sees a key of every chunk); ``AUTO``: flash-attn's when it is installed and
    ``q`` is a CUDA fp16/bf16 tensor with head dim <= 256; None: this module's kernel.
    ``window``: sliding-window attention, each query seeing at most ``window`` keys
    before itself (this module's kernel; chunks before every query's window skipped).
    """
    chunks = _Chunks(keys, values)
    _check(q, chunks, document_ids, query_start)
    b, hq, lq, d = q.shape
    first = chunks.total - lq if query_start is None else query_start
    flash = installed_flash_forward(q) if flash_forward is AUTO else flash_forward
    # flash-attn 2 needs one head size for q, k and v (MLA's differ)
    causal = (_flash_causal_flags(first, lq, chunks) if flash and document_ids is None
              and window is None and chunks.value_dim == d else None)
    if causal is not None:
        return _flash_partial(flash, q, chunks, causal, softmax_scale)
    g = chunks.keys[0].shape[1]
    r = hq // g
    stat = stat_dtype(q.dtype)
    q5 = q.reshape(b, g, r, lq, d)
    dv = chunks.value_dim
    out = torch.zeros(b, g, r, lq, dv, dtype=stat, device=q.device)
    lse = torch.full((b, g, r, lq), float("-inf"), dtype=stat, device=q.device)
    tiny = torch.finfo(stat).min
    blocks = _query_blocks(q, chunks.lengths(), max_block_elements)
    visible = _visible_pairs(document_ids, first, blocks, chunks)
    for block, (i0, i1) in enumerate(blocks):
        n = i1 - i0
        q_rows = q5[:, :, :, i0:i1].reshape(b, g, r * n, d)
        acc_out, acc_lse = out[:, :, :, i0:i1], lse[:, :, :, i0:i1]
        for c, (key, value, start) in enumerate(zip(chunks.keys, chunks.values, chunks.starts)):
            allowed = _allowed(first + i0, n, start, key.shape[2], document_ids, q.device,
                               window)
            if allowed is False or (visible is not None and not visible[block][c]):
                continue
            s = _scores(q_rows, key, allowed, (b, g, r, n), softmax_scale)
            row_max = s.amax(dim=-1, keepdim=True).clamp_min_(tiny)  # finite for empty rows
            probs = s.sub_(row_max).exp_()  # unnormalised, in place
            row_sum = probs.sum(dim=-1)
            # P rounded to the value dtype (as flash-attn does), the product is not
            part = _matmul_stat(probs.to(value.dtype).view(b, g, r * n, -1), value)
            part = part.view(b, g, r, n, dv) / row_sum.clamp_min(torch.finfo(stat).tiny)[..., None]
            part_lse = row_max[..., 0] + row_sum.log()  # -inf where a row sees nothing here
            new_lse = torch.logaddexp(acc_lse, part_lse)
            safe = new_lse.clamp_min(tiny)[..., None]
            acc_out.mul_(torch.exp(acc_lse[..., None] - safe)).add_(
                part * torch.exp(part_lse[..., None] - safe))
            acc_lse.copy_(new_lse)
    return out.view(b, hq, lq, dv), lse.view(b, hq, lq)


def lse_attention_backward(grad_out, q, out, lse, keys, values, *, softmax_scale,
                           document_ids=None, query_start=None,
                           max_block_elements=DEFAULT_MAX_BLOCK_ELEMENTS, dq_dtype=None,
                           window=None):
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
    q5 = q.reshape(b, g, r, lq, d)
    dv = chunks.value_dim
    do5 = grad_out.reshape(b, g, r, lq, dv)
    lse5 = lse.reshape(b, g, r, lq)
    delta = (grad_out.to(stat) * out.to(stat)).sum(-1).reshape(b, g, r, lq)
    dq = torch.zeros(b, g, r, lq, d, dtype=stat, device=q.device)
    dks = [torch.zeros(k.shape, dtype=stat, device=k.device) for k in chunks.keys]
    dvs = [torch.zeros(v.shape, dtype=stat, device=v.device) for v in chunks.values]
    first = chunks.total - lq if query_start is None else query_start
    blocks = _query_blocks(q, chunks.lengths(), max_block_elements)
    visible = _visible_pairs(document_ids, first, blocks, chunks)
    for block, (i0, i1) in enumerate(blocks):
        n = i1 - i0
        q_rows = q5[:, :, :, i0:i1].reshape(b, g, r * n, d)  # unscaled, q's dtype
        do_rows = do5[:, :, :, i0:i1].reshape(b, g, r * n, dv)
        row_lse = lse5[:, :, :, i0:i1, None]
        row_delta = delta[:, :, :, i0:i1, None]
        for c, (key, value, start) in enumerate(zip(chunks.keys, chunks.values, chunks.starts)):
            allowed = _allowed(first + i0, n, start, key.shape[2], document_ids, q.device,
                               window)
            if allowed is False or (visible is not None and not visible[block][c]):
                continue
            probs = _scores(q_rows, key, allowed, (b, g, r, n), softmax_scale).sub_(row_lse).exp_()
            probs_rows = probs.view(b, g, r * n, -1)
            dvs[c] += _matmul_stat(probs_rows.transpose(-1, -2).to(do_rows.dtype), do_rows)
            dp = _matmul_stat(do_rows, value.transpose(-1, -2)).view(b, g, r, n, -1)
            ds = dp.sub_(row_delta).mul_(probs).view(b, g, r * n, -1)  # dS / scale
            ds_in = ds.to(q.dtype)
            dq[:, :, :, i0:i1] += _matmul_stat(ds_in, key).view(b, g, r, n, d)
            dks[c] += _matmul_stat(ds_in.transpose(-1, -2), q_rows)
    dq.mul_(softmax_scale)
    for dk in dks:  # dS was left unscaled (q_rows too): dK = scale * dS^T Q
        dk.mul_(softmax_scale)
    return dq.view(b, hq, lq, d).to(dq_dtype or q.dtype), dks, dvs


__all__ = ["AUTO", "installed_flash_forward", "stat_dtype", "lse_attention_forward", "lse_attention_partial", "lse_attention_backward",
           "merge_partials", "DEFAULT_MAX_BLOCK_ELEMENTS"]
