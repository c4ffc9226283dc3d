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


def _assert_fp32_close(got, want, name):
    """Within 1e-6 of the tensor's scale (and 1e-6 relative): fp32 rounds values near 4
    to steps of 4.8e-7, and a K/V gradient sums keys and GQA heads in another order than
    the kernel it is compared with, so an absolute 1e-6 on gradients of magnitude ~5 is a
    few rounding steps and depends on the CPU's vector width (it failed on an AVX2 host)."""
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * scale, msg=name)


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
        _assert_fp32_close(a, e, name)


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
        _assert_fp32_close(a, e, name)
    # K/V (lk keys) aside, nothing saved spans more keys than the split's own block
    assert [s for s in saved if len(s) == 4 and s[-2] == lq and s[-1] > lq] == []
    assert (b, 1, lq, lq) in saved  # the own block's mask


def _rope(x, positions, base=10000.0):
    """Rotate-half RoPE (megatron-core's non-interleaved layout) at ``positions``."""
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = (f(torch.cat([angles, angles], dim=-1)).to(x.dtype) for f in (torch.cos, torch.sin))
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@pytest.mark.parametrize("hq,g,offset", [(4, 2, 0), (8, 2, 37), (4, 4, 1000)])
def test_rope_splits_equal_unsplit_causal_attention(hq, g, offset):
    """Splits of a RoPE'd sequence (positions from ``offset``; GQA), each against the keys
    up to its end, equal the unsplit causal attention's rows, outputs and gradients of the
    unrotated q, k, v within 1e-6 (of their scale) in fp32."""
    b, L, d, bounds = 2, 40, 8, [0, 7, 19, 40]  # three splits of 7, 12 and 21 tokens
    q, k, v = _inputs(b, hq, g, L, L, d, torch.float32, seed=3)
    positions = torch.arange(offset, offset + L)
    grad = torch.randn(b, hq, L, d, generator=torch.Generator().manual_seed(4))

    def unsplit(q, k, v):
        return F.scaled_dot_product_attention(_rope(q, positions), _rope(k, positions), v,
                                              is_causal=True, scale=d ** -0.5, enable_gqa=True)

    def split(q, k, v):
        qr, kr = _rope(q, positions), _rope(k, positions)
        first = (t[:, :, :bounds[1]] for t in (qr, kr, v))  # split 0: no prefix
        outs = [F.scaled_dot_product_attention(*first, is_causal=True, scale=d ** -0.5,
                                               enable_gqa=True)]
        for start, end in zip(bounds[1:-1], bounds[2:]):  # later splits: the kernel
            outs.append(split_causal_attention_cpu(qr[:, :, start:end], kr[:, :, :end],
                                                   v[:, :, :end], d ** -0.5))
        return torch.cat(outs, dim=2)

    want, got = (fn(q, k, v) for fn in (unsplit, split))
    _assert_fp32_close(got, want, "output")
    for name, a, e in zip(("dq", "dk", "dv"), torch.autograd.grad(got, (q, k, v), grad),
                          torch.autograd.grad(want, (q, k, v), grad)):
        _assert_fp32_close(a, e, name)


class _OutputShapes(torch.utils._python_dispatch.TorchDispatchMode):
    """Every operator's output shapes, forward and backward (what each op allocates)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("kernel", ["ours", "ours_documents", "dense"])
def test_no_op_makes_a_queries_by_keys_tensor_forward_or_backward(kernel):
    """No operator of the split kernel, forward or backward, outputs a tensor with a
    ``lq x n`` (n > lq keys) score/mask plane, with packed documents none beyond the own
    block's ``lq x lq``; the dense-mask kernel does (the check can fail)."""
    from megatron.seqsplit.attention_backends import SDPABackend

    b, hq, g, lq, lk, d = 2, 4, 2, 12, 30, 4  # d < lq: q, out and grads are no look-alikes
    q, k, v = _inputs(b, hq, g, lq, lk, d, torch.float32)
    ids = torch.tensor([[0] * 10 + [1] * 15 + [2] * 5, [0] * 20 + [1] * 10])  # crossing the split
    if kernel == "ours":
        attend = lambda *a: split_causal_attention_cpu(*a, 0.5)  # noqa: E731
    elif kernel == "ours_documents":
        attend = lambda *a: SDPABackend()(*a, softmax_scale=0.5, document_ids=ids)  # noqa: E731
    else:
        attend = lambda *a: F.scaled_dot_product_attention(  # noqa: E731
            *a, attn_mask=torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq), scale=0.5,
            enable_gqa=True)
    with _OutputShapes() as forward:
        out = attend(q, k, v)
    with _OutputShapes() as backward:
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    planes = [(op, s) for op, s in forward.shapes + backward.shapes
              if len(s) >= 2 and (s[-2] == lq and s[-1] > lq or s[-1] == lq and s[-2] > lq)]
    if kernel == "ours_documents":  # the own block's lq x lq mask, its rows padded (aligned)
        from megatron.seqsplit.documents import MASK_ROW_ALIGNMENT

        own = (b, 1, lq, -(-lq // MASK_ROW_ALIGNMENT) * MASK_ROW_ALIGNMENT)
        assert own[-1] < lk and planes == [("aten.zeros.default", own)], planes
    if kernel == "ours":
        assert planes == [], planes
        assert backward.shapes  # the mode saw the backward's operators
    else:
        assert planes
