"""Checks of what a split run did, from what `dist_runner.py` records on the last rank.

* `check_split_units`: the pipeline ran every microbatch of every schedule call as
  `splits` splits that tile the sequence (once per model chunk of the last rank), with
  lengths of the balance method's shape. A run that fell back to an unsplit schedule
  records no split units and fails here.
* `check_reports`: the schedule returned what megatron-core's returns: per call one loss
  report per microbatch, equal to the unsplit run's (loss sum within `rtol`, token
  count exact).
* `SplitStub`: a split's fields for the kernels' own tests,
  `check_backward_split_by_split` for their gradients and `recomputed_kernel` for
  selective recomputation's kernel.
"""

from collections import defaultdict
from dataclasses import dataclass


@dataclass
class SplitStub:
    """What the attention kernels read of a split (`megatron.seqsplit.split_context`'s
    fields), for calling `split_causal_attention` without a schedule."""

    microbatch_id: int
    split_index: int
    num_splits: int
    offset: int
    length: int
    seq_length: int
    document_ids: object = None  # [b, >= offset + length] with packed documents


def check_split_units(name, units, *, splits, method, seq_length, calls, microbatches,
                      chunks=1):
    assert len(units) == calls * microbatches * splits * chunks, f"{name}: {len(units)} split units"
    per_microbatch = defaultdict(list)
    for unit in units:
        assert unit["splits"] == splits, f"{name}: {unit}"
        per_microbatch[unit["call"], unit["microbatch"]].append(unit)
    assert sorted({call for call, _ in per_microbatch}) == list(range(calls)), name
    for (call, microbatch), seen in per_microbatch.items():
        assert sorted(u["split"] for u in seen) == sorted(list(range(splits)) * chunks), \
            f"{name} call {call} microbatch {microbatch}: splits {[u['split'] for u in seen]}"
        plan = sorted({(u["offset"], u["length"]) for u in seen})
        assert len(plan) == splits, f"{name}: splits of microbatch {microbatch} differ by chunk"
        lengths = [length for _, length in plan]
        assert [offset for offset, _ in plan] == [sum(lengths[:j]) for j in range(splits)], name
        assert sum(lengths) == seq_length, f"{name}: splits {lengths}"
        if method == "average":
            assert max(lengths) - min(lengths) <= 2, f"{name}: average splits {lengths}"
        else:  # equal FLOPs: later splits attend over longer prefixes, so are shorter
            assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1], \
                f"{name}: uniform_comp splits {lengths}"


def check_reports(name, reports, unsplit_reports, *, calls, microbatches, rtol=1e-5):
    assert len(reports) == len(unsplit_reports) == calls, name
    for call, (got, expected) in enumerate(zip(reports, unsplit_reports)):
        assert len(got) == len(expected) == microbatches, f"{name} call {call}: {len(got)} reports"
        for microbatch, (a, e) in enumerate(zip(got, expected)):
            (loss_sum, count), (expected_sum, expected_count) = a["lm loss"], e["lm loss"]
            assert count == expected_count, f"{name} call {call} microbatch {microbatch}"
            assert abs(loss_sum - expected_sum) <= rtol * abs(expected_sum), \
                f"{name} call {call} microbatch {microbatch}: {loss_sum} vs {expected_sum}"


def check_backward_split_by_split(outputs, leaves, lengths, grad_out, expected_grads, atol):
    """Runs each split's backward, the last split first as the pipeline does, with its
    rows of ``grad_out``; the q, k and v gradients joined over the splits (``leaves``: per
    split its (q, k, v) leaves) must equal ``expected_grads`` within ``atol``."""
    import torch

    starts = [sum(lengths[:j]) for j in range(len(lengths))]
    for j in reversed(range(len(lengths))):
        outputs[j].backward(grad_out[starts[j]:starts[j] + lengths[j]])
    for i, name in enumerate("qkv"):
        got = torch.cat([leaf[i].grad for leaf in leaves])
        torch.testing.assert_close(got, expected_grads[i], rtol=0, atol=atol, msg=name)


def recomputed_kernel(backend, monkeypatch):
    """Selective recomputation's checkpointed attention kernel (--recompute-activations)
    around ``backend``, on CPU: megatron-core's checkpoint saves the CUDA RNG state, here
    the CPU generator's (patched for this test only, not process-wide as
    ``cpu_support.apply`` would, which also turns off torch.compile)."""
    import torch
    from megatron.core.tensor_parallel import random as mp_random

    from megatron.seqsplit.recompute import RecomputedAttentionKernel

    monkeypatch.setattr(mp_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    monkeypatch.setattr(mp_random, "_set_cuda_rng_state",
                        lambda state, *a, **k: torch.set_rng_state(state))
    return RecomputedAttentionKernel(backend)
