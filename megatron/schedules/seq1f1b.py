"""Executor of the Seq1F1B schedule on megatron-core.

``forward_backward_pipelining_seq1f1b`` has the signature and return value of
megatron-core's ``forward_backward_pipelining_without_interleaving``. It runs the
per-rank action list of ``megatron.schedules.units`` (compute units and p2p steps
paired exactly as megatron's 1F1B pairs them) with megatron-core's
``P2PCommunicator``, giving every message its own shape (splits may differ in
length, so there is no shape handshake).

Loss: the user's loss function must return megatron's triple ``(loss_sum,
num_tokens, reported)``. A split's loss sum is normalised at backward time by the
token count of its whole microbatch (known by then: on the last stage all splits
of a microbatch run forward before its first backward), so the split losses add up
to the unsplit microbatch loss; with ``calculate_per_token_loss`` the sums are
used as they are and megatron-core divides by the total token count.

The model must consume each split (``check_split_consumed``: refused after the first
forward unit otherwise), and data-parallel gradient reduction starts as megatron-core's
schedules start it, from each model chunk's last backward unit (``GradSync``).
"""

import contextlib
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from megatron.schedules.messages import SEND, Message, checked_chunked_programs, producer
from megatron.schedules.units import (
    RECV_BACKWARD,
    RECV_FORWARD,
    SEND_BACKWARD,
    SEND_FORWARD,
    Unit,
    seq1f1b_rank_actions,
)
from megatron.seqsplit.kv_cache import KVCacheStore
from megatron.seqsplit.split_lengths import plan_splits, split_offsets
from megatron.seqsplit.split_context import SplitContext, slice_batch
from megatron.mcore_compat import backward_step


@dataclass
class Seq1F1BSettings:
    """How to split: the number of splits, the balance method and what it needs."""

    num_splits: int
    balance_method: str = "average"
    alignment: int = 1
    model_shape: Any = None  # megatron.seqsplit.split_lengths.ModelShape, for uniform_comp
    # on_unit_start/on_unit_end(rank, unit) of training iterations: forward-only calls
    # (evaluation) are not shown to them, so a timeline or memory probe of the last
    # iteration holds the training iteration only
    observers: List[Any] = field(default_factory=list)
    # "seq1f1b" (interleaved order with virtual stages) or "slimpipe" (splits are its
    # uniform slices; megatron.schedules.slimpipe's order, the Seq1F1B one when v = 1)
    schedule: str = "seq1f1b"
    # SlimPipe only: attention redistribution between paired units
    # (megatron.schedules.attention_balance); needs the chunked KV cache and model_shape
    attention_balance: bool = False
    exchange_cost: float = 0.0  # SliceCosts.exchange: one K/V chunk's send vs its attention


class SplitDataIterator:
    """What the user's ``forward_step`` receives as ``data_iterator`` under Seq1F1B.

    ``split`` is the ``SplitContext`` of the unit being run (pass it to the model as
    ``packed_seq_params``). ``next()`` returns that split's slice of the microbatch;
    the microbatch itself is read from the wrapped iterator once, at split 0.
    """

    def __init__(self, data_iterator):
        self.data_iterator = data_iterator
        self.split: Optional[SplitContext] = None
        self._batches = {}

    def __iter__(self):
        return self

    def __next__(self):
        split = self.split
        if split.split_index == 0:
            batch = next(self.data_iterator)
            if not isinstance(batch, dict):
                raise TypeError(
                    "with sequence splits the data iterator must yield dicts of per-token "
                    "tensors ([b, seq_length], e.g. tokens, labels, loss_mask, position_ids) "
                    f"so that each split gets its slice; got {type(batch).__name__}")
            self._batches[split.microbatch_id] = batch
        batch = self._batches[split.microbatch_id]
        if split.is_last:
            del self._batches[split.microbatch_id]
        return slice_batch(batch, split.offset, split.length, split.seq_length)


class GradSync:
    """When the data-parallel gradient reduction may start, as megatron-core's schedules
    decide it (``--overlap-grad-reduce``: megatron-core's DDP launches each bucket's
    reduction from the backward hooks once sync is on; ``finalize_model_grads`` waits).

    ``config.no_sync_func`` is active for every backward unit of this rank except the
    last one of each model chunk: with splits the last microbatch has one backward unit
    per split, and only its final one (split 0) may sync, so the reductions start while
    the rest of the pipeline still runs but only once every gradient is complete. A
    list of ``no_sync`` (one per chunk, as Megatron-LM sets it for virtual stages) is
    left chunk by chunk; one shared ``no_sync`` is left for each chunk's last unit and
    entered again after it, as megatron-core's interleaved schedule does. With
    ``config.grad_sync_func`` (Megatron-LM's align-grad-reduce) the hooks stay off and
    it is called for each chunk right after that chunk's last backward unit.
    """

    def __init__(self, config, chunks, actions):
        self.chunks = chunks
        self.final = {}  # chunk -> its last backward unit on this rank
        self.last = None  # the last backward unit of all
        for action in actions:
            if isinstance(action, Unit) and not action.is_forward:
                self.final[action.chunk] = self.last = action
        self.no_sync = config.no_sync_func or contextlib.nullcontext
        self.per_chunk = isinstance(self.no_sync, list)
        if self.per_chunk and len(self.no_sync) != len(chunks):
            raise ValueError(f"config.no_sync_func has {len(self.no_sync)} entries for "
                             f"{len(chunks)} model chunks")
        grad_sync_func = config.grad_sync_func
        if grad_sync_func is not None and not isinstance(grad_sync_func, list):
            grad_sync_func = [grad_sync_func] * len(chunks)
        self.grad_sync_func = grad_sync_func
        self.entered = {}  # chunk index (or None: the shared one) -> entered no_sync
        for key in (range(len(chunks)) if self.per_chunk else [None]):
            if self.final:  # forward-only runs have no backward and keep sync as it is
                self._enter(key)

    def _enter(self, key):
        context = self.no_sync[key]() if self.per_chunk else self.no_sync()
        context.__enter__()
        self.entered[key] = context

    def _leave(self, key):
        context = self.entered.pop(key, None)
        if context is not None:
            context.__exit__(None, None, None)

    def before_backward(self, unit: Unit):
        if self.grad_sync_func is None and self.final.get(unit.chunk) == unit:
            self._leave(unit.chunk if self.per_chunk else None)

    def after_backward(self, unit: Unit):
        if self.final.get(unit.chunk) != unit:
            return
        if self.grad_sync_func is not None:
            self.grad_sync_func[unit.chunk](self.chunks[unit.chunk].parameters())
        elif not self.per_chunk and unit != self.last:
            self._enter(None)  # the other chunks' gradients are not complete yet

    def close(self):
        for key in list(self.entered):
            self._leave(key)


class SplitNotConsumedError(RuntimeError):
    """A forward under sequence splits returned without the model using its split."""


def check_split_consumed(split: SplitContext, unit: Unit) -> None:
    """Refuse a forward whose model did not consume the split (see
    ``SplitContext.missing_consumers``): it would attend within the split only and
    train on wrong gradients, silently. Called after every forward unit with more than
    one split, so the first unit fails, before any backward."""
    missing = split.missing_consumers()
    if not missing:
        return
    raise SplitNotConsumedError(
        f"sequence splits (--seq1f1b-splits / --slimpipe-slices > 1): the forward of unit "
        f"{unit} (microbatch {unit.microbatch}, split {unit.split} of {split.num_splits}, "
        f"model chunk {unit.chunk}) returned without the split reaching the model's "
        f"{' and '.join(missing)}, so it would attend within the split only and train on "
        "wrong gradients. Build the model as megatron.seqsplit.model.SeqSplitGPTModel with "
        "transformer_layer_spec=split_aware_local_spec(config) (a stock megatron-core "
        "GPTModel cannot run splits), and have forward_step pass the split on: "
        "model(tokens, position_ids, None, labels=labels, "
        "packed_seq_params=data_iterator.split) (the forward_step contract in "
        "megatron.schedules.dispatch.get_forward_backward_func's docstring)")


def _hidden_shape(length, micro_batch_size, config, tp_size):
    seq = length // tp_size if config.sequence_parallel else length
    return (seq, micro_batch_size, config.hidden_size)


def forward_backward_pipelining_seq1f1b(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn=None,
    p2p_communicator: Optional[P2PCommunicator] = None,
    pg_collection=None,
    force_all_reduce: Optional[bool] = False,
    settings: Seq1F1BSettings,
):
    """Run one iteration of Seq1F1B. Returns the loss functions' reported values
    (last pipeline stage) as megatron-core's schedules do; an empty list elsewhere."""
    chunks = list(model) if isinstance(model, list) else [model]
    num_chunks = len(chunks)
    iterators = list(data_iterator) if isinstance(data_iterator, list) else [data_iterator]
    if len(iterators) == 1 and num_chunks > 1:
        iterators = iterators * num_chunks
    if len(iterators) != num_chunks:
        raise ValueError(f"{num_chunks} model chunks need {num_chunks} data iterators, "
                         f"got {len(iterators)}")
    model = chunks[0]
    if collect_non_loss_data:
        raise ValueError("collect_non_loss_data is not supported with --seq1f1b-splits > 1")
    if decoder_seq_length is not None or adjust_tensor_shapes_fn is not None:
        raise ValueError("encoder-decoder models are not supported with --seq1f1b-splits > 1")
    config = get_model_config(model)

    pp_group = (p2p_communicator.pp_group if p2p_communicator is not None
                else parallel_state.get_pipeline_model_parallel_group())
    if p2p_communicator is None:
        p2p_communicator = P2PCommunicator(pp_group=pp_group, config=config)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    rank, pp_size = pp_group.rank(), pp_group.size()
    if num_chunks > 1 and pp_size < 2:
        raise ValueError("virtual pipeline stages need --pipeline-model-parallel-size >= 2")
    # first/last *global* stage: where data enters and where the loss is computed
    is_first = rank == 0
    is_last = rank == pp_size - 1

    def holds_loss(unit):
        return is_last and unit.chunk == num_chunks - 1

    lengths = plan_splits(seq_length, settings.num_splits, settings.balance_method,
                          alignment=settings.alignment, model=settings.model_shape)
    offsets = split_offsets(lengths)
    kv_store = KVCacheStore(forward_only=forward_only)
    observers = () if forward_only else settings.observers
    for observer in observers:
        if hasattr(observer, "attach_kv_store"):
            observer.attach_kv_store(kv_store)
    split_iterators = [SplitDataIterator(iterator) for iterator in iterators]
    set_input_tensors = [get_attr_wrapped_model(chunk, "set_input_tensor") for chunk in chunks]

    def context(unit: Unit) -> SplitContext:
        return SplitContext(
            microbatch_id=unit.microbatch, split_index=unit.split,
            num_splits=settings.num_splits, offset=offsets[unit.split],
            length=lengths[unit.split], seq_length=seq_length, kv_store=kv_store)

    def shape(unit: Unit):
        return _hidden_shape(lengths[unit.split], micro_batch_size, config, tp_size)

    forward_data_store = []
    # megatron-core all-reduces this over NCCL on GPU: keep it on the device
    device = next(model.parameters()).device  # the run's device, not "CUDA if present"
    total_num_tokens = torch.zeros([], dtype=torch.int, device=device)
    tokens_per_microbatch = {}  # last stage: loss-mask tokens of each microbatch so far
    received_inputs, received_grads = {}, {}
    inputs, outputs, input_grads = {}, {}, {}
    forward_outputs = {}  # outputs waiting to be sent downstream

    exchanges = {}  # unit -> this rank's side of an attention-redistribution pair
    if settings.attention_balance and not forward_only:
        actions, exchanges = _balanced_actions(settings, rank, pp_group, pp_size,
                                               num_microbatches, num_chunks, seq_length,
                                               lengths, offsets)
    elif num_chunks == 1:  # SlimPipe without virtual stages is Seq1F1B over its slices
        actions = seq1f1b_rank_actions(rank, pp_size, num_microbatches, settings.num_splits,
                                       forward_only=forward_only)
    elif settings.schedule == "slimpipe":
        actions = checked_chunked_programs(
            pp_size, num_microbatches, num_chunks, settings.num_splits, None, forward_only,
            schedule="slimpipe")[rank]
    else:
        actions = checked_chunked_programs(
            pp_size, num_microbatches, num_chunks, settings.num_splits,
            getattr(config, "microbatch_group_size_per_vp_stage", None), forward_only)[rank]
    grad_sync = GradSync(config, chunks, actions)  # no_sync entered for the backwards

    def run_forward(unit: Unit):
        nonlocal total_num_tokens
        input_tensor = received_inputs.pop(unit, None)
        set_input_tensors[unit.chunk]([input_tensor])
        split_iterator = split_iterators[unit.chunk]
        split = split_iterator.split = context(unit)
        enable_autocast = getattr(config, "enable_autocast", False)
        autocast = (torch.autocast("cuda", dtype=config.autocast_dtype) if enable_autocast
                    else contextlib.nullcontext())
        with autocast:
            output_tensor, loss_func = forward_step_func(split_iterator, chunks[unit.chunk])
        if settings.num_splits > 1:
            check_split_consumed(split, unit)
        if holds_loss(unit):
            reduced = loss_func(output_tensor)
            if len(reduced) != 3:
                raise ValueError(
                    "with --seq1f1b-splits > 1 the loss function must return (loss_sum, "
                    "num_tokens, reported) so split losses can be normalised by the whole "
                    "microbatch's token count")
            output_tensor, num_tokens, reported = reduced
            forward_data_store.append((unit.microbatch, reported))
            num_tokens = torch.as_tensor(num_tokens).to(device=device, dtype=torch.int)
            tokens_per_microbatch[unit.microbatch] = (
                tokens_per_microbatch.get(unit.microbatch, 0) + num_tokens)
            total_num_tokens = total_num_tokens + num_tokens
        if not holds_loss(unit):
            forward_outputs[unit] = output_tensor  # until sent
        if not forward_only:
            inputs[unit] = input_tensor
            outputs[unit] = output_tensor

    def run_backward(unit: Unit):
        forward_unit = Unit("F", unit.microbatch, unit.split, unit.chunk)
        input_tensor = inputs.pop(forward_unit)
        output_tensor = outputs.pop(forward_unit)
        if holds_loss(unit):
            output_tensor = _normalise_loss(output_tensor, unit.microbatch)
        grad_sync.before_backward(unit)
        grad = backward_step(input_tensor, output_tensor, received_grads.pop(unit, None), config)
        grad_sync.after_backward(unit)
        input_grads[unit] = grad

    def _normalise_loss(loss_sum, microbatch):
        if config.calculate_per_token_loss:
            return loss_sum
        tokens = tokens_per_microbatch[microbatch].clamp(min=1).to(loss_sum.device)
        return loss_sum / tokens / num_microbatches

    def run_comm(step):
        ops = {op.op: op.unit for op in step}
        if SEND_FORWARD in ops and RECV_BACKWARD in ops:
            out_unit, grad_unit = ops[SEND_FORWARD], ops[RECV_BACKWARD]
            received_grads[grad_unit] = p2p_communicator.send_forward_recv_backward(
                _to_send(out_unit), shape(grad_unit), False)
            _release(out_unit)
        elif SEND_BACKWARD in ops and RECV_FORWARD in ops:
            grad_unit, in_unit = ops[SEND_BACKWARD], ops[RECV_FORWARD]
            received_inputs[in_unit] = p2p_communicator.send_backward_recv_forward(
                input_grads.pop(grad_unit), shape(in_unit), False)
        elif SEND_FORWARD in ops:
            p2p_communicator.send_forward(_to_send(ops[SEND_FORWARD]), False)
            _release(ops[SEND_FORWARD])
        elif RECV_FORWARD in ops:
            unit = ops[RECV_FORWARD]
            received_inputs[unit] = p2p_communicator.recv_forward(shape(unit), False)
        elif SEND_BACKWARD in ops:
            p2p_communicator.send_backward(input_grads.pop(ops[SEND_BACKWARD]), False)
        elif RECV_BACKWARD in ops:
            unit = ops[RECV_BACKWARD]
            received_grads[unit] = p2p_communicator.recv_backward(shape(unit), False)
        else:
            raise AssertionError(f"unexpected communication step {step}")

    def run_batch(batch):
        """Chunked programs: one batch_isend_irecv of sends and receives, each op with
        its own shape (see megatron.schedules.messages)."""
        ops, arrivals = [], []
        for message in batch:
            peer = torch.distributed.get_global_rank(pp_group, message.peer)
            if message.kind == SEND:
                _, produced = producer(message.unit, message.peer, pp_size, num_chunks)
                if produced.is_forward:
                    tensor = forward_outputs[produced]
                else:
                    tensor = input_grads.pop(produced)
                ops.append(torch.distributed.P2POp(torch.distributed.isend, tensor, peer,
                                                   pp_group))
            else:
                tensor = torch.empty(shape(message.unit), requires_grad=True, device=device,
                                     dtype=config.pipeline_dtype)
                ops.append(torch.distributed.P2POp(torch.distributed.irecv, tensor, peer,
                                                   pp_group))
                arrivals.append((message.unit, tensor))
        for request in torch.distributed.batch_isend_irecv(ops):
            request.wait()
        if config.batch_p2p_sync and torch.cuda.is_available():
            torch.cuda.synchronize()  # as megatron-core: guard against batch_isend_irecv races
        for unit, tensor in arrivals:
            (received_inputs if unit.is_forward else received_grads)[unit] = tensor
        for message in batch:
            if message.kind == SEND:
                _, produced = producer(message.unit, message.peer, pp_size, num_chunks)
                if produced.is_forward:
                    _release(produced)

    def _to_send(unit):
        return forward_outputs[unit]

    def _release(unit):
        # the activation has left: keep only what backward needs (megatron's trick)
        tensor = forward_outputs.pop(unit)
        if not forward_only:
            deallocate_output_tensor(tensor, config.deallocate_pipeline_outputs)

    def run_unit(unit: Unit):
        for observer in observers:
            observer.on_unit_start(rank, unit)
        kv_store.exchange = exchanges.get(unit)
        kv_store.exchange_unit_is_forward = unit.is_forward
        if unit.is_forward:
            run_forward(unit)
        else:
            run_backward(unit)
            if is_first and unit.chunk == 0:
                input_grads.pop(unit, None)  # nothing to send upstream
        kv_store.exchange = None
        for observer in observers:
            observer.on_unit_end(rank, unit)

    try:
        for action in actions:
            if isinstance(action, Unit):
                run_unit(action)
            elif isinstance(action[0], Message):
                run_batch(action)
            else:
                run_comm(action)
    finally:
        grad_sync.close()  # also on an error: the model's no_sync state is left as found

    if not forward_only:
        if kv_store.num_entries() != 0:
            raise AssertionError(f"{kv_store.num_entries()} KV-cache entries outlived their "
                                 "microbatch's backward")
        if config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func(
                chunks, total_num_tokens if config.calculate_per_token_loss else None,
                pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    kv_store.clear()
    return merge_split_reports(forward_data_store)


def merge_split_reports(reports):
    """One report per microbatch, in microbatch order, as megatron-core's schedules
    return them: the reports of a microbatch's splits added key by key. The loss
    function's reports are additive (a loss sum and a token count, as the executor
    requires the (loss_sum, num_tokens, reported) form), so the merged entry is what the
    unsplit microbatch reports, and a training loop that averages over the list's
    entries (or counts them) sees the same as without splits."""
    merged = {}
    for microbatch, reported in reports:
        if microbatch not in merged:
            merged[microbatch] = dict(reported)
        else:
            entry = merged[microbatch]
            for key, value in reported.items():
                entry[key] = entry[key] + value
    return [merged[m] for m in sorted(merged)]


def _balanced_actions(settings, rank, pp_group, pp_size, num_microbatches, num_chunks,
                      seq_length, lengths, offsets):
    """SlimPipe with attention redistribution: this rank's program (lowered on the
    balanced timeline, checked free of deadlock with the pairs as rendezvous) and the
    ``Exchange`` of each of its paired units."""
    from megatron.schedules.attention_balance import SliceCosts, checked_balanced_programs
    from megatron.seqsplit.attention_exchange import Exchange

    if settings.schedule != "slimpipe" or settings.model_shape is None:
        raise ValueError("attention balance needs the SlimPipe schedule and the model shape")
    costs = SliceCosts.from_model(settings.model_shape, seq_length // settings.num_splits,
                                  settings.exchange_cost)
    programs, plan = checked_balanced_programs(pp_size, num_microbatches, num_chunks,
                                               settings.num_splits, costs)
    exchanges = {
        unit: Exchange(
            role=o.role, peer=torch.distributed.get_global_rank(pp_group, o.peer),
            group=pp_group, asker_forward=o.asker.is_forward, num_chunks=o.num_chunks,
            query_length=lengths[o.asker.split], query_start=offsets[o.asker.split],
            chunk_lengths=tuple(lengths[:o.num_chunks]))
        for unit, o in plan.offloads[rank].items()}
    return list(programs[rank]), exchanges
