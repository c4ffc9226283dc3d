"""One pipeline stage of 1F1B / Seq1F1B on one GPU: true peak memory, unit times, prediction.

    # a 7B-shaped stage (TP-8 shard of each layer), one stage of pp=4, 32k tokens, bf16
    python tools/bench_stage_gpu.py --model 7B --tp-shard 8 --pp 4 --microbatches 8 \\
        --seq-length 32768 --splits 1 2 4 8 --json docs/results/bench_stage_gpu_7B_32k.json
    # tiny fp32 smoke run on CPU (what the tests run)
    python tools/bench_stage_gpu.py --tiny

For every split count (1 = 1F1B) and balance method, and for each stage
role (rank 0 with the embedding, a middle rank, rank p-1 with the LM head and loss),
the training executor runs the stage's program on one device with the project's model
(megatron-core layers, split-aware local spec, KV-prefix cache, Float16Module + DDP
gradient buffers) as that rank of a ``--pp``-stage pipeline; its transport stands in for
the other stages (received activations and gradients made up with the right shape,
sends dropped: see ``megatron/benchmarks/stage.py``). 1F1B is the executor's one-split
program, so every schedule here runs the same runtime.
Reported: activation peak (CUDA ``max_memory_allocated`` minus weights and gradient
buffers) and its ratio to 1F1B, per-unit forward/backward times, the split overhead
(s units of L/s against one unit of L) and the whole pipeline's span, bubble and
tokens/s predicted by the planner's simulator from the measured unit times (pipeline
only: no optimizer step, no data-parallel reduction; messages free unless
``--p2p-gbps`` is given).

``--tp-shard T`` builds the layers one tensor-parallel rank holds under TP=T (heads,
query groups, FFN and vocabulary divided by T) without the TP collectives, and
without sequence parallelism: the memory of the norms' and dropouts' inputs is that of
TP without SP.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megatron.seqsplit.attention_backends import BACKEND_NAMES  # noqa: E402

# what runs every schedule, 1F1B included (tools/bench.py times megatron-core's 1F1B)
RUNTIME = "executor (1F1B = its one-split program; other stages synthetic)"
TINY = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=256,
            vocab_size=512, pp=2, microbatches=4)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="planner preset (1.3B, 2.7B, 7B, 13B, 30B, "
                   "llama2-7B, ...); explicit flags override its fields")
    g.add_argument("--tiny", action="store_true", help="tiny fp32 model for a CPU smoke run")
    g.add_argument("--num-layers", type=int, default=None, help="whole model (divided by --pp)")
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--swiglu", action="store_true", default=None)
    g.add_argument("--tp-shard", type=int, default=1,
                   help="build one TP rank's share of each layer (no collectives)")
    g.add_argument("--attention-backend", choices=["auto", *BACKEND_NAMES], default="auto")
    g.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="default bf16 on CUDA, fp32 on CPU")
    g = p.add_argument_group("schedule")
    g.add_argument("--pp", type=int, default=None, help="pipeline size the stage belongs to")
    g.add_argument("--ranks", type=int, nargs="+", default=None,
                   help="ranks to emulate (default: 0, 1 and p-1: one per role)")
    g.add_argument("--microbatches", type=int, default=None)
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4])
    g.add_argument("--balance-methods", nargs="+", default=["average", "uniform_comp"],
                   choices=["average", "uniform_comp"])
    g.add_argument("--warmup-iters", type=int, default=1)
    g.add_argument("--iters", type=int, default=2, help="measured iterations per run")
    g.add_argument("--p2p-gbps", type=float, default=None,
                   help="price each p2p message at this bandwidth (GB/s) in the prediction")
    g.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="unit times from the wall clock, or from this process's CPU time "
                   "(CPU device on a shared machine: counts work, not waiting for a core)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--device", default=None, help="default cuda when available, else cpu")
    g.add_argument("--json", default=None)
    g.add_argument("--profile-ops", type=int, default=0, metavar="N",
                   help="profile one more iteration per schedule (torch.profiler; with "
                        "--clock cpu each operator's CPU time) and list the N operators "
                        "whose self time differs most from 1F1B's")
    args = p.parse_args(argv)
    if args.tiny:
        for key, value in TINY.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    if args.model:
        from megatron.planner.presets import get_preset

        spec = get_preset(args.model)
        for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                    "kv_channels", "ffn_hidden_size", "vocab_size", "swiglu"):
            if getattr(args, key) is None:
                setattr(args, key, getattr(spec, key))
        args.normalization = spec.normalization
        args.add_bias_linear = spec.add_bias_linear
    else:
        args.normalization, args.add_bias_linear = "LayerNorm", True
    defaults = dict(pp=4, microbatches=8, seq_length=4096, vocab_size=50257)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for flag in ("num_layers", "hidden_size", "num_attention_heads"):
        if getattr(args, flag) is None:
            p.error(f"--{flag.replace('_', '-')} is required (or --model / --tiny)")
    args.swiglu = bool(args.swiglu)
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = (int(args.hidden_size * 8 / 3 / 64) * 64 if args.swiglu
                                else 4 * args.hidden_size)
    if args.num_layers % args.pp:
        p.error(f"--num-layers {args.num_layers} is not divisible by --pp {args.pp}")
    t = args.tp_shard
    for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        if getattr(args, name) % t:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} is not divisible by "
                    f"--tp-shard {t}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    if args.clock == "cpu" and args.device.startswith("cuda"):
        p.error("--clock cpu is for CPU runs (GPU units are timed on the wall clock)")
    if args.dtype == "bf16" and not args.device.startswith("cuda"):
        p.error("--dtype bf16 needs a CUDA device (CPU runs fp32)")
    if args.ranks is None:
        from megatron.benchmarks.stage import roles_to_emulate

        args.ranks = roles_to_emulate(args.pp)
    if any(not 0 <= r < args.pp for r in args.ranks):
        p.error(f"--ranks must lie in [0, {args.pp - 1}]")
    return args


def stage_argv(args):
    """pretrain_gpt.py flags of one stage's model (one process, pp = 1)."""
    t = args.tp_shard
    argv = [
        "--num-layers", str(args.num_layers // args.pp), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.num_attention_heads // t),
        "--kv-channels", str(args.kv_channels),
        "--ffn-hidden-size", str(args.ffn_hidden_size // t),
        "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
        "--position-embedding-type", "rope", "--normalization", args.normalization,
        "--untie-embeddings-and-output-weights",
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--micro-batch-size", str(args.micro_batch_size),
        "--global-batch-size", str(args.micro_batch_size), "--train-iters", "1",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(args.vocab_size),
        "--attention-backend", args.attention_backend, "--seed", str(args.seed),
    ]
    if args.num_query_groups != args.num_attention_heads:
        argv += ["--num-query-groups", str(args.num_query_groups // t)]
    if args.swiglu:
        argv.append("--swiglu")
    if not args.add_bias_linear:
        argv.append("--disable-bias-linear")
    if args.dtype == "bf16":
        argv.append("--bf16")
    return argv


def setup(args):
    """Parse the stage's flags with the trainer's parser, create the (single) process group."""
    from megatron.trainer import initialize
    from megatron.trainer.arguments import parse_args as parse_trainer_args
    from megatron.model_shape import pad_vocab_size
    from megatron.trainer.model import transformer_config_from_args

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    targs = parse_trainer_args(stage_argv(args), world_size=1,
                               cuda_available=args.device.startswith("cuda"))
    initialize.initialize_distributed(targs)
    initialize.set_seeds(args.seed)
    # Megatron pads the vocabulary to a multiple of 128 x TP; one TP rank holds 1/T of it
    targs.padded_vocab_size = pad_vocab_size(args.vocab_size, args.tp_shard) // args.tp_shard
    config = transformer_config_from_args(targs)
    return targs, config


def model_shape(args, targs):
    """The stage's TP shard (``targs``) with the whole model's depth and the unpadded
    vocabulary's shard, for the split solver."""
    from dataclasses import replace

    from megatron.model_shape import ModelShape

    return replace(ModelShape.from_args(targs), num_layers=args.num_layers,
                   vocab_size=args.vocab_size // args.tp_shard)


def _gib(x):
    return "OOM" if x is None else f"{x / 2**30:.3f}"


def _ms(x):
    return "n/a" if x is None else f"{1000 * x:.2f}"


def report(args, results, predictions):
    """Markdown tables."""
    lines = []
    base = {r["rank"]: r for r in results if r["splits"] == 1 and not r["oom"]}
    lines.append("| rank (role) | schedule | act. peak GiB | ratio to 1F1B | max allocated GiB | "
                 "F per mb ms | B per mb ms | F+B vs 1F1B (split overhead) | stage busy ms |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        label = "1F1B" if r["splits"] == 1 else f"Seq1F1B s={r['splits']} {r['balance_method']}"
        b = base.get(r["rank"])
        if r["oom"]:
            lines.append(f"| {r['rank']} ({r['role']}) | {label} | OOM | | | | | | |")
            continue
        ratio = (r["activation_peak_bytes"] / b["activation_peak_bytes"]) if b else None
        fb = r["forward_per_microbatch_s"] + r["backward_per_microbatch_s"]
        overhead = fb / (b["forward_per_microbatch_s"] + b["backward_per_microbatch_s"]) if b else None
        lines.append(
            f"| {r['rank']} ({r['role']}) | {label} | {_gib(r['activation_peak_bytes'])} | "
            f"{'n/a' if ratio is None else f'{ratio:.3f}'} | "
            f"{_gib(r['max_memory_allocated_bytes']) if r['max_memory_allocated_bytes'] else 'n/a'} | "
            f"{_ms(r['forward_per_microbatch_s'])} | {_ms(r['backward_per_microbatch_s'])} | "
            f"{'n/a' if overhead is None else f'{overhead:.3f}'} | {_ms(r['busy_s'])} |")
    lines += ["", "Per-split unit times (ms, forward / backward, split 0 first):", ""]
    for r in results:
        if r["oom"] or r["splits"] == 1:
            continue
        pairs = ", ".join(f"{1000 * f:.2f}/{1000 * bw:.2f}"
                          for f, bw in zip(r["forward_s"], r["backward_s"]))
        lines.append(f"* rank {r['rank']}, s={r['splits']} {r['balance_method']} "
                     f"(lengths {r['split_lengths']}): {pairs}")
    lines += ["", f"Whole pipeline predicted from the measured unit times (planner simulator, "
              f"pp={args.pp}, m={args.microbatches}, pipeline only):", "",
              "| schedule | span ms | bubble | tokens/s | ratio to 1F1B |", "|---|---|---|---|---|"]
    base_pred = next((p for p in predictions if p["splits"] == 1 and "tokens_per_s" in p), None)
    for p in predictions:
        label = "1F1B" if p["splits"] == 1 else f"Seq1F1B s={p['splits']} {p['balance_method']}"
        if p.get("without_split_overhead"):
            label += ", units scaled to 1F1B's compute (no split overhead)"
        if "tokens_per_s" not in p:
            lines.append(f"| {label} | OOM | | | |")
            continue
        ratio = p["tokens_per_s"] / base_pred["tokens_per_s"] if base_pred else None
        oom = " (a stage OOM)" if p.get("oom") else ""
        lines.append(f"| {label}{oom} | {1000 * p['pipeline_span_s']:.1f} | "
                     f"{100 * p['bubble_fraction']:.1f}% | {p['tokens_per_s']:.1f} | "
                     f"{'n/a' if ratio is None else f'{ratio:.3f}'} |")
    return "\n".join(lines)


def op_report(op_times, top, clock_name="wall"):
    """Per rank and split schedule: the operators whose self time moved most against 1F1B
    (one profiled iteration each)."""
    from megatron.benchmarks.stage import op_differences

    lines = []
    for (rank, splits, method), times in op_times.items():
        base = op_times.get((rank, 1, None))
        if splits == 1 or base is None:
            continue
        total_base, total = sum(base.values()), sum(times.values())
        lines += [f"Operators, rank {rank}, Seq1F1B s={splits} {method} vs 1F1B (self ms per "
                  f"iteration, {'CPU time' if clock_name == 'cpu' else 'torch.profiler'}, "
                  f"one profiled iteration; all operators {1000 * total_base:.1f} -> "
                  f"{1000 * total:.1f}):", "",
                  "| operator | 1F1B | Seq1F1B | change |", "|---|---|---|---|"]
        for op, before, after in op_differences(base, times, top):
            lines.append(f"| `{op}` | {1000 * before:.1f} | {1000 * after:.1f} | "
                         f"{1000 * (after - before):+.1f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    from megatron.benchmarks.stage import (
        StageEmulator,
        measure,
        predict_pipeline,
        profile_ops,
        without_split_overhead,
    )

    targs, config = setup(args)
    shape = model_shape(args, targs)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    configs = []
    for s in args.splits:
        if s == 1:
            configs.append((1, None))
        else:
            configs += [(s, m) for m in args.balance_methods]
    started = time.time()
    results = []
    runs = {}  # (splits, method) -> {rank: StageRun}
    op_times = {}  # (rank, splits, method) -> {operator: self seconds}
    for rank in args.ranks:
        emulator = StageEmulator(targs, config, rank, args.pp, args.device, model_shape=shape)
        for splits, method in configs:
            run = measure(emulator, args.microbatches, splits, method or "average",
                          warmup_iters=args.warmup_iters, iters=args.iters, seed=args.seed,
                          clock=clock)
            runs.setdefault((splits, method), {})[rank] = run
            results.append(run.to_dict())
            if args.profile_ops and not run.oom:
                op_times[rank, splits, method] = profile_ops(
                    emulator, args.microbatches, splits, method or "average",
                    seed=args.seed, clock=clock)
            status = "OOM" if run.oom else (f"act. peak {_gib(run.activation_peak_bytes)} GiB, "
                                            f"busy {_ms(run.busy_s)} ms")
            print(f"[stage] rank {rank} s={splits} {method or ''}: {status}", flush=True)
        del emulator
        import gc

        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    tokens = args.microbatches * args.micro_batch_size * args.seq_length
    bytes_per = 2 if args.dtype == "bf16" else 4
    predictions = []
    for (splits, method), by_rank in runs.items():
        lengths = next(iter(by_rank.values())).split_lengths
        p2p = None
        if args.p2p_gbps:
            p2p = (lambda j, lengths=lengths: lengths[j] * args.micro_batch_size
                   * args.hidden_size * bytes_per / (args.p2p_gbps * 1e9))
        pred = predict_pipeline(by_rank, args.pp, args.microbatches, splits, tokens, p2p)
        pred.update({"splits": splits, "balance_method": method})
        predictions.append(pred)
        whole = runs.get((1, None), {})
        if splits > 1 and not pred.get("oom") and all(
                r in whole and not whole[r].oom for r in by_rank):
            free = {r: without_split_overhead(run, whole[r]) for r, run in by_rank.items()}
            bound = predict_pipeline(free, args.pp, args.microbatches, splits, tokens, p2p)
            bound.update({"splits": splits, "balance_method": method,
                          "without_split_overhead": True})
            predictions.append(bound)
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    command = "python tools/bench_stage_gpu.py " + " ".join(argv if argv is not None
                                                            else sys.argv[1:])
    print(f"# {command.strip()}")
    print(f"# device {device}, {args.dtype}; stage of pp={args.pp}: {args.num_layers // args.pp} "
          f"layers (hidden {args.hidden_size}, {args.num_attention_heads // args.tp_shard} heads"
          f" x {args.kv_channels}, FFN {args.ffn_hidden_size // args.tp_shard}"
          f"{', TP shard 1/' + str(args.tp_shard) if args.tp_shard > 1 else ''}), "
          f"m={args.microbatches} x {args.micro_batch_size} x {args.seq_length} tokens; "
          f"{args.clock} clock; runtime {RUNTIME}; "
          f"{time.time() - started:.0f} s")
    print()
    print(report(args, results, predictions))
    if op_times:
        print()
        print(op_report(op_times, args.profile_ops, args.clock))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump({"command": command.strip(), "device": device, "dtype": args.dtype,
                       "runtime": RUNTIME,
                       "args": {k: v for k, v in vars(args).items()},
                       "stage_runs": results, "predictions": predictions}, handle, indent=1)
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
