"""The pipeline executor: runs this rank's lowered program on megatron-core.

``forward_backward_pipelining_seq1f1b`` takes megatron-core's arguments (plus an optional
``settings``) and returns what its ``forward_backward_pipelining_without_interleaving``
returns. It builds this
rank's program for ``ScheduleSettings.schedule`` -- Seq1F1B (interleaved order with
virtual stages), SlimPipe, or SlimPipe with attention balance; one split is plain 1F1B
-- lowered by ``megatron.schedules.lowering`` and checked free of deadlock by the
simulator, and ``PipelineExecutor`` runs it: one method per action kind (a compute
unit, a batch of sends and receives), every message with its own shape (splits may
differ in length, so there is no shape handshake).

Messages and failures: ``run_batch`` hands each batch to a transport
(``megatron.schedules.transport``), which also says which rank of how many the program
runs as: the pipeline group's ``batch_isend_irecv`` in training, ``SyntheticNeighbours``
when one process runs one stage alone (the stage benchmark, tests). An exception in
any action leaves with a note (``failure_note``) naming the rank, the action's index
and the program around it in the actions' printed form; its type, message and
traceback are the original's.

Loss: the user's loss function must return megatron's triple ``(loss_sum,
num_tokens, reported)``. A split's loss sum is normalised at backward time by the
token count of its whole microbatch (known by then: on the last stage all splits
of a microbatch run forward before its first backward), so the split losses add up
to the unsplit microbatch loss; with ``calculate_per_token_loss`` the sums are
used as they are and megatron-core divides by the total token count.

What reaches the model: ``forward_step(data_iterator, model)`` gets a
``SplitDataIterator`` made for the unit, whose ``split`` is the unit's
``SplitContext`` (pass it to the model as ``packed_seq_params``); the model must
consume it (``check_split_consumed``: refused after the first forward unit
otherwise). The attention exchange of a paired unit (attention balance) reaches the
attention through the KV store's one context object, ``KVCacheStore.unit_exchange``,
which the executor sets around each unit. Data-parallel gradient reduction starts as
megatron-core's schedules start it (``megatron.schedules.grad_sync``).
"""

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol, runtime_checkable

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from megatron.mcore_compat import backward_step
from megatron.schedules.actions import FORWARD, SEND, Unit, format_action, producer
from megatron.schedules.grad_sync import GradSync
from megatron.schedules.lowering import checked_programs
from megatron.schedules import registry
from megatron.schedules.transport import ProcessGroupTransport, Transport
from megatron.seqsplit.kv_cache import KVCacheStore
from megatron.seqsplit.moe import RoutingStatistics
from megatron.seqsplit.split_context import CONSUMERS, SplitContext, slice_batch
from megatron.seqsplit.context_parallel import ContextParallel
from megatron.seqsplit.split_lengths import plan_splits, split_offsets


@runtime_checkable
class UnitObserver(Protocol):
    """Watches the units of training iterations (timeline recorder, memory probe).
    Forward-only calls (evaluation) are not shown to observers, so a timeline or memory
    probe of the last iteration holds the training iteration only."""

    def on_unit_start(self, rank: int, unit: Unit) -> None: ...

    def on_unit_end(self, rank: int, unit: Unit) -> None: ...


@runtime_checkable
class KVStoreObserver(UnitObserver, Protocol):
    """An observer that also counts the KV cache (given each iteration's store)."""

    def attach_kv_store(self, store: KVCacheStore) -> None: ...


@dataclass
class ScheduleSettings:
    """Which schedule the executor runs, how it splits, and who watches."""

    # a name of megatron.schedules.registry: "seq1f1b" (interleaved Seq1F1B with virtual
    # stages; one split is 1F1B), "1f1b" (one split), "slimpipe" (num_splits its uniform
    # slices; Seq1F1B's order when v = 1)
    schedule: str = "seq1f1b"
    num_splits: int = 1
    balance_method: str = "average"  # the split solver's method (seqsplit.split_lengths)
    alignment: int = 1
    model_shape: Any = None  # megatron.model_shape.ModelShape: uniform_comp, attention balance
    observers: List[UnitObserver] = field(default_factory=list)
    # SlimPipe only: attention redistribution between paired units
    # (megatron.schedules.attention_balance); needs the chunked KV cache and model_shape
    attention_balance: bool = False
    exchange_cost: float = 0.0  # SliceCosts.exchange: one K/V chunk's send vs its attention

    def __post_init__(self):
        """The command line's rules (``registry.resolve``): an unknown schedule or a
        combination it refuses raises ``ScheduleChoiceError`` naming the choices."""
        slimpipe = self.schedule == "slimpipe"
        registry.resolve(self.schedule, seq1f1b_splits=1 if slimpipe else self.num_splits,
                         slices_flag="--slimpipe-slices" if slimpipe else None,
                         balance_method=self.balance_method,
                         attention_balance=self.attention_balance)
        if self.num_splits < 1:
            raise registry.ScheduleChoiceError(
                f"{'--slimpipe-slices' if slimpipe else '--seq1f1b-splits'} must be >= 1, "
                f"got {self.num_splits}")

    @classmethod
    def from_config(cls, config) -> "ScheduleSettings":
        """The settings a model config carries, as the original Seq1F1B fork read them
        from its arguments: ``config.seq1f1b_splits`` (required), and optionally
        ``seq1f1b_balance_method``, ``seq1f1b_split_alignment``, ``pipeline_schedule``
        and ``slimpipe_slices`` (attributes set on the ``TransformerConfig``)."""
        splits = getattr(config, "seq1f1b_splits", None)
        slices = getattr(config, "slimpipe_slices", None)
        schedule = getattr(config, "pipeline_schedule", None)
        if splits is None and slices is None:
            raise ValueError(
                "forward_backward_pipelining_seq1f1b needs the split settings: set "
                "config.seq1f1b_splits (and optionally config.seq1f1b_balance_method) on the "
                "model's TransformerConfig, pass settings=ScheduleSettings(...), or get the "
                "function from get_forward_backward_func(seq1f1b_splits=...)")
        schedule = registry.resolve(
            schedule, seq1f1b_splits=splits or 1,
            slices_flag=None if slices is None else "--slimpipe-slices",
            balance_method=getattr(config, "seq1f1b_balance_method", None) or "average")
        return cls(schedule=schedule, num_splits=slices if schedule == "slimpipe" else splits,
                   balance_method=getattr(config, "seq1f1b_balance_method", None) or "average",
                   alignment=getattr(config, "seq1f1b_split_alignment", None) or 1)


class MicrobatchSlicer:
    """Reads each microbatch from the user's iterator once (at its split 0) and keeps it
    until its last split's slice is taken."""

    def __init__(self, data_iterator):
        self.data_iterator = data_iterator
        self.batches: Dict[int, dict] = {}

    def slice(self, split: SplitContext) -> dict:
        if split.split_index == 0:
            batch = next(self.data_iterator)
            if not isinstance(batch, dict):
                raise TypeError(
                    "with sequence splits the data iterator must yield dicts of per-token "
                    "tensors ([b, seq_length], e.g. tokens, labels, loss_mask, position_ids) "
                    f"so that each split gets its slice; got {type(batch).__name__}")
            self.batches[split.microbatch_id] = batch
        batch = self.batches[split.microbatch_id]
        if split.is_last:
            del self.batches[split.microbatch_id]
        split.microbatch = batch
        return slice_batch(batch, split.offset, split.length, split.seq_length)


class SplitDataIterator:
    """What the user's ``forward_step`` receives as ``data_iterator``: made for one unit,
    ``split`` is its ``SplitContext`` and ``next()`` returns the split's slice."""

    def __init__(self, slicer: MicrobatchSlicer, split: SplitContext):
        self.split = split
        self.slicer = slicer

    def __iter__(self):
        return self

    def __next__(self):
        return self.slicer.slice(self.split)


class SplitNotConsumedError(RuntimeError):
    """A forward under sequence splits returned without the model using its split."""


def chunk_consumers(chunk) -> tuple:
    """The split-aware parts a model chunk's forward must hand the split to: the position
    handling always, and attention where the chunk holds a transformer layer (a stage of
    --pipeline-model-parallel-layout may hold the embedding or the loss alone)."""
    has_layers = any(isinstance(module, TransformerLayer) for module in chunk.modules())
    return CONSUMERS if has_layers else tuple(c for c in CONSUMERS if c != "attention")


def check_split_consumed(split: SplitContext, unit: Unit, required=CONSUMERS) -> None:
    """Refuse a forward whose model did not consume the split (see
    ``SplitContext.missing_consumers``; ``required``: ``chunk_consumers`` of its chunk):
    it would attend within the split only and train on wrong gradients, silently. Called
    after every forward unit with more than one split (or a context-parallel part of
    one), so the first unit fails, before any backward."""
    missing = tuple(part for part in split.missing_consumers() if part in required)
    if not missing:
        return
    raise SplitNotConsumedError(
        f"sequence splits (--seq1f1b-splits / --slimpipe-slices > 1, or the parts of "
        f"--context-parallel-size > 1): the forward of unit "
        f"{unit} (microbatch {unit.microbatch}, split {unit.split} of {split.num_splits}, "
        f"model chunk {unit.chunk}) returned without the split reaching the model's "
        f"{' and '.join(missing)}, so it would attend within the split only and train on "
        "wrong gradients. Build the model as megatron.seqsplit.model.SeqSplitGPTModel with "
        "transformer_layer_spec=split_aware_local_spec(config) (a stock megatron-core "
        "GPTModel cannot run splits), and have forward_step pass the split on: "
        "model(tokens, position_ids, None, labels=labels, "
        "packed_seq_params=data_iterator.split) (the forward_step contract in "
        "megatron.schedules.dispatch.get_forward_backward_func's docstring)")


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


class PipelineExecutor:
    """One iteration of this rank's program: its state in named fields, one method per
    action kind."""

    def __init__(self, *, settings: ScheduleSettings, forward_step_func, chunks, iterators,
                 num_microbatches: int, seq_length: int, micro_batch_size: int,
                 forward_only: bool, pp_group=None, transport: Optional[Transport] = None):
        """``transport`` carries the messages and says which rank of how many this is;
        by default the pipeline group ``pp_group`` (``ProcessGroupTransport``)."""
        self.settings = settings
        self.forward_step_func = forward_step_func
        self.chunks = chunks
        self.num_chunks = len(chunks)
        self.consumers = [chunk_consumers(chunk) for chunk in chunks]
        self.config = get_model_config(chunks[0])
        self.transport = (transport if transport is not None
                          else ProcessGroupTransport(pp_group, self.config))
        self.rank, self.pp_size = self.transport.rank, self.transport.size
        self.num_microbatches = num_microbatches
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.forward_only = forward_only
        # megatron-core all-reduces this over NCCL on GPU: keep it on the run's device
        self.device = next(chunks[0].parameters()).device
        self.lengths = plan_splits(seq_length, settings.num_splits, settings.balance_method,
                                   alignment=settings.alignment, model=settings.model_shape)
        self.offsets = split_offsets(self.lengths)
        # --context-parallel-size > 1: every unit runs this rank's part of its split
        self.context_parallel = ContextParallel.from_parallel_state()
        if self.context_parallel is not None:  # a split the ranks cannot share stops here
            for length in self.lengths:
                self.context_parallel.part(0, length)
        self.kv_store = KVCacheStore(forward_only=forward_only)
        # MoE routers' per-split counts: their aux losses are over whole microbatches
        self.routing_stats = RoutingStatistics()
        self.observers = () if forward_only else tuple(settings.observers)
        for observer in self.observers:
            if isinstance(observer, KVStoreObserver):
                observer.attach_kv_store(self.kv_store)
        self.slicers = [MicrobatchSlicer(iterator) for iterator in iterators]
        self.set_input_tensors = [get_attr_wrapped_model(chunk, "set_input_tensor")
                                  for chunk in chunks]
        # this rank's program, and each paired unit's side of an attention-redistribution pair
        self.program, self.exchanges = self._program()
        self.grad_sync = GradSync(self.config, chunks, self.program)
        # tensors in flight, keyed by the unit that produced or consumes them
        self.received_inputs: Dict[Unit, torch.Tensor] = {}
        self.received_grads: Dict[Unit, torch.Tensor] = {}
        self.inputs: Dict[Unit, Optional[torch.Tensor]] = {}  # forward unit -> its input
        self.outputs: Dict[Unit, torch.Tensor] = {}  # forward unit -> its output (for backward)
        self.unsent_outputs: Dict[Unit, torch.Tensor] = {}  # until sent downstream
        self.input_grads: Dict[Unit, Optional[torch.Tensor]] = {}  # until sent upstream
        self.tokens_per_microbatch: Dict[int, torch.Tensor] = {}  # last stage: loss tokens
        self.cp_reduced_microbatches: set = set()  # token counts summed over the CP ranks
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=self.device)
        self.reports = []  # (microbatch, reported) per loss-holding forward

    def _program(self):
        """(this rank's checked program, unit -> its ``Exchange`` under attention balance)."""
        settings = self.settings
        if settings.attention_balance and not self.forward_only:
            return self._balanced_program()
        group_size = getattr(self.config, "microbatch_group_size_per_vp_stage", None)
        programs = checked_programs(self.pp_size, self.num_microbatches, self.num_chunks,
                                    settings.num_splits, group_size, self.forward_only,
                                    settings.schedule)
        return programs[self.rank], {}

    def _balanced_program(self):
        """SlimPipe with attention redistribution: this rank's program (lowered on the
        balanced timeline, checked free of deadlock with the pairs as rendezvous) and
        the ``Exchange`` of each of its paired units."""
        from megatron.schedules.attention_balance import SliceCosts, checked_balanced_programs
        from megatron.seqsplit.attention_exchange import Exchange

        settings = self.settings
        if settings.schedule != "slimpipe" or settings.model_shape is None:
            raise ValueError("attention balance needs the SlimPipe schedule and the model shape")
        costs = SliceCosts.from_model(settings.model_shape,
                                      self.seq_length // settings.num_splits,
                                      settings.exchange_cost)
        programs, plan = checked_balanced_programs(self.pp_size, self.num_microbatches,
                                                   self.num_chunks, settings.num_splits, costs)
        lengths, offsets = self.lengths, self.offsets
        exchanges = {
            unit: Exchange(
                role=o.role, peer=self.transport.global_rank(o.peer),
                group=self.transport.group, asker_forward=o.asker.is_forward,
                num_chunks=o.num_chunks, query_length=lengths[o.asker.split],
                query_start=offsets[o.asker.split], chunk_lengths=tuple(lengths[:o.num_chunks]))
            for unit, o in plan.offloads[self.rank].items()}
        return programs[self.rank], exchanges

    # ------------------------------------------------------------------ running

    def run(self) -> list:
        """Run the program; returns one loss report per microbatch (last stage)."""
        self._set_auxiliary_loss_scales()
        try:
            for index, action in enumerate(self.program):
                try:
                    if isinstance(action, Unit):
                        self.run_unit(action)
                    else:
                        self.run_batch(action)
                except Exception as error:  # same exception, told where in the program
                    error.add_note(failure_note(self.program, index, self.rank, self.pp_size))
                    raise
        finally:
            self.grad_sync.close()  # also on an error: no_sync state is left as found
        if not self.forward_only:
            if self.kv_store.num_entries() != 0:
                raise AssertionError(f"{self.kv_store.num_entries()} KV-cache entries "
                                     "outlived their microbatch's backward")
        self.kv_store.clear()
        self.routing_stats.clear()
        return merge_split_reports(self.reports)

    def _set_auxiliary_loss_scales(self) -> None:
        """The scale of the MoE auxiliary losses' and the multi-token prediction losses'
        gradient, as megatron-core's forward_step sets it on every stage: the main
        loss's (1 / microbatches, times the fp16 loss scale), also times the
        context-parallel size as the main loss's: each CP rank's share of these losses
        (the MTP loss's over the whole microbatch's token count, mtp.py) is summed over
        the ranks, and the gradient reduction averages over them. megatron-core scales
        its MoE losses so too; its MTP losses are each rank's mean over its own tokens."""
        scalers = [scaler for scaler, used in (
            (MoEAuxLossAutoScaler, getattr(self.config, "num_moe_experts", None) is not None),
            (MTPLossAutoScaler, getattr(self.config, "mtp_num_layers", None) is not None))
            if used]
        if not scalers:
            return
        one = torch.ones(1, device=self.device)
        scale = self.config.grad_scale_func(one) if self.config.grad_scale_func else one
        if not self.config.calculate_per_token_loss:
            scale = scale / self.num_microbatches
            if self.context_parallel is not None:
                scale = scale * self.context_parallel.size
        for scaler in scalers:
            scaler.set_loss_scale(scale)

    def run_unit(self, unit: Unit) -> None:
        for observer in self.observers:
            observer.on_unit_start(self.rank, unit)
        with self.kv_store.unit_exchange.running(self.exchanges.get(unit), unit.is_forward):
            if unit.is_forward:
                self._forward(unit)
            else:
                self._backward(unit)
        for observer in self.observers:
            observer.on_unit_end(self.rank, unit)

    def _holds_loss(self, unit: Unit) -> bool:
        return self.rank == self.pp_size - 1 and unit.chunk == self.num_chunks - 1

    def _split(self, unit: Unit) -> SplitContext:
        offset, length = self.offsets[unit.split], self.lengths[unit.split]
        if self.context_parallel is not None:
            offset, length = self.context_parallel.part(offset, length)
        return SplitContext(
            microbatch_id=unit.microbatch, split_index=unit.split,
            num_splits=self.settings.num_splits, offset=offset, length=length,
            seq_length=self.seq_length, kv_store=self.kv_store,
            routing_stats=self.routing_stats, context_parallel=self.context_parallel)

    def _forward(self, unit: Unit) -> None:
        config = self.config
        input_tensor = self.received_inputs.pop(unit, None)
        self.set_input_tensors[unit.chunk]([input_tensor])
        split = self._split(unit)
        data = SplitDataIterator(self.slicers[unit.chunk], split)
        autocast = (torch.autocast("cuda", dtype=config.autocast_dtype)
                    if getattr(config, "enable_autocast", False) else contextlib.nullcontext())
        with autocast:
            output_tensor, loss_func = self.forward_step_func(data, self.chunks[unit.chunk])
        if self.settings.num_splits > 1 or self.context_parallel is not None:
            check_split_consumed(split, unit, self.consumers[unit.chunk])
        if self._holds_loss(unit):
            output_tensor = self._loss(unit, loss_func(output_tensor))
        else:
            self.unsent_outputs[unit] = output_tensor
        if not self.forward_only:
            self.inputs[unit] = input_tensor
            self.outputs[unit] = output_tensor

    def _loss(self, unit: Unit, reduced) -> torch.Tensor:
        if len(reduced) != 3:
            raise ValueError(
                "with --seq1f1b-splits > 1 the loss function must return (loss_sum, "
                "num_tokens, reported) so split losses can be normalised by the whole "
                "microbatch's token count")
        loss_sum, num_tokens, reported = reduced
        self.reports.append((unit.microbatch, reported))
        num_tokens = torch.as_tensor(num_tokens).to(device=self.device, dtype=torch.int)
        self.tokens_per_microbatch[unit.microbatch] = (
            self.tokens_per_microbatch.get(unit.microbatch, 0) + num_tokens)
        self.total_num_tokens = self.total_num_tokens + num_tokens
        return loss_sum

    def _backward(self, unit: Unit) -> None:
        forward_unit = Unit(FORWARD, unit.microbatch, unit.split, unit.chunk)
        input_tensor = self.inputs.pop(forward_unit)
        output_tensor = self.outputs.pop(forward_unit)
        if self._holds_loss(unit) and not self.config.calculate_per_token_loss:
            output_tensor = self._normalised_loss(unit.microbatch, output_tensor)
        self.grad_sync.before_backward(unit)
        grad = backward_step(input_tensor, output_tensor, self.received_grads.pop(unit, None),
                             self.config)
        self.grad_sync.after_backward(unit)
        if self.rank != 0 or unit.chunk != 0:  # the first stage has nothing to send upstream
            self.input_grads[unit] = grad

    def _normalised_loss(self, microbatch: int, loss_sum: torch.Tensor) -> torch.Tensor:
        """A split's loss sum over its microbatch's loss tokens and the microbatch count.
        Context-parallel ranks each hold a part of the microbatch's tokens: their counts
        are summed (once per microbatch, at its first backward: the ranks run the same
        units) and the loss is multiplied by the rank count, because megatron-core's DDP
        averages the gradients over them; the parts' losses then add up to the whole
        microbatch's, whatever share of the loss mask each part holds."""
        tokens = self.tokens_per_microbatch[microbatch]
        context_parallel = self.context_parallel
        if context_parallel is not None and microbatch not in self.cp_reduced_microbatches:
            tokens = tokens.clone()
            torch.distributed.all_reduce(tokens, group=context_parallel.group)
            self.tokens_per_microbatch[microbatch] = tokens
            self.cp_reduced_microbatches.add(microbatch)
        loss = loss_sum / tokens.clamp(min=1).to(loss_sum.device) / self.num_microbatches
        return loss if context_parallel is None else loss * context_parallel.size

    def run_batch(self, batch) -> None:
        """One batch of sends and receives, posted together by the transport, each
        message with its own shape."""
        tensors, arrivals, sent_outputs = [], [], []
        for message in batch:
            if message.kind == SEND:
                _, produced = producer(message.unit, message.peer, self.pp_size, self.num_chunks)
                if produced.is_forward:
                    tensor = self.unsent_outputs[produced]
                    sent_outputs.append(produced)
                else:
                    tensor = self.input_grads.pop(produced)
            else:
                tensor = torch.empty(self._hidden_shape(message.unit), requires_grad=True,
                                     device=self.device, dtype=self.config.pipeline_dtype)
                arrivals.append((message.unit, tensor))
            tensors.append(tensor)
        self.transport.exchange(batch, tensors)
        for unit, tensor in arrivals:
            (self.received_inputs if unit.is_forward else self.received_grads)[unit] = tensor
        for unit in sent_outputs:
            # the activation has left: keep only what backward needs (megatron's trick)
            tensor = self.unsent_outputs.pop(unit)
            if not self.forward_only:
                deallocate_output_tensor(tensor, self.config.deallocate_pipeline_outputs)

    def _hidden_shape(self, unit: Unit):
        length = self.lengths[unit.split]
        if self.context_parallel is not None:  # each CP rank holds its part of the split
            length = self.context_parallel.part(0, length)[1]
        if self.config.sequence_parallel:  # each TP rank holds its share of the sequence
            length //= parallel_state.get_tensor_model_parallel_world_size()
        return (length, self.micro_batch_size, self.config.hidden_size)


def failure_note(program, index: int, rank: int, size: int, around: int = 3) -> str:
    """Where a rank's program failed, in the actions' printed form, the failing action
    marked: ``pipeline rank 1 of 2 failed at action 7 of 21 (F1.0): ... [R0:F1.0] B0.1
    [S0:B0.1] >> F1.0 << B0.0 [R0:F1.1 S0:B0.0] F1.1 ...``."""
    start, stop = max(0, index - around), min(len(program), index + around + 1)
    shown = [format_action(action) for action in program[start:stop]]
    shown[index - start] = f">> {shown[index - start]} <<"
    return (f"pipeline rank {rank} of {size} failed at action {index} of {len(program)} "
            f"({format_action(program[index])}): {'... ' if start else ''}{' '.join(shown)}"
            f"{' ...' if stop < len(program) else ''}")


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
    p2p_communicator=None,
    pg_collection=None,
    force_all_reduce: Optional[bool] = False,
    settings: Optional[ScheduleSettings] = None,
):
    """Seq1F1B beside megatron-core's ``forward_backward_pipelining_without_interleaving``:
    one training (or ``forward_only``) iteration over ``num_microbatches`` microbatches.

    Takes megatron-core's keyword arguments (``forward_step_func``, ``data_iterator``,
    ``model``, ``num_microbatches``, ``seq_length``, ``micro_batch_size``,
    ``decoder_seq_length``, ``forward_only``, ``collect_non_loss_data``,
    ``first_val_step``, ``adjust_tensor_shapes_fn``, ``p2p_communicator``,
    ``pg_collection``, ``force_all_reduce``) plus one optional keyword, ``settings``
    (``ScheduleSettings``: the schedule, splits, balance method, observers). Without it
    the split settings come from the model config (``ScheduleSettings.from_config``:
    ``config.seq1f1b_splits``, ``config.seq1f1b_balance_method``, ...). ``model`` and
    ``data_iterator`` may be lists (one per virtual stage: interleaved Seq1F1B).

    Returns the loss functions' reported values, one dict per microbatch (the splits'
    reports added), on the last pipeline stage as megatron-core's schedules do; an
    empty list elsewhere. The forward_step contract is in
    ``megatron.schedules.dispatch.get_forward_backward_func``'s docstring."""
    chunks = list(model) if isinstance(model, list) else [model]
    iterators = list(data_iterator) if isinstance(data_iterator, list) else [data_iterator]
    if len(iterators) == 1 and len(chunks) > 1:
        iterators = iterators * len(chunks)
    if len(iterators) != len(chunks):
        raise ValueError(f"{len(chunks)} model chunks need {len(chunks)} data iterators, "
                         f"got {len(iterators)}")
    if collect_non_loss_data:
        raise ValueError("collect_non_loss_data is not supported with --seq1f1b-splits > 1")
    if decoder_seq_length is not None or adjust_tensor_shapes_fn is not None:
        raise ValueError("encoder-decoder models are not supported with --seq1f1b-splits > 1")
    pp_group = (p2p_communicator.pp_group if p2p_communicator is not None
                else parallel_state.get_pipeline_model_parallel_group())
    if len(chunks) > 1 and pp_group.size() < 2:
        raise ValueError("virtual pipeline stages need --pipeline-model-parallel-size >= 2")
    if settings is None:
        settings = ScheduleSettings.from_config(get_model_config(chunks[0]))
    executor = PipelineExecutor(
        settings=settings, forward_step_func=forward_step_func, chunks=chunks,
        iterators=iterators, pp_group=pp_group, num_microbatches=num_microbatches,
        seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=forward_only)
    reports = executor.run()
    config = executor.config
    if not forward_only and config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func(
            chunks, executor.total_num_tokens if config.calculate_per_token_loss else None,
            pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    return reports
