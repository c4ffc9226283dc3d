"""Issue 22, items 1, 2 and 5: which attention kernel a CUDA call takes, decided as pure
functions of the call (device, dtype, head dim, grouped K/V, documents, dropout), so
checked here on CPU for hypothetical CUDA calls; the shared document mask's strides;
FlexAttention's block mask made once per split."""

import itertools
import warnings

import pytest
import torch

from megatron.seqsplit import attention_backends
from megatron.seqsplit.attention_backends import (
    AttentionCall,
    FlexAttentionBackend,
    SDPABackend,
    auto_backend_name,
    flash_attn_runs,
    get_backend,
    sdpa_expands_kv_heads,
)
from megatron.seqsplit.documents import document_attention_bias, document_causal_mask

HALF = (torch.float16, torch.bfloat16)


def torch_cuda_sdpa_kernel(call: AttentionCall, kv_expanded: bool) -> str:
    """PyTorch's CUDA SDPA dispatch (sdp_utils.cpp), as far as these calls go: flash
    takes fp16/bf16, head dim <= 256, grouped K/V, no explicit mask; memory-efficient
    takes any of those dtypes and masks but not grouped K/V; else math, which saves an
    fp32 [b, hq, lq, lk] probability tensor per layer."""
    grouped = call.grouped and not kv_expanded
    if call.dtype in HALF and call.head_dim <= 256 and not call.documents:
        return "flash"
    if not grouped:
        return "efficient"
    return "math"


CUDA_CALLS = [AttentionCall("cuda", dtype, head_dim, grouped, documents, dropout)
              for dtype, head_dim, grouped, documents, dropout in itertools.product(
                  (torch.float16, torch.bfloat16, torch.float32), (64, 128, 512),
                  (False, True), (False, True), (False, True))]


@pytest.mark.parametrize("flash_version", [None, (2, 6)], ids=["no-flash-attn", "flash-attn"])
@pytest.mark.parametrize("flex_available", [False, True], ids=["no-flex", "flex"])
def test_no_cuda_route_keeps_an_lq_by_lk_tensor_per_layer(flash_version, flex_available):
    """Every CUDA call is routed to flash-attn (when it runs), compiled FlexAttention
    (packed documents, no dropout) or an SDPA call PyTorch runs on a fused kernel."""
    for call in CUDA_CALLS:
        name = auto_backend_name(call, flash_version, flex_available)
        if name == "flash":
            assert flash_attn_runs(call, flash_version), call
        elif name == "flex":
            assert call.documents and flex_available and not call.dropout, call
        else:
            assert name == "sdpa", call
            assert torch_cuda_sdpa_kernel(call, sdpa_expands_kv_heads(call)) != "math", call


@pytest.mark.parametrize("call, flash_version, flex_available, expected", [
    # packed documents + GQA in bf16 (the case): flash varlen, else flex, else sdpa
    (AttentionCall("cuda", torch.bfloat16, 128, True, True), (2, 6), True, "flash"),
    (AttentionCall("cuda", torch.bfloat16, 128, True, True), None, True, "flex"),
    (AttentionCall("cuda", torch.bfloat16, 128, True, True), None, False, "sdpa"),
    (AttentionCall("cuda", torch.bfloat16, 128, True, True, dropout=True), None, True, "sdpa"),
    (AttentionCall("cuda", torch.float32, 128, True, True), (2, 6), True, "flex"),
    (AttentionCall("cuda", torch.bfloat16, 512, False, False), (2, 6), True, "sdpa"),
    (AttentionCall("cuda", torch.bfloat16, 128, True, False), None, True, "sdpa"),
    (AttentionCall("cpu", torch.float32, 64, True, True), (2, 6), True, "sdpa"),
])
def test_auto_route(call, flash_version, flex_available, expected):
    assert auto_backend_name(call, flash_version, flex_available) == expected


@pytest.mark.parametrize("call, expanded", [
    (AttentionCall("cuda", torch.bfloat16, 128, True, True), True),  # documents: a mask
    (AttentionCall("cuda", torch.float32, 128, True, False), True),  # fp32: no flash
    (AttentionCall("cuda", torch.bfloat16, 512, True, False), True),  # head dim > 256
    (AttentionCall("cuda", torch.bfloat16, 128, True, False), False),  # torch's flash: GQA
    (AttentionCall("cuda", torch.float32, 128, False, True), False),  # not grouped
    (AttentionCall("cpu", torch.float32, 128, True, True), False),  # CPU's kernel reads GQA
])
def test_sdpa_expands_kv_heads_only_where_cuda_needs_it(call, expanded):
    assert sdpa_expands_kv_heads(call) is expanded


def test_auto_backend_routes_each_call(monkeypatch):
    pytest.importorskip("torch.nn.attention.flex_attention")
    monkeypatch.setattr(attention_backends, "_flash_attn_version", lambda: None)
    auto = get_backend("auto")
    documents = AttentionCall("cuda", torch.bfloat16, 128, True, True)
    assert isinstance(auto.backend_for(documents), FlexAttentionBackend)
    assert isinstance(auto.backend_for(AttentionCall("cuda", torch.bfloat16, 128, True, False)),
                      SDPABackend)
    assert auto.backend_for(documents) is auto.backend_for(documents)  # made once


def _tensors(b=2, hq=4, g=2, lq=6, lk=14, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, g, lk, d, generator=gen, dtype=torch.float64) for _ in range(2))
    ids = torch.tensor([[0] * 5 + [1] * 6 + [2] * 3, [0] * 9 + [1] * 5], dtype=torch.int32)
    return q, k, v, ids[:b, :lk]


@pytest.mark.parametrize("lq, lk, documents", [(6, 14, True), (6, 14, False), (14, 14, False)])
def test_sdpa_with_expanded_heads_is_the_same_attention(monkeypatch, lq, lk, documents):
    """The expanded-heads path (CUDA's, forced here on CPU) gives the grouped result
    and says so in one line, once. (One row: two would take CPU's own bottom-right path.)"""
    q, k, v, ids = _tensors(b=1, lq=lq, lk=lk)
    kwargs = dict(softmax_scale=0.3, document_ids=ids if documents else None)
    grouped = SDPABackend()(q, k, v, **kwargs)
    monkeypatch.setattr(attention_backends, "sdpa_expands_kv_heads", lambda call: True)
    monkeypatch.setattr(attention_backends, "_EXPANSION_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _layer in range(3):
            expanded = SDPABackend()(q, k, v, **kwargs)
    torch.testing.assert_close(expanded, grouped, rtol=0, atol=1e-12)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "\n" not in messages[0] and "expanded 2x" in messages[0]


def torch_mask_is_aligned(mask, alignment=8):
    """PyTorch's `aligned_tensor<8>` (attention.cpp `preprocess_mask`): unless every
    stride but the last is a multiple of 8 and the last is 1, CUDA's SDPA pads a copy."""
    return mask.stride(-1) == 1 and all(s % alignment == 0 for s in mask.stride()[:-1])


@pytest.mark.parametrize("q_length", [1, 3, 5, 7, 8, 13])
def test_document_mask_rows_are_aligned_for_cuda(q_length):
    """The shared mask is not copied per layer by CUDA's memory-efficient kernel; its
    values are the per-document causal mask."""
    gen = torch.Generator().manual_seed(q_length)
    lk = 19
    ids = torch.sort(torch.randint(0, 4, (2, lk), generator=gen), dim=1).values
    first_key, bias = document_attention_bias(ids, q_length, torch.bfloat16)
    assert torch_mask_is_aligned(bias), (bias.shape, bias.stride())
    allowed = document_causal_mask(ids[:, first_key:], lk - q_length - first_key, q_length)
    assert torch.equal(bias == 0, allowed)


def test_flex_block_mask_made_once_per_split(monkeypatch):
    """Layers share their split's block mask: one per split, not one per layer."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    made = []
    original = flex.create_block_mask

    def counting(mask_mod, b, h, lq, lk, **kwargs):
        made.append((b, lq, lk))
        return original(mask_mod, b, h, lq, lk, **kwargs)

    monkeypatch.setattr(flex, "create_block_mask", counting)
    attention_backends._causal_block_mask.cache_clear()
    q, k, v, ids = _tensors()
    layers = [FlexAttentionBackend() for _ in range(3)]
    for documents in (ids, ids.clone(), None):  # two splits with documents, one without
        for layer in layers:
            layer(q, k, v, softmax_scale=0.3, document_ids=documents)
    assert made == [(2, 6, 14), (2, 6, 14), (None, 6, 14)]


@pytest.mark.parametrize("dropout, sync", [
    (0.5, "__int__"),  # the masked kernel over the keys from the first visible one (CUDA's)
    (0.0, "tolist"),  # CPU without dropout: which rows see which prefix keys
])
def test_sdpa_document_mask_costs_one_host_sync_per_split(dropout, sync):
    """Without autograd no layer keeps the mask, so it is remade per layer; the host
    sync behind it (the first visible key, or the prefix's rows) is not: one per split."""
    from gpu_readiness import HostSyncCounter

    q, k, v, ids = _tensors()
    with torch.no_grad(), HostSyncCounter() as counter:
        for documents in (ids, ids.clone()):  # two splits
            for _layer in range(3):
                SDPABackend()(q, k, v, softmax_scale=0.3, dropout_p=dropout,
                              document_ids=documents)
    assert counter.calls == [sync, sync]
