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
