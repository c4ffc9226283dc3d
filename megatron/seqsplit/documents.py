"""Packed documents (``--reset-attention-mask``): per-document causal attention.

Each row carries ``document_ids`` [L] (int32): the index of the document each token
belongs to, a new document starting after every end-of-document token (Megatron-LM's
rule: the EOD closes its document). That is O(L) per row instead of Megatron's dense
L x L mask, slices per split, and gives the attention mask of any query range over
any key prefix: query ``i`` sees key ``j`` iff ``j <= i`` and both are in the same
document. A split that starts mid-document sees its document's earlier tokens through
the KV cache and never a token of an earlier document.
"""

import torch
import torch.nn.functional as F


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


def document_attention(q, k, v, *, mask, softmax_scale, dropout_p=0.0):
    """SDPA with an explicit mask; q [b, hq, lq, d], k/v [b, g, lk, d]."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=softmax_scale,
        enable_gqa=q.shape[1] != k.shape[1])
