"""The runtime side of SlimPipe's attention redistribution (`--slimpipe-attention-balance`).

`megatron.schedules.attention_balance` pairs a heavy unit (the *asker*) with a light
unit running at the same time on another pipeline rank (the *helper*). In every layer
of the two units the chunked KV cache's attention (`kv_chunks`) calls this module:

* forward, asker: send the query slice and its first ``k`` prefix K/V chunks, compute
  attention over the remaining chunks meanwhile, receive the helper's partial output
  and log-sum-exp and merge (`lse_attention.merge_partials`): exact, no approximation;
* backward, asker: send the query, the merged output and LSE, the output gradient and
  the same ``k`` chunks; receive the query's partial gradient and the chunks'
  gradients, which go where locally computed ones would;
* helper (forward or backward unit of its own): before its own attention, receive the
  request, compute the partial (`lse_attention_partial` / `lse_attention_backward` with
  the queries placed after the prefix) and send it back. Nothing stays on the helper.

Shapes are known on both sides from the plan (slice lengths) and the layer's own
tensors (batch, heads, groups, head size and dtype are the same on every rank), so
no shape is sent. Messages go over the pipeline group between the two ranks with the
same tensor-parallel rank (heads are split the same way on both).

Attention finds the running unit's side of a pair through `UnitExchange`
(`KVCacheStore.unit_exchange`): the executor wraps each unit in
``unit_exchange.running(exchange, unit_is_forward)`` and attention asks
``unit_exchange.current(in_forward)``.
"""

import contextlib
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

import torch

from megatron.seqsplit.lse_attention import (
    lse_attention_backward,
    lse_attention_partial,
    stat_dtype,
)

ASK, HELP = "ask", "help"


@dataclass(frozen=True)
class Exchange:
    """One unit's side of a pair, with what the runtime needs to talk to the peer."""

    role: str  # ASK or HELP
    peer: int  # global rank of the peer
    group: object  # the pipeline process group
    asker_forward: bool  # the asker's unit is a forward (else: a backward)
    num_chunks: int  # prefix chunks 0..k-1 of the asker's microbatch computed remotely
    query_length: int  # the asker's slice length
    query_start: int  # the asker's slice offset (its queries follow every moved chunk)
    chunk_lengths: tuple  # lengths of the moved chunks


class UnitExchange:
    """The exchange of the pipeline unit being run, as its attention layers see it.

    One per `KVCacheStore` (its ``unit_exchange`` field), so attention reaches it
    through the store its split already carries:

        with store.unit_exchange.running(exchanges.get(unit), unit.is_forward):
            ...  # the unit's forward or backward; attention calls current(...)
    """

    def __init__(self):
        self._exchange: Optional[Exchange] = None  # None: no unit running, or not paired
        self._unit_is_forward = True

    @contextlib.contextmanager
    def running(self, exchange: Optional[Exchange], unit_is_forward: bool) -> Iterator[None]:
        """While one unit runs: its side of a pair (None when the unit is not paired)
        and whether the unit is a forward. The previous state is restored on exit."""
        saved = self._exchange, self._unit_is_forward
        self._exchange, self._unit_is_forward = exchange, unit_is_forward
        try:
            yield
        finally:
            self._exchange, self._unit_is_forward = saved

    def current(self, in_forward: bool) -> Optional[Exchange]:
        """The exchange for an attention forward (``in_forward``) or backward pass: the
        running unit's when the unit runs in that direction, else None. A forward pass
        inside a backward unit is a recomputation (``--recompute-granularity full``): it
        runs locally, since the pair's forward exchange happened in the forward unit
        (same result up to rounding)."""
        if self._exchange is None or self._unit_is_forward != in_forward:
            return None
        return self._exchange


def _post(exchange: Exchange, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor]):
    ops = [torch.distributed.P2POp(torch.distributed.isend, t.contiguous(), exchange.peer,
                                   exchange.group) for t in sends]
    ops += [torch.distributed.P2POp(torch.distributed.irecv, t, exchange.peer, exchange.group)
            for t in recvs]
    return torch.distributed.batch_isend_irecv(ops) if ops else []


class _Pending:
    """Requests in flight; ``wait()`` returns the received tensors."""

    def __init__(self, requests, keep: List[torch.Tensor], received: List[torch.Tensor]):
        self.requests, self.keep, self.received = requests, keep, received

    def wait(self) -> List[torch.Tensor]:
        for request in self.requests:
            request.wait()
        self.keep = None  # sent tensors may be freed now
        return self.received


def _documents(documents):
    """Packed documents: the ids of every position up to the asker's last query."""
    return [] if documents is None else [documents.contiguous()]


def ask_forward(exchange: Exchange, q, keys, values, documents=None) -> _Pending:
    """Asker's forward: ship q [b, hq, lq, d], chunks [b, g, l_c, d] (and the document
    ids [b, query_start + lq] with packed documents); the pending result is (partial
    output [b, hq, lq, d], LSE [b, hq, lq]) in the statistics dtype."""
    stat = stat_dtype(q.dtype)
    out = torch.empty(q.shape, dtype=stat, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=stat, device=q.device)
    sends = [q.contiguous(), *keys, *values] + _documents(documents)
    return _Pending(_post(exchange, sends, [out, lse]), sends, [out, lse])


def ask_backward(exchange: Exchange, grad_out, q, out, lse, keys, values,
                 documents=None) -> _Pending:
    """Asker's backward: ship what the flash recurrence needs; the pending result is
    (dq partial in the statistics dtype, [dk_c], [dv_c])."""
    stat = stat_dtype(q.dtype)
    dq = torch.empty(q.shape, dtype=stat, device=q.device)
    dks = [torch.empty(k.shape, dtype=stat, device=k.device) for k in keys]
    dvs = [torch.empty(v.shape, dtype=stat, device=v.device) for v in values]
    sends = [grad_out.contiguous(), q.contiguous(), out.contiguous(), lse.contiguous(),
             *keys, *values] + _documents(documents)
    return _Pending(_post(exchange, sends, [dq, *dks, *dvs]), sends, [dq, *dks, *dvs])


def split_backward_result(exchange: Exchange, received):
    k = exchange.num_chunks
    return received[0], received[1:1 + k], received[1 + k:1 + 2 * k]


def _receive(exchange: Exchange, shapes, dtypes, device) -> List[torch.Tensor]:
    tensors = [torch.empty(shape, dtype=dtype, device=device)
               for shape, dtype in zip(shapes, dtypes)]
    for request in _post(exchange, [], tensors):
        request.wait()
    return tensors


def serve(exchange: Exchange, query, key, *, softmax_scale, documents=None) -> None:
    """Helper: answer one request of the asker, for one layer. ``query`` [b, hq, l, d]
    and ``key`` [b, g, l, d] are this rank's own tensors of the layer (for batch, heads,
    groups, head size, dtype and device); ``documents``, this rank's own document ids
    or None, says whether packed documents are used (the same flags on every rank) and
    gives their dtype."""
    b, hq, _, d = query.shape
    g = key.shape[1]
    dtype, device = query.dtype, query.device
    stat = stat_dtype(dtype)
    q_shape = (b, hq, exchange.query_length, d)
    chunk_shapes = [(b, g, length, d) for length in exchange.chunk_lengths]
    k = exchange.num_chunks
    doc_shapes, doc_dtypes = [], []
    if documents is not None:
        doc_shapes = [(b, exchange.query_start + exchange.query_length)]
        doc_dtypes = [documents.dtype]
    with torch.no_grad():
        if exchange.asker_forward:
            received = _receive(exchange, [q_shape] + chunk_shapes * 2 + doc_shapes,
                                [dtype] * (1 + 2 * k) + doc_dtypes, device)
            q, keys, values = received[0], received[1:1 + k], received[1 + k:1 + 2 * k]
            out, lse = lse_attention_partial(
                q, keys, values, softmax_scale=softmax_scale, query_start=exchange.query_start,
                document_ids=received[1 + 2 * k] if doc_shapes else None)
            replies = [out, lse]
        else:
            shapes = [q_shape, q_shape, q_shape, q_shape[:3]] + chunk_shapes * 2 + doc_shapes
            dtypes = [dtype, dtype, dtype, stat] + [dtype] * (2 * k) + doc_dtypes
            received = _receive(exchange, shapes, dtypes, device)
            grad_out, q, out, lse = received[:4]
            keys, values = received[4:4 + k], received[4 + k:4 + 2 * k]
            dq, dks, dvs = lse_attention_backward(
                grad_out, q, out, lse, keys, values, softmax_scale=softmax_scale,
                query_start=exchange.query_start, dq_dtype=stat,
                document_ids=received[4 + 2 * k] if doc_shapes else None)
            replies = [dq, *dks, *dvs]
        for request in _post(exchange, replies, []):
            request.wait()
