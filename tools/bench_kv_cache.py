"""Buffer vs chunked KV cache: one layer's split attention, time and memory side by side.

    python tools/bench_kv_cache.py                              # CPU, fp32, 4096 tokens
    python tools/bench_kv_cache.py --seq-length 16384 --splits 4 8 --dtype bf16   # GPU

Prints, for each split count, the unsplit causal call (s = 1) and both layouts
(`--seq1f1b-kv-cache buffer|chunked`): median forward+backward time of one microbatch's
splits and its ratio to the unsplit call, the activation peak (saved-for-backward bytes
plus cached K/V and gradient accumulators) and its ratio, and the largest difference
from the unsplit result. See megatron/benchmarks/kv_cache_layouts.py.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megatron.benchmarks.kv_cache_layouts import compare_layouts  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=4, help="K/V groups (GQA)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--repeats", type=int, default=5, help="timed rounds, alternating layouts")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp64"], default=None,
                   help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--attention-backend", default="auto",
                   help="kernel of the buffer layout and of the unsplit call")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}[
        args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")]
    command = "python tools/bench_kv_cache.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"# {command.strip()}")
    print(f"# {args.device} {dtype} seq={args.seq_length} b={args.micro_batch_size} "
          f"heads={args.heads} groups={args.groups} head_dim={args.head_dim} "
          f"torch {torch.__version__}; one layer, one microbatch, forward + backward")
    print("| s | layout | median ms | time vs unsplit | peak MiB | peak vs unsplit | "
          "max abs diff vs unsplit |")
    print("|---|---|---|---|---|---|---|")
    all_rows = []
    for splits in args.splits:
        rows = compare_layouts(seq=args.seq_length, batch=args.micro_batch_size,
                               heads=args.heads, groups=args.groups, head_dim=args.head_dim,
                               splits=splits, repeats=args.repeats, dtype=dtype,
                               device=args.device, backend=args.attention_backend)
        for row in rows:
            if row["layout"] == "unsplit" and splits != args.splits[0]:
                continue
            print(f"| {row['splits']} | {row['layout']} | {row['median_s'] * 1e3:.1f} | "
                  f"{row['time_vs_unsplit']:.2f} | {row['peak_bytes'] / 2**20:.1f} | "
                  f"{row['peak_vs_unsplit']:.2f} | {row['max_abs_diff_vs_unsplit']:.1e} |")
        all_rows += rows
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"command": command, "rows": all_rows}, handle, indent=1)


if __name__ == "__main__":
    main()
