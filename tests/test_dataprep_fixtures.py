"""Shared fixtures and helpers of the data-tooling tests (imported by test_dataprep_*.py).

Everything is built in temporary directories from a few kilobytes of text: a tiny
GPT-2-format BPE trained offline, JSONL writers, and an in-process preprocess runner.
"""

import json
import os
import warnings

import pytest

# megatron-core warns at import about optional GPU libraries.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import megatron.core  # noqa: F401

from megatron.dataprep.preprocess import main as preprocess_main  # noqa: E402
from megatron.dataprep.tokenizer import build_tokenizer  # noqa: E402
from megatron.dataprep.train_bpe import train_gpt2_bpe  # noqa: E402

UNICODE_SAMPLES = [
    "plain ascii text, with punctuation!?",
    "emoji 😀🎉 and a family 👨‍👩‍👧 (zero-width joiners)",
    "CJK 漢字かなカナ 한국어",
    "combining e\u0301 a\u0308 n\u0303 and precomposed é ä ñ",
    "right-to-left עברית العربية",
    "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√ and NUL-free control \t tab",
    "  leading and trailing spaces  \n\n",
    "def f(x):\n    return x ** 2  # code\n",
    "<|endoftext|> written literally",
]

TRAINING_TEXT = [
    "import os\nimport sys\n\n\ndef main(argv):\n    return len(argv)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "The quick brown fox jumps over the lazy dog. It was not amused.",
    "for i in range(10):\n    print(i, i * i)\n",
] * 20 + UNICODE_SAMPLES


def write_jsonl(path, records):
    """records: dicts (dumped as JSON) or bytes (written verbatim as one line)."""
    with open(path, "wb") as f:
        for record in records:
            line = record if isinstance(record, bytes) else json.dumps(record).encode("utf-8")
            f.write(line + b"\n")
    return str(path)


def run_preprocess(*argv):
    """In-process tools/preprocess_data.py; returns the exit code."""
    return preprocess_main([str(a) for a in argv])


def outputs(directory):
    return sorted(os.listdir(directory))


@pytest.fixture(scope="session")
def gpt2_files(tmp_path_factory):
    """(vocab.json, merges.txt) of a 300-entry byte-level BPE."""
    out = tmp_path_factory.mktemp("bpe")
    return train_gpt2_bpe(TRAINING_TEXT, 300, str(out))


@pytest.fixture(scope="session")
def gpt2(gpt2_files):
    return build_tokenizer("GPT2BPETokenizer", *gpt2_files)


@pytest.fixture
def gpt2_args(gpt2_files):
    vocab, merges = gpt2_files
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
