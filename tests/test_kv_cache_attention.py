"""Split attention with the K/V prefix cache equals full causal attention, exactly.

Backward runs one split at a time in reverse order, each split on its own leaf
tensors, as a pipeline does: cross-split gradients can only flow through the cache.
"""

from dataclasses import dataclass

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from megatron.seqsplit.attention_backends import available_backends, get_backend
from megatron.seqsplit.kv_cache import KVCacheStore, split_causal_attention
from megatron.seqsplit.plan import split_offsets

DTYPE = torch.float64
BACKENDS = available_backends(torch.device("cpu"), DTYPE)
HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA
LENGTHS = [[3, 4], [5, 5], [4, 1, 3, 2], [1, 6], [2, 3, 1, 1, 5], [1, 1, 1]]
D = 8
SCALE = D ** -0.5


@dataclass
class Split:
    microbatch_id: int
    split_index: int
    num_splits: int
    offset: int
    length: int
    seq_length: int


def splits_of(lengths, mb=0):
    return [
        Split(mb, j, len(lengths), o, l, sum(lengths))
        for j, (o, l) in enumerate(zip(split_offsets(lengths), lengths))
    ]


def reference_attention(q, k, v):
    """Explicit-softmax causal attention, megatron layout [L, b, h, d]."""
    hq, g = q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(hq // g, dim=2), v.repeat_interleave(hq // g, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * SCALE
    L = q.shape[0]
    mask = torch.ones(L, L, dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,kbhd->qbhd", probs, v)


def make_inputs(L, b, hq, g, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(L, b, hq, D, generator=gen, dtype=DTYPE)
    k = torch.randn(L, b, g, D, generator=gen, dtype=DTYPE)
    v = torch.randn(L, b, g, D, generator=gen, dtype=DTYPE)
    w = torch.randn(L, b, hq, D, generator=gen, dtype=DTYPE)  # upstream gradient
    return q, k, v, w


def reference_grads(q, k, v, w):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = reference_attention(q, k, v)
    out.backward(w)
    return out.detach(), q.grad, k.grad, v.grad


class SplitRun:
    """Forward/backward of one microbatch split by split, each split on its own leaves."""

    def __init__(self, q, k, v, w, lengths, store, backend, mb=0, layer_key=0):
        self.q, self.k, self.v, self.w = q, k, v, w
        self.splits = splits_of(lengths, mb)
        self.store, self.backend, self.layer_key = store, backend, layer_key
        self.leaves, self.outs = [], []

    def forward(self, j):
        s = self.splits[j]
        sl = slice(s.offset, s.offset + s.length)
        leaves = [t[sl].clone().requires_grad_() for t in (self.q, self.k, self.v)]
        out = split_causal_attention(
            *leaves, split=s, store=self.store, layer_key=self.layer_key,
            backend=self.backend, softmax_scale=SCALE,
        )
        self.leaves.append(leaves)
        self.outs.append(out)

    def backward(self, j):
        s = self.splits[j]
        self.outs[j].backward(self.w[s.offset:s.offset + s.length])

    def results(self):
        out = torch.cat([o.detach() for o in self.outs])
        grads = [torch.cat([leaves[i].grad for leaves in self.leaves]) for i in range(3)]
        return out, *grads


def assert_close(got, want, atol=1e-10):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.to(g.dtype), rtol=0, atol=atol)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("hq,g", HEADS)
def test_split_attention_matches_full(backend_name, lengths, b, hq, g):
    q, k, v, w = make_inputs(sum(lengths), b, hq, g)
    store = KVCacheStore()
    run = SplitRun(q, k, v, w, lengths, store, get_backend(backend_name))
    for j in range(len(lengths)):
        run.forward(j)
    assert store.num_entries() == 1
    for j in reversed(range(len(lengths))):
        assert store.num_entries() == 1
        run.backward(j)
    assert store.num_entries() == 0  # freed by split 0's backward
    assert_close(run.results(), reference_grads(q, k, v, w))


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_two_microbatches_interleaved(backend_name):
    backend, store = get_backend(backend_name), KVCacheStore()
    runs = []
    for mb, lengths in enumerate([[4, 2, 3], [2, 2, 5]]):
        q, k, v, w = make_inputs(9, 2, 4, 2, seed=mb + 10)
        runs.append((SplitRun(q, k, v, w, lengths, store, backend, mb=mb), (q, k, v, w)))
    for run, _ in runs:
        for j in range(3):
            run.forward(j)
    assert store.num_entries() == 2
    for mb, (run, inputs) in enumerate(runs):
        for j in reversed(range(3)):
            run.backward(j)
        assert store.num_entries() == 1 - mb
        assert_close(run.results(), reference_grads(*inputs))


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_two_layers_chained(backend_name):
    """Layer 2 consumes layer 1's output: gradients cross splits through both caches."""
    backend, store = get_backend(backend_name), KVCacheStore()
    L, b, hq, g, lengths = 10, 2, 4, 2, [4, 3, 2, 1]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(L, b, hq * D, generator=gen, dtype=DTYPE)
    w = torch.randn(L, b, hq, D, generator=gen, dtype=DTYPE)
    proj = [torch.randn(hq * D, (hq + 2 * g) * D, generator=gen, dtype=DTYPE) / 8 for _ in range(2)]

    def qkv(h, p):
        q, k, v = (h @ p).split([hq * D, g * D, g * D], dim=-1)
        return q.unflatten(-1, (hq, D)), k.unflatten(-1, (g, D)), v.unflatten(-1, (g, D))

    def model(h, attend):
        for layer, p in enumerate(proj):
            h = attend(layer, *qkv(h, p)).flatten(2)
        return h.unflatten(-1, (hq, D))

    xr = x.clone().requires_grad_()
    model(xr, lambda _, q, k, v: reference_attention(q, k, v)).backward(w)

    xs, outs = [], []
    for s in splits_of(lengths):
        xj = x[s.offset:s.offset + s.length].clone().requires_grad_()
        attend = lambda layer, q, k, v, s=s: split_causal_attention(
            q, k, v, split=s, store=store, layer_key=layer, backend=backend, softmax_scale=SCALE)
        xs.append(xj)
        outs.append(model(xj, attend))
    assert store.num_entries() == 2
    for s in reversed(splits_of(lengths)):
        outs[s.split_index].backward(w[s.offset:s.offset + s.length])
    assert store.num_entries() == 0
    assert_close([torch.cat([t.grad for t in xs])], [xr.grad])


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode", "no_requires_grad"])
def test_forward_only_frees_after_last_split(backend_name, grad_mode):
    q, k, v, _ = make_inputs(9, 2, 4, 1)
    lengths, store = [4, 3, 2], KVCacheStore()
    want = reference_attention(q, k, v)
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(grad_mode)
    outs = []
    with ctx() if ctx else torch.enable_grad():
        for s in splits_of(lengths):
            sl = slice(s.offset, s.offset + s.length)
            outs.append(split_causal_attention(
                q[sl], k[sl], v[sl], split=s, store=store, layer_key="l0",
                backend=get_backend(backend_name), softmax_scale=SCALE))
            expected_entries = 0 if s.split_index == len(lengths) - 1 else 1
            assert store.num_entries() == expected_entries
    assert_close([torch.cat(outs)], [want])


def test_forward_only_false_keeps_entry_until_clear():
    """Reentrant recomputation runs its first forward under no_grad: keep the prefix."""
    q, k, v, _ = make_inputs(6, 1, 4, 4)
    store = KVCacheStore(forward_only=False)
    with torch.no_grad():
        for s in splits_of([3, 3]):
            sl = slice(s.offset, s.offset + s.length)
            split_causal_attention(q[sl], k[sl], v[sl], split=s, store=store, layer_key=0,
                                   backend=get_backend("sdpa"), softmax_scale=SCALE)
    assert store.num_entries() == 1
    store.clear()
    assert store.num_entries() == 0 and store.cached_bytes() == 0


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_no_split_is_plain_causal_attention(backend_name):
    q, k, v, w = make_inputs(7, 2, 4, 2)
    store = KVCacheStore()
    for split in (None, Split(0, 0, 1, 0, 7, 7)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = split_causal_attention(*leaves, split=split, store=store, layer_key=0,
                                     backend=get_backend(backend_name), softmax_scale=SCALE)
        out.backward(w)
        assert store.num_entries() == 0
        assert_close([out.detach()] + [t.grad for t in leaves], reference_grads(q, k, v, w))


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_recomputation(reentrant):
    """Checkpointed splits recompute forward during backward and still get exact grads.

    The reentrant checkpoint's first forward runs under no_grad, so the store must be
    told it is a training pass (forward_only=False); otherwise the default works.
    """
    q, k, v, w = make_inputs(10, 2, 4, 2)
    store = KVCacheStore(forward_only=False if reentrant else None)
    backend, leaves, outs = get_backend("sdpa"), [], []
    for s in splits_of([4, 3, 2, 1]):
        sl = slice(s.offset, s.offset + s.length)
        split_leaves = [t[sl].clone().requires_grad_() for t in (q, k, v)]
        attend = lambda *qkv, s=s: split_causal_attention(
            *qkv, split=s, store=store, layer_key=0, backend=backend, softmax_scale=SCALE)
        outs.append(checkpoint(attend, *split_leaves, use_reentrant=reentrant))
        leaves.append(split_leaves)
    for s in reversed(splits_of([4, 3, 2, 1])):
        outs[s.split_index].backward(w[s.offset:s.offset + s.length])
    assert store.num_entries() == 0
    grads = [torch.cat([split_leaves[i].grad for split_leaves in leaves]) for i in range(3)]
    assert_close(grads, reference_grads(q, k, v, w)[1:])


def test_bfloat16_accumulates_prefix_gradients_in_float32():
    q, k, v, w = make_inputs(12, 1, 4, 2)
    store = KVCacheStore()
    run = SplitRun(*(t.bfloat16() for t in (q, k, v, w)), [3] * 4, store, get_backend("sdpa"))
    for j in range(4):
        run.forward(j)
    run.backward(3)
    kv_elems = 2 * 12 * 1 * 2 * D  # K and V, [L, b, g, d]
    assert store.cached_bytes() == kv_elems * 2 + kv_elems * 4  # bf16 buffers, fp32 accumulators
    for j in (2, 1, 0):
        run.backward(j)
    assert_close(run.results(), reference_grads(q, k, v, w), atol=0.05)


def test_split_before_split0_is_an_error():
    q, k, v, _ = make_inputs(6, 1, 4, 4)
    s = splits_of([3, 3])[1]
    with pytest.raises(RuntimeError, match="before split 0"):
        split_causal_attention(q[3:], k[3:], v[3:], split=s, store=KVCacheStore(), layer_key=0,
                               backend=get_backend("sdpa"), softmax_scale=SCALE)


def test_get_backend():
    assert get_backend("sdpa").name == "sdpa"
    assert get_backend("auto", torch.device("cpu"), torch.float32).name == "sdpa"
    assert get_backend("flex").name == "flex"
    assert available_backends("cpu", torch.bfloat16) == ["sdpa", "flex"]
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("xformers")
    if "flash" not in available_backends("cuda", torch.bfloat16):
        with pytest.raises(ValueError, match="flash-attn"):
            get_backend("flash")


def run_and_measure(num_splits, L=64, b=1, hq=4, g=2):
    """Peak cached bytes and the bytes of storages saved for backward, by kind."""
    q, k, v, w = make_inputs(L, b, hq, g)
    store = KVCacheStore()
    run = SplitRun(q, k, v, w, [L // num_splits] * num_splits, store, get_backend("sdpa"))
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        # K/V are the only 4-D tensors with g heads; 2-D ones are lq x lk masks that
        # SDPA materialises for causal_lower_right on CPU (kernels need none on CUDA).
        kind = "kv" if t.dim() == 4 and t.shape[1] == g else "mask" if t.dim() == 2 else "other"
        saved[st.data_ptr()] = (kind, st.nbytes())
        return t

    peak = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for j in range(num_splits):
            run.forward(j)
            peak = max(peak, store.cached_bytes())
    kv_bytes = store.cached_bytes()
    for j in reversed(range(num_splits)):
        run.backward(j)
        peak = max(peak, store.cached_bytes())
    assert store.num_entries() == 0
    by_kind = {kind: [n for kd, n in saved.values() if kd == kind] for kind in ("kv", "mask", "other")}
    return kv_bytes, peak, by_kind


def test_memory_does_not_grow_with_splits():
    L, b, g = 64, 1, 2
    itemsize = torch.finfo(DTYPE).bits // 8
    full_kv = 2 * L * b * g * D * itemsize
    results = {s: run_and_measure(s, L=L, b=b, g=g) for s in (2, 8)}
    for kv_bytes, peak, saved in results.values():
        assert kv_bytes == full_kv  # one full-length K and V per microbatch and layer
        assert peak == 2 * full_kv  # plus one full-length gradient accumulator
        # Every split's attention saved aliases of the same two buffers, no copies.
        assert saved["kv"] == [full_kv // 2] * 2
        assert sum(saved["mask"]) <= L * L * itemsize
    # q/out/softmax statistics are partitioned among splits: no growth with s.
    assert sum(results[8][2]["other"]) <= sum(results[2][2]["other"])
