"""Megatron-LM's --recompute-modules beyond core attention (layernorm, mlp, shared_experts,
mla_up_proj) run here: the pieces they need, in one process. Their exactness under
sequence splits is trained in tests/test_moe_exactness.py (D_pp2_s3_modules,
D_pp2_vp2_s3_chunked_modules, X_pp2_tp2_sp_etp1_ep2_s2), their memory measured against the planner in
tests/test_planner_memory_probe.py.

megatron-core frees the output of a ``CheckpointWithoutOutput`` (the norms', MLA's
up-projections') in place after the forward and refills it in the backward; two things
stood in the way here: the checkpoint itself needed Transformer Engine, and the chunked
K/V cache could keep the freed key's storage."""

from types import SimpleNamespace

import pytest
import torch
from megatron.core.tensor_parallel import random as mcore_random

from megatron import cpu_support
from megatron.seqsplit.kv_chunks import _own_copy
from megatron.seqsplit.recompute import (
    checkpoint_without_output_runs_without_te,
    prepare_output_discarding_checkpoints,
)


def _norm_then_linear(x, weight, checkpointed):
    """A norm whose output only a linear layer keeps, as in a transformer layer."""
    if checkpointed is None:
        normed = torch.nn.functional.layer_norm(x, x.shape[-1:])
    else:
        normed = checkpointed.checkpoint(lambda t: torch.nn.functional.layer_norm(
            t, t.shape[-1:]), x)
    out = normed @ weight
    if checkpointed is not None:
        checkpointed.discard_output_and_register_recompute(out)
    return out, normed


# megatron-core >= 0.19 builds a C++ extension (ninja, the compiler: processes) at its
# first recomputation; the model build does it first (prepare_output_discarding_checkpoints)
@pytest.mark.distributed
def test_checkpoint_without_output_runs_without_transformer_engine():
    """megatron-core's ``CheckpointWithoutOutput()`` took its FP8 path (``fp8 is not None``
    for the default False) and stopped with a NameError without Transformer Engine.
    Patched, it frees the norm's output after the forward and gives the gradients of
    the unrecomputed norm."""
    assert not mcore_random.HAVE_TE  # what this machine is: the case the patch is for
    config = SimpleNamespace(recompute_granularity="selective", recompute_modules=["layernorm"])
    prepare_output_discarding_checkpoints(config)
    checkpoint_without_output_runs_without_te()  # once is enough; twice changes nothing
    torch.manual_seed(0)
    x0, weight0 = torch.randn(6, 8, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    grads = []
    with cpu_support.patched(cuda=False):  # the checkpoint keeps the (CPU) RNG states
        for checkpointed in (None, mcore_random.CheckpointWithoutOutput()):
            x, weight = x0.clone().requires_grad_(), weight0.clone().requires_grad_()
            out, normed = _norm_then_linear(x, weight, checkpointed)
            if checkpointed is not None:
                assert checkpointed.fp8 is False
                assert normed.untyped_storage().nbytes() == 0  # freed until the backward
            out.square().sum().backward()
            grads.append((x.grad, weight.grad))
    for plain, recomputed in zip(*grads):
        assert torch.equal(plain, recomputed)


def test_a_k_v_chunk_never_shares_the_callers_storage():
    """The chunked cache keeps [b, g, l, d] copies of a split's K/V; with one micro-batch
    row and one head per rank the permuted view is already contiguous, and the chunk was
    the caller's key itself, which --recompute-modules mla_up_proj frees after core
    attention, before the next split reads it ("setStorage: ... out of bounds for storage
    of size 0")."""
    for shape in ((5, 1, 1, 4), (5, 2, 3, 4), (5, 1, 3, 4)):
        key = torch.randn(shape)
        chunk = _own_copy(key)
        assert chunk.untyped_storage().data_ptr() != key.untyped_storage().data_ptr(), shape
        assert torch.equal(chunk, key.permute(1, 2, 0, 3)) and chunk.is_contiguous()
        key.untyped_storage().resize_(0)  # what megatron-core's checkpoint does to it
        assert chunk.sum().isfinite()


def test_a_machine_that_cannot_build_the_extension_stops_at_the_model_build(monkeypatch):
    """megatron-core 0.19's recomputation needs its share_storage extension built (ninja, a
    C++ compiler): where the build fails, the model build stops naming the modules and
    what to do, instead of the first backward; without those modules nothing is built."""
    def cannot_build():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(mcore_random, "_get_share_storage", cannot_build, raising=False)
    with pytest.raises(RuntimeError) as error:
        prepare_output_discarding_checkpoints(SimpleNamespace(
            recompute_granularity="selective", recompute_modules=["core_attn", "mla_up_proj"]))
    assert str(error.value).startswith(
        "--recompute-modules mla_up_proj: megatron-core builds a C++ extension")
    assert "Ninja is required" in str(error.value) and "Install ninja" in str(error.value)
    for granularity, modules in (("selective", ["core_attn", "mlp", "moe"]),
                                 ("full", ["layernorm"]), (None, None)):
        prepare_output_discarding_checkpoints(SimpleNamespace(
            recompute_granularity=granularity, recompute_modules=modules))
