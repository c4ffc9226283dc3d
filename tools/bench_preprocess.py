"""Preprocessing throughput (MB/s of text) against a plain HF `encode_batch` upper bound.

    python tools/bench_preprocess.py --output-md docs/results/preprocess_throughput.md

Builds the built-in corpus and trains its tokenizer in a temporary directory, then, in
rounds, times (1) `tokenizers.Tokenizer.encode_batch` on all texts already in memory, with
HF's own thread pool on every core — the bound: tokenization alone, no reading, parsing or
writing — and (2) the whole of tools/preprocess_data.py (read JSONL, parse, tokenize,
write .bin/.idx) with --workers 1 and 2, in this process. Ratios divide best throughputs
measured side by side in the same run. A benchmark, not a test.
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

with warnings.catch_warnings():  # megatron-core warns about optional GPU libraries
    warnings.simplefilter("ignore")
    import megatron.core  # noqa: F401

from megatron.dataprep.code_corpus import build_corpus  # noqa: E402
from megatron.dataprep.preprocess import main as preprocess_main  # noqa: E402
from megatron.dataprep.tokenizer import build_tokenizer  # noqa: E402
from megatron.dataprep.train_bpe import train_gpt2_bpe  # noqa: E402


def load_texts(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["content"] for line in f]


def cpu_seconds():
    """(this process, its reaped children): user + system CPU seconds."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def timed(fn, *args):
    """(wall seconds, CPU seconds of this process, CPU seconds of child processes)."""
    cpu0, start = cpu_seconds(), time.perf_counter()
    fn(*args)
    wall, cpu1 = time.perf_counter() - start, cpu_seconds()
    return wall, cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]


def run_bound(tokenizer, texts):
    tokenizer._hf.encode_batch(texts)  # the very tokenizer the tool uses


def preprocess_argv(corpus, prefix, vocab, merges, workers):
    return ["--input", corpus, "--json-keys", "content", "--output-prefix", prefix,
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
            "--merge-file", merges, "--append-eod", "--workers", str(workers),
            "--log-interval", "1000000"]


def run_tool(argv):
    devnull = open(os.devnull, "w")
    stderr, sys.stderr = sys.stderr, devnull  # keep the tool's summary out of the table
    try:
        rc = preprocess_main(argv)
    finally:
        sys.stderr = stderr
        devnull.close()
    if rc != 0:
        raise SystemExit(f"preprocess_data failed with exit code {rc}: {' '.join(argv)}")


def time_cli(argv):
    """The same run as a fresh process: adds interpreter start and imports (megatron-core)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), *argv],
                   check=True, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="corpus size (default 8 MB)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    p.add_argument("--output-md", help="also write the table to this Markdown file")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        build_corpus(corpus, max_bytes=args.max_bytes)
        texts = load_texts(corpus)
        vocab, merges = train_gpt2_bpe(texts, args.vocab_size, tmp)
        tokenizer = build_tokenizer("GPT2BPETokenizer", vocab, merges)
        text_mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
        tokens = sum(len(ids) for ids in tokenizer.tokenize_batch(texts))

        load_before = os.getloadavg()[0]
        runs = {"bound": [], 1: [], 2: []}
        for _ in range(args.rounds):  # interleaved, so background load hits all alike
            runs["bound"].append(timed(run_bound, tokenizer, texts))
            for workers in (1, 2):
                prefix = os.path.join(tmp, f"w{workers}")
                runs[workers].append(
                    timed(run_tool, preprocess_argv(corpus, prefix, vocab, merges, workers)))
        load_after = os.getloadavg()[0]
        cli = {w: time_cli(preprocess_argv(corpus, os.path.join(tmp, f"cli{w}"), vocab,
                                           merges, w)) for w in (1, 2)}
        same = all(_read(os.path.join(tmp, f"w{w}_content_document.bin")) ==
                   _read(os.path.join(tmp, "w1_content_document.bin")) for w in (1, 2))

    fastest = {k: min(v) for k, v in runs.items()}  # (wall, own CPU, children CPU)
    best = {k: text_mb / fastest[k][0] for k in runs}
    median = {k: text_mb / statistics.median(r[0] for r in v) for k, v in runs.items()}
    cores = len(os.sched_getaffinity(0))
    command = " ".join(["python tools/bench_preprocess.py",
                        *(sys.argv[1:] if argv is None else argv)])
    lines = [
        f"Corpus: built-in stdlib corpus, {len(texts)} files, {text_mb:.2f} MB of text, "
        f"{tokens} tokens (GPT-2-format BPE, vocab {args.vocab_size}); "
        f"{cores} CPU cores, Python {platform.python_version()}; best and median of "
        f"{args.rounds} interleaved rounds; 1-minute load average {load_before:.1f} before, "
        f"{load_after:.1f} after.",
        "",
        "| run | MB/s (best) | MB/s (median) | ratio to bound (best) | wall s | CPU s main "
        "| CPU s workers | MB per CPU s | CLI wall incl. start-up |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| HF `encode_batch`, {cores} threads (bound) | {best['bound']:.2f} | "
        f"{median['bound']:.2f} | 1.00 | {fastest['bound'][0]:.2f} | {fastest['bound'][1]:.2f} "
        f"| - | {text_mb / fastest['bound'][1]:.2f} | - |",
    ]
    for w in (1, 2):
        wall, main_cpu, kids_cpu = fastest[w]
        lines.append(f"| preprocess_data.py --workers {w} | {best[w]:.2f} | {median[w]:.2f} | "
                     f"{best[w] / best['bound']:.2f} | {wall:.2f} | {main_cpu:.2f} | "
                     f"{kids_cpu:.2f} | {text_mb / (main_cpu + kids_cpu):.2f} | {cli[w]:.1f} s |")
    lines += ["", f"Outputs of --workers 1 and 2 identical: {same}.", "", f"Command: `{command}`"]
    table = "\n".join(lines)
    print(table)
    if args.output_md:
        with open(args.output_md, "w", encoding="utf-8") as f:
            f.write("# Preprocessing throughput\n\n" + table + "\n")
    return 0


def _read(path):
    with open(path, "rb") as f:
        return f.read()


if __name__ == "__main__":
    sys.exit(main())
