"""Host overhead per unit: our executor's per unit against megatron-core's per microbatch.

    OMP_NUM_THREADS=1 python tools/bench_host_overhead.py --splits 4 --microbatches 8 \\
        --rounds 7 --iters 5

One process, one stage holding the whole model (embedding, the layers, the LM head and
loss: pp = 1), a model whose compute is near zero (by default hidden 8, one head, FFN 8,
one layer, 64 tokens, vocabulary 64), so what an iteration costs is the host's work per
unit: the model's Python (megatron-core modules), the schedule's loop and, under
Seq1F1B, the split bookkeeping (split context, slicing, the KV cache, the split
attention's two kernels and merge). Timed with this process's CPU time
(``time.process_time``), so other load on the host does not enter. Per round, each
schedule runs ``--iters`` iterations in turn (order rotating), after one warm-up each;
reported: the median over rounds of an iteration's CPU time divided by its units.

* megatron-core: its own ``forward_backward_no_pipelining`` (what megatron-core runs for
  one stage) with ``pretrain_gpt.forward_step``; per microbatch;
* executor s=1: our executor's one-split program (1F1B's unit order); per microbatch;
* executor s=S: our executor's Seq1F1B program; per split unit (m x S units).

Same model object, same DDP gradient buffers, same batches for all.
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--hidden-size", type=int, default=8)
    p.add_argument("--num-attention-heads", type=int, default=1)
    p.add_argument("--ffn-hidden-size", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=64)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--splits", type=int, nargs="+", default=[4])
    p.add_argument("--balance-method", choices=["average", "uniform_comp"], default="average")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=5, help="timed iterations per schedule and round")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if any(s < 2 for s in args.splits):
        p.error("--splits: split counts of at least 2 (s=1 is always measured)")
    return args


def build(args):
    """The stage (pp = 1) through tools/bench_stage_gpu.py's setup and the StageEmulator."""
    import bench_stage_gpu

    from megatron.benchmarks.stage import StageEmulator

    stage_args = bench_stage_gpu.parse_args([
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.num_attention_heads),
        "--ffn-hidden-size", str(args.ffn_hidden_size), "--vocab-size", str(args.vocab_size),
        "--seq-length", str(args.seq_length), "--pp", "1", "--microbatches",
        str(args.microbatches), "--device", "cpu", "--dtype", "fp32", "--seed", str(args.seed)])
    targs, config = bench_stage_gpu.setup(stage_args)
    shape = bench_stage_gpu.model_shape(stage_args, targs)
    return StageEmulator(targs, config, 0, 1, "cpu", model_shape=shape)


def schedules(emulator, args):
    """{label: (units per iteration, one iteration)}."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    m, L = args.microbatches, args.seq_length
    batches = emulator.make_batches(m, torch.Generator().manual_seed(args.seed))

    def mcore():
        emulator.model.zero_grad_buffer()
        forward_backward_no_pipelining(
            forward_step_func=emulator.forward_step, data_iterator=iter(batches),
            model=[emulator.model], num_microbatches=m, seq_length=L,
            micro_batch_size=1, forward_only=False)

    runs = {"megatron-core no pipelining (per microbatch)": (m, mcore),
            "executor s=1 (per microbatch)":
                (m, lambda: emulator.run_iteration(m, 1, args.balance_method, batches))}
    for s in args.splits:
        runs[f"executor s={s} {args.balance_method} (per split unit)"] = (
            m * s, lambda s=s: emulator.run_iteration(m, s, args.balance_method, batches))
    return runs


def measure(runs, rounds, iters):
    """{label: [CPU seconds per unit, one per round]}; the order rotates per round."""
    labels = list(runs)
    for label in labels:  # warm-up
        runs[label][1]()
    per_unit = {label: [] for label in labels}
    for r in range(rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            units, step = runs[label]
            start = time.process_time()
            for _ in range(iters):
                step()
            per_unit[label].append((time.process_time() - start) / (iters * units))
    return per_unit


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    emulator = build(args)
    per_unit = measure(schedules(emulator, args), args.rounds, args.iters)
    base = statistics.median(per_unit["megatron-core no pipelining (per microbatch)"])
    command = "python tools/bench_host_overhead.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    print(f"# {command.strip()}")
    print(f"# CPU clock (process_time); pp=1 stage, {args.num_layers} layer(s), hidden "
          f"{args.hidden_size}, {args.seq_length} tokens, m={args.microbatches}; "
          f"{args.rounds} rounds x {args.iters} iterations; torch threads 1")
    print()
    print("| schedule | forward + backward, us per unit (median) | rounds min-max | "
          "vs megatron-core per microbatch |")
    print("|---|---|---|---|")
    for label, values in per_unit.items():
        med = statistics.median(values)
        print(f"| {label} | {1e6 * med:.0f} | {1e6 * min(values):.0f}-{1e6 * max(values):.0f} | "
              f"{med / base:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
