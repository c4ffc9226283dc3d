"""Weight-gradient accumulation per split on CPU: what the extra ``add_``s into
``main_grad`` cost per iteration, and what accumulating inside the weight-gradient GEMM
would save.

    OMP_NUM_THREADS=1 python tools/bench_grad_accum.py --iters 2 --repeats 5

Each backward unit ends, for every parameter, in megatron-core DDP's post-hook
``param.main_grad.add_(param.grad)``: a unit-sized gradient is allocated by autograd,
then added into the fp32 buffer. 1F1B runs it once per microbatch, Seq1F1B ``s`` times.
Part 1 runs one stage of the benchmark's pipeline (``tools/bench_stage_gpu.py``'s
emulator, the model of docs/results/bench_cpu.md) and, per iteration, counts the
``add_``s whose destination is the DDP gradient buffer and times each with this
process's CPU time (a dispatch mode around the real iteration; nothing else is timed).
Part 2 prices megatron-core's ``gradient_accumulation_fusion`` done on CPU: for every
linear layer's weight of the stage and every backward unit's token count, the weight gradient as
``mm`` then ``add_`` (today) against ``main_grad.addmm_(dy^T, x)`` (the GEMM accumulates,
as ``fused_weight_gradient_mlp_cuda`` does on CUDA), CPU time, summed over an iteration.
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# the benchmark's model and shape (docs/results/bench_cpu.md)
STAGE_FLAGS = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
               "--vocab-size", "1025", "--pp", "2", "--microbatches", "4",
               "--seq-length", "2048", "--device", "cpu", "--dtype", "fp32"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[0, 1])
    p.add_argument("--splits", type=int, default=4)
    p.add_argument("--balance-methods", nargs="+", default=["average", "uniform_comp"],
                   choices=["average", "uniform_comp"])
    p.add_argument("--iters", type=int, default=2, help="counted iterations per schedule")
    p.add_argument("--repeats", type=int, default=5, help="GEMM timings per shape (median)")
    return p.parse_args(argv)


class MainGradAdds(TorchDispatchMode):
    """Counts and CPU-times the in-place adds into the DDP gradient buffers."""

    def __init__(self, buffer_ptrs):
        super().__init__()
        self.buffer_ptrs, self.count, self.seconds = buffer_ptrs, 0, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.add_.Tensor and \
                args[0].untyped_storage().data_ptr() in self.buffer_ptrs:
            start = time.process_time()
            out = func(*args, **(kwargs or {}))
            self.seconds += time.process_time() - start
            self.count += 1
            return out
        return func(*args, **(kwargs or {}))


def grad_buffer_ptrs(model):
    return {p.main_grad.untyped_storage().data_ptr()
            for p in model.parameters() if getattr(p, "main_grad", None) is not None}


def count_adds(emulator, m, splits, method, iters):
    """(adds per iteration, CPU s per iteration in them), ``m`` microbatches."""
    batches = emulator.make_batches(m, torch.Generator().manual_seed(0))
    emulator.run_iteration(m, splits, method, batches)  # warm
    mode = MainGradAdds(grad_buffer_ptrs(emulator.model))
    with mode:
        for _ in range(iters):
            emulator.run_iteration(m, splits, method, batches)
    return mode.count / iters, mode.seconds / iters


def _cpu_time(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def wgrad_costs(weights, tokens, repeats):
    """CPU s of all 2-D weights' gradients for one unit of ``tokens`` tokens:
    (mm alone, mm + add_ into main_grad, addmm_ into main_grad)."""
    gen = torch.Generator().manual_seed(0)
    mm = sep = fused = 0.0
    for shape in weights:
        out_f, in_f = shape
        dy, x = torch.randn(tokens, out_f, generator=gen), torch.randn(tokens, in_f, generator=gen)
        main = torch.zeros(shape)
        mm += _cpu_time(lambda: torch.mm(dy.t(), x), repeats)
        sep += _cpu_time(lambda: main.add_(torch.mm(dy.t(), x)), repeats)
        fused += _cpu_time(lambda: main.addmm_(dy.t(), x), repeats)
    return mm, sep, fused


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    import bench_stage_gpu

    from megatron.benchmarks.stage import StageEmulator

    stage_args = bench_stage_gpu.parse_args(STAGE_FLAGS)
    targs, config = bench_stage_gpu.setup(stage_args)
    shape = bench_stage_gpu.model_shape(stage_args, targs)
    m = stage_args.microbatches
    command = "python tools/bench_grad_accum.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    print(f"# {command.strip()}")
    print("# CPU clock (process_time); torch threads 1; stage of pp=2 (2 layers, hidden 256, "
          "8 heads, 2048 tokens, m=4, fp32)")
    rows, gemm_rows = [], []
    for rank in args.ranks:
        emulator = StageEmulator(targs, config, rank, 2, "cpu", model_shape=shape)
        # the linear layers' weights (the embedding's gradient is an index_add, no GEMM)
        weights = [tuple(p.shape) for name, p in emulator.model.named_parameters()
                   if p.dim() == 2 and "embedding" not in name]
        configs = [(1, "average")] + [(args.splits, b) for b in args.balance_methods]
        base = None
        for splits, method in configs:
            count, seconds = count_adds(emulator, m, splits, method, args.iters)
            base = base or seconds
            label = "1F1B" if splits == 1 else f"Seq1F1B s={splits} {method}"
            rows.append(f"| {rank} | {label} | {count:.0f} | {1000 * seconds:.2f} | "
                        f"{1000 * (seconds - base):+.2f} |")
            lengths = emulator.split_lengths(splits, method)
            costs = [wgrad_costs(weights, n, args.repeats) for n in lengths]
            mm, sep, fused = (m * sum(c[i] for c in costs) for i in range(3))
            gemm_rows.append(f"| {rank} | {label} | {len(weights)} | {1000 * mm:.1f} | "
                             f"{1000 * sep:.1f} | {1000 * fused:.1f} | "
                             f"{1000 * (sep - fused):+.1f} |")
        del emulator
    print()
    print("Adds into main_grad (megatron-core DDP's post-hook), per iteration:")
    print()
    print("| rank | schedule | adds | CPU ms in them | vs 1F1B |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("Linear weights' gradients per iteration (every backward unit's token count), CPU ms:")
    print()
    print("| rank | schedule | weights | mm alone | mm + add_ (today) | addmm_ into main_grad "
          "(accumulation fused) | saved by fusing |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(gemm_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
