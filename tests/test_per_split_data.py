"""Megatron-LM's per-part data sources: --train-data-path, --valid-data-path and
--test-data-path (each blend read whole: megatron-core's blend_per_split), the files that
name them (--per-split-data-args-path, JSON) or --data-path's list (--data-args-path), and
--dataloader-type single. Mistakes stop while parsing, naming the flag."""

import json
import math

import numpy
import pytest

import distributed
from distributed import TINY_MODEL, assert_close_series, run_configs
from megatron.dataprep.gpt_datasets import build_gpt_datasets
from megatron.dataprep.tokenizer import build_tokenizer
from megatron.trainer.arguments import ArgumentError, parse_args
from packed_documents import write_document_corpus

VOCAB, SEQ = 200, 48
BASE = [f for f in TINY_MODEL if f != "--mock-data"] + [
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two corpora of other tokens (seeds 7 and 8), 24 sequences each."""
    tmp = tmp_path_factory.mktemp("per_split")
    a, b = str(tmp / "a"), str(tmp / "b")
    write_document_corpus(a, vocab_size=VOCAB, seed=7)
    write_document_corpus(b, vocab_size=VOCAB, seed=8)
    return tmp, a, b


def _samples(dataset):
    return [dataset[i]["tokens"].tolist() for i in range(len(dataset))]


def test_each_part_reads_its_blend_whole(corpora):
    """blend_per_split's parts are the datasets --data-path would build from the same blend
    given all of --split: the training data from A's blend, validation from B alone, no
    test set."""
    tmp, a, b = corpora
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB)

    def build(path, split, samples, per_split=None):
        return build_gpt_datasets(path, split, SEQ - 1, 1234, tokenizer, samples,
                                  data_path_per_split=per_split)

    train, valid, test = build(None, None, [30, 8, 0], per_split=[["1", a, "3", b], [b], [b]])
    assert test is None  # 0 samples asked: not built (as for a --split share of 0)
    assert _samples(train) == _samples(build(["1", a, "3", b], "1,0,0", [30, 0, 0])[0])
    assert _samples(valid) == _samples(build([b], "0,1,0", [0, 8, 0])[1])
    assert _samples(valid) != _samples(build([a], "0,1,0", [0, 8, 0])[1])


def _parse(*flags, world_size=1):
    return parse_args(BASE + list(flags), world_size=world_size, cuda_available=False)


def test_megatron_lm_data_source_flags(corpora):
    tmp, a, b = corpora
    args = _parse("--train-data-path", a, "--valid-data-path", "0.5", a, "0.5", b,
                  "--dataloader-type", "single")
    assert args.data_path_per_split == [[a], ["0.5", a, "0.5", b], None]
    assert args.data_path is None and args.split is None and args.dataloader_type == "single"
    # the JSON file Megatron-LM reads: strings or lists; null for no test set
    per_split = tmp / "per_split.json"
    per_split.write_text(json.dumps({"train": f"0.3 {a} 0.7 {b}", "valid": [b], "test": None}))
    args = _parse("--per-split-data-args-path", str(per_split))
    assert args.data_path_per_split == [["0.3", a, "0.7", b], [b], None]
    listed = tmp / "data_args.txt"
    listed.write_text(f"0.3 {a}\n0.7 {b}\n")
    args = _parse("--data-args-path", str(listed), "--split", "90,10,0")
    assert args.data_path == ["0.3", a, "0.7", b] and args.data_path_per_split is None
    assert _parse("--data-path", a, "--split", "90,10,0").split == "90,10,0"


def test_full_validation_flags(corpora):
    """--full-validation, --multiple-validation-sets and --validation-set-names (run in
    tests/test_full_validation.py): their mistakes stop while parsing, naming the flag."""
    tmp, a, b = corpora
    two = ["--train-data-path", a, "--valid-data-path", a, b, "--full-validation",
           "--multiple-validation-sets"]
    args = _parse(*two, "--validation-set-names", "web", "code", "--eval-iters", "0")
    assert args.validation_set_names == ["web", "code"] and args.full_validation
    for flags, match in (
            (two[:-2] + ["--multiple-validation-sets"], "--multiple-validation-sets needs "
                                                        "--full-validation"),
            (two[:-1] + ["--validation-set-names", "web"], "--validation-set-names needs "
                                                            "--multiple-validation-sets"),
            (two + ["--validation-set-names", "web"], "gives 1 names for 2 validation set"),
            (["--train-data-path", a, "--valid-data-path", "1", a, "3", b,
              "--full-validation"], "--full-validation reads each validation prefix whole, "
                                    "which a weighted blend"),
            (["--data-path", "1", a, "3", b, "--split", "90,10,0", "--full-validation"],
             "weighted blend \\(--data-path"),
            (["--mock-data", "--full-validation"], "--mock-data's is megatron-core's mock")):
        with pytest.raises(ArgumentError, match=match):
            _parse(*flags)


def test_data_source_mistakes_name_the_flag(corpora):
    tmp, a, b = corpora
    bad_json = tmp / "bad.json"
    bad_json.write_text(json.dumps({"train": [a], "valid": [b]}))
    for flags, match in (
            (["--train-data-path", a, "--split", "90,10,0"], "drop --split"),
            (["--train-data-path", a, "--data-path", a], "mutually exclusive"),
            (["--train-data-path", a, "--mock-data"], "mutually exclusive"),
            (["--valid-data-path", b], "without --train-data-path"),
            (["--train-data-path", "--valid-data-path", b], "--train-data-path: no dataset"),
            (["--train-data-path", a, "--valid-data-path", str(tmp / "missing")],
             "--valid-data-path: .*missing.bin"),
            (["--train-data-path", a + ".bin"], "--train-data-path: give the prefix"),
            (["--data-args-path", str(tmp / "missing.txt")], "--data-args-path .*cannot be read"),
            (["--data-args-path", str(bad_json), "--data-path", a], "--data-args-path and"),
            (["--per-split-data-args-path", str(bad_json)], '"test"'),
            (["--per-split-data-args-path", str(bad_json), "--train-data-path", a],
             "mutually exclusive"),
            (["--train-data-path", a, "--dataloader-type", "cyclic"], "--dataloader-type cyclic")):
        with pytest.raises(ArgumentError, match=match):
            _parse(*flags)


@pytest.mark.distributed
def test_training_on_per_split_data(corpora, tmp_path):
    """pp=2 with Seq1F1B splits trained from --per-split-data-args-path (train A, valid and
    test B) equals, iteration by iteration, an unsplit run on --data-path A with all of A for
    training; it evaluates on B (validation and test losses logged), which the --data-path
    run has none of."""
    _, a, b = corpora
    per_split = tmp_path / "per_split.json"
    per_split.write_text(json.dumps({"train": [a], "valid": [b], "test": [b]}))
    pp2 = ["--pipeline-model-parallel-size", "2"]
    results = run_configs(tmp_path, 2, [
        {"name": "per_split", "argv": BASE + pp2 + [
            "--per-split-data-args-path", str(per_split), "--eval-iters", "1",
            "--eval-interval", "1000", "--seq1f1b-splits", "3"]},
        {"name": "data_path", "argv": BASE + pp2 + ["--data-path", a, "--split", "100,0,0"]},
    ])
    split_run, whole = results["per_split"], results["data_path"]
    assert len(split_run["losses"]) == 2
    assert_close_series(split_run["losses"], whole["losses"], 1e-5, "training loss")
    assert_close_series(split_run["grad_norms"], whole["grad_norms"], 1e-5, "grad norm")
    for loss in (split_run["final_validation_loss"], split_run["test_loss"]):
        assert loss is not None and math.isfinite(loss)
    assert whole["final_validation_loss"] is None and whole["test_loss"] is None


@pytest.mark.distributed
def test_token_ids_of_a_validation_blend_are_checked(corpora, tmp_path):
    """A --valid-data-path .bin tokenized with a larger vocabulary (an id of 300 against
    TINY_MODEL's 200 tokens, padded to 256) stops before training, naming that flag."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    _, a, _ = corpora
    beyond = str(tmp_path / "beyond")
    builder = IndexedDatasetBuilder(beyond + ".bin", dtype=numpy.int32)
    builder.add_document(numpy.array([5] * 30 + [300] + [9] * 30, dtype=numpy.int32), [61])
    builder.finalize(beyond + ".idx")
    proc = distributed.pretrain(BASE + ["--train-data-path", a, "--valid-data-path", beyond,
                                        "--eval-iters", "1"])
    assert proc.returncode != 0
    assert f"error: --valid-data-path: {beyond}.bin holds token id 300" in proc.stderr, \
        proc.stderr[-2000:]
    assert "iteration" not in proc.stdout
