"""Packed documents: split attention with the KV cache equals per-document causal attention.

Every backend that runs on CPU is checked in float64 (outputs and q/k/v gradients
within 1e-10, backward split by split): SDPA with an explicit mask, FlexAttention (its
eager reference path), and flash-attn's variable-length path with the kernel replaced
by an emulation (the boundaries, packing and unpacking are ours; the kernel itself
needs CUDA and is exercised only by the CUDA tests at the end, skipped without one).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.seqsplit.attention_backends import (
    FlashAttnBackend,
    FlexAttentionBackend,
    available_backends,
    get_backend,
)
from megatron.seqsplit import attention_backends
from megatron.seqsplit.documents import (
    document_attention_bias,
    document_causal_mask,
    document_ids,
    document_mask_mod,
    varlen_document_layout,
)
from megatron.seqsplit.kv_cache import KVCacheStore, split_causal_attention
from split_checks import SplitStub as Split

EOD = 0


def emulated_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                    dropout_p, softmax_scale, causal):
    """flash_attn_varlen_func's contract on CPU: each sequence causal, bottom-right aligned."""
    assert causal and dropout_p == 0.0
    assert q.dim() == k.dim() == 3 and k.shape == v.shape
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    assert cu_seqlens_q[-1] == q.shape[0] and cu_seqlens_k[-1] == k.shape[0]
    lengths_q, lengths_k = cu_seqlens_q.diff().tolist(), cu_seqlens_k.diff().tolist()
    assert max_seqlen_q == max(lengths_q) and max_seqlen_k == max(lengths_k)
    outs = []
    for i, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        assert 1 <= lq <= lk
        qs = q[cu_seqlens_q[i]:cu_seqlens_q[i] + lq].transpose(0, 1)  # [h, lq, d]
        ks = k[cu_seqlens_k[i]:cu_seqlens_k[i] + lk].transpose(0, 1)
        vs = v[cu_seqlens_k[i]:cu_seqlens_k[i] + lk].transpose(0, 1)
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        outs.append(F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=softmax_scale,
            enable_gqa=qs.shape[0] != ks.shape[0]).transpose(0, 1))
    return torch.cat(outs)


def make_backend(name):
    if name == "flash_emulated":
        return FlashAttnBackend(kernels=(None, emulated_varlen))
    if name == "chunked":  # the chunked KV cache's own kernel (sdpa only for one split)
        return get_backend("sdpa")
    return get_backend(name)


def kv_cache_of(name):
    return "chunked" if name == "chunked" else "buffer"


BACKENDS = available_backends("cpu", torch.float64) + ["flash_emulated", "chunked"]


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


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("lengths", [[24], [8, 8, 8], [12, 7, 5], [1, 10, 13]])
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
@pytest.mark.parametrize("rows", [2, 1], ids=["mbs2", "mbs1"])
def test_split_document_attention_matches_per_document(backend_name, lengths, heads, groups,
                                                       rows):
    torch.manual_seed(0)
    tokens = TOKENS[:rows]
    L, b, d = tokens.shape[1], tokens.shape[0], 8
    q = torch.randn(L, b, heads, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(L, b, groups, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(L, b, groups, d, dtype=torch.float64, requires_grad=True)
    scale = d ** -0.5
    expected = reference(q, k, v, tokens, scale)
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)

    ids = document_ids(tokens, EOD)
    store, backend = KVCacheStore(forward_only=False), make_backend(backend_name)
    leaves, outputs, offset = [], [], 0
    for j, length in enumerate(lengths):
        part = [t[offset:offset + length].detach().requires_grad_() for t in (q, k, v)]
        split = Split(0, j, len(lengths), offset, length, L, ids[:, :offset + length])
        outputs.append(split_causal_attention(*part, split=split, store=store, layer_key=1,
                                              backend=backend, softmax_scale=scale,
                                              kv_cache=kv_cache_of(backend_name)))
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


# ---- flash-attn variable-length boundaries (pure tensor logic) ----

def layout_of(rows, q_length):
    layout = varlen_document_layout(torch.tensor(rows, dtype=torch.int32), q_length)
    return (layout.cu_seqlens_q.tolist(), layout.cu_seqlens_k.tolist(),
            layout.max_seqlen_q, layout.max_seqlen_k, layout.key_starts)


# name -> (document ids per row (the key prefix), query length,
#          expected cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, key_starts)
VARLEN_CASES = {
    # document 1 starts at 3 and crosses the split edge at 4: its keys start at 3
    "crosses_split_edge": ([[0, 0, 0, 1, 1, 1, 1, 1]], 4, [0, 4], [0, 5], 4, 5, [3]),
    # the split holds three documents shorter than it; document 0 lies in the prefix only
    "shorter_than_split": ([[0, 0, 0, 0, 1, 2, 2, 3]], 4, [0, 1, 3, 4], [0, 1, 3, 4], 2, 2, [4]),
    # the first split: two short documents and the start of a third
    "short_first_split": ([[0, 1, 1, 2]], 4, [0, 1, 3, 4], [0, 1, 3, 4], 2, 2, [0]),
    # a document starts exactly at the split edge: no key of the prefix is needed
    "boundary_at_edge": ([[0, 0, 0, 0, 1, 1, 1, 1]], 4, [0, 4], [0, 4], 4, 4, [4]),
    # and the split before that edge ends its document exactly
    "boundary_at_edge_before": ([[0, 0, 0, 0]], 4, [0, 4], [0, 4], 4, 4, [0]),
    # one document spanning every split: the last split sees the whole prefix
    "spans_every_split": ([[0] * 12], 4, [0, 4], [0, 12], 4, 12, [0]),
    "spans_every_split_middle": ([[0] * 8], 4, [0, 4], [0, 8], 4, 8, [0]),
    # micro-batch size 2, different boundaries per row: rows are flattened, row 1's
    # queries start at 4 and its keys after row 0's five
    "mbs2_rows_differ": ([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 2, 2]], 4,
                         [0, 4, 5, 6, 8], [0, 5, 10, 11, 13], 4, 5, [3, 0]),
    # no split (lq == lk), two rows
    "unsplit_mbs2": ([[0, 0, 1], [0, 1, 1]], 3, [0, 2, 3, 4, 6], [0, 2, 3, 4, 6], 2, 2, [0, 0]),
}


@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_varlen_layout_cases(name):
    rows, q_length, *expected = VARLEN_CASES[name]
    assert list(layout_of(rows, q_length)) == expected


def mask_from_layout(layout, b, q_length, k_length):
    """The [b, lq, lk] mask flash-attn applies for this layout (bottom-right per sequence)."""
    mask = torch.zeros(b, q_length, k_length, dtype=torch.bool)
    offset = k_length - q_length
    kept = [k_length - start for start in layout.key_starts]
    key_base = [sum(kept[:r]) for r in range(b)]
    cu_q, cu_k = layout.cu_seqlens_q.tolist(), layout.cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        row = cu_q[i] // q_length
        assert cu_q[i + 1] - 1 < (row + 1) * q_length  # a sequence never crosses rows
        assert key_base[row] <= cu_k[i] and cu_k[i + 1] <= key_base[row] + kept[row]
        q_pos = [offset + p - row * q_length for p in range(cu_q[i], cu_q[i + 1])]
        k_pos = [layout.key_starts[row] + p - key_base[row] for p in range(cu_k[i], cu_k[i + 1])]
        lq, lk = len(q_pos), len(k_pos)
        causal = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        mask[row, q_pos[0] - offset:q_pos[-1] + 1 - offset, k_pos[0]:k_pos[-1] + 1] = causal
    return mask


@pytest.mark.parametrize("lengths", [[24], [8, 8, 8], [12, 7, 5], [1, 10, 13], [3] * 8])
def test_varlen_layout_equals_document_mask(lengths):
    """Every split of the packed rows: the varlen sequences give exactly the document mask."""
    ids = document_ids(TOKENS, EOD)
    offset = 0
    for length in lengths:
        prefix = ids[:, :offset + length]
        layout = varlen_document_layout(prefix, length)
        got = mask_from_layout(layout, ids.shape[0], length, offset + length)
        assert torch.equal(got, document_causal_mask(prefix, offset, length)[:, 0]), (offset, length)
        offset += length


@pytest.mark.parametrize("rows", [[0, 1], [0], [1]], ids=["both", "row0", "row1"])
@pytest.mark.parametrize("lengths", [[24], [8, 8, 8], [12, 7, 5], [1, 10, 13], [3] * 8])
def test_document_bias_is_the_mask_without_invisible_keys(rows, lengths):
    """SDPA's additive mask: the document mask over the keys from `first_key` on, where
    every key left out is invisible to every query and the first kept one is not."""
    ids = document_ids(TOKENS[rows], EOD)
    offset = 0
    for length in lengths:
        prefix = ids[:, :offset + length]
        first_key, bias = document_attention_bias(prefix, length, torch.float64)
        full = document_causal_mask(prefix, offset, length)
        assert not full[..., :first_key].any()
        assert full[..., first_key].any()
        assert bias.dtype == torch.float64 and bias.shape == full[..., first_key:].shape
        assert torch.equal(bias == 0, full[..., first_key:])
        assert bool((bias[~full[..., first_key:]] == float("-inf")).all())
        offset += length


def test_sdpa_layers_of_a_split_keep_one_document_mask():
    """Two layers of one split build the mask once and keep one copy for backward (not
    one per layer): on CPU without dropout, the split's own block's (its prefix runs
    unmasked, cpu_split_attention); it dies with the backward."""
    import gc

    torch.manual_seed(0)
    ids = document_ids(TOKENS[:1], EOD)  # row 0: position 16's document starts at 14
    L, b, heads, d, offset, length = TOKENS.shape[1], 1, 4, 8, 16, 8
    store, backend = KVCacheStore(forward_only=False), get_backend("sdpa")
    split = Split(0, 1, 2, offset, length, L, ids[:, :offset + length])
    kept = {}

    def pack(t):
        if t.dim() == 4 and t.shape[1] == 1:  # [b, 1, lq, lk'] masks
            kept[t.untyped_storage().data_ptr()] = tuple(t.shape)
        return t

    outputs = []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for s in (Split(0, 0, 2, 0, offset, L, ids[:, :offset]), split):  # a unit ...
            for layer in (1, 2):  # ... runs every layer of the stage on its split
                part = [torch.randn(s.length, b, heads, d, dtype=torch.float64,
                                    requires_grad=True) for _ in range(3)]
                outputs.append(split_causal_attention(
                    *part, split=s, store=store, layer_key=layer, backend=backend,
                    softmax_scale=d ** -0.5))
    first_key, _ = document_attention_bias(ids[:, :offset + length], length, torch.float64)
    assert first_key == 14
    split_masks = [shape for shape in kept.values() if shape[2] == length]
    assert split_masks == [(b, 1, length, length)]  # not the keys from first_key on
    for out in reversed(outputs):  # split 1's layers, then split 0's, as the pipeline
        out.backward(torch.randn_like(out))
    del outputs, out
    gc.collect()
    assert store.num_entries() == 0
    assert attention_backends._shared_document_bias._last[2]() is None  # nothing lingers


def test_flash_varlen_layout_made_once_per_split(monkeypatch):
    """The layers of one split share its variable-length layout (two host syncs each
    otherwise); a new split (a new document-id tensor) gets its own."""
    made = []

    def counting_layout(doc_ids, q_length):
        made.append(q_length)
        return varlen_document_layout(doc_ids, q_length)

    monkeypatch.setattr(attention_backends, "varlen_document_layout", counting_layout)
    torch.manual_seed(0)
    ids = document_ids(TOKENS, EOD)
    L, b, heads, d = TOKENS.shape[1], TOKENS.shape[0], 4, 8
    store, backend = KVCacheStore(forward_only=False), make_backend("flash_emulated")
    offset = 0
    for j, length in enumerate([12, 7, 5]):
        split = Split(0, j, 3, offset, length, L, ids[:, :offset + length])
        for layer in (1, 2, 3):
            part = [torch.randn(length, b, heads, d, dtype=torch.float64) for _ in range(3)]
            split_causal_attention(*part, split=split, store=store, layer_key=layer,
                                   backend=backend, softmax_scale=d ** -0.5)
        offset += length
    assert made == [12, 7, 5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn kernels need CUDA")
def test_flash_varlen_kernel_matches_sdpa_bf16():
    """The real flash_attn_varlen_func on the document layout (untested without a GPU)."""
    pytest.importorskip("flash_attn")
    _compare_on_cuda(get_backend("flash"), torch.bfloat16, atol=2e-2)


# ---- FlexAttention ----

def test_flex_cpu_path_equals_public_flex_attention():
    """On CPU the backend calls the op behind flex_attention directly (the public function
    refuses inputs that require grad there); without grad both must agree exactly."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    gen = torch.Generator().manual_seed(1)
    ids = document_ids(TOKENS, EOD)
    lq, lk = 7, 19
    q = torch.randn(2, 4, lq, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, lk, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    prefix = ids[:, :lk]
    mask = flex.create_block_mask(document_mask_mod(prefix, lq), 2, None, lq, lk, device="cpu")
    want = flex.flex_attention(q, k, v, block_mask=mask, scale=0.3, enable_gqa=True)
    got = FlexAttentionBackend()(q, k, v, softmax_scale=0.3, document_ids=prefix)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    sdpa = get_backend("sdpa")(q, k, v, softmax_scale=0.3, document_ids=prefix)
    torch.testing.assert_close(got, sdpa, rtol=0, atol=1e-12)


def test_flex_refuses_dropout():
    pytest.importorskip("torch.nn.attention.flex_attention")
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="--attention-dropout 0"):
        FlexAttentionBackend()(q, q, q, softmax_scale=1.0, dropout_p=0.1)


def test_core_attention_with_flex_needs_dropout_zero():
    """Chosen at model build time: a dropout the backend cannot apply is refused there."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.seqsplit.core_attention import SplitCausalAttention

    def build(dropout):
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                   attention_dropout=dropout)
        return SplitCausalAttention(config, 1, AttnMaskType.causal, "self", backend_name="flex")

    with pytest.raises(ValueError, match="--attention-dropout 0"):
        build(0.1)
    assert build(0.0).backend.name == "flex"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled FlexAttention needs CUDA here")
@pytest.mark.parametrize("name", ["sdpa", "flex", "chunked"])
def test_document_attention_cuda_bf16(name):
    """bf16 on CUDA against the float64 CPU reference (untested without a GPU)."""
    _compare_on_cuda(make_backend(name), torch.bfloat16, atol=2e-2, kv_cache=kv_cache_of(name))


def _compare_on_cuda(backend, dtype, atol, kv_cache="buffer"):
    torch.manual_seed(0)
    L, b, heads, groups, d, scale = TOKENS.shape[1], TOKENS.shape[0], 4, 2, 64, 0.125
    q = torch.randn(L, b, heads, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(L, b, groups, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(L, b, groups, d, dtype=torch.float64, requires_grad=True)
    expected = reference(q, k, v, TOKENS, scale)
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    ids = document_ids(TOKENS, EOD).cuda()
    store, leaves, outputs, offset, lengths = KVCacheStore(), [], [], 0, [10, 8, 6]
    for j, length in enumerate(lengths):
        part = [t[offset:offset + length].detach().to("cuda", dtype).requires_grad_()
                for t in (q, k, v)]
        split = Split(0, j, len(lengths), offset, length, L, ids[:, :offset + length])
        outputs.append(split_causal_attention(*part, split=split, store=store, layer_key=1,
                                              backend=backend, softmax_scale=scale,
                                              kv_cache=kv_cache))
        leaves.append(part)
        offset += length
    torch.testing.assert_close(torch.cat(outputs).double().cpu(), expected.detach(),
                               rtol=0, atol=atol)
    offsets = [sum(lengths[:j]) for j in range(len(lengths))]
    for j in reversed(range(len(lengths))):
        outputs[j].backward(grad_out[offsets[j]:offsets[j] + lengths[j]].to("cuda", dtype))
    for i, name in enumerate("qkv"):
        got = torch.cat([leaf[i].grad for leaf in leaves]).double().cpu()
        torch.testing.assert_close(got, expected_grads[i], rtol=0, atol=4 * atol, msg=name)
