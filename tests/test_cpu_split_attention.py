"""A split's CPU attention as two mask-free kernels merged by LSE (megatron/seqsplit/cpu_split_attention.py)
equals the single masked kernel it replaced, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

from megatron.seqsplit.attention_backends import _bottom_right_causal_cpu
from megatron.seqsplit.cpu_split_attention import split_causal_attention_cpu


def _inputs(b, hq, g, lq, lk, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=gen).to(dtype).requires_grad_()
            for h, n in ((hq, lq), (g, lk), (g, lk))]


def _run(attend, q, k, v, grad_seed=1):
    out = attend(q, k, v)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


@pytest.mark.parametrize("b,hq,g,lq,lk,d", [
    (1, 4, 4, 8, 24, 16),   # MHA, three splits' worth of prefix
    (2, 4, 2, 5, 21, 8),    # GQA, micro-batch 2, lengths that divide nothing
    (2, 8, 1, 1, 9, 16),    # one query, one K/V group
    (1, 4, 2, 16, 17, 32),  # a one-key prefix
    (1, 8, 8, 64, 256, 32),
])
def test_equals_the_masked_kernel_in_fp32(b, hq, g, lq, lk, d):
    q, k, v = _inputs(b, hq, g, lq, lk, d, torch.float32)
    scale = d ** -0.5
    got = _run(lambda *a: split_causal_attention_cpu(*a, scale), q, k, v)
    masked = _run(lambda *a: _bottom_right_causal_cpu(*a, scale, 0.0), q, k, v)
    for name, a, e in zip(("output", "dq", "dk", "dv"), got, masked):
        assert a.shape == e.shape, name
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6, msg=name)


def test_half_precision_stays_within_its_rounding():
    q, k, v = _inputs(2, 4, 2, 32, 96, 16, torch.bfloat16)
    got = _run(lambda *a: split_causal_attention_cpu(*a, 0.25), q, k, v)
    reference = _run(lambda *a: F.scaled_dot_product_attention(
        *a, attn_mask=torch.ones(32, 96, dtype=torch.bool).tril(96 - 32), scale=0.25,
        enable_gqa=True), *(t.detach().double().requires_grad_() for t in (q, k, v)))
    for a, e in zip(got, reference):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.double(), e, rtol=2e-2, atol=2e-2)


def test_a_split_without_prefix_is_refused():
    q, k, v = _inputs(1, 2, 2, 8, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="need lq < lk"):
        split_causal_attention_cpu(q, k, v, 0.3)


# rows of document ids (contiguous runs) over 14 keys, for a split of the last 6: a
# document open since before the split, one that starts exactly at it, one spanning all
DOCUMENTS = {
    "crossing_and_short": [[0] * 5 + [1] * 6 + [2] * 3, [0] * 9 + [1] * 5],
    "starts_at_the_split_and_spans_all": [[0] * 8 + [1] * 6, [0] * 14],
}


@pytest.mark.parametrize("case", list(DOCUMENTS))
@pytest.mark.parametrize("hq,g", [(4, 4), (4, 2)])
def test_documents_equal_the_masked_kernel_and_keep_only_the_own_blocks_mask(case, hq, g):
    from megatron.seqsplit.attention_backends import SDPABackend
    from megatron.seqsplit.documents import document_causal_mask

    ids = torch.tensor(DOCUMENTS[case])
    b, lq, lk, d = ids.shape[0], 6, ids.shape[1], 4  # d < lq: q and out are no mask look-alikes
    q, k, v = _inputs(b, hq, g, lq, lk, d, torch.float32)
    saved = []

    def keep(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        got = _run(lambda *a: SDPABackend()(*a, softmax_scale=0.3, document_ids=ids), q, k, v)
    masked = _run(lambda *a: F.scaled_dot_product_attention(
        *a, attn_mask=document_causal_mask(ids, lk - lq, lq), scale=0.3, enable_gqa=hq != g),
        q, k, v)
    for name, a, e in zip(("output", "dq", "dk", "dv"), got, masked):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6, msg=name)
    # K/V (lk keys) aside, nothing saved spans more keys than the split's own block
    assert [s for s in saved if len(s) == 4 and s[-2] == lq and s[-1] > lq] == []
    assert (b, 1, lq, lq) in saved  # the own block's mask
