"""Buffer vs chunked KV cache, side by side: one layer's split attention of one microbatch.

For each layout the microbatch's `s` splits run forward in order and backward in
reverse, each split on its own leaf tensors (as pipeline stages run them), through
`split_causal_attention`. Measured per layout:

* time: forward+backward of all splits, median over alternating repeats (after one
  warm-up round per layout), and its ratio to the unsplit causal call (`s = 1`);
* memory: the pipelines' activation probe (`ActivationMemoryProbe`): the peak, over
  split boundaries, of the bytes of storages autograd saved for backward plus the
  cache's K/V and gradient accumulators (each storage once);
* exactness: outputs and q/k/v gradients against the unsplit call.
"""

import statistics
import time
import torch

from megatron.schedules.memory_probe import ActivationMemoryProbe
from megatron.schedules.actions import BACKWARD, FORWARD, Unit
from megatron.seqsplit.attention_backends import get_backend
from megatron.seqsplit.kv_cache import KVCacheStore, split_causal_attention
from megatron.seqsplit.split_lengths import plan_splits, split_offsets
from megatron.seqsplit.split_context import SplitContext


def _inputs(seq, batch, heads, groups, head_dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def make(h):
        return torch.randn(seq, batch, h, head_dim, generator=gen).to(device, dtype)

    return make(heads), make(groups), make(groups), make(heads)


def run_layout(layout, q, k, v, grad, lengths, backend, measure_memory=False):
    """(seconds, peak bytes or None, out, dq, dk, dv) for one microbatch's splits."""
    seq = q.shape[0]
    splits = [SplitContext(microbatch_id=0, split_index=j, num_splits=len(lengths), offset=o,
                           length=n, seq_length=seq)
              for j, (o, n) in enumerate(zip(split_offsets(lengths), lengths))]
    store = KVCacheStore()
    probe = ActivationMemoryProbe() if measure_memory else None
    if probe is not None:
        probe.attach_kv_store(store)
        probe.reset()

    def run(unit, work):
        if probe is not None:
            probe.on_unit_start(0, unit)
        work()
        if probe is not None:
            probe.on_unit_end(0, unit)

    leaves, outs = [], []
    sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for s in splits:
        part = [t[s.offset:s.offset + s.length].detach().requires_grad_() for t in (q, k, v)]
        leaves.append(part)
        run(Unit(FORWARD, 0, s.split_index), lambda: outs.append(split_causal_attention(
            *part, split=s, store=store, layer_key=0, backend=backend,
            softmax_scale=q.shape[-1] ** -0.5, kv_cache=layout)))
    for s in reversed(splits):
        run(Unit(BACKWARD, 0, s.split_index),
            lambda: outs[s.split_index].backward(grad[s.offset:s.offset + s.length]))
        outs[s.split_index] = outs[s.split_index].detach()
    sync()
    seconds = time.perf_counter() - start
    assert store.num_entries() == 0
    out = torch.cat(outs)
    dq, dk, dv = (torch.cat([leaf[i].grad for leaf in leaves]) for i in range(3))
    return seconds, (probe.peak_bytes if probe else None), out, dq, dk, dv


def compare_layouts(seq=4096, batch=1, heads=16, groups=4, head_dim=64, splits=4,
                    repeats=5, dtype=torch.float32, device="cpu", backend="auto"):
    """Rows for s = 1 (unsplit) and both layouts at `splits`; see the module docstring."""
    q, k, v, grad = _inputs(seq, batch, heads, groups, head_dim, dtype, device)
    attention = get_backend(backend, device=device, dtype=dtype)
    lengths = plan_splits(seq, splits, "average")
    configs = {"unsplit": ("buffer", [seq]), "buffer": ("buffer", lengths),
               "chunked": ("chunked", lengths)}
    results = {name: {"times": []} for name in configs}
    for name, (layout, lengths) in configs.items():  # warm-up, memory and exactness
        _, peak, *tensors = run_layout(layout, q, k, v, grad, lengths, attention,
                                       measure_memory=True)
        results[name]["peak_bytes"] = peak
        results[name]["tensors"] = tensors
    for _ in range(repeats):  # alternating timed rounds
        for name, (layout, lengths) in configs.items():
            seconds, *_ = run_layout(layout, q, k, v, grad, lengths, attention)
            results[name]["times"].append(seconds)
    reference = results["unsplit"]["tensors"]
    rows = []
    for name, res in results.items():
        median = statistics.median(res["times"])
        error = max((a.double() - b.double()).abs().max().item()
                    for a, b in zip(res["tensors"], reference))
        rows.append({"layout": name, "splits": 1 if name == "unsplit" else splits,
                     "median_s": median,
                     "time_vs_unsplit": median / statistics.median(results["unsplit"]["times"]),
                     "peak_bytes": res["peak_bytes"],
                     "peak_vs_unsplit": res["peak_bytes"] / results["unsplit"]["peak_bytes"],
                     "max_abs_diff_vs_unsplit": error})
    return rows
