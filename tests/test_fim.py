"""--fim-data (Megatron-LM's fill-in-the-middle datasets, megatron/dataprep/fim.py): the
rearrangement of each document piece (PSM, SPM, fragments, --fim-no-prefix, the sample's
length kept), its wiring from the flags through the trainer's datasets with a tokenizer
holding the FIM tokens, per-sample determinism, the flags' checks, and a training run."""

import json
from argparse import Namespace

import numpy as np
import pytest
from tokenizers import Tokenizer

from distributed import TINY_MODEL, TINY_MODEL_WITHOUT_DATA, argument_problems, pretrain
from megatron.dataprep.fim import FimSettings, fill_in_the_middle
from megatron.dataprep.tokenizer import build_tokenizer
from test_dataprep_fixtures import TRAINING_TEXT, gpt2_files  # noqa: F401

# ---- the rearrangement, with a character tokenizer (one id per character) ----------------

PRE, MID, SUF, PAD, EOD, BOS = 2_000_001, 2_000_002, 2_000_003, 2_000_004, 2_000_005, 2_000_006
SPECIAL = {PRE: "<P>", MID: "<M>", SUF: "<S>", PAD: "<pad>", EOD: "<eod>", BOS: "<bos>"}


class CharTokenizer:
    def tokenize(self, text):
        return [ord(c) for c in text]

    def text_without_special_tokens(self, ids):
        return "".join(chr(i) for i in ids if i not in SPECIAL)


def settings(rate=1.0, spm_rate=0.0, **more):
    return FimSettings(rate=rate, spm_rate=spm_rate, prefix_id=PRE, middle_id=MID,
                       suffix_id=SUF, pad_id=PAD, eod_id=EOD, **more)


def ids(text):
    return [ord(c) for c in text]


def pieces(result):
    """The result's pieces between end-of-document tokens, as strings."""
    text = "".join(SPECIAL.get(int(i), chr(int(i)) if int(i) < 0x110000 else "?")
                   for i in result)
    return text.split("<eod>")


def unpermute(piece, spm):
    """The original text of one rearranged piece."""
    if spm:
        assert piece.startswith("<P><S>")
        suffix, rest = piece[len("<P><S>"):].split("<M>")
        return rest + suffix  # prefix + middle, then the suffix
    assert piece.startswith("<P>")
    prefix, rest = piece[len("<P>"):].split("<S>")
    suffix, middle = rest.split("<M>")
    return prefix + middle + suffix


@pytest.mark.parametrize("spm", [False, True])
def test_every_piece_is_rearranged_and_keeps_its_text(spm):
    docs = ["def f(x):\n    return x\n", "class A:\n    pass\n", "import os\n" * 4]
    sample = ids(docs[0]) + [EOD] + ids(docs[1]) + [EOD] + ids(docs[2])
    result = fill_in_the_middle(sample, settings(spm_rate=float(spm)), CharTokenizer(),
                                np.random.default_rng(0))
    assert len(result) == len(sample) and result.dtype == np.int64
    got = pieces(result)
    assert len(got) == 3  # the end-of-document tokens stay between the pieces
    assert [unpermute(p, spm) for p in got[:2]] == docs[:2]
    # three sentinels per piece: the last piece lost six tokens of its end to keep the length
    assert got[2].startswith("<P>") and len(result) - len(sample) == 0


def test_the_cuts_fall_anywhere_and_both_orders_occur():
    text = "abcdefghij"
    seen_cuts, orders = set(), set()
    for seed in range(200):
        result = fill_in_the_middle(ids(text) + [EOD] + ids("x" * 10), settings(spm_rate=0.5),
                                    CharTokenizer(), np.random.default_rng(seed))
        piece = pieces(result)[0]
        spm = piece.startswith("<P><S>")
        orders.add(spm)
        assert unpermute(piece, spm) == text
        if not spm:
            prefix, rest = piece[3:].split("<S>")
            seen_cuts.add((len(prefix), len(prefix) + len(rest.split("<M>")[1])))
    assert orders == {False, True}
    assert (0, 0) in seen_cuts or (0, 10) in seen_cuts or (10, 10) in seen_cuts  # empty parts
    assert len(seen_cuts) > 20


def test_rate_zero_is_the_sample_itself_and_the_rate_is_a_probability():
    sample = ids("abc") + [EOD] + ids("defgh") + [EOD, EOD] + ids("ij")
    rng = np.random.default_rng(1)
    assert fill_in_the_middle(sample, settings(rate=0.0), CharTokenizer(), rng).tolist() == sample
    rearranged = sum(
        pieces(fill_in_the_middle(ids("abcdef") + [EOD] + ids("g" * 20), settings(rate=0.3),
                                  CharTokenizer(), np.random.default_rng(seed)))[0]
        .startswith("<P>") for seed in range(400))
    assert 80 < rearranged < 160  # about 0.3 x 400


def test_an_empty_piece_keeps_its_end_of_document_token():
    sample = [EOD] + ids("abc") + [EOD, EOD] + ids("de")
    result = fill_in_the_middle(sample, settings(rate=0.0), CharTokenizer(),
                                np.random.default_rng(0))
    assert result.tolist() == sample


def test_special_tokens_inside_a_piece_leave_it_and_padding_fills_the_length():
    # the piece's text leaves out the BOS ids: 4 fewer tokens, 3 sentinels more
    sample = [BOS] * 4 + ids("hello world")
    result = fill_in_the_middle(sample, settings(), CharTokenizer(), np.random.default_rng(0))
    assert len(result) == len(sample)
    assert result[-1] == PAD and (result == PAD).sum() == 1
    assert unpermute(pieces(result[:-1])[0], spm=False) == "hello world"


def test_fragments_are_rearranged_one_by_one_at_the_split_token():
    sep = ord("|")
    files = ["first file", "second one", "third"]
    sample = ids("|".join(files))
    result = fill_in_the_middle(sample, settings(split_id=sep, fragment_rate=1.0),
                                CharTokenizer(), np.random.default_rng(0))
    fragments = pieces(result)[0].split("|")
    assert [unpermute(f, spm=False) for f in fragments[:2]] == files[:2]
    # the sample-level draw uses --fim-rate: at 0 no fragment changes
    assert fill_in_the_middle(sample, settings(rate=0.0, split_id=sep, fragment_rate=1.0),
                              CharTokenizer(), np.random.default_rng(0)).tolist() == sample
    # a piece without the split token is rearranged whole, with --fim-rate
    whole = fill_in_the_middle(ids("no separator here"), settings(split_id=sep,
                               fragment_rate=0.0), CharTokenizer(), np.random.default_rng(0))
    assert pieces(whole)[0].startswith("<P>")


def test_pieces_starting_with_the_no_prefix_text_stay():
    sample = ids("#!keep this") + [EOD] + ids("change this")
    result = fill_in_the_middle(sample, settings(no_prefix="#!"), CharTokenizer(),
                                np.random.default_rng(0))
    kept, changed = pieces(result)
    assert kept == "#!keep this" and changed.startswith("<P>")


# ---- the trainer's datasets, a tokenizer with FIM tokens ---------------------------------

FIM_TOKENS = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]


@pytest.fixture(scope="module")
def fim_corpus(tmp_path_factory, gpt2_files):
    """(a HF tokenizer directory with the FIM tokens, a corpus preprocessed with it, ending
    each document with <|endoftext|>)."""
    directory = tmp_path_factory.mktemp("fim")
    hf = Tokenizer.from_file(_gpt2_json(directory, gpt2_files))
    hf.add_special_tokens(FIM_TOKENS)
    hf.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(directory))
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    # what tools/preprocess_data.py --append-eod writes, without its worker processes
    prefix = str(directory / "code_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for text in TRAINING_TEXT:
        tokens = tokenizer.tokenize(text) + [tokenizer.eod]
        builder.add_document(np.asarray(tokens, dtype=np.int32), [len(tokens)])
    builder.finalize(prefix + ".idx")
    return str(directory), str(directory / "code_text_document")


def _gpt2_json(directory, gpt2_files):
    path = str(directory / "gpt2.json")
    build_tokenizer("GPT2BPETokenizer", *gpt2_files)._hf.save(path)
    return path


def _model(fim_corpus, *flags, tokenizer_flags=None):
    tokenizer, prefix = fim_corpus
    if tokenizer_flags is None:
        tokenizer_flags = ["--tokenizer-type", "HuggingFaceTokenizer",
                           "--tokenizer-model", tokenizer]
    return (TINY_MODEL_WITHOUT_DATA + tokenizer_flags + [
        "--data-path", prefix, "--split", "100,0,0", "--global-batch-size", "2",
        "--micro-batch-size", "1", "--train-iters", "2"] + list(flags))


def _train_samples(fim_corpus, *flags):
    from megatron.trainer.arguments import parse_args
    from megatron.trainer.gpt import datasets_provider

    # samples of several documents each
    args = parse_args(_model(fim_corpus, "--seq-length", "256", "--max-position-embeddings",
                             "256", *flags))
    train, _, _, tokenizer = datasets_provider(args)
    return train, tokenizer


def test_trainer_datasets_rearrange_with_the_tokenizers_fim_tokens(fim_corpus):
    train, tokenizer = _train_samples(fim_corpus, "--fim-data", "--fim-rate", "1",
                                      "--fim-spm-rate", "0")
    plain, _ = _train_samples(fim_corpus)
    prefix, middle, suffix, pad = (tokenizer.token_id(t) for t in FIM_TOKENS)
    eod = tokenizer.eod
    documents = set(TRAINING_TEXT)
    checked = 0
    for i in range(6):
        text = np.asarray(train[i]["tokens"]).tolist() + [int(train[i]["labels"][-1])]
        original = np.asarray(plain[i]["tokens"]).tolist()
        assert len(text) - 1 == len(original) and text != original + text[-1:]
        # every whole piece (between two EODs) is a PSM rearrangement of a document
        ends = [k for k, t in enumerate(text) if t == eod]
        for start, end in zip(ends, ends[1:]):
            piece = text[start + 1:end]
            assert piece[0] == prefix, piece
            s, m = piece.index(suffix), piece.index(middle)
            restored = (tokenizer.detokenize(piece[1:s]) + tokenizer.detokenize(piece[m + 1:])
                        + tokenizer.detokenize(piece[s + 1:m]))
            assert restored in documents
            checked += 1
    assert checked >= 6
    assert pad is not None
    # the HF tokenizer's text leaves its special tokens out (the FIM ones are)
    assert tokenizer.text_without_special_tokens(
        [prefix] + tokenizer.tokenize("x = 1") + [pad]) == "x = 1"


def test_fim_tokens_given_by_flag_to_a_gpt2_tokenizer(fim_corpus, gpt2_files):
    """Megatron-LM's way to FIM with a GPT-2 vocabulary: --tokenizer-special-tokens adds
    the FIM tokens (after its 300 entries, in order: the ids of the tokenizer holding
    them), and the training samples are those of that tokenizer."""
    vocab, merges = gpt2_files
    gpt2_flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                  "--merge-file", merges, "--tokenizer-special-tokens", *FIM_TOKENS]
    flags = ("--fim-data", "--fim-rate", "0.5", "--fim-spm-rate", "0.5")
    held, tokenizer = _train_samples(fim_corpus, *flags)
    from megatron.trainer.arguments import parse_args
    from megatron.trainer.gpt import datasets_provider

    args = parse_args(_model(fim_corpus, "--seq-length", "256", "--max-position-embeddings",
                             "256", *flags, tokenizer_flags=gpt2_flags))
    given, _, _, by_flag = datasets_provider(args)
    assert [by_flag.token_id(t) for t in FIM_TOKENS] == [tokenizer.token_id(t)
                                                         for t in FIM_TOKENS]
    assert by_flag.vocab_size == tokenizer.vocab_size
    for i in range(8):
        assert (np.asarray(given[i]["tokens"]).tolist()
                == np.asarray(held[i]["tokens"]).tolist())
    # without the flag the GPT-2 vocabulary lacks them: refused naming the flag
    from megatron.trainer.arguments import ArgumentErrors

    with pytest.raises(ArgumentErrors) as error:
        parse_args(_model(fim_corpus, *flags, tokenizer_flags=gpt2_flags[:6]))
    assert any("<fim_prefix>" in p for p in error.value.problems), error.value.problems


def test_a_sample_is_the_same_whatever_was_read_before(fim_corpus):
    flags = ("--fim-data", "--fim-rate", "0.5", "--fim-spm-rate", "0.5")
    first, _ = _train_samples(fim_corpus, *flags)
    again, _ = _train_samples(fim_corpus, *flags)
    forward = [np.asarray(first[i]["tokens"]).tolist() for i in range(8)]
    backward = [np.asarray(again[i]["tokens"]).tolist() for i in reversed(range(8))][::-1]
    assert forward == backward
    assert np.asarray(first[3]["tokens"]).tolist() == forward[3]  # read twice
    assert len({tuple(t) for t in forward}) == 8


def test_rate_zero_reads_the_plain_samples(fim_corpus):
    fim, _ = _train_samples(fim_corpus, "--fim-data", "--fim-rate", "0")
    plain, _ = _train_samples(fim_corpus)
    for i in range(6):
        assert np.array_equal(np.asarray(fim[i]["tokens"]), np.asarray(plain[i]["tokens"]))


# ---- the flags' checks ----------------------------------------------------------------------

def test_fim_flags_problems_name_the_flag(fim_corpus, gpt2_files):
    mock = TINY_MODEL + ["--global-batch-size", "2", "--fim-data", "--fim-rate", "1.5",
                         "--fim-split-sample", "|", "--dataloader-inter-document-masking"]
    problems, _ = argument_problems(mock)
    assert "--fim-rate 1.5 is a probability: give a value in [0, 1]" in problems
    assert ("--fim-split-sample needs --fim-fragment-rate (the probability that each "
            "fragment is rearranged)") in problems
    assert any(p.startswith("--fim-data rearranges the text of the documents, and "
                            "--mock-data's") for p in problems)
    assert any(p.startswith("--fim-data needs a tokenizer with a vocabulary") for p in problems)
    assert any(p.startswith("--fim-data with --dataloader-inter-document-masking")
               for p in problems)
    # a tokenizer without the FIM tokens: one line naming each missing one
    vocab, merges = gpt2_files
    plain_gpt2 = _model(fim_corpus, tokenizer_flags=[
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges])
    problems, _ = argument_problems(plain_gpt2 + ["--fim-data"])
    assert problems == [
        f"--fim-data: the tokenizer (--tokenizer-type GPT2BPETokenizer of {vocab}) has no "
        "--fim-prefix-token <fim_prefix>; no --fim-middle-token <fim_middle>; no "
        "--fim-suffix-token <fim_suffix>; no --fim-pad-token <fim_pad>: give the tokens your "
        "tokenizer has for them (e.g. --fim-prefix-token '<|fim_prefix|>'), or a tokenizer "
        "with FIM tokens"]
    problems, _ = argument_problems(_model(fim_corpus, "--fim-data", "--fim-split-sample", "<sep>",
                                   "--fim-fragment-rate", "0.5"))
    assert len(problems) == 1 and "no --fim-split-sample <sep>:" in problems[0]


def test_fim_flags_without_fim_data_are_noted(fim_corpus):
    problems, args = argument_problems(_model(fim_corpus, "--fim-rate", "0.9", "--fim-no-prefix", "#"))
    assert problems == []
    assert ("note: --fim-rate, --fim-no-prefix have no effect without --fim-data (as in "
            "Megatron-LM)") in args.flag_notes
    assert not any("fim" in note for note in argument_problems(_model(fim_corpus))[1].flag_notes)


@pytest.mark.distributed
def test_training_on_fim_data(fim_corpus):
    run = pretrain(_model(fim_corpus, "--fim-data", "--fim-rate", "0.9",
                          "--fim-split-sample", "<fim_pad>", "--fim-fragment-rate", "0.5"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert " iteration        2/       2 " in run.stdout, run.stdout[-2000:]


def test_settings_reject_nothing_with_all_tokens_present():
    from megatron.trainer.fim_arguments import fim_settings

    class Vocabulary:
        def token_id(self, token):
            return {"<fim_prefix>": 1, "<fim_middle>": 2, "<fim_suffix>": 3, "<fim_pad>": 4,
                    "<|endoftext|>": 5}.get(token)

    args = Namespace(fim_prefix_token="<fim_prefix>", fim_middle_token="<fim_middle>",
                     fim_suffix_token="<fim_suffix>", fim_pad_token="<fim_pad>",
                     fim_eod_token="<|endoftext|>", fim_split_sample=None, fim_rate=0.5,
                     fim_spm_rate=0.25, fim_fragment_rate=None, fim_no_prefix=None,
                     tokenizer_type="HuggingFaceTokenizer", tokenizer_model="t", vocab_file=None)
    assert fim_settings(args, Vocabulary()) == FimSettings(
        rate=0.5, spm_rate=0.25, prefix_id=1, middle_id=2, suffix_id=3, pad_id=4, eod_id=5)


def test_sentencepiece_tokenizers_find_tokens_and_drop_special_ones(tmp_path):
    from test_megatron_launch import _sentencepiece_model

    model = _sentencepiece_model(tmp_path)
    plain = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=model)
    piece = plain._sp.id_to_piece(10)
    assert [plain.token_id(t) for t in ("<EOD>", piece, "<unk>", "</s>", "<fim_prefix>")] == [
        302, 10, 0, 2, None]
    assert llama.token_id("<EOD>") is None  # Llama-2's adds no tokens
    ids = llama.tokenize("import os") + [plain.token_id("<EOD>"), llama.eod]  # bos first
    assert plain.text_without_special_tokens(ids) == "import os"
    assert llama.text_without_special_tokens(ids[:-2]) == "import os"
