"""Model FLOPs, memory peaks and the Megatron-style iteration line."""

import math
import resource
import sys

import torch

from megatron.model_shape import ModelShape
from megatron.trainer import device


def model_flops_per_iteration(args) -> float:
    """Training FLOPs of one iteration, ``ModelShape.iteration_flops``: forward + backward
    (3x forward) over the global batch, causal attention as ``S (S + 1) / 2`` pairs per
    sequence (Megatron-LM counts ``S^2 / 2``; see ``megatron.model_shape``)."""
    shape = ModelShape.from_args(args)
    return shape.iteration_flops(args.seq_length, args.global_batch_size)


# the memory column's heading says what it measures
GPU_MEMORY = "peak memory per pipeline stage (GB)"  # max_memory_allocated, as Megatron-LM
CPU_RESIDENT = "peak resident set per pipeline stage (GB)"
CPU_ACTIVATIONS = "activation peak per pipeline stage (GB)"


def _probe(observers):
    """The activation-memory probe among the schedule's observers, if any."""
    return next((o for o in observers if hasattr(o, "peak_bytes")), None)


def memory_label(observers=()) -> str:
    if device.on_cuda():
        return GPU_MEMORY
    return CPU_ACTIVATIONS if _probe(observers) is not None else CPU_RESIDENT


def peak_memory_bytes(observers=()) -> int:
    """GPU: torch.cuda.max_memory_allocated. CPU: the probe's activation peak of the last
    iteration when --activation-memory-file is on (the resident set buries activations
    under weights, Python and allocator caches), else the process's peak resident set."""
    if device.on_cuda():
        return torch.cuda.max_memory_allocated()
    probe = _probe(observers)
    if probe is not None:
        return probe.peak_bytes
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def stage_peaks_gb(observers=()) -> list:
    """Peak memory of every pipeline stage (max over its ranks), in GB, as
    ``peak_memory_bytes`` measures it. Collective."""
    from megatron.core import parallel_state

    world = torch.distributed.get_world_size()
    mine = (parallel_state.get_pipeline_model_parallel_rank(), peak_memory_bytes(observers))
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, mine)
    stages = {}
    for stage, peak in gathered:
        stages[stage] = max(stages.get(stage, 0), peak)
    return [stages[s] / 1e9 for s in sorted(stages)]


def format_throughput(tflops) -> str:
    """Megatron-LM's field (--log-throughput), whose log parsers read it as is, also on
    CPU; below 1 TFLOP/s (CPU, tiny models) with three significant digits in plain
    decimals instead of 0.0 (a slow iteration of a tiny model is under 1e-4)."""
    return f" throughput per GPU (TFLOP/s/GPU): {tflops:.{_decimals(tflops)}f} |"


def _decimals(value) -> int:
    if value >= 1 or value <= 0:
        return 1
    return min(12, 2 - math.floor(math.log10(value)))


def format_iteration_line(iteration, train_iters, consumed_samples, elapsed_ms, lr,
                          global_batch_size, loss, grad_norm, tokens_per_s, tflops,
                          stage_peaks, memory_heading=GPU_MEMORY, num_zeros=None,
                          params_norm=None, moe_losses=None, skipped_samples=0):
    """Megatron-LM's iteration line, plus tokens/s and memory peaks. ``tflops``: model
    TFLOP/s per device, or None to leave the throughput field out (Megatron-LM prints it
    with --log-throughput only); ``num_zeros``, ``params_norm``: Megatron-LM's fields of
    --log-num-zeros-in-grad and --log-params-norm (None: not printed); ``moe_losses``:
    Megatron-LM's MoE auxiliary losses (name -> value), printed after the lm loss;
    ``skipped_samples``: the run's samples read and not trained on, or left out of a
    decreased batch (printed when there are any, as Megatron-LM)."""
    # as Megatron-LM: no norm (--clip-grad 0, an fp16 skip) prints no grad norm field
    grad = "" if grad_norm is None else f" grad norm: {grad_norm:.6g} |"
    if num_zeros is not None:
        grad += f" num zeros: {num_zeros} |"
    if params_norm is not None:
        grad += f" params norm: {params_norm:.6g} |"
    throughput = "" if tflops is None else format_throughput(tflops)
    peaks = " ".join(f"{p:.3f}" for p in stage_peaks)
    moe = "".join(f" {name}: {value:.6g} |" for name, value in (moe_losses or {}).items())
    return (
        f" iteration {iteration:8d}/{train_iters:8d} |"
        f" consumed samples: {consumed_samples:12d} |"
        + (f" skipped samples: {skipped_samples:12d} |" if skipped_samples else "")
        + f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
        f"{throughput}"
        f" learning rate: {lr:.6e} |"
        f" global batch size: {global_batch_size:5d} |"
        f" lm loss: {loss:.6g} |"
        f"{moe}"
        f"{grad}"
        f" tokens/s: {tokens_per_s:.1f} |"
        f" {memory_heading}: {peaks} |"
    )
