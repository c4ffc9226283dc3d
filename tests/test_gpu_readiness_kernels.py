"""Issue 22, items 3, 4 and 9: the chunked log-sum-exp kernel (`lse_attention`) as it
will run on a GPU, checked on CPU.

* bf16 accuracy: against a float64 reference of the same bf16 inputs, its output and
  gradients are within the error SDPA's fused bf16 kernel makes (CPU's flash kernel,
  which like CUDA's keeps scores in fp32 and rounds P and dS to bf16);
* no host sync without documents, one per split with documents (counted);
* flash-attn's public forward, when installed, computes the chunks' partials and LSEs
  (here a float64 stand-in with flash-attn's signature and layout).
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from megatron.seqsplit.documents import document_ids
from megatron.seqsplit.lse_attention import (
    lse_attention_backward,
    lse_attention_forward,
)
from gpu_readiness import HostSyncCounter, relative_error

B, HQ, G, D = 1, 4, 2, 64
SCALE = D ** -0.5


def inputs(lq, chunk_lengths, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lk = sum(chunk_lengths)
    q = (torch.randn(B, HQ, lq, D, generator=gen) * 1.5).to(dtype)  # peaked softmax rows
    k = torch.randn(B, G, lk, D, generator=gen).to(dtype)
    v = torch.randn(B, G, lk, D, generator=gen).to(dtype)
    grad_out = torch.randn(B, HQ, lq, D, generator=gen).to(dtype)
    return q, k, v, grad_out


def sdpa_with_grads(q, k, v, grad_out):
    """SDPA's output and (dq, dk, dv), bottom-right causal, GQA."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(
        *leaves, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), scale=SCALE,
        enable_gqa=True)
    out.backward(grad_out)
    return [out.detach()] + [x.grad for x in leaves]


def chunked_with_grads(q, k, v, grad_out, chunk_lengths, flash_forward=None, **kwargs):
    """The chunked kernel's output and (dq, dk, dv), K/V grads in the inputs' dtype as
    `kv_chunks` returns them."""
    keys, values = list(k.split(chunk_lengths, 2)), list(v.split(chunk_lengths, 2))
    out, lse = lse_attention_forward(q, keys, values, softmax_scale=SCALE,
                                     flash_forward=flash_forward, **kwargs)
    dq, dks, dvs = lse_attention_backward(grad_out, q, out, lse, keys, values,
                                          softmax_scale=SCALE, **kwargs)
    return [out, dq, torch.cat(dks, 2).to(k.dtype), torch.cat(dvs, 2).to(v.dtype)]


@pytest.mark.parametrize("max_block_elements", [1 << 26, 4096], ids=["one-block", "blocks"])
def test_bf16_chunked_kernel_is_as_accurate_as_sdpa(max_block_elements):
    """Before the fix (QK^T and dO V^T rounded to bf16, query pre-scaled in bf16) the
    output's error was 3.5x SDPA's and dq's 2.8x."""
    lengths = [256, 128, 128]
    q, k, v, grad_out = inputs(256, lengths, torch.bfloat16)
    reference = sdpa_with_grads(*(x.double() for x in (q, k, v, grad_out)))
    sdpa = sdpa_with_grads(q, k, v, grad_out)
    chunked = chunked_with_grads(q, k, v, grad_out, lengths,
                                 max_block_elements=max_block_elements)
    for name, ours, theirs, exact in zip(("out", "dq", "dk", "dv"), chunked, sdpa, reference):
        bound = relative_error(theirs, exact)
        error = relative_error(ours, exact)
        assert error <= 1.1 * bound, f"{name}: chunked bf16 error {error:.2e} vs SDPA's {bound:.2e}"


def test_no_host_sync_without_documents():
    """Before the fix, every query block's diagonal chunk asked `bool(allowed.any())`."""
    lengths = [16, 16, 16]
    q, k, v, grad_out = inputs(16, lengths, torch.float32)
    with HostSyncCounter() as counter:
        chunked_with_grads(q, k, v, grad_out, lengths, max_block_elements=256)
    assert counter.calls == []


def test_documents_cost_one_host_sync_per_split():
    """With documents, which (query block, chunk) pairs see nothing is asked once per
    split: the layers' forwards and backwards share the split's id tensor."""
    lengths = [16, 16, 16]
    q, k, v, grad_out = inputs(16, lengths, torch.float32)
    tokens = torch.randint(1, 50, (B, sum(lengths)), generator=torch.Generator().manual_seed(1))
    tokens[:, [5, 20, 40]] = 0  # three documents end inside the sequence
    ids = document_ids(tokens, eod=0)
    with HostSyncCounter() as counter:
        for _layer in range(3):
            chunked_with_grads(q, k, v, grad_out, lengths, document_ids=ids,
                               max_block_elements=256)
    assert counter.calls == ["tolist"]


class FlashStandIn:
    """flash_attn_func's contract in float64: [b, l, h, d] layout, GQA, bottom-right
    causal, ``return_attn_probs=True`` -> (out, softmax_lse [b, h, lq], None). Records
    the ``causal`` flag of every call."""

    def __init__(self):
        self.causal_flags = []

    def __call__(self, q, k, v, softmax_scale, causal, return_attn_probs):
        assert return_attn_probs
        self.causal_flags.append(causal)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [b, h, l, d]
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
        scores = q @ k.transpose(-1, -2) * softmax_scale
        if causal:
            lq, lk = scores.shape[-2:]
            visible = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
            scores = scores.masked_fill(~visible, float("-inf"))
        lse = scores.logsumexp(-1)
        out = (scores - lse[..., None]).exp() @ v
        return out.transpose(1, 2), lse, None


def test_flash_forward_computes_the_chunks_partials():
    """Prefix chunks run without a mask, the split's own chunk with flash's causal mask;
    the merged output and LSE (which backward uses) are the kernel's own."""
    lengths = [8, 12, 8]  # the last chunk is the split's own: its 8 queries
    q, k, v, _ = inputs(8, lengths, torch.float64)
    keys, values = list(k.split(lengths, 2)), list(v.split(lengths, 2))
    flash = FlashStandIn()
    out, lse = lse_attention_forward(q, keys, values, softmax_scale=SCALE, flash_forward=flash)
    expected_out, expected_lse = lse_attention_forward(q, keys, values, softmax_scale=SCALE,
                                                       flash_forward=None)
    assert flash.causal_flags == [False, False, True]
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=1e-12)


@pytest.mark.parametrize("lengths, lq, query_start, why", [
    ([6, 4], 5, None, "the first query sees no key of the own chunk (flash: LSE +inf)"),
    ([8, 8, 8], 4, 16, "the queries end inside the last chunk, not at its end"),
])
def test_flash_forward_left_out_where_its_mask_is_not_ours(lengths, lq, query_start, why):
    q, k, v, _ = inputs(lq, lengths, torch.float64)
    keys, values = list(k.split(lengths, 2)), list(v.split(lengths, 2))
    flash = FlashStandIn()
    lse_attention_forward(q, keys, values, softmax_scale=SCALE, flash_forward=flash,
                          query_start=query_start)
    assert flash.causal_flags == [], why


def test_flash_forward_skipped_with_documents():
    lengths = [8, 8]
    q, k, v, _ = inputs(8, lengths, torch.float64)
    ids = torch.zeros(B, 16, dtype=torch.int32)
    ids[:, 10:] = 1
    flash = FlashStandIn()
    lse_attention_forward(q, list(k.split(lengths, 2)), list(v.split(lengths, 2)),
                          softmax_scale=SCALE, document_ids=ids, flash_forward=flash)
    assert flash.causal_flags == []


class Bf16FlashStandIn(FlashStandIn):
    """The stand-in with flash-attn's rounding: bf16 partial outputs, fp32 LSE."""

    def __call__(self, q, k, v, softmax_scale, causal, return_attn_probs):
        out, lse, _ = super().__call__(q.double(), k.double(), v.double(), softmax_scale,
                                       causal, return_attn_probs)
        return out.to(q.dtype), lse.float(), None


def test_bf16_flash_forward_partials_stay_near_sdpa_accuracy():
    """flash-attn's public forward returns each chunk's partial rounded to bf16: merging
    three of them costs the output about 1.15x SDPA's error (gradients come from this
    module's fp32 backward). The bound the CUDA run is held to, too."""
    lengths = [128, 128, 256]  # the split's own chunk last, as long as its queries
    q, k, v, grad_out = inputs(256, lengths, torch.bfloat16)
    reference = sdpa_with_grads(*(x.double() for x in (q, k, v, grad_out)))
    sdpa = sdpa_with_grads(q, k, v, grad_out)
    flash = Bf16FlashStandIn()
    chunked = chunked_with_grads(q, k, v, grad_out, lengths, flash_forward=flash)
    assert flash.causal_flags == [False, False, True]
    for name, ours, theirs, exact in zip(("out", "dq", "dk", "dv"), chunked, sdpa, reference):
        bound = relative_error(theirs, exact)
        error = relative_error(ours, exact)
        assert error <= 1.25 * bound, f"{name}: {error:.2e} vs SDPA's {bound:.2e}"
