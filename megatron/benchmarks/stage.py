"""One pipeline stage of 1F1B / Seq1F1B, emulated on one device.

A stage's share of an iteration is its unit list from the shared generator
(``megatron.schedules.seq1f1b.seq1f1b_rank_units(rank, p, m, s)``). This module runs
that list on one device with the project's real model (``pretrain_gpt``'s model
provider: megatron-core layers with the split-aware local spec, the KV-prefix cache,
Float16Module for bf16, megatron-core DDP gradient buffers) and replaces every
point-to-point message by a tensor produced locally with the shape and dtype the
neighbour would send:

* forward input of a non-first stage: ``[l_j, b, h]`` with ``requires_grad`` (what
  the executor's receive returns), kept until the unit's backward;
* after a non-last stage's forward the output is "sent": megatron's
  ``deallocate_output_tensor`` drops its data, as the executor does;
* backward of a non-last stage receives a ``[l_j, b, h]`` output gradient;
* the first stage reads tokens / position ids, the last stage labels / loss mask
  (random tokens), through ``pretrain_gpt.forward_step`` and, with splits,
  ``megatron.schedules.executor.SplitDataIterator`` (the executor's own slicing).

Backward is megatron-core's ``backward_step``. Measured per run: every unit's wall
time (device synchronised around each unit, ``TimelineRecorder``), the activation
peak (CUDA: ``torch.cuda.max_memory_allocated`` minus what was allocated before the
iteration, i.e. weights and gradient buffers; CPU: the project's saved-tensor
``ActivationMemoryProbe`` in a separate iteration, since CPU has no allocator
counter), and from the unit times the split overhead and, through the planner's
simulator, the whole pipeline's span, bubble and tokens/s.
"""

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from megatron.schedules.simulate import simulate
from megatron.schedules.memory_probe import ActivationMemoryProbe
from megatron.schedules.actions import Unit
from megatron.schedules.seq1f1b import seq1f1b_rank_units, seq1f1b_schedule
from megatron.seqsplit.kv_cache import KVCacheStore
from megatron.seqsplit.split_lengths import plan_splits, split_offsets
from megatron.seqsplit.split_context import SplitContext

FIRST, MIDDLE, LAST = "first", "middle", "last"


def role_of(rank: int, pp: int) -> str:
    if rank == 0:
        return FIRST
    return LAST if rank == pp - 1 else MIDDLE


def roles_to_emulate(pp: int) -> List[int]:
    """One rank per distinct role: 0, 1 (a middle stage, if any) and p - 1."""
    return sorted({0, min(1, pp - 1), pp - 1})


@dataclass
class StageRun:
    """What one (rank, splits, balance method) emulation measured."""

    rank: int
    role: str
    splits: int
    balance_method: Optional[str]
    split_lengths: List[int]
    oom: bool = False
    error: Optional[str] = None
    activation_peak_bytes: Optional[int] = None
    max_memory_allocated_bytes: Optional[int] = None
    static_bytes: Optional[int] = None
    # mean seconds per split index (averaged over microbatches and measured iterations)
    forward_s: List[float] = field(default_factory=list)
    backward_s: List[float] = field(default_factory=list)
    busy_s: Optional[float] = None  # one iteration of this stage, units only
    units: List[Dict] = field(default_factory=list)  # the last iteration's unit records

    @property
    def forward_per_microbatch_s(self) -> Optional[float]:
        return sum(self.forward_s) if self.forward_s else None

    @property
    def backward_per_microbatch_s(self) -> Optional[float]:
        return sum(self.backward_s) if self.backward_s else None

    def to_dict(self) -> Dict:
        out = {k: v for k, v in self.__dict__.items() if k != "units"}
        out["forward_per_microbatch_s"] = self.forward_per_microbatch_s
        out["backward_per_microbatch_s"] = self.backward_per_microbatch_s
        return out


class _Sequence:
    """A one-shot iterator over fixed microbatches (1F1B reads one per forward)."""

    def __init__(self, batches):
        self._it = iter(batches)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._it)


class StageEmulator:
    """Builds one stage's model (its role decides embedding / LM head) and runs unit lists."""

    def __init__(self, args, config, rank: int, pp: int, device):
        from megatron.trainer import gpt as pretrain_gpt  # pretrain_gpt.py's providers
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.transformer.module import Float16Module
        from megatron.core.utils import get_attr_wrapped_model

        self.args, self.config, self.rank, self.pp = args, config, rank, pp
        self.device = torch.device(device)
        self.role = role_of(rank, pp)
        self.first, self.last = rank == 0, rank == pp - 1
        # as megatron.trainer.training.build_model, but the stage's role is ours to choose
        # (parallel_state has pp = 1 in this single process)
        model = pretrain_gpt.model_provider(args, config, pre_process=self.first,
                                            post_process=self.last)
        model.to(self.device)
        if args.bf16 or args.fp16:
            model = Float16Module(config, model)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=args.bf16 or args.fp16,
                                                   overlap_grad_reduce=False)
        self.model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        self.model.train()
        self.forward_step = pretrain_gpt.forward_step
        self.set_input_tensor = get_attr_wrapped_model(self.model, "set_input_tensor")
        self.dtype = config.params_dtype

    def make_batches(self, microbatches: int, generator: torch.Generator) -> List[Dict]:
        b, L, vocab = self.args.micro_batch_size, self.args.seq_length, self.args.padded_vocab_size
        batches = []
        for _ in range(microbatches):
            tokens = torch.randint(0, vocab, (b, L + 1), generator=generator)
            batches.append({
                "tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                "loss_mask": torch.ones(b, L), "position_ids": torch.arange(L).repeat(b, 1),
            })
        return batches

    def run_iteration(self, microbatches: int, splits: int, lengths: Sequence[int],
                      batches: List[Dict], observers=()) -> None:
        """Run this rank's unit list once (one iteration of this stage)."""
        from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

        from megatron.schedules.executor import (KVStoreObserver, MicrobatchSlicer,
                                                 SplitDataIterator)
        from megatron.mcore_compat import backward_step

        args, config = self.args, self.config
        b, h, L = args.micro_batch_size, args.hidden_size, args.seq_length
        offsets = split_offsets(list(lengths))
        kv_store = KVCacheStore(forward_only=False)
        for observer in observers:  # as the executor does: the probe counts the cache's
            if isinstance(observer, KVStoreObserver):  # buffers and gradient accumulators
                observer.attach_kv_store(kv_store)
        iterator = _Sequence(batches)
        slicer = MicrobatchSlicer(iterator)
        generator = torch.Generator(device=self.device).manual_seed(1000 + self.rank)
        inputs, outputs = {}, {}
        self.model.zero_grad_buffer()
        for unit in seq1f1b_rank_units(self.rank, self.pp, microbatches, splits):
            for observer in observers:
                observer.on_unit_start(self.rank, unit)
            length = lengths[unit.split]
            key = (unit.microbatch, unit.split)
            if unit.is_forward:
                received = None
                if not self.first:  # what recv_forward would return
                    received = torch.randn(length, b, h, dtype=self.dtype, device=self.device,
                                           generator=generator).requires_grad_()
                self.set_input_tensor([received])
                if splits > 1:  # as the executor: an iterator made for the unit
                    iterator = SplitDataIterator(slicer, SplitContext(
                        microbatch_id=unit.microbatch, split_index=unit.split, num_splits=splits,
                        offset=offsets[unit.split], length=length, seq_length=L,
                        kv_store=kv_store))
                output, loss_func = self.forward_step(iterator, self.model, args=args)
                if self.last:
                    loss_sum, _, _ = loss_func(output)
                    output = loss_sum / (b * L) / microbatches
                else:
                    deallocate_output_tensor(output, config.deallocate_pipeline_outputs)  # "sent"
                inputs[key], outputs[key] = received, output
            else:
                grad = None
                if not self.last:  # what recv_backward would return
                    grad = torch.randn(length, b, h, dtype=self.dtype, device=self.device,
                                       generator=generator) * 1e-3
                backward_step(inputs.pop(key), outputs.pop(key), grad, config)
                # the input gradient would be sent upstream here: drop it
            for observer in observers:
                observer.on_unit_end(self.rank, unit)
        if kv_store.num_entries():
            raise AssertionError(f"{kv_store.num_entries()} KV-cache entries outlived the iteration")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_ops(emulator: StageEmulator, microbatches: int, splits: int,
                lengths: Sequence[int], seed: int = 1234) -> Dict[str, float]:
    """Self time (s) per operator of one iteration of the stage under torch.profiler
    (CPU activity, plus CUDA kernels on a GPU), for comparing schedules op by op."""
    from torch.profiler import ProfilerActivity, profile

    batches = emulator.make_batches(microbatches, torch.Generator().manual_seed(seed))
    emulator.run_iteration(microbatches, splits, lengths, batches)  # warm
    activities = [ProfilerActivity.CPU]
    if emulator.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    _sync(emulator.device)
    with profile(activities=activities) as prof:
        emulator.run_iteration(microbatches, splits, lengths, batches)
        _sync(emulator.device)
    times = {}
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0) or 0
        times[event.key] = (event.self_cpu_time_total + device_us) / 1e6
    return times


def op_differences(base: Dict[str, float], other: Dict[str, float], top: int):
    """[(op, base s, other s)] of the `top` operators whose self time changed most."""
    ops = sorted(set(base) | set(other),
                 key=lambda op: -abs(other.get(op, 0.0) - base.get(op, 0.0)))
    return [(op, base.get(op, 0.0), other.get(op, 0.0)) for op in ops[:top]]


def measure(emulator: StageEmulator, microbatches: int, splits: int, balance_method: str,
            lengths: Sequence[int], warmup_iters: int = 1, iters: int = 2,
            seed: int = 1234, clock=time.perf_counter) -> StageRun:
    """Warm up, then time ``iters`` iterations of the stage and measure its activation peak.

    ``clock``: ``time.perf_counter`` (wall) or ``time.process_time`` (this process's CPU
    time: on a shared CPU it counts the work, not the waiting for a core)."""
    from megatron.schedules.timeline import TimelineRecorder

    device = emulator.device
    run = StageRun(emulator.rank, emulator.role, splits, balance_method if splits > 1 else None,
                   list(lengths))
    batches = emulator.make_batches(microbatches, torch.Generator().manual_seed(seed))
    failure = None
    try:
        for _ in range(warmup_iters):
            emulator.run_iteration(microbatches, splits, lengths, batches)
        _sync(device)
        gc.collect()
        records = []
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            run.static_bytes = torch.cuda.memory_allocated(device)
        for _ in range(iters):
            recorder = TimelineRecorder(rank=emulator.rank,
                                        sync=(lambda: _sync(device)) if device.type == "cuda" else None,
                                        clock=clock)
            emulator.run_iteration(microbatches, splits, lengths, batches, observers=[recorder])
            records.append(recorder.events)
        _sync(device)
        if device.type == "cuda":
            run.max_memory_allocated_bytes = torch.cuda.max_memory_allocated(device)
            run.activation_peak_bytes = run.max_memory_allocated_bytes - run.static_bytes
        else:
            probe = ActivationMemoryProbe(emulator.model)
            probe.reset()
            emulator.run_iteration(microbatches, splits, lengths, batches, observers=[probe])
            run.activation_peak_bytes = probe.peak_bytes
    except torch.OutOfMemoryError as err:  # the stage does not fit: that is a result
        failure = str(err).splitlines()[0]
    if failure is not None:
        # outside the except block: the traceback (and the tensors its frames hold) is gone
        run.oom, run.error = True, failure
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return run
    forward = [[] for _ in range(splits)]
    backward = [[] for _ in range(splits)]
    busy = []
    for events in records:
        busy.append(sum(e["end"] - e["start"] for e in events))
        for e in events:
            (forward if e["kind"] == "F" else backward)[e["split"]].append(e["end"] - e["start"])
    run.forward_s = [statistics.mean(x) for x in forward]
    run.backward_s = [statistics.mean(x) for x in backward]
    run.busy_s = statistics.mean(busy)
    run.units = records[-1]
    return run


def predict_pipeline(runs_by_rank: Dict[int, StageRun], pp: int, microbatches: int,
                     splits: int, tokens_per_iteration: int, p2p_seconds=None) -> Dict:
    """The planner's simulator on the measured unit times, for the whole pipeline.

    Every rank uses the unit times measured for its role (first / middle / last);
    a role that was not emulated borrows the nearest emulated rank's times.
    ``p2p_seconds(split)``: the time of one activation / gradient message (default free).
    """
    emulated = sorted(r for r, run in runs_by_rank.items() if not run.oom)
    if not emulated:
        return {"oom": True}

    def source(rank):
        role = role_of(rank, pp)
        same = [r for r in emulated if role_of(r, pp) == role]
        return runs_by_rank[same[0] if same else min(emulated, key=lambda r: abs(r - rank))]

    def duration(rank, unit: Unit):
        run = source(rank)
        return (run.forward_s if unit.is_forward else run.backward_s)[unit.split]

    comm = None
    if p2p_seconds is not None:
        comm = lambda src, dst, unit: p2p_seconds(unit.split)  # noqa: E731
    sim = simulate(seq1f1b_schedule(pp, microbatches, splits), duration, comm)
    return {"oom": any(run.oom for run in runs_by_rank.values()),
            "pipeline_span_s": sim.makespan, "bubble_fraction": sim.bubble_fraction(),
            "tokens_per_s": tokens_per_iteration / sim.makespan,
            "ranks_measured": emulated,
            "busy_per_rank_s": [sim.busy(r) for r in range(pp)]}


def split_lengths_for(args, splits: int, balance_method: str, model_shape) -> List[int]:
    if splits == 1:
        return [args.seq_length]
    return plan_splits(args.seq_length, splits, balance_method, alignment=1, model=model_shape)
