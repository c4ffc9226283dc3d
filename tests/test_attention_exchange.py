"""SlimPipe's attention redistribution kernel path, two real processes over gloo.

Rank 0 runs a split's chunked-cache attention as the *asker* (its first ``k`` prefix
chunks computed by rank 1), rank 1 runs its own split as the *helper* and serves the
request in forward and in backward. Both results are compared, in float64, with the
same attention computed locally without any exchange: outputs, the query/key/value
gradients of both splits and the prefix-chunk gradients left in the cache.
Forward and backward roles are independent in the plan, so the backward also runs
with a forward-only pair and with the helper's side in its backward unit. With packed
documents (each row its own boundaries, documents crossing the split edges and the moved
chunks) the asker also ships the document ids.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.seqsplit.attention_exchange import ASK, HELP, Exchange, UnitExchange
from megatron.seqsplit.kv_cache import KVCacheStore
from megatron.seqsplit.kv_chunks import chunked_split_attention
from megatron.seqsplit.split_context import SplitContext

B, HQ, G, D = 2, 4, 2, 8
LENGTHS = [5, 5, 5, 5]
SCALE = 0.3


def _inputs(seed, splits):
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(LENGTHS[j], B, h, D, generator=gen, dtype=torch.float64,
                              requires_grad=True) for h in (HQ, G, G)) for j in splits]


# per-row document ids of the 20 positions: boundaries inside splits, at a split edge
# (position 10) and inside the moved chunks (position 3)
DOCUMENTS = torch.tensor([[0] * 3 + [1] * 7 + [2] * 6 + [3] * 4,
                          [0] * 10 + [1] * 10])


def _run_microbatch(store, inputs, microbatch, exchanges_fwd, exchanges_bwd, documents=None):
    """Forwards of splits 0..j (chunked cache), then backwards in reverse; returns the
    last split's output and every input's gradient. ``exchanges_*[j]``: the exchange
    set while split j runs forward / backward."""
    offsets = [sum(LENGTHS[:j]) for j in range(len(LENGTHS))]
    outs = []
    for j, (q, k, v) in enumerate(inputs):
        split = SplitContext(microbatch_id=microbatch, split_index=j, num_splits=len(inputs),
                             offset=offsets[j], length=LENGTHS[j], seq_length=sum(LENGTHS),
                             kv_store=store, document_ids=documents)
        with store.unit_exchange.running(exchanges_fwd.get(j), True):
            outs.append(chunked_split_attention(q, k, v, split=split, store=store, layer_key=0,
                                                softmax_scale=SCALE))
    grads = []
    gen = torch.Generator().manual_seed(99 + microbatch)
    for j in reversed(range(len(inputs))):
        with store.unit_exchange.running(exchanges_bwd.get(j), False):
            outs[j].backward(torch.randn(outs[j].shape, generator=gen, dtype=torch.float64))
    for q, k, v in inputs:
        grads += [q.grad, k.grad, v.grad]
    return [o.detach() for o in outs], grads


def _worker(rank, rendezvous_file, queue, with_documents):
    # a file rendezvous: no port to pick (a port picked free can be taken by the tests
    # running beside before the ranks bind it: EADDRINUSE, seen once in CI)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous_file}", rank=rank,
                            world_size=2)
    try:
        group = dist.new_group([0, 1])
        n = len(LENGTHS)
        k = 2  # the asker's (split 3) first two prefix chunks go to the helper

        def exchange(role, asker_forward):
            return Exchange(role=role, peer=1 - rank, group=group, asker_forward=asker_forward,
                            num_chunks=k, query_length=LENGTHS[3], query_start=sum(LENGTHS[:3]),
                            chunk_lengths=tuple(LENGTHS[:k]))

        # rank 0 asks with split 3 in forward and backward; rank 1 helps with split 1's
        # forward (request of a forward) and with split 0's backward (request of a backward)
        if rank == 0:
            fwd, bwd = {3: exchange(ASK, True)}, {3: exchange(ASK, False)}
        else:
            fwd, bwd = {1: exchange(HELP, True)}, {0: exchange(HELP, False)}
        documents = DOCUMENTS if with_documents else None
        inputs = _inputs(seed=rank, splits=range(n))
        outs, grads = _run_microbatch(KVCacheStore(), inputs, 0, fwd, bwd, documents)
        reference_inputs = _inputs(seed=rank, splits=range(n))
        ref_outs, ref_grads = _run_microbatch(KVCacheStore(), reference_inputs, 0, {}, {},
                                              documents)
        out_err = max((a - b).abs().max().item() for a, b in zip(outs, ref_outs))
        grad_err = max((a - b).abs().max().item() for a, b in zip(grads, ref_grads))
        queue.put((rank, out_err, grad_err))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("with_documents", [False, True], ids=["causal", "documents"])
def test_asker_and_helper_equal_local_attention_float64(with_documents, tmp_path):
    # forkserver: one server process imports this module (torch, the trainer) once for
    # every test of the session, and forks the two ranks from it; spawn would import it
    # all again in each rank
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker,
                         args=(rank, str(tmp_path / "rendezvous"), queue, with_documents))
             for rank in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=120)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    finally:
        for p in procs:  # a rank left waiting for its peer: stop it (the ones we started)
            if p.is_alive():
                p.kill()
                p.join()
    results = sorted(queue.get(timeout=10) for _ in range(2))
    for rank, out_err, grad_err in results:
        assert out_err < 1e-12, f"rank {rank}: outputs differ by {out_err}"
        assert grad_err < 1e-12, f"rank {rank}: gradients differ by {grad_err}"


def test_unit_exchange_serves_attention_passes_of_the_units_direction():
    """A forward unit's exchange serves its attention forwards, a backward unit's its
    attention backwards; a forward inside a backward unit (recomputation) runs locally,
    and leaving the unit (even by an error) clears it."""
    unit_exchange = UnitExchange()
    ask = Exchange(role=ASK, peer=1, group=None, asker_forward=True, num_chunks=1,
                   query_length=2, query_start=2, chunk_lengths=(2,))
    assert unit_exchange.current(True) is None and unit_exchange.current(False) is None
    with unit_exchange.running(ask, True):
        assert unit_exchange.current(True) is ask and unit_exchange.current(False) is None
    with unit_exchange.running(ask, False):
        assert unit_exchange.current(False) is ask and unit_exchange.current(True) is None
    with unit_exchange.running(None, True):
        assert unit_exchange.current(True) is None
    with pytest.raises(RuntimeError), unit_exchange.running(ask, True):
        raise RuntimeError("unit failed")
    assert unit_exchange.current(True) is None and unit_exchange.current(False) is None
