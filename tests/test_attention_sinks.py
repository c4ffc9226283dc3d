"""Attention sinks (--softmax-type off-by-one / learnable, gpt-oss) under sequence splits.

megatron-core's ``SoftmaxOne`` joins a logit per head to every query's softmax, with no
value. Split attention with the buffer KV cache (the CPU kernels: the fused split node,
the split kernel with packed documents, the masked kernel for sliding windows and for
unsplit calls) equals that definition in float64, outputs and q/k/v gradients within
1e-10, backward split by split as the pipeline runs it, and so does the sinks' own
gradient, summed over the splits. The model-level check (Seq1F1B against one process) is
the "gpt-oss" recipe of tests/test_model_flags_exactness.py; the routes that have no sinks
stop with the reason.
"""

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from megatron.seqsplit.attention_backends import get_backend
from megatron.seqsplit.documents import document_ids
from megatron.seqsplit.kv_cache import KVCacheStore, split_causal_attention
from megatron_lm_parser import megatron_lm_args
from split_checks import SplitStub as Split
from split_checks import check_backward_split_by_split, recomputed_kernel

EOD = 0


def reference(q, k, v, sink, scale, window=None, tokens=None):
    """[l, b, h, d] causal attention with megatron-core's SoftmaxOne: the sink logit of each
    head as one more column of every row's softmax, dropped after it."""
    L, b = q.shape[0], q.shape[1]
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    position = torch.arange(L)
    rel = position[None, :] - position[:, None]  # key - query
    visible = (rel <= 0)[None].expand(b, L, L)
    if window is not None:
        visible = visible & (rel >= -window)
    if tokens is not None:  # each query within its own document
        ids = document_ids(tokens, EOD)
        visible = visible & (ids[:, :, None] == ids[:, None, :])
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    column = sink.view(1, -1, 1, 1).expand(b, -1, L, 1)
    probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("bhqk,kbhd->qbhd", probs, v)


def make_backend(name, monkeypatch=None):
    """A backend by name; "recomputed": selective recomputation's checkpointed kernel
    (--recompute-activations), the sinks an input of its checkpoint; "chunked": the chunked
    KV cache's kernel (sdpa serves its unsplit calls)."""
    if name == "chunked":
        return get_backend("sdpa")
    if name == "recomputed":
        return recomputed_kernel(get_backend("sdpa"), monkeypatch)
    return get_backend(name)


TOKENS = torch.tensor([[5, 7, EOD, 3, 3, 9, 4, EOD, 6, 2, 8, 1, 5, 5, 7, 3, EOD, 2, 2, 4, 6, 9,
                        1, 3],
                       [4, 4, 4, 4, 4, 4, EOD, 8, 8, 8, EOD, 5, 5, 5, 5, 5, 5, 5, 5, 5, EOD, 1,
                        2, 3]])


@pytest.mark.parametrize("case", ["causal", "window", "documents"])
@pytest.mark.parametrize("lengths", [[24], [8, 8, 8], [5, 11, 8], [12, 12]])
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
@pytest.mark.parametrize("backend_name", ["sdpa", "auto", "recomputed", "chunked"])
def test_split_attention_with_sinks_matches_the_definition(case, lengths, heads, groups,
                                                           backend_name, monkeypatch):
    if backend_name == "chunked" and case == "documents":
        pytest.skip("sinks with packed documents are not in the chunked kernel (refused)")
    torch.manual_seed(0)
    L, b, d, scale = sum(lengths), 2, 8, 8 ** -0.5
    q = torch.randn(L, b, heads, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(L, b, groups, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(L, b, groups, d, dtype=torch.float64, requires_grad=True)
    sink = torch.randn(heads, dtype=torch.float64, requires_grad=True)
    window = 6 if case == "window" else None
    tokens = TOKENS if case == "documents" else None
    expected = reference(q, k, v, sink, scale, window, tokens)
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q, k, v, sink), grad_out)

    ids = document_ids(tokens, EOD) if tokens is not None else None
    store, backend = KVCacheStore(forward_only=False), make_backend(backend_name, monkeypatch)
    leaves, outputs, offset = [], [], 0
    split_sink = sink.detach().clone().requires_grad_()
    for j, length in enumerate(lengths):
        part = [t[offset:offset + length].detach().requires_grad_() for t in (q, k, v)]
        split = (None if len(lengths) == 1 else
                 Split(0, j, len(lengths), offset, length, L,
                       None if ids is None else ids[:, :offset + length]))
        if split is None and ids is not None:  # unsplit with documents: one whole split
            split = Split(0, 0, 1, 0, L, L, ids)
        outputs.append(split_causal_attention(
            *part, split=split, store=store, layer_key=1, backend=backend, softmax_scale=scale,
            window=window, sink=split_sink,
            kv_cache="chunked" if backend_name == "chunked" else "buffer"))
        leaves.append(part)
        offset += length
    torch.testing.assert_close(torch.cat(outputs), expected, rtol=0, atol=1e-10)
    check_backward_split_by_split(outputs, leaves, lengths, grad_out, expected_grads, 1e-10)
    torch.testing.assert_close(split_sink.grad, expected_grads[3], rtol=0, atol=1e-10)
    assert store.num_entries() == 0


def test_forward_only_splits_with_sinks():
    """Evaluation (no graph): the split kernel without the fused cache node."""
    torch.manual_seed(1)
    L, lengths = 24, [8, 8, 8]
    q, k, v = (torch.randn(L, 1, 4, 8, dtype=torch.float64) for _ in range(3))
    sink = torch.randn(4, dtype=torch.float64)
    store, outputs, offset = KVCacheStore(forward_only=True), [], 0
    with torch.no_grad():
        for j, length in enumerate(lengths):
            outputs.append(split_causal_attention(
                q[offset:offset + length], k[offset:offset + length], v[offset:offset + length],
                split=Split(0, j, 3, offset, length, L), store=store, layer_key=1,
                backend=get_backend("sdpa"), softmax_scale=0.3, sink=sink))
            offset += length
    torch.testing.assert_close(torch.cat(outputs), reference(q, k, v, sink, 0.3), rtol=0,
                               atol=1e-10)


def test_a_sink_changes_attention():
    """The checks above can fail: a sink of 0 (off-by-one) is not plain softmax."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(12, 1, 2, 8, dtype=torch.float64) for _ in range(3))
    with_sink = reference(q, k, v, torch.zeros(2, dtype=torch.float64), 0.3)
    without = reference(q, k, v, torch.full((2,), -1e4, dtype=torch.float64), 0.3)
    assert not torch.allclose(with_sink, without)


@pytest.mark.parametrize("what", ["dropout", "flex", "chunked documents"])
def test_routes_without_sinks_stop_with_the_reason(what):
    q = torch.randn(1, 2, 4, 8)
    sink = torch.zeros(2)
    if what == "dropout":
        with pytest.raises(ValueError, match="attention sinks"):
            get_backend("sdpa")(q, q, q, softmax_scale=0.3, dropout_p=0.1, sink=sink)
    elif what == "flex":
        with pytest.raises(ValueError, match="attention sinks"):
            get_backend("flex")(q, q, q, softmax_scale=0.3, sink=sink)
    else:
        x = torch.randn(4, 1, 2, 8)
        store, ids = KVCacheStore(), document_ids(TOKENS[:1, :8], EOD)
        split_causal_attention(x, x, x, split=Split(0, 0, 2, 0, 4, 8, ids[:, :4]), store=store,
                               layer_key=1, backend=get_backend("sdpa"), softmax_scale=0.3,
                               kv_cache="chunked")
        with pytest.raises(ValueError, match="packed documents"):
            split_causal_attention(x, x, x, split=Split(0, 1, 2, 4, 4, 8, ids), store=store,
                                   layer_key=1, backend=get_backend("sdpa"), softmax_scale=0.3,
                                   kv_cache="chunked", sink=sink)


# --- the flag ----------------------------------------------------------------------------

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--train-iters", "1", "--mock-data", "--vocab-size", "128",
        "--micro-batch-size", "1", "--global-batch-size", "1", "--attention-dropout", "0"]


def parsed(*flags, cuda=False):
    from megatron.trainer.arguments import parse_args

    return parse_args(BASE + list(flags), world_size=1, cuda_available=cuda,
                      check_files=False)


@pytest.mark.parametrize("kind", ["vanilla", "off-by-one", "learnable"])
def test_softmax_type_reaches_the_config_and_the_model(kind):
    from megatron.seqsplit.core_attention import SplitCausalAttention
    from megatron.trainer.model import transformer_config_from_args

    flags = ["--softmax-type", kind]
    config = transformer_config_from_args(parsed(*flags))
    assert config.softmax_type == kind
    megatron_lm = megatron_lm_args(flags)
    if megatron_lm is not None:
        assert megatron_lm.softmax_type == kind
    attention = SplitCausalAttention(config, 1, AttnMaskType.causal, "self")
    offset = attention.softmax_offset
    params = dict(attention.named_parameters())
    if kind == "vanilla":
        assert offset is None and not params
    elif kind == "off-by-one":  # megatron-core's: zeros, not a parameter, not saved
        assert torch.equal(offset, torch.zeros(4)) and not params
        assert "softmax_offset" not in attention.state_dict()
    else:
        assert params == {"softmax_offset": offset} and offset.shape == (4,)
        assert offset.abs().sum() > 0  # initialised with init_method, as megatron-core


def test_megatron_lm_default_is_vanilla():
    assert parsed().softmax_type == "vanilla"
    megatron_lm = megatron_lm_args([])
    if megatron_lm is not None:
        assert megatron_lm.softmax_type == "vanilla"


@pytest.mark.parametrize("flags, cuda, message", [
    (["--softmax-type", "learnable", "--seq1f1b-splits", "2"], True,
     "on CUDA needs --seq1f1b-kv-cache chunked"),
    (["--softmax-type", "off-by-one", "--attention-dropout", "0.1"], False,
     "--attention-dropout 0"),
    (["--softmax-type", "learnable", "--seq1f1b-kv-cache", "chunked", "--reset-attention-mask"],
     False, "--reset-attention-mask on CUDA or with the chunked KV cache"),
    (["--softmax-type", "learnable", "--attention-backend", "flex"], False,
     "--attention-backend flex"),
])
def test_softmax_type_stops_where_there_are_no_sinks(flags, cuda, message):
    from megatron.trainer.arguments import ArgumentErrors

    with pytest.raises(ArgumentErrors) as error:
        parsed(*flags, cuda=cuda)
    assert message in "\n".join(error.value.problems)


@pytest.mark.parametrize("flags", [
    ["--softmax-type", "learnable"],  # no splits: the unsplit kernel has the sinks
    ["--softmax-type", "learnable", "--seq1f1b-splits", "2", "--seq1f1b-kv-cache", "chunked"],
])
def test_softmax_type_runs_on_cuda_where_a_kernel_has_sinks(flags):
    assert parsed(*flags, cuda=True).softmax_type == "learnable"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 9])
def test_sinks_on_cuda_bf16(window):
    """bf16 on CUDA: splits through the chunked cache's kernel and the unsplit call through
    the same kernel over one chunk, against the float64 CPU definition (not run yet: no
    GPU where this was written)."""
    torch.manual_seed(0)
    lengths, heads, groups, d, scale = [16, 8, 16], 4, 2, 64, 0.125
    L = sum(lengths)
    q = torch.randn(L, 1, heads, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(L, 1, groups, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(L, 1, groups, d, dtype=torch.float64, requires_grad=True)
    sink = torch.randn(heads, dtype=torch.float64, requires_grad=True)
    expected = reference(q, k, v, sink, scale, window)
    grad_out = torch.randn_like(expected)
    want = torch.autograd.grad(expected, (q, k, v, sink), grad_out)
    for split_lengths in ([L], lengths):
        store, leaves, outputs, offset = KVCacheStore(), [], [], 0
        cuda_sink = sink.detach().to("cuda", torch.bfloat16).requires_grad_()
        for j, length in enumerate(split_lengths):
            part = [t[offset:offset + length].detach().to("cuda", torch.bfloat16)
                    .requires_grad_() for t in (q, k, v)]
            split = (None if len(split_lengths) == 1
                     else Split(0, j, len(split_lengths), offset, length, L))
            outputs.append(split_causal_attention(
                *part, split=split, store=store, layer_key=1, backend=get_backend("auto"),
                softmax_scale=scale, window=window, sink=cuda_sink, kv_cache="chunked"))
            leaves.append(part)
            offset += length
        torch.testing.assert_close(torch.cat(outputs).double().cpu(), expected.detach(),
                                   rtol=0, atol=2e-2)
        starts = [sum(split_lengths[:j]) for j in range(len(split_lengths))]
        for j in reversed(range(len(split_lengths))):
            outputs[j].backward(grad_out[starts[j]:starts[j] + split_lengths[j]]
                                .to("cuda", torch.bfloat16))
        for i, name in enumerate("qkv"):
            got = torch.cat([leaf[i].grad for leaf in leaves]).double().cpu()
            torch.testing.assert_close(got, want[i], rtol=0, atol=8e-2, msg=name)
        torch.testing.assert_close(cuda_sink.grad.double().cpu(), want[3], rtol=0, atol=0.5)
