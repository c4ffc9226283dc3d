"""Packed documents (``--reset-attention-mask``): per-document causal attention.

Each row carries ``document_ids`` [L] (int32): the index of the document each token
belongs to, a new document starting after every end-of-document token (Megatron-LM's
rule: the EOD closes its document). That is O(L) per row instead of Megatron's dense
L x L mask, slices per split, and gives the attention mask of any query range over
any key prefix: query ``i`` sees key ``j`` iff ``j <= i`` and both are in the same
document. A split that starts mid-document sees its document's earlier tokens through
the KV cache and never a token of an earlier document.

Attention backends receive the ids of the key prefix, ``[b, lk]``, whose last ``lq``
positions are the queries, and turn them into what their kernel wants:

* SDPA: a dense additive ``[b, 1, lq, lk']`` mask over the keys from the first document
  any query is in (``document_attention_bias``), made once per split and shared by the
  layers;
* FlexAttention: a ``mask_mod`` closure over the ids (``document_mask_mod``);
* flash-attn varlen: per-document query and key boundaries (``varlen_document_layout``).

Ids must be non-decreasing along a row (documents are contiguous runs), as
``document_ids`` makes them.
"""

import weakref
from dataclasses import dataclass

import torch


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[.., L] token ids -> [.., L] document index (exclusive running count of EODs)."""
    is_eod = (tokens == eod).to(torch.int32)
    return (torch.cumsum(is_eod, dim=-1) - is_eod).to(torch.int32)


class DocumentIdsDataset(torch.utils.data.Dataset):
    """Adds ``document_ids`` to every sample of a GPT dataset (tokens + EOD id)."""

    def __init__(self, dataset, eod: int):
        self.dataset, self.eod = dataset, eod

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        sample = dict(self.dataset[index])
        sample["document_ids"] = document_ids(torch.as_tensor(sample["tokens"]), self.eod)
        return sample


def key_documents(split, num_keys: int, device):
    """Packed documents: the document of each of the first `num_keys` keys of a split
    (``split.document_ids`` [b, >= num_keys]) as [b, num_keys] on `device`, or None.

    Memoised on the split, so every layer of a unit passes the same tensor and the
    SDPA backend builds the split's mask once for all of them."""
    documents = getattr(split, "document_ids", None)
    if documents is None:
        return None
    memo = vars(split).setdefault("_key_documents", {})
    key = (num_keys, str(device))
    if key not in memo:
        memo[key] = documents[:, :num_keys].to(device)
    return memo[key]


class PerSplitMemo:
    """What a backend derives from a split's document ids alone (a mask, a layout), made
    once per split instead of once per layer: every layer of a pipeline unit passes the
    same document-id tensor (`key_documents`), so the last value is reused while
    that tensor (and the other arguments) come back. The tensor is held weakly, so a new
    one that reuses its memory is never taken for it. With `weak`, the value is too: it
    then lives only as long as something else keeps it (a kernel, for backward), and
    without autograd it is remade per layer."""

    def __init__(self, make, weak=False):
        self._make, self._weak, self._last = make, weak, None

    def __call__(self, document_ids, *args):
        last = self._last
        if last is not None and last[0]() is document_ids and last[1] == args:
            value = last[2]() if self._weak else last[2]
            if value is not None:
                return value
        value = self._make(document_ids, *args)
        self._last = (weakref.ref(document_ids), args,
                      weakref.ref(value) if self._weak else value)
        return value


def document_causal_mask(doc_ids: torch.Tensor, q_offset: int, q_length: int) -> torch.Tensor:
    """Boolean [b, 1, q_length, q_offset + q_length] mask, True where attention is allowed.

    ``doc_ids`` [b, >= q_offset + q_length] holds the document index of every key.
    """
    k_length = q_offset + q_length
    keys = doc_ids[:, :k_length]
    queries = doc_ids[:, q_offset:k_length]
    same_document = queries[:, :, None] == keys[:, None, :]
    q_pos = torch.arange(q_offset, k_length, device=doc_ids.device)
    k_pos = torch.arange(k_length, device=doc_ids.device)
    causal = k_pos[None, :] <= q_pos[:, None]
    return (same_document & causal)[:, None]


# CUDA's memory-efficient SDPA kernel copies (pads) a mask unless every stride but the
# last is a multiple of 8 elements (torch's `preprocess_mask`), and the copy is what it
# saves for backward: per layer. Rows padded to 16 elements keep the shared mask as is.
MASK_ROW_ALIGNMENT = 16


def first_visible_key(doc_ids: torch.Tensor, q_length: int) -> int:
    """The earliest start, over the rows, of the document holding the first of the last
    ``q_length`` positions: no query sees a key before it. One host sync (a shape)."""
    offset = doc_ids.shape[1] - q_length
    starts_before = (doc_ids[:, :offset + 1] == doc_ids[:, offset:offset + 1]).int().argmax(dim=1)
    return int(starts_before.min())


def aligned_mask_buffer(shape, dtype, device, alignment=MASK_ROW_ALIGNMENT):
    """Zeros of ``shape`` whose rows (last dim) start every multiple of ``alignment``
    elements: a view of a buffer with padded rows, so kernels need not pad a copy."""
    padded = -(-shape[-1] // alignment) * alignment
    return torch.zeros(*shape[:-1], padded, dtype=dtype, device=device)[..., :shape[-1]]


def document_attention_bias(doc_ids: torch.Tensor, q_length: int, dtype, first_key=None):
    """(first_key, bias): the per-document causal mask of the last ``q_length`` of
    ``doc_ids`` [b, lk] as an additive float mask [b, 1, q_length, lk - first_key]
    (0 where allowed, -inf elsewhere) over the keys from ``first_key`` on.

    ``first_key`` (``first_visible_key``, computed here when not given): no query of
    the split sees a key before it (documents are contiguous runs), so those keys are
    left out of the kernel call altogether. The mask is in the query's dtype because
    that is what SDPA keeps for backward (a boolean mask is converted on every call),
    with rows aligned (``aligned_mask_buffer``) so CUDA's kernel keeps it uncopied.
    """
    offset = doc_ids.shape[1] - q_length
    if first_key is None:
        first_key = first_visible_key(doc_ids, q_length)
    allowed = document_causal_mask(doc_ids[:, first_key:], offset - first_key, q_length)
    bias = aligned_mask_buffer(allowed.shape, dtype, doc_ids.device)
    return first_key, bias.masked_fill_(~allowed, float("-inf"))


def visible_key_ranges(doc_ids: torch.Tensor, query_blocks, key_ranges):
    """For every query block (first, last + 1) and key range (start, end), in absolute
    positions of ``doc_ids`` [b, positions]: whether any query of the block sees any key
    of the range (causal, same document), as nested Python lists [block][range].

    Everything is computed on the device and leaves it in one transfer (one host sync
    for all pairs, where asking pair by pair would sync per pair)."""
    positions = doc_ids.shape[1]
    pos = torch.arange(positions, device=doc_ids.device)
    is_start = torch.ones_like(doc_ids, dtype=torch.bool)
    is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    # a query at p sees exactly the keys [doc_start[p], p]
    doc_start = torch.where(is_start, pos, 0).cummax(dim=1).values  # [b, positions]
    rows = []
    for q0, q1 in query_blocks:
        starts, ends = doc_start[:, q0:q1], pos[q0:q1]
        rows.append(torch.stack([
            (starts.clamp_min(k0) <= ends.clamp_max(k1 - 1)).any() for k0, k1 in key_ranges]))
    return torch.stack(rows).tolist()


def document_mask_mod(doc_ids: torch.Tensor, q_length: int):
    """FlexAttention ``mask_mod`` for queries = the last ``q_length`` of ``doc_ids`` [b, lk].

    Bottom-right aligned causal (query ``i`` is absolute position ``lk - q_length + i``)
    and same document. The closure indexes the id tensor, which FlexAttention supports
    both eagerly and under ``torch.compile``.
    """
    offset = doc_ids.shape[1] - q_length

    def mask_mod(b, h, q_idx, kv_idx):
        q_pos = q_idx + offset
        return (kv_idx <= q_pos) & (doc_ids[b, q_pos] == doc_ids[b, kv_idx])

    return mask_mod


@dataclass
class VarlenLayout:
    """Documents of one split as flash-attn variable-length sequences.

    Rows are flattened: queries of row ``r`` are packed rows ``r * lq .. (r+1) * lq - 1``
    (all of the split's queries), keys of row ``r`` are its positions
    ``key_starts[r] .. lk - 1`` (documents that ended before the split have no query and
    are left out). Sequence ``i`` is one (row, document) pair with queries
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and keys ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``;
    its queries are the last of its keys, so flash-attn's causal mask (bottom-right per
    sequence) is exactly the per-document causal mask.
    """

    cu_seqlens_q: torch.Tensor  # int32 [n + 1]
    cu_seqlens_k: torch.Tensor  # int32 [n + 1]
    max_seqlen_q: int
    max_seqlen_k: int
    key_starts: list  # [b] first key position kept per row


def varlen_document_layout(doc_ids: torch.Tensor, q_length: int) -> VarlenLayout:
    """Query/key boundaries for ``doc_ids`` [b, lk] whose last ``q_length`` are queries."""
    b, lk = doc_ids.shape
    offset = lk - q_length
    if q_length < 1 or offset < 0:
        raise ValueError(f"need 1 <= q_length <= {lk}, got {q_length}")
    device = doc_ids.device
    pos = torch.arange(lk, device=device).expand(b, lk)
    starts = torch.ones(b, lk, dtype=torch.bool, device=device)  # a document starts here
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    # first kept key per row: the start of the document holding the first query
    key_start = torch.where(starts[:, :offset + 1], pos[:, :offset + 1], 0).amax(dim=1)
    # sequences start at the first query and at every document start inside the split
    seq_start = starts.clone()
    seq_start[:, :offset] = False
    seq_start[:, offset] = True
    rows, cols = seq_start.nonzero(as_tuple=True)  # row-major: sorted within and across rows
    q_starts = rows * q_length + (cols - offset)
    key_lengths = lk - key_start
    row_key_base = torch.cumsum(key_lengths, 0) - key_lengths
    k_cols = torch.where(cols == offset, key_start[rows], cols)  # first sequence: from its doc start
    k_starts = row_key_base[rows] + (k_cols - key_start[rows])
    total_q = torch.tensor([b * q_length], device=device)
    total_k = key_lengths.sum().reshape(1)
    cu_q = torch.cat([q_starts, total_q]).to(torch.int32)
    cu_k = torch.cat([k_starts, total_k]).to(torch.int32)
    # flash-attn takes the maxima and the key gather the row starts as Python ints: one
    # host sync here (nonzero above is the other); computed per layer, tiny next to attention
    host = torch.cat([cu_q.diff().max().reshape(1), cu_k.diff().max().reshape(1),
                      key_start.to(cu_q.dtype)]).tolist()
    return VarlenLayout(cu_q, cu_k, host[0], host[1], host[2:])
