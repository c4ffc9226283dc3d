"""What the mask costs in CPU split attention: one layer's attention, unsplit vs split.

    OMP_NUM_THREADS=1 python tools/bench_attention_masks.py --seq-length 2048 --splits 4

Times, for one microbatch of one layer, forward and forward + backward of:
  unsplit   one causal call over the whole sequence (`is_causal=True`), what 1F1B runs;
  ours      the splits through the project's SDPA backend: on CPU without dropout the
            own block with `is_causal` and the prefix without a mask, two fused kernels
            merged by log-sum-exp (`megatron/seqsplit/cpu_split_attention.py`);
  vector mask  the previous kernel (and ours with dropout): one call with the
            bottom-right causal mask, queries reversed so the mask is a vector;
  dense     the splits with torch's materialised `causal_lower_right` mask;
  no mask   the splits with no mask at all: the same score blocks as `ours`, no
            masking work. Wrong attention, timed only as the floor a mask-free split
            kernel could reach.
Splits are `average` (equal lengths); split j attends over the keys of splits 0..j.
Median of `--repeats` alternating rounds, printed as ratios to `unsplit`; `--clock cpu`
times the process's CPU time (other load on the host then barely enters).

`--query-rows N ...` adds what one query row costs in torch's fused CPU kernel (unmasked,
against `--seq-length` keys) for each query length N: the kernel picks its query block
from the query length (smaller blocks below 768 rows in torch 2.13), so a split's
queries may cost more per row than the whole sequence's.
"""

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def variants(backend):
    from megatron.seqsplit.attention_backends import _bottom_right_causal_cpu

    def ours(q, k, v):
        return backend(q, k, v, softmax_scale=q.shape[-1] ** -0.5)

    def vector_mask(q, k, v):
        if q.shape[2] == k.shape[2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return _bottom_right_causal_cpu(q, k, v, q.shape[-1] ** -0.5, 0.0)

    def dense(q, k, v):
        lq, lk = q.shape[2], k.shape[2]
        mask = causal_lower_right(lq, lk) if lq != lk else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=lq == lk)

    def no_mask(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] == k.shape[2])

    return {"ours": ours, "vector mask": vector_mask, "dense": dense, "no mask": no_mask}


def run(call, pieces, backward):
    for q, k, v, grad in pieces:
        out = call(q, k, v)
        if backward:
            out.backward(grad)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--splits", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the process's CPU time (robust to other load on the host)")
    parser.add_argument("--query-rows", type=int, nargs="*", default=[],
                        help="also time one query row of unmasked attention against "
                             "--seq-length keys for each of these query lengths")
    args = parser.parse_args(argv)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    from megatron.seqsplit.attention_backends import get_backend

    L, s, h, d = args.seq_length, args.splits, args.heads, args.head_dim
    if L % s:
        parser.error(f"--seq-length {L} must divide into --splits {s}")
    generator = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_()

    whole = [(leaf(1, h, L, d), leaf(1, h, L, d), leaf(1, h, L, d), torch.randn(1, h, L, d))]
    l = L // s
    split = [(leaf(1, h, l, d), leaf(1, h, l * (j + 1), d), leaf(1, h, l * (j + 1), d),
              torch.randn(1, h, l, d)) for j in range(s)]
    calls = {"unsplit": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                         whole)}
    calls.update({name: (fn, split) for name, fn in variants(get_backend("sdpa")).items()})
    times = {(name, b): [] for name in calls for b in (False, True)}
    for round_ in range(args.repeats + 1):  # round 0 warms up
        for name, (fn, pieces) in calls.items():
            for backward in (False, True):
                start = clock()
                run(fn, pieces, backward)
                if round_:
                    times[name, backward].append(clock() - start)
    print(f"# python tools/bench_attention_masks.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"# one layer, {h} heads x {d}, {L} tokens, {s} splits of {l}; fp32 CPU, "
          f"{torch.get_num_threads()} thread(s); median of {args.repeats} rounds, "
          f"{args.clock} clock")
    print("| attention | forward ms | vs unsplit | forward + backward ms | vs unsplit |")
    print("|---|---|---|---|---|")
    base = {b: statistics.median(times["unsplit", b]) for b in (False, True)}
    for name in calls:
        f, fb = (statistics.median(times[name, b]) for b in (False, True))
        print(f"| {name} | {1000 * f:.1f} | {f / base[False]:.3f} | {1000 * fb:.1f} | "
              f"{fb / base[True]:.3f} |")
    if args.query_rows:
        print_query_rows(args, clock, leaf)
    return 0


def print_query_rows(args, clock, leaf):
    """Per query row, forward and forward + backward, unmasked, against L keys."""
    L, h, d = args.seq_length, args.heads, args.head_dim
    k, v = leaf(1, h, L, d), leaf(1, h, L, d)
    pieces = {n: [(leaf(1, h, n, d), k, v, torch.randn(1, h, n, d))] for n in args.query_rows}
    times = {(n, b): [] for n in pieces for b in (False, True)}
    for round_ in range(args.repeats + 1):  # round 0 warms up
        for n, piece in pieces.items():
            for backward in (False, True):
                start = clock()
                run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), piece, backward)
                if round_:
                    times[n, backward].append(clock() - start)
    print()
    print(f"Unmasked fused attention against {L} keys, per query row (median of "
          f"{args.repeats} rounds):")
    print("| query rows | forward us/row | vs longest | forward + backward us/row | vs longest |")
    print("|---|---|---|---|---|")
    per_row = {key: statistics.median(t) / key[0] for key, t in times.items()}
    longest = max(pieces)
    for n in pieces:
        f, fb = per_row[n, False], per_row[n, True]
        print(f"| {n} | {1e6 * f:.1f} | {f / per_row[longest, False]:.3f} | {1e6 * fb:.1f} | "
              f"{fb / per_row[longest, True]:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
