"""A damaged or mismatched .bin/.idx pair is one line naming the file, before any process
group exists (issue 16 pt 5): pretrain_gpt.py runs on real preprocess_data.py output and
on corrupted copies of it."""

import json
import os
import shutil
import struct

import numpy
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

import distributed
from distributed import TINY_MODEL
from megatron.dataprep.gpt_datasets import DataPathError, parse_data_path
from test_dataprep_fixtures import run_preprocess, write_jsonl

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

VOCAB = 200  # TINY_MODEL's NullTokenizer vocabulary
DATA_FLAGS = [f for f in TINY_MODEL if f != "--mock-data"] + [
    "--global-batch-size", "2", "--train-iters", "1", "--split", "100,0,0"]


def preprocess(directory, name, documents):
    """`documents` (lists of token ids) through tools/preprocess_data.py; returns the prefix."""
    src = write_jsonl(directory / f"{name}.jsonl",
                      [{"text": " ".join(map(str, doc))} for doc in documents])
    assert run_preprocess("--input", src, "--output-prefix", directory / name, "--append-eod",
                          "--tokenizer-type", "NullTokenizer", "--vocab-size", VOCAB) == 0
    return directory / f"{name}_text_document"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(a 40-document prefix, a 10-document prefix), both written by preprocess_data.py."""
    directory = tmp_path_factory.mktemp("data")
    big = preprocess(directory, "big", [[(7 * i + j) % 150 for j in range(5 + i % 9)]
                                        for i in range(40)])
    small = preprocess(directory, "small", [list(range(3 + i)) for i in range(10)])
    return big, small


def copy_pair(source, prefix):
    for ext in (".bin", ".idx"):
        shutil.copyfile(f"{source}{ext}", f"{prefix}{ext}")
    return prefix


def pretrain(prefix):
    return distributed.pretrain([*DATA_FLAGS, "--data-path", str(prefix)])


def assert_refused(prefix, bad_file, *words):
    """pretrain_gpt.py exits before training with one line naming `bad_file`."""
    proc = pretrain(prefix)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: --data-path: ") and f"{bad_file}" in lines[0], lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    assert "iteration" not in proc.stdout, proc.stdout[-2000:]
    return lines[0]


def test_healthy_copy_trains(data, tmp_path):
    prefix = copy_pair(data[0], tmp_path / "healthy")
    proc = pretrain(prefix)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "iteration        1/" in proc.stdout, proc.stdout[-2000:]


def test_bin_8_bytes_short(data, tmp_path):
    """Used to train ~300 iterations, then 'buffer is smaller than requested size'."""
    prefix = copy_pair(data[0], tmp_path / "short")
    size = os.path.getsize(f"{prefix}.bin")
    os.truncate(f"{prefix}.bin", size - 8)
    line = assert_refused(prefix, f"{prefix}.bin", f"holds {size - 8} bytes",
                          f"{prefix}.idx describes {size}", "truncated copy?",
                          "tools/preprocess_data.py")
    assert line.endswith("re-run tools/preprocess_data.py or copy the file again")


def test_bin_longer_than_idx_says(data, tmp_path):
    prefix = copy_pair(data[0], tmp_path / "long")
    size = os.path.getsize(f"{prefix}.bin")
    with open(f"{prefix}.bin", "ab") as f:
        f.write(b"\0" * 8)
    assert_refused(prefix, f"{prefix}.bin", f"holds {size + 8} bytes", f"describes {size}")


def test_idx_of_another_file(data, tmp_path):
    """Used to train silently on the first part of the .bin."""
    prefix = copy_pair(data[0], tmp_path / "mixed")
    shutil.copyfile(f"{data[1]}.idx", f"{prefix}.idx")
    assert_refused(prefix, f"{prefix}.bin", f"{prefix}.idx", "another file")


def test_idx_truncated(data, tmp_path):
    """Used to be a traceback."""
    prefix = copy_pair(data[0], tmp_path / "cut")
    os.truncate(f"{prefix}.idx", os.path.getsize(f"{prefix}.idx") - 5)
    assert_refused(prefix, f"{prefix}.idx", "is truncated", "40 sequences")


def test_idx_garbage_magic(data, tmp_path):
    prefix = copy_pair(data[0], tmp_path / "garbage")
    with open(f"{prefix}.idx", "r+b") as f:
        f.write(b"NOTANIDX!")
    assert_refused(prefix, f"{prefix}.idx", "not a megatron-core index")


def test_zero_length_sequence(tmp_path):
    """megatron-core's GPT dataset spins forever on it; preprocess_data.py never writes
    one, so the pair is written with megatron-core's own builder."""
    prefix = str(tmp_path / "hole")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.uint16)
    for length in (30, 0, 30):
        builder.add_document(torch.arange(length) % 150, [length])
    builder.finalize(f"{prefix}.idx")
    assert_refused(prefix, f"{prefix}.idx", "empty sequence (number 1)", "loops forever")


# the remaining malformations, in process (the subprocess path is the same as above)

def rewrite_idx(prefix, offset, fmt, value):
    with open(f"{prefix}.idx", "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))


@pytest.mark.parametrize("offset, fmt, value, words", [
    (9, "<Q", 2, "index version 2"),
    (17, "<B", 99, "unknown token type code 99"),
    (18, "<Q", 41, "is truncated: its header describes 41 sequences"),
    (18, "<Q", 39, "not the"),  # fewer sequences than the arrays hold
    (34 + 40 * 4 + 8, "<q", 3, "offsets do not follow"),  # the second sequence's offset
    (34 + 40 * 4 + 40 * 8, "<q", 1, "document boundaries"),  # the first boundary
    (34, "<i", -4, "sequence 0 has length -4"),
])
def test_inconsistent_idx(data, tmp_path, offset, fmt, value, words):
    prefix = copy_pair(data[0], tmp_path / "edited")
    rewrite_idx(prefix, offset, fmt, value)
    with pytest.raises(DataPathError, match="--data-path: ") as error:
        parse_data_path([str(prefix)])
    assert f"{prefix}.idx" in str(error.value) and words in str(error.value)


def test_empty_idx(data, tmp_path):
    prefix = copy_pair(data[0], tmp_path / "empty")
    open(f"{prefix}.idx", "wb").close()
    with pytest.raises(DataPathError, match="is empty"):
        parse_data_path([str(prefix)])


@pytest.mark.parametrize("offset, value, words", [
    (None, None, None),  # a healthy pair passes block by block
    (34 + 40 * 4 + 39 * 8, 1, "offsets do not follow"),  # the last offset, a block edge
    (34 + 40 * 4 + 40 * 8 + 14 * 8, 10**6, "document boundaries"),
])
def test_arrays_are_checked_in_blocks(data, tmp_path, monkeypatch, offset, value, words):
    """The arrays are compared a block at a time (an .idx can be gigabytes): a mismatch
    on or beside a block edge is found."""
    import megatron.dataprep.gpt_datasets as gpt_datasets

    monkeypatch.setattr(gpt_datasets, "_BLOCK", 7)
    prefix = copy_pair(data[0], tmp_path / "blocks")
    if offset is None:
        assert parse_data_path([str(prefix)]) == ([str(prefix)], None)
        return
    rewrite_idx(prefix, offset, "<q", value)
    with pytest.raises(DataPathError, match=words):
        parse_data_path([str(prefix)])


def _builder_pair(prefix, documents):
    """A .bin/.idx pair written with megatron-core's own builder (preprocess_data.py only
    writes ids of its tokenizer: other data is what a user brings from elsewhere)."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.uint16)
    for document in documents:
        builder.add_document(torch.tensor(document), [len(document)])
    builder.finalize(f"{prefix}.idx")
    return prefix


def test_token_ids_beyond_the_vocabulary(tmp_path):
    """TINY_MODEL's NullTokenizer has 200 tokens (--vocab-size 200), padded to 256.
    An id of 300 (data of a larger tokenizer) used to die at iteration 1 with a bare
    IndexError: now one line naming the .bin and the id, before training. An id of 230
    trains (the padded embedding has the row) with a warning. The largest id is cached
    next to the index, keyed by the .bin's size and time."""
    beyond = _builder_pair(str(tmp_path / "beyond"), [[5] * 30, [7] * 20 + [300] + [9] * 9])
    line = assert_refused(beyond, f"{beyond}.bin", "holds token id 300",
                          "vocabulary has 256 entries",
                          "--tokenizer-type NullTokenizer --vocab-size 200: 200 tokens, "
                          "padded to 256", "another tokenizer")
    assert line.startswith(f"error: --data-path: {beyond}.bin holds token id 300")
    assert json.loads(open(f"{beyond}.maxid.json").read())["max_id"] == 300

    padded = _builder_pair(str(tmp_path / "padded"), [[5] * 30, [230] * 30])
    proc = pretrain(padded)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"warning: --data-path: {padded}.bin holds token id 230, beyond the tokenizer's "
            f"200 tokens") in proc.stdout
    assert "iteration        1/" in proc.stdout


def test_largest_id_cache_follows_the_bin(tmp_path, monkeypatch):
    from megatron.dataprep import token_range

    prefix = _builder_pair(str(tmp_path / "cached"), [[5, 6, 7], [40, 8]])
    scans = []
    scan = token_range._scan
    monkeypatch.setattr(token_range, "_scan", lambda *a: scans.append(a) or scan(*a))
    monkeypatch.setattr(token_range, "_BLOCK", 2)  # the blocks of a long .bin
    assert token_range.largest_token_id(prefix) == 40 and len(scans) == 1
    assert token_range.largest_token_id(prefix) == 40 and len(scans) == 1  # the cache
    with open(f"{prefix}.bin", "r+b") as f:  # same size, new bytes and time
        f.seek(2)
        f.write(struct.pack("<H", 999))
    os.utime(f"{prefix}.bin", ns=(1, 1))
    assert token_range.largest_token_id(prefix) == 999 and len(scans) == 2


def test_dataset_smaller_than_one_sample_is_named(tmp_path):
    """A 5-token corpus under --seq-length 48: every sample repeats it ~10 times."""
    tiny = _builder_pair(str(tmp_path / "tiny"), [[5, 6, 7, 8, 9]])
    proc = pretrain(tiny)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"warning: --data-path: the training split of {tiny} holds 5 token(s), fewer "
            f"than one sample (--seq-length 48 + 1): every sample repeats them about 10 "
            f"times") in proc.stdout, proc.stdout[-3000:]
