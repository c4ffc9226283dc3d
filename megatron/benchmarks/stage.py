"""One pipeline stage of 1F1B / Seq1F1B, emulated on one device.

A stage's share of an iteration is its rank's program, run by the training executor
itself (``megatron.schedules.executor.PipelineExecutor``, schedule ``seq1f1b``; one
split is 1F1B) as rank ``r`` of a ``p``-stage pipeline in one process: its
``SyntheticNeighbours`` transport stands in for the other stages. Everything else is
what training runs, with the project's real model (``pretrain_gpt``'s model provider:
megatron-core layers with the split-aware local spec, the KV-prefix cache,
Float16Module for bf16, megatron-core DDP gradient buffers):

* a non-first stage's forward input is a received ``[l_j, b, h]`` buffer with
  ``requires_grad`` (filled with made-up values), kept until the unit's backward;
* a non-last stage's output is "sent" (dropped), then megatron's
  ``deallocate_output_tensor`` frees its data, as after a real send;
* a non-last stage's backward receives a made-up ``[l_j, b, h]`` output gradient;
* the first stage reads tokens / position ids, the last stage labels / loss mask
  (random tokens), through ``pretrain_gpt.forward_step`` and the executor's split
  slicing; the loss is normalised as in training (the executor's).

Measured per run: every unit's wall time (device synchronised around each unit,
``TimelineRecorder``), the activation peak (CUDA: ``torch.cuda.max_memory_allocated``
minus what was allocated before the iteration, i.e. weights and gradient buffers; CPU:
the project's saved-tensor ``ActivationMemoryProbe`` in a separate iteration, since CPU
has no allocator counter), and from the unit times the split overhead and, through the
planner's simulator, the whole pipeline's span, bubble and tokens/s. Nothing
communicates, so no message time enters the unit times.
"""

import dataclasses
import functools
import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from megatron.schedules.actions import Unit
from megatron.schedules.executor import PipelineExecutor, ScheduleSettings
from megatron.schedules.memory_probe import ActivationMemoryProbe
from megatron.schedules.seq1f1b import seq1f1b_schedule
from megatron.schedules.simulate import simulate
from megatron.schedules.transport import SyntheticNeighbours
from megatron.seqsplit.split_lengths import plan_splits

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


class StageEmulator:
    """Builds one stage's model (its role decides embedding / LM head) and runs its
    program with the training executor, the other stages synthetic."""

    def __init__(self, args, config, rank: int, pp: int, device, model_shape=None):
        from megatron.trainer import gpt as pretrain_gpt  # pretrain_gpt.py's providers
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.transformer.module import Float16Module

        self.args, self.config, self.rank, self.pp = args, config, rank, pp
        self.model_shape = model_shape  # for uniform_comp split lengths
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
        self.forward_step = functools.partial(pretrain_gpt.forward_step, args=args)

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

    def settings(self, splits: int, balance_method: str, observers=()) -> ScheduleSettings:
        return ScheduleSettings(schedule="seq1f1b", num_splits=splits,
                                balance_method=balance_method, model_shape=self.model_shape,
                                observers=list(observers))

    def split_lengths(self, splits: int, balance_method: str) -> List[int]:
        """The lengths the executor plans for these settings (its own call)."""
        settings = self.settings(splits, balance_method)
        return plan_splits(self.args.seq_length, splits, balance_method,
                           alignment=settings.alignment, model=settings.model_shape)

    def run_iteration(self, microbatches: int, splits: int, balance_method: str,
                      batches: List[Dict], observers=()) -> list:
        """One iteration of this stage: the executor runs rank ``rank``'s program of a
        ``pp``-stage pipeline; returns its loss reports (last stage)."""
        executor = PipelineExecutor(
            settings=self.settings(splits, balance_method, observers),
            forward_step_func=self.forward_step, chunks=[self.model], iterators=[iter(batches)],
            num_microbatches=microbatches, seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size, forward_only=False,
            transport=SyntheticNeighbours(self.rank, self.pp))
        self.model.zero_grad_buffer()
        return executor.run()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_ops(emulator: StageEmulator, microbatches: int, splits: int,
                balance_method: str, seed: int = 1234, clock=time.perf_counter) -> Dict[str, float]:
    """Self time (s) per operator of one iteration of the stage under torch.profiler
    (CPU activity, plus CUDA kernels on a GPU), for comparing schedules op by op. With
    ``clock=time.process_time`` (CPU device): each operator's CPU time instead
    (``op_clock.OpCpuTimes``), which other load on the host does not enter."""
    from torch.profiler import ProfilerActivity, profile

    batches = emulator.make_batches(microbatches, torch.Generator().manual_seed(seed))
    emulator.run_iteration(microbatches, splits, balance_method, batches)  # warm
    if clock is time.process_time and emulator.device.type == "cpu":
        from megatron.benchmarks.op_clock import OpCpuTimes

        with OpCpuTimes() as timer:
            emulator.run_iteration(microbatches, splits, balance_method, batches)
        return dict(timer.seconds)
    activities = [ProfilerActivity.CPU]
    if emulator.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    _sync(emulator.device)
    with profile(activities=activities) as prof:
        emulator.run_iteration(microbatches, splits, balance_method, batches)
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
            warmup_iters: int = 1, iters: int = 2,
            seed: int = 1234, clock=time.perf_counter) -> StageRun:
    """Warm up, then time ``iters`` iterations of the stage and measure its activation peak.

    ``clock``: ``time.perf_counter`` (wall) or ``time.process_time`` (this process's CPU
    time: on a shared CPU it counts the work, not the waiting for a core)."""
    from megatron.schedules.timeline import TimelineRecorder

    device = emulator.device
    run = StageRun(emulator.rank, emulator.role, splits, balance_method if splits > 1 else None,
                   emulator.split_lengths(splits, balance_method))
    batches = emulator.make_batches(microbatches, torch.Generator().manual_seed(seed))
    failure = None
    try:
        for _ in range(warmup_iters):
            emulator.run_iteration(microbatches, splits, balance_method, batches)
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
            emulator.run_iteration(microbatches, splits, balance_method, batches,
                                   observers=[recorder])
            records.append(recorder.events)
        _sync(device)
        if device.type == "cuda":
            run.max_memory_allocated_bytes = torch.cuda.max_memory_allocated(device)
            run.activation_peak_bytes = run.max_memory_allocated_bytes - run.static_bytes
        else:
            probe = ActivationMemoryProbe(emulator.model)
            probe.reset()
            emulator.run_iteration(microbatches, splits, balance_method, batches,
                                   observers=[probe])
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


def without_split_overhead(run: StageRun, whole: StageRun) -> StageRun:
    """``run``'s split units scaled so that a microbatch's splits cost what ``whole`` (the
    same rank under 1F1B) measured for the whole microbatch, forward and backward apart:
    the splits keep their measured proportions (how unequal they are) and lose the
    overhead of splitting. The simulator on these gives the best a balance method can
    reach with splitting made free."""
    scale_f = whole.forward_s[0] / sum(run.forward_s)
    scale_b = whole.backward_s[0] / sum(run.backward_s)
    return dataclasses.replace(run, forward_s=[t * scale_f for t in run.forward_s],
                               backward_s=[t * scale_b for t in run.backward_s])


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
