"""End to end: built-in corpus -> BPE tokenizer -> .bin/.idx -> pp=2 training from files."""

import json
import math
import subprocess
import sys

import pytest

from distributed import ROOT, assert_close_series, run_configs
from packed_documents import document_cases

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)


def tool(*argv):
    proc = subprocess.run([sys.executable] + list(argv), cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_corpus_to_training(tmp_path):
    corpus = tmp_path / "stdlib.jsonl"
    tool("tools/build_code_corpus.py", "--output", str(corpus), "--max-bytes", "400000")
    assert sum(1 for _ in corpus.open()) > 10
    tool("tools/train_tokenizer.py", "--input", str(corpus), "--json-key", "content",
         "--vocab-size", "1024", "--output-dir", str(tmp_path / "tok"))
    vocab, merges = tmp_path / "tok" / "vocab.json", tmp_path / "tok" / "merges.txt"
    # the file paths are short documents: the packed-document runs train on them, so
    # their rows hold many document boundaries (a file's content is longer than a row)
    tool("tools/preprocess_data.py", "--input", str(corpus), "--json-keys", "content", "path",
         "--output-prefix", str(tmp_path / "stdlib"), "--tokenizer-type", "GPT2BPETokenizer",
         "--vocab-file", str(vocab), "--merge-file", str(merges), "--append-eod",
         "--workers", "2")
    prefix = str(tmp_path / "stdlib_content_document")
    assert len(json.loads(vocab.read_text())) == 1024

    flags = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "2", "--global-batch-size", "6", "--train-iters", "3",
        "--lr", "1e-3", "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1",
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--data-path", prefix, "--split", "90,10,0", "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", str(vocab), "--merge-file", str(merges),
        "--data-cache-path", str(tmp_path / "cache"),
        "--pipeline-model-parallel-size", "2",
    ]
    paths = str(tmp_path / "stdlib_path_document")
    docs = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
    docs_flags = [paths if f == prefix else f for f in flags] + docs
    results = run_configs(tmp_path, 2, [
        {"name": "1f1b", "argv": flags},
        {"name": "seq1f1b", "argv": flags + ["--seq1f1b-splits", "2"]},
        {"name": "docs_1f1b", "argv": docs_flags},
        {"name": "docs_seq1f1b", "argv": docs_flags + ["--seq1f1b-splits", "4"]},
    ])
    for name in ("1f1b", "docs_1f1b"):
        losses = results[name]["losses"]
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
        assert abs(losses[0] - math.log(1024)) < 1.0  # an untrained model on a 1024 vocab
        assert len(results[name]["validation_losses"]) == 1
    assert_close_series(results["seq1f1b"]["losses"], results["1f1b"]["losses"], 1e-5, "split")
    assert_close_series(results["docs_seq1f1b"]["losses"], results["docs_1f1b"]["losses"],
                        1e-5, "split, packed documents")
    # ... and the split runs really met packed documents
    met = document_cases(results["docs_seq1f1b"]["forward_units"])
    assert {"crosses a split edge", "shorter than its split"} <= met, met
