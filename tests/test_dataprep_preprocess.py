"""tools/preprocess_data.py: round trips, keys, sentences, bad input, atomic output, inputs."""

import gzip
import json
import os
import sys

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.dataprep import preprocess as preprocess_module
from megatron.dataprep import writer as writer_module
from megatron.dataprep.tokenizer import build_tokenizer
from test_dataprep_fixtures import (  # noqa: F401
    UNICODE_SAMPLES,
    gpt2,
    gpt2_args,
    gpt2_files,
    outputs,
    run_preprocess,
    write_jsonl,
)

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

# Optional packages: the tests that need one skip, with this reason, where it is missing.
NO_NLTK = "nltk is not installed (pip install nltk): --split-sentences needs it"
NO_DATASETS = "datasets is not installed (pip install datasets): save_to_disk input needs it"


def documents(prefix):
    """Each document of <prefix>.bin/.idx as a list of sequences (lists of ids)."""
    ds = IndexedDataset(str(prefix))
    bounds = ds.document_indices
    return [[ds[s].tolist() for s in range(a, b)] for a, b in zip(bounds[:-1], bounds[1:])]


# ---- round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
def test_round_trip_ids_are_the_tokenizers(tmp_path, gpt2, gpt2_args, workers):
    texts = UNICODE_SAMPLES * 3
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    rc = run_preprocess("--input", src, "--output-prefix", tmp_path / "out", *gpt2_args,
                        "--workers", workers, "--chunk-size", 2)
    assert rc == 0
    docs = documents(tmp_path / "out_text_document")
    assert [d[0] for d in docs] == [gpt2.tokenize(t) for t in texts]  # input order kept
    assert [gpt2.detokenize(d[0]) for d in docs] == texts
    assert IndexedDataset(str(tmp_path / "out_text_document")).index.dtype == numpy.uint16


def test_append_eod_and_several_keys(tmp_path, gpt2, gpt2_args, capsys):
    records = [{"title": f"title {i}", "body": f"body number {i} ✓"} for i in range(5)]
    records[2] = {"title": "only a title"}
    src = write_jsonl(tmp_path / "in.jsonl", records)
    rc = run_preprocess("--input", src, "--output-prefix", tmp_path / "out", *gpt2_args,
                        "--json-keys", "title", "body", "--append-eod")
    assert rc == 0
    titles = documents(tmp_path / "out_title_document")
    bodies = documents(tmp_path / "out_body_document")
    assert [d[0] for d in titles] == [gpt2.tokenize(r["title"]) + [gpt2.eod] for r in records]
    assert [d[0] for d in bodies] == [
        gpt2.tokenize(r["body"]) + [gpt2.eod] for r in records if "body" in r
    ]
    err = capsys.readouterr().err
    assert "body: 4 written, 1 skipped" in err and "missing_key: 1" in err and "in.jsonl:3" in err


def test_several_files_glob_and_gzip_keep_order(tmp_path, gpt2, gpt2_args):
    for n in range(3):
        write_jsonl(tmp_path / f"part{n}.jsonl", [{"text": f"file {n} doc {i}"} for i in range(7)])
    with gzip.open(tmp_path / "zzz.jsonl.gz", "wb") as f:
        f.write(json.dumps({"text": "gzipped"}).encode() + b"\n")
    rc = run_preprocess("--input", str(tmp_path / "part*.jsonl"), str(tmp_path / "zzz.jsonl.gz"),
                        "--output-prefix", tmp_path / "out", *gpt2_args, "--workers", 2,
                        "--chunk-size", 3)
    assert rc == 0
    expected = [f"file {n} doc {i}" for n in range(3) for i in range(7)] + ["gzipped"]
    docs = documents(tmp_path / "out_text_document")
    assert [gpt2.detokenize(d[0]) for d in docs] == expected


# ---- sentences ----------------------------------------------------------------------------


def test_split_sentences(tmp_path, gpt2, gpt2_args):
    pytest.importorskip("nltk", reason=NO_NLTK)
    text = "Hello there. Dr. Smith went home. Did he?\nYes!"
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": text}, {"text": "One sentence only"}])
    rc = run_preprocess("--input", src, "--output-prefix", tmp_path / "out", *gpt2_args,
                        "--split-sentences", "--append-eod")
    assert rc == 0
    assert "out_text_sentence.bin" in outputs(tmp_path)
    docs = documents(tmp_path / "out_text_sentence")
    sentences = ["Hello there.", "Dr. Smith went home.", "Did he?", "Yes!"]
    assert docs[0] == [gpt2.tokenize(s) for s in sentences[:-1]] + [
        gpt2.tokenize(sentences[-1]) + [gpt2.eod]
    ]
    assert docs[1] == [gpt2.tokenize("One sentence only") + [gpt2.eod]]


def test_split_sentences_keep_newlines_keeps_every_character(tmp_path, gpt2, gpt2_args):
    pytest.importorskip("nltk", reason=NO_NLTK)
    text = "  First line.\nSecond one!\n\n  Third?  "
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": text}])
    rc = run_preprocess("--input", src, "--output-prefix", tmp_path / "out", *gpt2_args,
                        "--split-sentences", "--keep-newlines")
    assert rc == 0
    (doc,) = documents(tmp_path / "out_text_sentence")
    assert len(doc) == 3
    assert "".join(gpt2.detokenize(s) for s in doc) == text
    assert gpt2.detokenize(doc[0]) == "  First line.\n"


def _hide(monkeypatch, package):
    """Make `package` (and its loaded submodules) unimportable in this process."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)  # import raises ModuleNotFoundError


def _no_worker_may_start(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a worker started before the missing package was reported")

    monkeypatch.setattr(preprocess_module, "_Workers", refuse)


def test_split_sentences_without_nltk_is_one_line_before_any_worker(tmp_path, gpt2_args,
                                                                   monkeypatch, capsys):
    _hide(monkeypatch, "nltk")
    _no_worker_may_start(monkeypatch)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "One. Two."}])
    rc = run_preprocess("--input", src, "--output-prefix", tmp_path / "out", *gpt2_args,
                        "--split-sentences", "--workers", 2)
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("preprocess_data.py: error: --split-sentences "
                                               "needs the nltk package"), err
    assert "pip install nltk" in err[0] and "worker" not in err[0]
    assert outputs(tmp_path) == ["in.jsonl"]


def test_saved_dataset_without_datasets_is_one_line(tmp_path, gpt2_args, monkeypatch, capsys):
    _hide(monkeypatch, "datasets")
    _no_worker_may_start(monkeypatch)
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text("{}")  # what marks a save_to_disk folder
    rc = run_preprocess("--input", tmp_path / "ds", "--output-prefix", tmp_path / "out",
                        *gpt2_args)
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs the datasets package: pip install datasets" in err[0], err


# ---- bad input ----------------------------------------------------------------------------

BAD_LINES = {
    "malformed_json": b'{"text": "unterminated',
    "missing_key": json.dumps({"other": "x"}).encode(),
    "non_string": json.dumps({"text": 42}).encode(),
    "invalid_utf8": b'{"text": "bad \xff byte"}',
    "empty": json.dumps({"text": ""}).encode(),
    "blank_line": b"   ",
}


def _bad_input(tmp_path, reason):
    good = [json.dumps({"text": f"good document {i}"}).encode() for i in range(4)]
    lines = good[:2] + [BAD_LINES[reason]] + good[2:]  # the bad line is line 3
    return write_jsonl(tmp_path / "in.jsonl", lines)


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_bad_input_lenient_skips_and_reports(tmp_path, gpt2, gpt2_args, reason, capsys):
    src = _bad_input(tmp_path, reason)
    rc = run_preprocess("--input", src, "--output-prefix", tmp_path / "out", *gpt2_args)
    assert rc == 0
    docs = documents(tmp_path / "out_text_document")
    assert [gpt2.detokenize(d[0]) for d in docs] == [f"good document {i}" for i in range(4)]
    err = capsys.readouterr().err
    assert "5 documents read" in err and "4 written, 1 skipped" in err
    assert f"{reason}: 1" in err and f"{src}:3" in err


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_bad_input_strict_is_fatal_and_writes_nothing(tmp_path, gpt2_args, reason, capsys):
    src = _bad_input(tmp_path, reason)
    rc = run_preprocess("--input", src, "--output-prefix", tmp_path / "out", *gpt2_args,
                        "--strict", "--workers", 2, "--chunk-size", 1)
    assert rc == 1
    err = capsys.readouterr().err
    assert f"{src}:3" in err and reason in err and "--strict" in err
    assert outputs(tmp_path) == ["in.jsonl"]


def test_lone_surrogate_and_empty_after_encoding(tmp_path, gpt2_args, capsys):
    pytest.importorskip("nltk", reason=NO_NLTK)
    lines = [b'{"text": "lone \\ud800 surrogate"}', json.dumps({"text": "fine"}).encode(),
             json.dumps({"text": " \n "}).encode()]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    # Sentence splitting turns whitespace-only text into no sentence at all.
    rc = run_preprocess("--input", src, "--output-prefix", tmp_path / "out", *gpt2_args,
                        "--split-sentences")
    assert rc == 0
    err = capsys.readouterr().err
    assert f"invalid_utf8: 1" in err and f"{src}:1" in err
    assert "empty_after_encoding: 1" in err and f"{src}:3" in err
    assert len(documents(tmp_path / "out_text_sentence")) == 1


def test_many_bad_lines_report_only_the_first_few(tmp_path, gpt2_args, capsys):
    lines = [b"{broken"] * 12 + [json.dumps({"text": "ok"}).encode()]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    assert run_preprocess("--input", src, "--output-prefix", tmp_path / "out", *gpt2_args) == 0
    err = capsys.readouterr().err
    assert "malformed_json: 12" in err and f"{src}:5, ..." in err and f"{src}:6" not in err


def test_nothing_to_write_is_an_error(tmp_path, gpt2_args, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": ""}, {"other": "x"}])
    assert run_preprocess("--input", src, "--output-prefix", tmp_path / "out", *gpt2_args) == 1
    err = capsys.readouterr().err
    # the reasons and the first lines, not only that nothing is left
    assert (f"error: no document left to write for key 'text': 2 skipped: missing_key 1 "
            f"(key absent) at {src}:2; empty 1 (empty text) at {src}:1; nothing written") \
        in err, err
    assert outputs(tmp_path) == ["in.jsonl"]


# ---- atomic output ----------------------------------------------------------------------------


def test_failure_at_commit_leaves_no_pair_and_no_temporaries(tmp_path, gpt2_args, monkeypatch,
                                                             capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "old text"}] * 3)
    assert run_preprocess("--input", src, "--output-prefix", tmp_path / "out", *gpt2_args) == 0
    assert outputs(tmp_path) == ["in.jsonl", "out_text_document.bin", "out_text_document.idx"]

    real_replace = os.replace

    def failing_replace(a, b):
        if str(b).endswith(".bin"):
            raise OSError("disk full (simulated)")
        return real_replace(a, b)

    monkeypatch.setattr(writer_module.os, "replace", failing_replace)
    write_jsonl(tmp_path / "in.jsonl", [{"text": "new text"}] * 3)
    # an OSError is one line naming the output (issue 30 pt 6), not a traceback
    assert run_preprocess("--input", src, "--output-prefix", tmp_path / "out", *gpt2_args) == 1
    out = tmp_path / "out_text_document"
    # the old .idx had gone when the rename failed: the line says so, not "nothing written"
    assert (f"error: writing {tmp_path / 'out'}_text_document.{{bin,idx}} failed: disk full "
            f"(simulated); temporary files removed, the previous {out}.idx was already "
            f"removed (the .bin beside it is no dataset without it): rerun to write both: "
            f"free space or choose another --output-prefix\n") in capsys.readouterr().err
    # The old .idx is removed before anything is renamed: the old .bin alone is no dataset,
    # and no new .bin can ever sit beside an .idx that does not describe it.
    assert outputs(tmp_path) == ["in.jsonl", "out_text_document.bin"]


def test_failure_after_one_output_was_published_names_it(tmp_path, gpt2_args, monkeypatch,
                                                         capsys):
    """Two keys, the second's rename fails after the first pair is in place: the line
    names the pair written in full instead of "nothing written"."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"title": "a title", "body": "a body"}] * 3)
    real_replace = os.replace

    def failing_replace(a, b):
        if str(b).endswith("body_document.bin"):
            raise OSError("disk full (simulated)")
        return real_replace(a, b)

    monkeypatch.setattr(writer_module.os, "replace", failing_replace)
    assert run_preprocess("--input", src, "--output-prefix", tmp_path / "out", *gpt2_args,
                          "--json-keys", "title", "body") == 1
    title = tmp_path / "out_title_document"
    err = capsys.readouterr().err
    assert (f"failed: disk full (simulated); temporary files removed, {title}.bin and "
            f"{title}.idx written in full: free space") in err, err
    assert outputs(tmp_path) == ["in.jsonl", "out_title_document.bin", "out_title_document.idx"]


def test_worker_crash_cleans_up(tmp_path, gpt2_args, monkeypatch):
    from megatron.dataprep import encode

    def boom(self, chunk):
        raise RuntimeError("worker crashed (simulated)")

    monkeypatch.setattr(encode.ChunkEncoder, "__call__", boom)  # inherited by forked workers
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "x"}] * 10)
    with pytest.raises(RuntimeError, match="simulated"):
        run_preprocess("--input", src, "--output-prefix", tmp_path / "out", *gpt2_args,
                       "--workers", 2, "--chunk-size", 2)
    assert outputs(tmp_path) == ["in.jsonl"]


def test_interrupt_cleans_up(tmp_path, gpt2_args, monkeypatch, capsys):
    from megatron.dataprep.report import Report

    def interrupted(self, items, text_bytes):
        raise KeyboardInterrupt  # what Ctrl-C (or SIGTERM, turned into it) raises mid-run

    monkeypatch.setattr(Report, "advance", interrupted)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "x"}] * 10)
    rc = run_preprocess("--input", src, "--output-prefix", tmp_path / "out", *gpt2_args,
                        "--workers", 2, "--chunk-size", 2)
    assert rc == 130
    assert "interrupted" in capsys.readouterr().err
    assert outputs(tmp_path) == ["in.jsonl"]


# ---- other inputs and tokenizers ----------------------------------------------------------------


def test_save_to_disk_input(tmp_path, gpt2, gpt2_args, capsys):
    datasets = pytest.importorskip("datasets", reason=NO_DATASETS)

    rows = {"content": ["first ✓", "second", None, ""], "n": [1, 2, 3, 4]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    rc = run_preprocess("--input", tmp_path / "ds", "--json-keys", "content",
                        "--output-prefix", tmp_path / "out", *gpt2_args, "--workers", 2)
    assert rc == 0
    docs = documents(tmp_path / "out_content_document")
    assert [d[0] for d in docs] == [gpt2.tokenize("first ✓"), gpt2.tokenize("second")]
    err = capsys.readouterr().err
    assert "non_string: 1" in err and "[row 2]" in err and "empty: 1" in err and "[row 3]" in err


def test_save_to_disk_missing_column_is_a_flag_error(tmp_path, gpt2_args, capsys):
    datasets = pytest.importorskip("datasets", reason=NO_DATASETS)

    datasets.Dataset.from_dict({"content": ["a"]}).save_to_disk(str(tmp_path / "ds"))
    rc = run_preprocess("--input", tmp_path / "ds", "--output-prefix", tmp_path / "out",
                        *gpt2_args)
    assert rc == 2
    assert "--json-keys: " in capsys.readouterr().err


def test_null_tokenizer(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl",
                      [{"text": "1 2 3"}, {"text": "4 x"}, {"text": "7\n8"}, {"text": "99"}])
    rc = run_preprocess("--input", src, "--output-prefix", tmp_path / "out",
                        "--tokenizer-type", "NullTokenizer", "--vocab-size", 50, "--append-eod")
    assert rc == 0
    # as Megatron-LM 0.18+: the end-of-document id is the last, 49
    assert [d[0] for d in documents(tmp_path / "out_text_document")] == [[1, 2, 3, 49], [7, 8, 49]]
    err = capsys.readouterr().err
    assert "encode_error: 2" in err and f"{src}:2" in err and f"{src}:4" in err


def test_huggingface_tokenizer(tmp_path, gpt2, gpt2_files):
    path = str(tmp_path / "tokenizer.json")
    gpt2._hf.save(path)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in UNICODE_SAMPLES])
    rc = run_preprocess("--input", src, "--output-prefix", tmp_path / "out",
                        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", path,
                        "--append-eod", "--workers", 2)
    assert rc == 0
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path)
    docs = documents(tmp_path / "out_text_document")
    assert [d[0] for d in docs] == [hf.tokenize(t) + [hf.eod] for t in UNICODE_SAMPLES]


# ---- user mistakes: one line naming the flag, before any work ----------------------------------


@pytest.mark.parametrize(
    "change, flag",
    [
        (lambda a, t: a.update({"--input": str(t / "missing.jsonl")}), "--input"),
        (lambda a, t: a.update({"--input": str(t / "nothing*.jsonl")}), "--input"),
        (lambda a, t: a.update({"--input": str(t)}), "--input"),
        (lambda a, t: a.update({"--vocab-file": str(t / "no-vocab.json")}), "--vocab-file"),
        (lambda a, t: a.pop("--merge-file"), "--merge-file"),
        (lambda a, t: a.update({"--tokenizer-type": "BertTokenizer"}), "--tokenizer-type"),
        (lambda a, t: a.update({"--output-prefix": str(t / "no" / "dir" / "out")}),
         "--output-prefix"),
        (lambda a, t: a.update({"--dataset-impl": "lazy"}), "--dataset-impl"),
        (lambda a, t: a.update({"--workers": "0"}), "--workers"),
        (lambda a, t: a.update({"--partitions": "2"}), "--keep-sequential-samples"),
        (lambda a, t: a.update({"--tokenizer-hf-no-use-fast": None}),
         "--tokenizer-hf-no-use-fast: only HF tokenizers' fast tokenizer"),
        (lambda a, t: a.update({"--find-optimal-num-workers": None}),
         "--find-optimal-num-workers"),
        (lambda a, t: a.update({"--vocab-extra-ids": "100"}), "--vocab-extra-ids"),
        (lambda a, t: a.update({"--split-sentences": None, "--lang": "german"}),
         "--lang german: nltk's Punkt model for german (punkt_tab) is not installed"),
    ],
)
def test_user_mistakes(tmp_path, gpt2_files, change, flag, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "x"}])
    args = {"--input": src, "--output-prefix": str(tmp_path / "out"),
            "--tokenizer-type": "GPT2BPETokenizer", "--vocab-file": gpt2_files[0],
            "--merge-file": gpt2_files[1]}
    change(args, tmp_path)
    argv = [x for kv in args.items() for x in kv if x is not None]
    assert run_preprocess(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err
    assert outputs(tmp_path) == ["in.jsonl"]


def test_megatron_lm_flags_that_change_nothing_here(tmp_path, gpt2, gpt2_args, capsys):
    """A Megatron-LM command line with --partitions/--keep-sequential-samples, --lang
    english, the vocabulary-padding flags, --trust-remote-code and the defaults of the
    worker-timing flags: the same documents in input order, a note for each no-op."""
    pytest.importorskip("nltk", reason=NO_NLTK)
    texts = [f"Document {i}. It has two sentences." for i in range(7)]
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    rc = run_preprocess("--input", src, "--output-prefix", tmp_path / "out", *gpt2_args,
                        "--workers", 2, "--partitions", 2, "--keep-sequential-samples",
                        "--split-sentences", "--lang", "english", "--padded-vocab-size", 512,
                        "--no-pad-vocab-size", "--trust-remote-code", "--vocab-extra-ids", 0,
                        "--workers-to-check", 16, 32, "--max-documents", 100)
    assert rc == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if ": note: " in line]
    assert [line.split(": note: ")[1].split(" ")[0] for line in notes] == [
        "--padded-vocab-size", "--no-pad-vocab-size", "--trust-remote-code",
        "--workers-to-check", "--max-documents"]
    docs = documents(tmp_path / "out_text_sentence")
    assert docs == [[gpt2.tokenize(f"Document {i}."), gpt2.tokenize("It has two sentences.")]
                    for i in range(7)]


def test_hf_special_tokens_only_without_the_flag(tmp_path, gpt2_files):
    """--tokenizer-hf-no-include-special-tokens: no BOS from the post-processor."""
    from test_dataprep_tokenizer import bos_tokenizer_dir

    directory, bos = bos_tokenizer_dir(tmp_path, gpt2_files)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in UNICODE_SAMPLES])
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", directory]
    assert run_preprocess("--input", src, "--output-prefix", tmp_path / "with", *hf) == 0
    assert run_preprocess("--input", src, "--output-prefix", tmp_path / "without", *hf,
                          "--tokenizer-hf-no-include-special-tokens") == 0
    with_bos = documents(tmp_path / "with_text_document")
    without = documents(tmp_path / "without_text_document")
    assert all(d[0][0] == bos for d in with_bos)
    assert [d[0] for d in without] == [d[0][1:] for d in with_bos]


def test_special_tokens_flag_writes_them_as_one_id(tmp_path, gpt2_args, gpt2_files):
    """--tokenizer-special-tokens (Megatron-LM's; its 0.17 spelling too): each is one id in
    the output, in the workers as in the main process."""
    src = write_jsonl(tmp_path / "in.jsonl",
                      [{"text": f"def f{i}(): <fim_prefix> return {i} <tool>"} for i in range(9)])
    for flag in ("--tokenizer-special-tokens", "--tiktoken-special-tokens"):
        out = tmp_path / flag.strip("-")
        assert run_preprocess("--input", src, "--output-prefix", out, *gpt2_args, flag,
                              "<fim_prefix>", "<tool>", "--workers", "2") == 0
        docs = documents(tmp_path / f"{flag.strip('-')}_text_document")
        plain = build_tokenizer("GPT2BPETokenizer", *gpt2_files)
        assert [d[0] for d in docs] == [
            plain.tokenize(f"def f{i}(): ") + [300] + plain.tokenize(f" return {i} ") + [301]
            for i in range(9)]


def test_append_eod_without_an_eod_token(tmp_path, gpt2, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a a"}])
    rc = run_preprocess("--input", src, "--output-prefix", tmp_path / "out", "--append-eod",
                        "--tokenizer-type", "HuggingFaceTokenizer",
                        "--tokenizer-model", tmp_path / "tokenizer.json")
    assert rc == 2
    assert "--append-eod" in capsys.readouterr().err


def test_progress_lines(tmp_path, gpt2_args, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": f"doc {i}"} for i in range(30)])
    rc = run_preprocess("--input", src, "--output-prefix", tmp_path / "out", *gpt2_args,
                        "--log-interval", 10, "--chunk-size", 5)
    assert rc == 0
    err = capsys.readouterr().err
    progress = [l for l in err.splitlines() if "processed" in l]
    assert len(progress) == 3 and "docs/s" in progress[0] and "MB/s" in progress[0]
    assert "30 documents read" in err and "30 written, 0 skipped" in err and "tokens" in err
