"""Train a GPT-2-format byte-level BPE (vocab.json + merges.txt) on a JSONL corpus.

    python tools/train_tokenizer.py --input data/stdlib.jsonl --json-key content \
        --vocab-size 8192 --output-dir data/tokenizer

Offline; the files load with --tokenizer-type GPT2BPETokenizer --vocab-file
DIR/vocab.json --merge-file DIR/merges.txt. <|endoftext|> is the last id, as in GPT-2.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.dataprep.train_bpe import train_gpt2_bpe  # noqa: E402


def read_texts(path: str, key: str, counts: dict):
    """The string values of `key`; other lines are counted, not fatal (training input)."""
    with open(path, "rb") as f:
        for line in f:
            try:
                value = json.loads(line).get(key)
            except (ValueError, AttributeError):
                counts["unreadable"] += 1
                continue
            if isinstance(value, str) and value:
                counts["used"] += 1
                yield value
            else:
                counts["no_text"] += 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="JSONL corpus")
    p.add_argument("--json-key", default="text", help="key holding the text (default text)")
    p.add_argument("--vocab-size", type=int, default=8192,
                   help="final vocabulary size, <|endoftext|> included (default 8192)")
    p.add_argument("--min-frequency", type=int, default=2,
                   help="least count for a merge (default 2)")
    p.add_argument("--output-dir", required=True, help="directory for vocab.json, merges.txt")
    args = p.parse_args(argv)
    if not os.path.isfile(args.input):
        p.error(f"--input: {args.input} does not exist (tools/build_code_corpus.py makes one)")
    os.makedirs(args.output_dir, exist_ok=True)
    counts = {"used": 0, "unreadable": 0, "no_text": 0}
    start = time.perf_counter()
    try:
        vocab, merges = train_gpt2_bpe(read_texts(args.input, args.json_key, counts),
                                       args.vocab_size, args.output_dir, args.min_frequency)
    except ValueError as exc:
        p.error(str(exc))
    if counts["used"] == 0:
        p.error(f"--json-key: no line of {args.input} has a non-empty string {args.json_key!r}")
    with open(vocab, encoding="utf-8") as f:
        size = len(json.load(f))
    short = "" if size == args.vocab_size else (
        f" (asked for {args.vocab_size}: the corpus has too few frequent pairs)")
    print(f"train_tokenizer: vocabulary of {size}{short}; "
          f"{vocab}, {merges} from {counts['used']} documents "
          f"(skipped: {counts['unreadable']} unreadable, {counts['no_text']} without text) "
          f"in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
