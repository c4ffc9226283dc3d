"""Issue 22 on the GPU itself: what the CPU tests decide as pure functions, measured on
CUDA. Skipped without CUDA; `bash tools/gpu_checks.sh tests` runs them on the device.
(Written without a GPU at hand: not run yet.)"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from megatron.seqsplit import attention_backends
from megatron.seqsplit.attention_backends import AttentionCall, SDPABackend, get_backend
from megatron.seqsplit.lse_attention import lse_attention_backward, lse_attention_forward

from gpu_readiness import relative_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BF16 = torch.bfloat16


def _randn(*shape, requires_grad=False, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=gen).to(BF16).requires_grad_(requires_grad)


def _documents(lk, length):
    """[1, lk] ids of documents of `length` tokens: boundaries off multiples of 8."""
    return (torch.arange(lk, device="cuda") // length).int()[None]


def _backend_available(name):
    if name == "flash":
        pytest.importorskip("flash_attn")
    if name in ("flex", "auto"):
        pytest.importorskip("torch.nn.attention.flex_attention")


@pytest.mark.parametrize("name", ["auto", "sdpa", "flex", "flash"])
def test_packed_documents_with_gqa_keep_no_lq_by_lk_tensor(name):
    """Packed documents + GQA in bf16, 4096 queries over 8192 keys, 16 heads: the
    math kernel would keep 2 GiB of fp32 probabilities for backward."""
    _backend_available(name)
    b, hq, g, lq, lk, d = 1, 16, 4, 4096, 8192, 128
    backend = get_backend(name)
    q = _randn(b, hq, lq, d, requires_grad=True)
    k, v = (_randn(b, g, lk, d, requires_grad=True, seed=s) for s in (1, 2))
    if name == "auto":
        routed = backend.backend_for(AttentionCall.of(q, k, _documents(lk, 3001)))
        assert routed.name == ("flash" if attention_backends._flash_attn_version() else "flex")
    for ids in (_documents(lk, 3001), _documents(lk, 3001)):  # warm-up (compiles), measure
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = backend(q, k, v, softmax_scale=d ** -0.5, document_ids=ids)
        kept = torch.cuda.memory_allocated() - base  # what forward leaves for backward
        out.backward(torch.ones_like(out))
        peak = torch.cuda.max_memory_allocated() - base
        del out
        q.grad = k.grad = v.grad = None
    probabilities = b * hq * lq * lk * 4
    assert kept < probabilities / 8, f"{name}: forward keeps {kept / 2**20:.0f} MiB"
    assert peak < probabilities / 2, f"{name}: peak {peak / 2**20:.0f} MiB"


def test_sdpa_keeps_the_shared_document_mask_uncopied():
    """Three layers save the split's one mask, not a padded copy each (the keys from
    the first visible one: 1536 - 1001 = 535, not a multiple of 8)."""
    b, h, lq, lk, d = 1, 8, 512, 1536, 64
    ids = _documents(lk, 1001)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    outputs = []  # keep every layer's graph (and what it saved) alive
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for layer in range(3):
            q = _randn(b, h, lq, d, requires_grad=True, seed=layer)
            k, v = (_randn(b, h, lk, d, requires_grad=True, seed=10 + layer) for _ in range(2))
            outputs.append(SDPABackend()(q, k, v, softmax_scale=d ** -0.5, document_ids=ids))
    masks = [t for t in saved if t.dim() == 4 and t.shape[-2:] == (lq, lk - 1001)]
    assert len(masks) >= 3, [tuple(t.shape) for t in saved]
    # one storage for all layers: a padded copy per layer would be three
    assert len({t.untyped_storage().data_ptr() for t in masks}) == 1


def _chunked(q, keys, values, grad_out):
    out, lse = lse_attention_forward(q, keys, values, softmax_scale=q.shape[-1] ** -0.5)
    dq, dks, dvs = lse_attention_backward(grad_out, q, out, lse, keys, values,
                                          softmax_scale=q.shape[-1] ** -0.5)
    return [out, dq, torch.cat(dks, 2).to(BF16), torch.cat(dvs, 2).to(BF16)]


def _chunk_inputs():
    lengths, b, hq, g, d = [1024, 1024, 2048], 1, 8, 2, 128
    q = (_randn(b, hq, 2048, d) * 1.5).to(BF16)
    k, v = (_randn(b, g, sum(lengths), d, seed=s) for s in (1, 2))
    return q, k, v, _randn(b, hq, 2048, d, seed=3), lengths


def test_chunked_kernel_bf16_is_as_accurate_as_sdpa():
    """On CUDA (flash-attn's forward when installed, fp32-product matmuls) against a
    float64 reference, within the bound the CPU tests hold (1.25x SDPA's error)."""
    q, k, v, grad_out, lengths = _chunk_inputs()

    def sdpa(*tensors):
        leaves = [x.detach().clone().requires_grad_() for x in tensors[:3]]
        out = F.scaled_dot_product_attention(
            *leaves, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
            scale=q.shape[-1] ** -0.5, enable_gqa=True)
        out.backward(tensors[3])
        return [out.detach()] + [x.grad for x in leaves]

    reference = sdpa(*(x.double() for x in (q, k, v, grad_out)))
    theirs = sdpa(q, k, v, grad_out)
    ours = _chunked(q, list(k.split(lengths, 2)), list(v.split(lengths, 2)), grad_out)
    for name, a, b_, exact in zip(("out", "dq", "dk", "dv"), ours, theirs, reference):
        bound = relative_error(b_, exact)
        assert relative_error(a, exact) <= 1.25 * bound, (name, relative_error(a, exact), bound)


def test_chunked_kernel_without_documents_never_syncs():
    q, k, v, grad_out, lengths = _chunk_inputs()
    keys, values = list(k.split(lengths, 2)), list(v.split(lengths, 2))
    _chunked(q, keys, values, grad_out)  # warm-up: imports and one-time probes
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _chunked(q, keys, values, grad_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
