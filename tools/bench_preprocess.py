"""Preprocessing throughput (MB/s of text) against a plain HF `encode_batch` upper bound.

    python tools/bench_preprocess.py --output-md docs/results/preprocess_throughput.md

Builds the built-in corpus and trains its tokenizer in a temporary directory, then, in
rounds, times (1) `tokenizers.Tokenizer.encode_batch` on all texts already in memory, with
HF's own thread pool on every core — the bound: tokenization alone, no reading, parsing or
writing — plus `encode_batch_fast` (no offsets; what the tool's workers call), and (2) the
whole of tools/preprocess_data.py (read JSONL, parse, tokenize, write .bin/.idx) with
--workers 1 and 2, in this process. Ratios divide best throughputs measured side by side
in the same run; each round waits for idle cores first (the machine may be shared). A
benchmark, not a test.
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


def cpu_times():
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle) / tick, sum(values) / tick


def own_cpu():
    """(this process, its reaped children): user + system CPU seconds."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def wait_until_quiet(max_wait, threshold=0.05):
    """Wait (at most max_wait s) until other processes use under 5% of the cores."""
    deadline = time.monotonic() + max_wait
    while True:
        busy0, total0 = cpu_times()
        time.sleep(1.0)
        busy1, total1 = cpu_times()
        if (busy1 - busy0) / max(total1 - total0, 1e-9) < threshold:
            return
        if time.monotonic() >= deadline:
            return


class Timing:
    """Wall and CPU seconds of one timed call, and how much CPU others took meanwhile."""

    def __init__(self, fn, *args):
        machine0, own0, start = cpu_times(), own_cpu(), time.perf_counter()
        fn(*args)
        self.wall = time.perf_counter() - start
        machine1, own1 = cpu_times(), own_cpu()
        self.main_cpu = own1[0] - own0[0]
        self.workers_cpu = own1[1] - own0[1]
        others = (machine1[0] - machine0[0]) - self.main_cpu - self.workers_cpu
        # Others' share of the machine's capacity while we ran (clock ticks: +-1%).
        self.others = max(others, 0.0) / max(machine1[1] - machine0[1], 1e-9)

    @property
    def clean(self) -> bool:
        return self.others < 0.05


def run_bound(tokenizer, texts):
    tokenizer._hf.encode_batch(texts)  # the very tokenizer the tool uses


def run_fast_bound(tokenizer, texts):
    tokenizer._hf.encode_batch_fast(texts)  # what the tool's workers call (no offsets)


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


names_short = {"bound": "encode_batch", "fast": "encode_batch_fast", 1: "--workers 1",
               2: "--workers 2"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="corpus size (default 8 MB)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3,
                   help="undisturbed measurements wanted per run (default 3)")
    p.add_argument("--max-minutes", type=float, default=20,
                   help="stop measuring after this long even if short of --rounds (default 20)")
    p.add_argument("--quiet-wait", type=float, default=120,
                   help="before each round, wait up to this many seconds for idle cores "
                        "(default 120; 0 = do not wait)")
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

        runs = {"bound": [], "fast": [], 1: [], 2: []}
        deadline = time.monotonic() + 60 * args.max_minutes
        rounds = 0
        # Interleaved rounds until each run has `rounds` measurements undisturbed by other
        # processes (the machine may be shared), or time is up.
        while min(sum(t.clean for t in v) for v in runs.values()) < args.rounds:
            if time.monotonic() > deadline:
                break
            if args.quiet_wait > 0:
                wait_until_quiet(args.quiet_wait)
            rounds += 1
            runs["bound"].append(Timing(run_bound, tokenizer, texts))
            runs["fast"].append(Timing(run_fast_bound, tokenizer, texts))
            for workers in (1, 2):
                prefix = os.path.join(tmp, f"w{workers}")
                runs[workers].append(
                    Timing(run_tool, preprocess_argv(corpus, prefix, vocab, merges, workers)))
        cli = {w: time_cli(preprocess_argv(corpus, os.path.join(tmp, f"cli{w}"), vocab,
                                           merges, w)) for w in (1, 2)}
        same = all(_read(os.path.join(tmp, f"w{w}_content_document.bin")) ==
                   _read(os.path.join(tmp, "w1_content_document.bin")) for w in (1, 2))

    used = {k: [t for t in v if t.clean] or v for k, v in runs.items()}
    fastest = {k: min(v, key=lambda t: t.wall) for k, v in used.items()}
    best = {k: text_mb / fastest[k].wall for k in runs}
    median = {k: text_mb / statistics.median(t.wall for t in v) for k, v in used.items()}
    cores = len(os.sched_getaffinity(0))
    command = " ".join(["python tools/bench_preprocess.py",
                        *(sys.argv[1:] if argv is None else argv)])
    clean = ", ".join(f"{names_short[k]} {sum(t.clean for t in v)}/{len(v)}"
                      for k, v in runs.items())
    lines = [
        f"Corpus: built-in stdlib corpus, {len(texts)} files, {text_mb:.2f} MB of text, "
        f"{tokens} tokens (GPT-2-format BPE, vocab {args.vocab_size}); "
        f"{cores} CPU cores, Python {platform.python_version()}.",
        "",
        f"{rounds} interleaved rounds; a measurement counts only if other processes used "
        f"under 5% of the cores meanwhile (undisturbed: {clean}); best and median over those.",
        "",
        "| run | MB/s (best) | MB/s (median) | ratio to bound (best) | ratio to fast bound "
        "| wall s | CPU s main | CPU s workers | MB per CPU s | CLI wall incl. start-up |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    names = {"bound": f"HF `encode_batch`, {cores} threads (**the bound**)",
             "fast": f"HF `encode_batch_fast`, {cores} threads",
             1: "preprocess_data.py --workers 1", 2: "preprocess_data.py --workers 2"}
    for k in runs:
        t = fastest[k]
        kids = f"{t.workers_cpu:.2f}" if k in (1, 2) else "-"
        cli_wall = f"{cli[k]:.1f} s" if k in (1, 2) else "-"
        lines.append(
            f"| {names[k]} | {best[k]:.2f} | {median[k]:.2f} | {best[k] / best['bound']:.2f} | "
            f"{best[k] / best['fast']:.2f} | {t.wall:.2f} | {t.main_cpu:.2f} | {kids} | "
            f"{text_mb / (t.main_cpu + t.workers_cpu):.2f} | {cli_wall} |")
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
