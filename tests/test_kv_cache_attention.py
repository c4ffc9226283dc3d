"""Split attention with the K/V prefix cache equals full causal attention, exactly.

Backward runs one split at a time in reverse order, each split on its own leaf
tensors, as a pipeline does: cross-split gradients can only flow through the cache.
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from megatron.seqsplit.attention_backends import AttentionCall, available_backends, get_backend
from megatron.seqsplit.kv_cache import KVCacheStore, split_causal_attention, storage_id
from megatron.seqsplit.split_lengths import split_offsets
from split_checks import SplitStub as Split

DTYPE = torch.float64
BACKENDS = available_backends(torch.device("cpu"), DTYPE)
# (backend, KV-cache layout): every backend over the buffer cache, and the chunked cache
# (its own log-sum-exp kernel; the backend only serves unsplit calls)
CASES = [f"{name}/buffer" for name in BACKENDS] + ["sdpa/chunked"]
HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA
LENGTHS = [[3, 4], [5, 5], [4, 1, 3, 2], [1, 6], [2, 3, 1, 1, 5], [1, 1, 1]]
D = 8
SCALE = D ** -0.5


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


def attention_of(case):
    """split_causal_attention bound to one "backend/layout" case."""
    name, layout = case.split("/")
    backend = get_backend(name)

    def attend(q, k, v, **kwargs):
        return split_causal_attention(q, k, v, backend=backend, softmax_scale=SCALE,
                                      kv_cache=layout, **kwargs)
    return attend


class SplitRun:
    """Forward/backward of one microbatch split by split, each split on its own leaves."""

    def __init__(self, q, k, v, w, lengths, store, case, mb=0, layer_key=0):
        self.q, self.k, self.v, self.w = q, k, v, w
        self.splits = splits_of(lengths, mb)
        self.store, self.attend, self.layer_key = store, attention_of(case), layer_key
        self.leaves, self.outs = [], []

    def forward(self, j):
        s = self.splits[j]
        sl = slice(s.offset, s.offset + s.length)
        leaves = [t[sl].clone().requires_grad_() for t in (self.q, self.k, self.v)]
        out = self.attend(*leaves, split=s, store=self.store, layer_key=self.layer_key)
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


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("hq,g", HEADS)
def test_split_attention_matches_full(case, lengths, b, hq, g):
    q, k, v, w = make_inputs(sum(lengths), b, hq, g)
    store = KVCacheStore()
    run = SplitRun(q, k, v, w, lengths, store, case)
    for j in range(len(lengths)):
        run.forward(j)
    assert store.num_entries() == 1
    for j in reversed(range(len(lengths))):
        assert store.num_entries() == 1
        run.backward(j)
    assert store.num_entries() == 0  # freed by split 0's backward
    assert_close(run.results(), reference_grads(q, k, v, w))


@pytest.mark.parametrize("case", CASES)
def test_two_microbatches_interleaved(case):
    store = KVCacheStore()
    runs = []
    for mb, lengths in enumerate([[4, 2, 3], [2, 2, 5]]):
        q, k, v, w = make_inputs(9, 2, 4, 2, seed=mb + 10)
        runs.append((SplitRun(q, k, v, w, lengths, store, case, mb=mb), (q, k, v, w)))
    for run, _ in runs:
        for j in range(3):
            run.forward(j)
    assert store.num_entries() == 2
    for mb, (run, inputs) in enumerate(runs):
        for j in reversed(range(3)):
            run.backward(j)
        assert store.num_entries() == 1 - mb
        assert_close(run.results(), reference_grads(*inputs))


@pytest.mark.parametrize("case", CASES)
def test_two_layers_chained(case):
    """Layer 2 consumes layer 1's output: gradients cross splits through both caches."""
    attention, store = attention_of(case), KVCacheStore()
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
        attend = lambda layer, q, k, v, s=s: attention(
            q, k, v, split=s, store=store, layer_key=layer)
        xs.append(xj)
        outs.append(model(xj, attend))
    assert store.num_entries() == 2
    for s in reversed(splits_of(lengths)):
        outs[s.split_index].backward(w[s.offset:s.offset + s.length])
    assert store.num_entries() == 0
    assert_close([torch.cat([t.grad for t in xs])], [xr.grad])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode", "no_requires_grad"])
def test_forward_only_frees_after_last_split(case, grad_mode):
    q, k, v, _ = make_inputs(9, 2, 4, 1)
    lengths, store = [4, 3, 2], KVCacheStore()
    want = reference_attention(q, k, v)
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(grad_mode)
    outs = []
    with ctx() if ctx else torch.enable_grad():
        for s in splits_of(lengths):
            sl = slice(s.offset, s.offset + s.length)
            outs.append(attention_of(case)(q[sl], k[sl], v[sl], split=s, store=store,
                                           layer_key="l0"))
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


@pytest.mark.parametrize("case", ["sdpa/buffer", "sdpa/chunked"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_recomputation(reentrant, case):
    """Checkpointed splits recompute forward during backward and still get exact grads.

    The reentrant checkpoint's first forward runs under no_grad, so the store must be
    told it is a training pass (forward_only=False); otherwise the default works.
    """
    q, k, v, w = make_inputs(10, 2, 4, 2)
    store = KVCacheStore(forward_only=False if reentrant else None)
    attention, leaves, outs = attention_of(case), [], []
    for s in splits_of([4, 3, 2, 1]):
        sl = slice(s.offset, s.offset + s.length)
        split_leaves = [t[sl].clone().requires_grad_() for t in (q, k, v)]
        attend = lambda *qkv, s=s: attention(*qkv, split=s, store=store, layer_key=0)
        outs.append(checkpoint(attend, *split_leaves, use_reentrant=reentrant))
        leaves.append(split_leaves)
    for s in reversed(splits_of([4, 3, 2, 1])):
        outs[s.split_index].backward(w[s.offset:s.offset + s.length])
    assert store.num_entries() == 0
    grads = [torch.cat([split_leaves[i].grad for split_leaves in leaves]) for i in range(3)]
    assert_close(grads, reference_grads(q, k, v, w)[1:])
    assert store.cached_bytes() == 0


def test_bfloat16_accumulates_prefix_gradients_in_float32():
    q, k, v, w = make_inputs(12, 1, 4, 2)
    store = KVCacheStore()
    run = SplitRun(*(t.bfloat16() for t in (q, k, v, w)), [3] * 4, store, "sdpa/buffer")
    for j in range(4):
        run.forward(j)
    run.backward(3)
    kv_elems = 2 * 12 * 1 * 2 * D  # K and V, [L, b, g, d]
    # bf16 buffers; fp32 accumulators sized to the last split's prefix (9 of 12 positions)
    assert store.cached_bytes() == kv_elems * 2 + kv_elems * 9 // 12 * 4
    for j in (2, 1, 0):
        run.backward(j)
    assert_close(run.results(), reference_grads(q, k, v, w), atol=0.05)


def test_backward_out_of_split_order_is_an_error():
    """The prefix-gradient stash is sized by the first backward (the last split's): a
    split whose backward comes after a shorter-prefix split's is refused, not misadded."""
    q, k, v, w = make_inputs(12, 1, 4, 2)
    run = SplitRun(q, k, v, w, [3] * 4, KVCacheStore(), "sdpa/buffer")
    for j in range(4):
        run.forward(j)
    run.backward(2)
    with pytest.raises(AssertionError, match="last to first"):
        run.backward(3)


def test_split_before_split0_is_an_error():
    q, k, v, _ = make_inputs(6, 1, 4, 4)
    s = splits_of([3, 3])[1]
    with pytest.raises(RuntimeError, match="before split 0"):
        split_causal_attention(q[3:], k[3:], v[3:], split=s, store=KVCacheStore(), layer_key=0,
                               backend=get_backend("sdpa"), softmax_scale=SCALE)


def test_get_backend():
    assert get_backend("sdpa").name == "sdpa"
    auto = get_backend("auto", torch.device("cpu"), torch.float32)
    q = torch.zeros(1, 4, 3, 8)
    assert auto.name == "auto" and auto.backend_for(AttentionCall.of(q, q)).name == "sdpa"
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
    run = SplitRun(q, k, v, w, [L // num_splits] * num_splits, store, "sdpa/buffer")
    saved = {}  # storage_id -> (kind, storage): sizes read after the last forward
    row_bytes = 2 * b * g * D * (torch.finfo(DTYPE).bits // 8)  # K and V of one position

    def pack(t):
        # K/V are the only 4-D tensors with g heads; 2-D ones are the bottom-right causal
        # masks of splits with lq != lk that CPU SDPA keeps (kernels need none on CUDA).
        kind = "kv" if t.dim() == 4 and t.shape[1] == g else "mask" if t.dim() == 2 else "other"
        saved[storage_id(t)] = (kind, t.untyped_storage())
        return t

    peak = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for j in range(num_splits):
            run.forward(j)
            # the buffers grow with the splits run: nothing allocated for later ones
            assert store.cached_bytes() == row_bytes * L // num_splits * (j + 1)
            peak = max(peak, store.cached_bytes())
    kv_bytes = store.cached_bytes()
    saved = {key: (kind, st.nbytes()) for key, (kind, st) in saved.items()}
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
    for s, (kv_bytes, peak, saved) in results.items():
        assert kv_bytes == full_kv  # one full-length K and V per microbatch and layer
        # plus one gradient accumulator over the last split's prefix, (s - 1) / s of it
        assert peak == full_kv + full_kv * (s - 1) // s
        # Every split's attention saved aliases of the same two buffers, no copies.
        assert saved["kv"] == [full_kv // 2] * 2
        # ... and no mask: a CPU split runs as two mask-free kernels (cpu_split_attention)
        assert saved["mask"] == []
    # q/out/softmax statistics are partitioned among splits: no growth with s.
    assert sum(results[8][2]["other"]) <= sum(results[2][2]["other"])


def saved_storages(fn, *inputs):
    """{storage pointer: (bytes, shape)} of what autograd keeps for backward in fn."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    return out, saved


@pytest.mark.parametrize("b,hq,g,lq,lk", [
    (1, 2, 2, 16, 64),  # lk > hq d
    (1, 8, 8, 16, 64),  # lk <= hq d
    (2, 8, 2, 16, 64),  # b > 1, GQA
    (1, 4, 4, 63, 64),  # a one-key prefix
])
def test_cpu_split_attention_keeps_no_mask(b, hq, g, lq, lk):
    """CPU SDPA with lq != lk (the own block causal, the prefix unmasked, merged by LSE):
    equal to torch's kernel with the materialised `causal_lower_right` mask, forward and
    backward, and what the kernel plus the caller's output projection keep (K/V excluded:
    they alias the cache) is that kernel's minus its lq x lk mask: nothing of lq x lk size."""
    from torch.nn.attention.bias import causal_lower_right
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, D, generator=gen, dtype=DTYPE, requires_grad=True)
               for h, n in ((hq, lq), (g, lk), (g, lk)))
    w = torch.randn(lq, b, hq, D, dtype=DTYPE, requires_grad=True)

    def layer(attend):  # attention, then what the caller does with the output
        def fn(q, k, v):
            out = attend(q, k, v).permute(2, 0, 1, 3).contiguous()
            return out * w  # stands for the output projection, which saves its input
        return fn

    backend = get_backend("sdpa")
    got, saved = saved_storages(layer(lambda *a: backend(*a, softmax_scale=SCALE)), q, k, v)
    want, saved_ref = saved_storages(layer(lambda *a: F.scaled_dot_product_attention(
        *a, attn_mask=causal_lower_right(lq, lk), scale=SCALE, enable_gqa=hq != g)), q, k, v)
    grad = torch.randn_like(want)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for a, e in zip(torch.autograd.grad(got, (q, k, v), grad),
                    torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-12)

    kv = {t.untyped_storage().data_ptr() for t in (k, v)}
    assert not [shape for ptr, (_, shape) in saved.items()
                if ptr not in kv and shape[-2:] == (lq, lk)], saved
    kept, kept_ref = (sum(n for ptr, (n, _) in d.items() if ptr not in kv)
                      for d in (saved, saved_ref))
    assert kept < kept_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,g", [(4, 4), (4, 2)])
def test_cpu_split_fuses_the_cache_and_the_kernel_into_one_node(dtype, hq, g):
    """On CPU a split with a prefix is one autograd node (cache write + the two mask-free
    kernels + the K/V gradient bookkeeping) and gives bitwise the outputs, gradients and
    stashed prefix gradients of the two nodes (`_PrefixKV`, then the kernel) it replaces;
    it saves the same tensors (aliases of the cache buffer)."""
    from megatron.seqsplit.attention_backends import SDPABackend

    class TwoNodes(SDPABackend):  # the same kernels, the cache's own node before them
        def runs_split_kernel_cpu(self, call):
            return False

    lengths = [5, 3, 4, 4]
    q, k, v, w = (t.to(dtype) for t in make_inputs(sum(lengths), 2, hq, g))
    results, nodes, stashes = [], [], []
    for backend in (get_backend("auto"), TwoNodes()):
        store = KVCacheStore()
        run = SplitRun(q, k, v, w, lengths, store, "sdpa/buffer")
        run.attend = lambda *a, backend=backend, **kw: split_causal_attention(
            *a, backend=backend, softmax_scale=SCALE, **kw)
        for j in range(len(lengths)):
            run.forward(j)
        # the node under the output's permute back to megatron layout
        nodes.append([type(o.grad_fn.next_functions[0][0]).__name__ for o in run.outs])
        run.backward(3)
        entry = store.lookup((0, 0))
        stashes.append((entry.grad_key.clone(), entry.grad_value.clone()))
        for j in (2, 1, 0):
            run.backward(j)
        assert store.num_entries() == 0
        results.append(run.results())
    assert all(n == "_CachedSplitAttentionBackward" for n in nodes[0][1:]), nodes[0]
    assert "_CachedSplitAttentionBackward" not in nodes[1]
    for got, want in zip(results[0] + stashes[0], results[1] + stashes[1]):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert stashes[0][0].dtype == torch.float32  # half precision stashes sum in fp32


def test_chunked_cache_holds_split_chunks_and_saves_no_mask():
    """The chunked layout: K/V allocated split by split, no lq x lk mask or prefix copy saved."""
    L, b, hq, g, lengths = 48, 2, 4, 2, [8, 16, 24]
    q, k, v, w = make_inputs(L, b, hq, g)
    store = KVCacheStore()
    run = SplitRun(q, k, v, w, lengths, store, "sdpa/chunked")
    itemsize = torch.finfo(DTYPE).bits // 8
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    cached, filled = [], 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for j, length in enumerate(lengths):
            run.forward(j)
            filled += length
            cached.append(store.cached_bytes())
            assert cached[-1] == 2 * filled * b * g * D * itemsize  # only what has run
    # each split saves exactly its query [l, b, hq, d], output [l, b, hq, d] (the layout
    # the output projection keeps: one copy) and LSE [b, hq, l]: no K/V (the cache holds
    # them), no mask, no concatenated prefix
    assert saved == [shape for length in lengths
                     for shape in ((length, b, hq, D), (length, b, hq, D), (b, hq, length))]
    for j in reversed(range(len(lengths))):
        run.backward(j)
    assert store.num_entries() == 0
    assert_close(run.results(), reference_grads(q, k, v, w))


@pytest.mark.parametrize("max_block_elements", [1, 200, 10 ** 9])
def test_lse_kernel_query_blocks_and_chunks(max_block_elements):
    """Blocked queries and uneven chunks give the same result as one causal softmax."""
    from megatron.seqsplit.lse_attention import lse_attention_backward, lse_attention_forward

    gen = torch.Generator().manual_seed(5)
    b, hq, g, lk, lq = 2, 6, 3, 23, 9
    q = torch.randn(b, hq, lq, D, generator=gen, dtype=DTYPE, requires_grad=True)
    k = torch.randn(b, g, lk, D, generator=gen, dtype=DTYPE, requires_grad=True)
    v = torch.randn(b, g, lk, D, generator=gen, dtype=DTYPE, requires_grad=True)
    grad = torch.randn(b, hq, lq, D, generator=gen, dtype=DTYPE)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(hq // g, 1), v.repeat_interleave(hq // g, 1),
        attn_mask=torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq), scale=SCALE)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    cuts = [0, 5, 6, 14, 20, lk]
    keys = [k.detach()[:, :, a:e] for a, e in zip(cuts, cuts[1:])]
    values = [v.detach()[:, :, a:e] for a, e in zip(cuts, cuts[1:])]
    out, lse = lse_attention_forward(q.detach(), keys, values, softmax_scale=SCALE,
                                     max_block_elements=max_block_elements)
    dq, dks, dvs = lse_attention_backward(grad, q.detach(), out, lse, keys, values,
                                          softmax_scale=SCALE,
                                          max_block_elements=max_block_elements)
    assert_close([out, dq, torch.cat(dks, 2), torch.cat(dvs, 2)],
                 [want.detach(), *want_grads])


def test_chunked_cache_bfloat16_accumulates_in_float32():
    q, k, v, w = make_inputs(12, 1, 4, 2)
    store = KVCacheStore()
    run = SplitRun(*(t.bfloat16() for t in (q, k, v, w)), [3] * 4, store, "sdpa/chunked")
    for j in range(4):
        run.forward(j)
    run.backward(3)
    chunk = 3 * 1 * 2 * D
    # four bf16 K and V chunks; fp32 gradients left for the three earlier chunks
    assert store.cached_bytes() == 2 * 4 * chunk * 2 + 2 * 3 * chunk * 4
    for j in (2, 1, 0):
        run.backward(j)
    assert_close(run.results(), reference_grads(q, k, v, w), atol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["sdpa/buffer", "sdpa/chunked"]
                         + (["flash/buffer"] if "flash" in available_backends("cuda", torch.bfloat16)
                            else []))
def test_split_attention_cuda_bf16(case):
    """bf16 on CUDA against the float64 CPU reference (GPU check of issue #3 / #8)."""
    L, b, hq, g, lengths = 512, 2, 8, 2, [128, 192, 192]
    q, k, v, w = make_inputs(L, b, hq, g)
    run = SplitRun(*(t.to("cuda", torch.bfloat16) for t in (q, k, v, w)), lengths,
                   KVCacheStore(), case)
    for j in range(len(lengths)):
        run.forward(j)
    for j in reversed(range(len(lengths))):
        run.backward(j)
    got = [t.double().cpu() for t in run.results()]
    want = reference_grads(q, k, v, w)
    for name, g_, w_ in zip(["out", "dq", "dk", "dv"], got, want):
        torch.testing.assert_close(g_, w_, rtol=0, atol=3e-2 * max(1.0, w_.abs().max().item()),
                                   msg=name)


@pytest.mark.parametrize("case", ["sdpa/buffer", "sdpa/chunked"])  # CPU's: sdpa
def test_value_head_size_differs_from_query_key(case):
    """MLA: values of head size 5 beside query-key heads of 8, split and unsplit, both
    cache layouts; the cache keeps V at its own size (not padded to the key's)."""
    gen = torch.Generator().manual_seed(3)
    lengths, b, h, dv = [3, 4, 2], 2, 4, 5
    L = sum(lengths)
    q, k = (torch.randn(L, b, h, D, generator=gen, dtype=DTYPE) for _ in range(2))
    v, w = (torch.randn(L, b, h, dv, generator=gen, dtype=DTYPE) for _ in range(2))
    store = KVCacheStore()
    run = SplitRun(q, k, v, w, lengths, store, case)
    for j in range(len(lengths)):
        run.forward(j)
    # K [L, b, h, 8] and V [L, b, h, 5] (buffer) or the same per chunk (chunked)
    assert store.cached_bytes() == L * b * h * (D + dv) * 8
    for j in reversed(range(len(lengths))):
        run.backward(j)
    want = reference_grads(q, k, v, w)
    assert want[0].shape[-1] == dv
    assert_close(run.results(), want)
    unsplit = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention_of(case)(*unsplit, split=None, store=None, layer_key=0)
    out.backward(w)
    assert_close((out.detach(), *(t.grad for t in unsplit)), want)
