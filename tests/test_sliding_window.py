"""Sliding-window attention (--window-size, --window-attn-skip-freq) under sequence splits.

Split attention with the buffer KV cache equals the unsplit windowed attention computed
from the definition (query at position p sees keys p - LEFT .. p), outputs and q/k/v
gradients in float64 within 1e-10, backward split by split as the pipeline runs it, for
every backend that runs on CPU (SDPA with its banded mask, FlexAttention's eager path,
flash-attn's call with the kernel replaced by that definition). The mask is megatron-core's
rule (`get_sliding_window_causal_mask`, CUDA-only there, restated here). The model-level
check (Seq1F1B against one process) is the "qwen3-swa" recipe of
tests/test_model_flags_exactness.py; the flags' parsing and refusals are at the end.
"""

import pytest
import torch

from megatron.seqsplit.attention_backends import (
    FlashAttnBackend,
    available_backends,
    get_backend,
    window_mask,
)
from megatron.seqsplit.core_attention import layer_window
from megatron.seqsplit.kv_cache import KVCacheStore, split_causal_attention
from megatron_lm_parser import megatron_lm_args
from split_checks import SplitStub as Split
from split_checks import check_backward_split_by_split, recomputed_kernel


def megatron_core_window_mask(sq, skv, window_size):
    """megatron.core.transformer.utils.get_sliding_window_causal_mask, on CPU: True where
    the score is masked out."""
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(mu, diagonal=skv - sq + window_size[1])


@pytest.mark.parametrize("lq,lk,window", [(8, 8, 3), (5, 17, 4), (6, 6, 0), (4, 30, 40),
                                          (16, 16, 15)])
def test_window_mask_is_megatron_cores_rule(lq, lk, window):
    want = ~megatron_core_window_mask(lq, lk, (window, 0))
    assert torch.equal(window_mask(lq, lk, window, torch.device("cpu")), want)


def reference(q, k, v, window, scale):
    """[l, b, h, d] windowed causal attention from the definition, heads grouped."""
    L = q.shape[0]
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    position = torch.arange(L)
    rel = position[None, :] - position[:, None]  # key - query
    visible = (rel <= 0) & (rel >= -window)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,kbhd->qbhd", probs, v)


def emulated_flash(q, k, v, *, dropout_p, softmax_scale, causal, window_size=(-1, -1)):
    """flash_attn_func's contract ([b, l, h, d], bottom-right causal window) from the
    definition, to check what the backend passes and how it lays tensors out."""
    assert causal and dropout_p == 0.0
    lq, lk = q.shape[1], k.shape[1]
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    rel = torch.arange(lk)[None, :] - torch.arange(lq)[:, None] - (lk - lq)
    visible = rel <= 0
    if window_size[0] >= 0:
        visible &= rel >= -window_size[0]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def make_backend(name, monkeypatch=None):
    if name == "flash_emulated":
        return FlashAttnBackend(kernels=(emulated_flash, None))
    if name == "chunked":  # the chunked KV cache's own kernel; sdpa serves unsplit calls
        return get_backend("sdpa")
    if name == "recomputed":  # --recompute-activations: the kernel checkpointed
        return recomputed_kernel(get_backend("sdpa"), monkeypatch)
    return get_backend(name)


BACKENDS = available_backends("cpu", torch.float64) + ["auto", "flash_emulated", "recomputed",
                                                        "chunked"]


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("lengths,window", [([8, 8, 8, 8], 5), ([6, 10, 7, 9], 11),
                                            ([12, 20], 3), ([10, 10, 12], 40),
                                            ([9, 9, 9], 0)])
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
def test_split_window_attention_matches_unsplit(backend_name, lengths, window, heads, groups,
                                                monkeypatch):
    torch.manual_seed(0)
    L, b, d = sum(lengths), 2, 8
    q = torch.randn(L, b, heads, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(L, b, groups, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(L, b, groups, d, dtype=torch.float64, requires_grad=True)
    scale = d ** -0.5
    expected = reference(q, k, v, window, scale)
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)

    store, backend = KVCacheStore(forward_only=False), make_backend(backend_name, monkeypatch)
    unsplit = split_causal_attention(q, k, v, split=None, store=None, layer_key=1,
                                     backend=backend, softmax_scale=scale, window=window)
    torch.testing.assert_close(unsplit, expected, rtol=0, atol=1e-10)
    leaves, outputs, offset = [], [], 0
    for j, length in enumerate(lengths):
        part = [t[offset:offset + length].detach().requires_grad_() for t in (q, k, v)]
        split = Split(0, j, len(lengths), offset, length, L)
        outputs.append(split_causal_attention(*part, split=split, store=store, layer_key=1,
                                              backend=backend, softmax_scale=scale,
                                              window=window, kv_cache=kv_cache_of(backend_name)))
        leaves.append(part)
        offset += length
    torch.testing.assert_close(torch.cat(outputs), expected, rtol=0, atol=1e-10)
    check_backward_split_by_split(outputs, leaves, lengths, grad_out, expected_grads, 1e-10)
    assert store.num_entries() == 0


def test_window_changes_attention():
    """The check above can fail: a window shorter than the sequence is not causal attention."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(24, 1, 2, 8, dtype=torch.float64) for _ in range(3))
    assert not torch.allclose(reference(q, k, v, 5, 0.3), reference(q, k, v, 100, 0.3))


def test_fp32_cpu_split_with_window_matches_unsplit():
    """fp32 on the default backend: the split run (banded mask per split) against the
    unsplit windowed call, within 1e-6."""
    torch.manual_seed(1)
    L, lengths = 64, [16, 16, 16, 16]
    q, k, v = (torch.randn(L, 1, 4, 16) for _ in range(3))
    backend = get_backend("auto")
    whole = split_causal_attention(q, k, v, split=None, store=None, layer_key=1,
                                   backend=backend, softmax_scale=0.25, window=20)
    store, parts, offset = KVCacheStore(forward_only=True), [], 0
    for j, length in enumerate(lengths):
        split = Split(0, j, len(lengths), offset, length, L)
        parts.append(split_causal_attention(
            q[offset:offset + length], k[offset:offset + length], v[offset:offset + length],
            split=split, store=store, layer_key=1, backend=backend, softmax_scale=0.25,
            window=20))
        offset += length
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-6)


class _Config:
    def __init__(self, window_size, skip=None):
        self.window_size, self.window_attn_skip_freq = window_size, skip


def test_layer_window_follows_megatron_cores_skip_rule():
    assert [layer_window(_Config((7, 0), 2), n) for n in range(1, 5)] == [7, None, 7, None]
    assert [layer_window(_Config((7, 0), [1, 0, 0, 1]), n) for n in range(1, 5)] == [
        7, None, None, 7]
    assert layer_window(_Config(None), 1) is None
    assert layer_window(_Config((-1, 0)), 1) is None
    with pytest.raises(ValueError, match="need \\(left, 0\\)"):
        layer_window(_Config((7, 3)), 1)


def kv_cache_of(backend_name):
    return "chunked" if backend_name == "chunked" else "buffer"


@pytest.mark.parametrize("window", [0, 3, 9, 50])
@pytest.mark.parametrize("sink", [False, True])
def test_whole_sequence_kernel_with_window_and_sinks(window, sink):
    """The chunked kernel over one chunk (what an unsplit call with sinks runs on CUDA)."""
    from megatron.seqsplit.kv_chunks import whole_sequence_attention
    from test_attention_sinks import reference as sink_reference

    torch.manual_seed(2)
    L, heads, groups, d, scale = 20, 4, 2, 8, 0.3
    q = torch.randn(L, 1, heads, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(L, 1, groups, d, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    logits = torch.randn(heads, dtype=torch.float64, requires_grad=True) if sink else None
    expected = (sink_reference(q, k, v, logits, scale, window) if sink
                else reference(q, k, v, window, scale))
    grad_out = torch.randn_like(expected)
    leaves = [q, k, v] + ([logits] if sink else [])
    want = torch.autograd.grad(expected, leaves, grad_out)

    def bhld(x):
        return x.permute(1, 2, 0, 3)

    got = whole_sequence_attention(bhld(q), bhld(k), bhld(v), softmax_scale=scale,
                                   window=window, sink=logits).permute(2, 0, 1, 3)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    for name, g, w in zip("qkvs", torch.autograd.grad(got, leaves, grad_out), want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10, msg=name)


# --- the flags ------------------------------------------------------------------------

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--train-iters", "1", "--mock-data", "--vocab-size", "128",
        "--micro-batch-size", "1", "--global-batch-size", "1"]


def args_of(*flags):
    from megatron.trainer.arguments import parse_args

    return parse_args(BASE + list(flags), world_size=1, cuda_available=False,
                      check_files=False)


def problems_of(*flags):
    from megatron.trainer.arguments import ArgumentErrors

    with pytest.raises(ArgumentErrors) as error:
        args_of(*flags)
    return "\n".join(error.value.problems)


@pytest.mark.parametrize("flags, size, skip", [
    (["--window-size", "128,0"], (128, 0), None),
    (["--window-size", "(64,0)", "--window-attn-skip-freq", "2"], (64, 0), 2),
    (["--window-size", "8,0", "--window-attn-skip-freq", "[1,1,1,0]"], (8, 0), [1, 1, 1, 0]),
])
def test_window_flags_reach_the_config_as_in_megatron_lm(flags, size, skip):
    from megatron.trainer.model import transformer_config_from_args

    args = args_of(*flags)
    assert (args.window_size, args.window_attn_skip_freq) == (size, skip)
    config = transformer_config_from_args(args)
    assert (config.window_size, config.window_attn_skip_freq) == (size, skip)
    megatron_lm = megatron_lm_args(flags)
    if megatron_lm is not None:  # megatron-core 0.19.2 ships Megatron-LM's parser
        assert (megatron_lm.window_size, megatron_lm.window_attn_skip_freq) == (size, skip)


@pytest.mark.parametrize("flags, message", [
    (["--window-size", "8,2"], "must be 0: give 8,0"),
    (["--window-size", "8"], "LEFT,RIGHT"),
    (["--window-size=-3,0"], ">= 0"),
    (["--window-size", "8,0", "--window-attn-skip-freq", "[1,0]"], "gives 2 layers"),
    (["--window-size", "8,0", "--window-attn-skip-freq", "0"], ">= 1"),
    (["--window-size", "8,0", "--seq1f1b-kv-cache", "chunked", "--pipeline-schedule",
      "slimpipe", "--slimpipe-attention-balance"], "--slimpipe-attention-balance"),
    (["--window-size", "8,0", "--reset-attention-mask"], "--reset-attention-mask"),
])
def test_window_flags_stop_before_work(flags, message):
    assert message in problems_of(*flags)


def test_skip_freq_alone_is_noted_as_without_effect():
    args = args_of("--window-attn-skip-freq", "2")
    assert any("--window-attn-skip-freq without --window-size" in note
               for note in args.flag_notes)


# --- FLOPs and uniform_comp's split plan -------------------------------------------------

def _shape(**window):
    from megatron.model_shape import ModelShape

    return ModelShape(4, 256, 8, 8, 1024, False, 1024, **window)


@pytest.mark.parametrize("length, offset", [(512, 0), (512, 1536), (7, 3), (100, 700), (1, 0)])
def test_window_pairs_count_what_each_query_sees(length, offset):
    """Per layer, against counting every query's keys: min(p, window) earlier ones and
    itself in a sliding-window layer, p + 1 in a full one."""
    shape = _shape(window=300, window_layers=(1, 0, 1, 1))
    for layer, windowed in enumerate(shape.window_layers):
        counted = sum((min(p, 300) if windowed else p) + 1
                      for p in range(offset, offset + length))
        assert shape.layer_pairs(layer, length, offset) == counted
    full = _shape()
    unlimited = _shape(window=10**6, window_layers=(1, 1, 1, 1))
    assert unlimited.forward_flops(length, offset) == pytest.approx(
        full.forward_flops(length, offset), rel=1e-12)


def test_uniform_comp_balances_windowed_splits():
    """With windows the later splits stop growing in cost: uniform_comp's splits are equal
    in the model's FLOPs (within one token's worth) and differ from full attention's."""
    from megatron.seqsplit.split_lengths import plan_splits, split_flops

    windowed = _shape(window=512, window_layers=(1, 1, 1, 1))
    lengths = plan_splits(2048, 4, "uniform_comp", model=windowed)
    assert sum(lengths) == 2048 and lengths != plan_splits(2048, 4, "uniform_comp",
                                                           model=_shape())
    flops = split_flops(lengths, windowed)
    one_token = windowed.forward_flops(1, 2047)
    assert max(flops) - min(flops) <= 2 * one_token, (lengths, flops)


def test_model_shape_reads_the_window_flags_as_megatron_core():
    from megatron.core.transformer.utils import is_layer_window_attention
    from megatron.model_shape import ModelShape

    for skip in (None, 2, 4, [1, 0, 0, 1]):
        flags = ["--window-size", "64,0"] + (
            [] if skip is None else ["--window-attn-skip-freq", str(skip).replace(" ", "")])
        shape = ModelShape.from_args(args_of(*flags), vocab_size=128)
        want = tuple(int(is_layer_window_attention((64, 0), skip, n)) for n in range(1, 5))
        assert (shape.window, shape.window_layers) == (64, want), skip
    assert ModelShape.from_args(args_of(), vocab_size=128).window_layers == ()


# --- CUDA (skipped here; run by `bash tools/gpu_checks.sh tests`) -------------------------

def _cuda_backends():
    names = ["sdpa", "auto", "chunked"]
    if torch.cuda.is_available():
        names += [name for name in available_backends("cuda", torch.bfloat16) if name != "sdpa"]
    return names


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend_name", _cuda_backends())
def test_split_window_attention_cuda_bf16(backend_name, monkeypatch):
    """bf16 on CUDA, split by split, against the float64 CPU definition: with the buffer
    KV cache SDPA's masked kernel, flash-attn's window_size and FlexAttention's block mask,
    each where installed; the chunked cache's kernel (not run yet: no GPU where this was
    written)."""
    torch.manual_seed(0)
    lengths, window, heads, groups, d, scale = [40, 24, 32, 32], 37, 4, 2, 64, 0.125
    L, b = sum(lengths), 1
    q = torch.randn(L, b, heads, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(L, b, groups, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(L, b, groups, d, dtype=torch.float64, requires_grad=True)
    expected = reference(q, k, v, window, scale)
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    store, backend = KVCacheStore(), make_backend(backend_name, monkeypatch)
    leaves, outputs, offset = [], [], 0
    for j, length in enumerate(lengths):
        part = [t[offset:offset + length].detach().to("cuda", torch.bfloat16).requires_grad_()
                for t in (q, k, v)]
        outputs.append(split_causal_attention(
            *part, split=Split(0, j, len(lengths), offset, length, L), store=store,
            layer_key=1, backend=backend, softmax_scale=scale, window=window,
            kv_cache=kv_cache_of(backend_name)))
        leaves.append(part)
        offset += length
    torch.testing.assert_close(torch.cat(outputs).double().cpu(), expected.detach(),
                               rtol=0, atol=2e-2)
    starts = [sum(lengths[:j]) for j in range(len(lengths))]
    for j in reversed(range(len(lengths))):
        outputs[j].backward(grad_out[starts[j]:starts[j] + lengths[j]].to("cuda", torch.bfloat16))
    for i, name in enumerate("qkv"):
        got = torch.cat([leaf[i].grad for leaf in leaves]).double().cpu()
        torch.testing.assert_close(got, expected_grads[i], rtol=0, atol=8e-2, msg=name)
