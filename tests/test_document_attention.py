"""Packed documents: split attention with the KV cache equals per-document causal attention."""

from dataclasses import dataclass

import pytest
import torch

from megatron.seqsplit.attention_backends import get_backend
from megatron.seqsplit.documents import document_causal_mask, document_ids
from megatron.seqsplit.kv_cache import KVCacheStore, split_causal_attention

EOD = 0


@dataclass
class Split:
    microbatch_id: int
    split_index: int
    num_splits: int
    offset: int
    length: int
    seq_length: int
    document_ids: torch.Tensor


def reference(q, k, v, tokens, scale):
    """Each document of each row attended on its own (plain causal attention)."""
    out = torch.zeros_like(q)
    for row in range(tokens.shape[0]):
        ends = [i + 1 for i, t in enumerate(tokens[row].tolist()) if t == EOD]
        starts = [0] + ends
        if starts[-1] != tokens.shape[1]:
            ends = ends + [tokens.shape[1]]
        for a, b in zip(starts, ends):
            qs, ks, vs = q[a:b, row], k[a:b, row], v[a:b, row]  # [l, h, d]
            groups = qs.shape[1] // ks.shape[1]
            ks, vs = ks.repeat_interleave(groups, 1), vs.repeat_interleave(groups, 1)
            scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
            causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            out[a:b, row] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs)
    return out


# documents crossing split edges, shorter than a split, a boundary exactly at a split
# edge (position 8 with splits of 8), one document spanning every split (row 1)
TOKENS = torch.tensor([
    [5, 3, 0, 7, 7, 7, 9, 0, 4, 4, 0, 2, 3, 0, 6, 6, 6, 1, 1, 2, 2, 0, 3, 3],
    [5, 3, 1, 7, 7, 7, 9, 2, 4, 4, 1, 2, 3, 4, 6, 6, 6, 1, 1, 2, 2, 8, 3, 3],
])


@pytest.mark.parametrize("lengths", [[24], [8, 8, 8], [12, 7, 5], [1, 10, 13]])
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
def test_split_document_attention_matches_per_document(lengths, heads, groups):
    torch.manual_seed(0)
    L, b, d = TOKENS.shape[1], TOKENS.shape[0], 8
    q = torch.randn(L, b, heads, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(L, b, groups, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(L, b, groups, d, dtype=torch.float64, requires_grad=True)
    scale = d ** -0.5
    expected = reference(q, k, v, TOKENS, scale)
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)

    ids = document_ids(TOKENS, EOD)
    store, backend = KVCacheStore(forward_only=False), get_backend("sdpa")
    leaves, outputs, offset = [], [], 0
    for j, length in enumerate(lengths):
        part = [t[offset:offset + length].detach().requires_grad_() for t in (q, k, v)]
        split = Split(0, j, len(lengths), offset, length, L, ids[:, :offset + length])
        outputs.append(split_causal_attention(*part, split=split, store=store, layer_key=1,
                                              backend=backend, softmax_scale=scale))
        leaves.append(part)
        offset += length
    torch.testing.assert_close(torch.cat(outputs), expected, rtol=0, atol=1e-10)
    offset_of = [sum(lengths[:j]) for j in range(len(lengths))]
    for j in reversed(range(len(lengths))):  # backward split by split, as the pipeline does
        grad = grad_out[offset_of[j]:offset_of[j] + lengths[j]]
        outputs[j].backward(grad)
    for i, name in enumerate("qkv"):
        got = torch.cat([leaf[i].grad for leaf in leaves])
        torch.testing.assert_close(got, expected_grads[i], rtol=0, atol=1e-10, msg=name)
    assert store.num_entries() == 0


def test_mask_rule_matches_megatron():
    """Megatron-LM: after an EOD at i, later tokens cannot see positions <= i."""
    ids = document_ids(TOKENS[:1], EOD)
    mask = document_causal_mask(ids, 0, TOKENS.shape[1])[0, 0]
    dense = torch.ones(24, 24, dtype=torch.bool).tril()
    for i, token in enumerate(TOKENS[0].tolist()):
        if token == EOD:
            dense[i + 1:, :i + 1] = False
    assert torch.equal(mask, dense)
