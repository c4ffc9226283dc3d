"""Stage activation peaks of 1F1B and Seq1F1B (or SlimPipe), measured side by side in one run.

    python tools/bench_memory.py                      # CPU: pp=4 over gloo, s in {2, 4, 8}
    python tools/bench_memory.py --splits 2 4 8 --seq-length 2048 --json out.json
    python tools/bench_memory.py --slimpipe 4 8 --vp 1 2 --num-layers 8   # SlimPipe

Each configuration trains the same model with ``pretrain_gpt.py
--activation-memory-file``: the probe counts the bytes autograd holds for backward
(parameters excluded), sampled at every pipeline unit boundary of the last
iteration (see megatron/schedules/memory_probe.py). Stage 0's peak is compared with

* the paper's ratio ``(s + p - 1) / (s p)`` (activations only), and
* the same walk over stage 0's unit list with the KV cache counted: each in-flight
  split holds its share ``l_j / L`` of a microbatch's non-K/V activations ``M - K``,
  plus each microbatch's K/V and K/V-gradient accumulators as the cache layout
  (``--extra --seq1f1b-kv-cache chunked``) holds them (``predicted_peak``; M is
  measured under 1F1B as peak / p; K = 2 L b g d bytes per layer).

With ``--slimpipe N ...`` the rows are SlimPipe runs (``--slimpipe-slices N`` with each
``--vp V``) instead of Seq1F1B. Stage 0's peak is compared with the generator's slice
count ``(n v + 2 (p - 1)) / (n v)`` of one microbatch ``M`` (``(n + p - 1) / n`` for
``v = 1``, which is Seq1F1B's order) and with the same walk over stage 0's units, chunk
by chunk (``predicted_peak`` with ``v`` chunks: a unit ``(mb, slice j, chunk c)`` holds
``(M - K) / v * l_j / L``, each ``(mb, chunk)`` its share ``K / v`` of the KV cache as the
layout holds it).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.schedules.slimpipe import slimpipe_rank_units  # noqa: E402
from megatron.schedules.seq1f1b import in_flight_peak, seq1f1b_rank_units  # noqa: E402
from megatron.seqsplit.split_lengths import plan_splits  # noqa: E402


def run_probe(args, splits, out_path, schedule=()):
    model = [
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq_length),
        "--max-position-embeddings", str(args.seq_length), "--position-embedding-type", "rope",
        "--micro-batch-size", "1", "--global-batch-size", str(args.microbatches),
        "--train-iters", "2", "--log-interval", "1", "--eval-iters", "0",
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
        "--pipeline-model-parallel-size", str(args.pp),
        "--activation-memory-file", out_path,
    ] + (list(schedule) or ["--seq1f1b-splits", str(splits)]) + args.extra
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.pp),
           "--master-port", str(args.master_port), os.path.join(ROOT, "pretrain_gpt.py")] + model
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return json.load(open(out_path))["stages"]


def predicted_peak(units, lengths, num_chunks, per_microbatch, kv_bytes, layout="buffer"):
    """Walk one stage's units: in-flight slice shares of M - K plus the KV cache.

    A unit (microbatch, split j, model chunk c) holds its share ``l_j / L`` of the chunk's
    non-K/V activations ``(M - K) / v``. The KV cache term, per (microbatch, chunk) and
    `layout` of --seq1f1b-kv-cache, in units of the chunk's ``K / v``:
    both:    the K/V of the splits that ran forward (``l_j / L`` each: the buffer grows
             split by split, the chunked cache adds a chunk), until the split-0 backward;
    buffer:  from the first backward to split 0's, the K/V gradient accumulator (splits'
             prefix gradients wait there for their own split; it spans the last split's
             prefix, ``o_{s-1} / L``);
    chunked: after split j's backward the gradients left for chunks < j (``o_j / L``).
    Seq1F1B is the case of one chunk.
    """
    total = sum(lengths)
    offsets = [sum(lengths[:j]) for j in range(len(lengths))]
    share = (per_microbatch - kv_bytes) / num_chunks
    kv_chunk = kv_bytes / num_chunks
    alive_units, kv, peak = set(), {}, 0.0  # kv: (microbatch, chunk) -> bytes held
    for unit in units:
        key, j = (unit.microbatch, unit.chunk), unit.split
        if unit.is_forward:
            alive_units.add((key, j))
            kv[key] = kv.get(key, 0.0) + kv_chunk * lengths[j] / total
        else:
            alive_units.discard((key, j))
            if j == 0:
                kv.pop(key, None)
            elif layout == "chunked":
                # all chunks stay until split 0's backward; gradients for chunks < j wait
                kv[key] = kv_chunk * (1.0 + offsets[j] / total)
            else:
                kv[key] = kv_chunk * (1.0 + offsets[-1] / total)
        now = sum(share * lengths[j] / total for _, j in alive_units)
        if len(lengths) > 1:
            now += sum(kv.values())
        peak = max(peak, now)
    return peak


def kv_layout(args):
    """The --seq1f1b-kv-cache layout the runs use (given through --extra)."""
    return "chunked" if "chunked" in args.extra else "buffer"


def slimpipe_rows(args, tmp, per_microbatch, kv_bytes):
    p, m = args.pp, args.microbatches
    rows = []
    for v in args.vp:
        for n in args.slimpipe:
            flags = ["--pipeline-schedule", "slimpipe", "--slimpipe-slices", str(n)]
            if v > 1:
                flags += ["--virtual-pipeline-model-parallel-size", str(v)]
            stages = run_probe(args, 1, os.path.join(tmp, f"slim_v{v}_n{n}.json"), flags)
            units = slimpipe_rank_units(0, p, m, v, n)
            lengths = plan_splits(args.seq_length, n, "average")
            held = in_flight_peak(units)
            rows.append({"schedule": "slimpipe", "vp": v, "slices": n,
                         "stage_peaks_bytes": [st["activation_peak_bytes"] for st in stages],
                         "slices_held": held, "paper_microbatches": held / (n * v),
                         "predicted_with_kv_bytes": predicted_peak(
                             units, lengths, v, per_microbatch, kv_bytes, kv_layout(args))})
    return rows


def print_slimpipe_table(rows, base_peak, per_microbatch):
    print("| schedule | v | n | slices held (generator) | held / (nv) | stage-0 peak MiB "
          "| peak / M | peak / 1F1B | predicted with KV cache / M | measured / predicted "
          "| worst stage MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        peak0 = row["stage_peaks_bytes"][0]
        worst = max(row["stage_peaks_bytes"]) / 2**20
        if row["schedule"] == "1f1b":
            print(f"| 1F1B | 1 | 1 | - | - | {peak0 / 2**20:.1f} | {peak0 / per_microbatch:.3f} "
                  f"| 1.000 | - | - | {worst:.1f} |")
            continue
        pred = row["predicted_with_kv_bytes"]
        print(f"| SlimPipe | {row['vp']} | {row['slices']} | {row['slices_held']} | "
              f"{row['paper_microbatches']:.3f} | {peak0 / 2**20:.1f} | "
              f"{peak0 / per_microbatch:.3f} | {peak0 / base_peak:.3f} | "
              f"{pred / per_microbatch:.3f} | {peak0 / pred:.3f} | {worst:.1f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--slimpipe", type=int, nargs="+", default=None,
                        help="SlimPipe slice counts (multiples of --pp) to run instead of "
                             "Seq1F1B splits")
    parser.add_argument("--vp", type=int, nargs="+", default=[1, 2],
                        help="with --slimpipe: virtual stages per rank (--num-layers must be "
                             "a multiple of pp x each)")
    parser.add_argument("--master-port", type=int, default=29571)
    parser.add_argument("--json", type=str, default=None)
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="more pretrain_gpt.py flags for every run, e.g. "
                             "--extra --recompute-granularity selective")
    args = parser.parse_args()

    p, m = args.pp, args.microbatches
    layout = kv_layout(args)
    layers_per_stage = args.num_layers // p
    head_dim = args.hidden_size // args.heads
    kv_bytes = 2 * args.seq_length * 1 * args.heads * head_dim * 4 * layers_per_stage
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        baseline = run_probe(args, 1, os.path.join(tmp, "s1.json"))
        base_peak = baseline[0]["activation_peak_bytes"]
        per_microbatch = base_peak / min(p, m)
        rows.append({"schedule": "1f1b", "splits": 1,
                     "stage_peaks_bytes": [st["activation_peak_bytes"] for st in baseline]})
        if args.slimpipe:
            rows += slimpipe_rows(args, tmp, per_microbatch, kv_bytes)
        for s in ([] if args.slimpipe else args.splits):
            stages = run_probe(args, s, os.path.join(tmp, f"s{s}.json"))
            lengths = plan_splits(args.seq_length, s, "average")
            predicted = predicted_peak(seq1f1b_rank_units(0, p, m, s), lengths, 1,
                                       per_microbatch, kv_bytes, layout)
            rows.append({"schedule": "seq1f1b", "splits": s,
                         "stage_peaks_bytes": [st["activation_peak_bytes"] for st in stages],
                         "paper_ratio": (s + p - 1) / (s * p),
                         "predicted_ratio_with_kv": predicted / base_peak})
    command = "python tools/bench_memory.py " + " ".join(sys.argv[1:])
    print(f"# {command.strip()}")
    print(f"# pp={p} microbatches={m} layers={args.num_layers} hidden={args.hidden_size} "
          f"heads={args.heads} seq={args.seq_length} fp32 CPU {' '.join(args.extra)}; "
          "stage-0 activation peak")
    print(f"# M (one microbatch on stage 0, from 1F1B) = {per_microbatch / 2**20:.1f} MiB, "
          f"K (its K/V) = {kv_bytes / 2**20:.1f} MiB")
    if args.slimpipe:
        print_slimpipe_table(rows, base_peak, per_microbatch)
    else:
        print_seq1f1b_table(rows, base_peak)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump({"command": command, "runs": rows}, handle, indent=1)


def print_seq1f1b_table(rows, base_peak):
    print("| schedule | s | stage-0 peak MiB | ratio to 1F1B | (s+p-1)/(sp) | "
          "predicted with KV cache | measured / predicted | worst stage MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        peak0 = row["stage_peaks_bytes"][0]
        ratio = peak0 / base_peak
        worst = max(row["stage_peaks_bytes"]) / 2**20
        if row["splits"] == 1:
            print(f"| 1F1B | 1 | {peak0 / 2**20:.1f} | 1.000 | 1.000 | 1.000 | 1.000 | "
                  f"{worst:.1f} |")
        else:
            pred = row["predicted_ratio_with_kv"]
            print(f"| Seq1F1B | {row['splits']} | {peak0 / 2**20:.1f} | {ratio:.3f} | "
                  f"{row['paper_ratio']:.3f} | {pred:.3f} | {ratio / pred:.3f} | {worst:.1f} |")


if __name__ == "__main__":
    main()
