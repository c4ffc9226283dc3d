"""Tokenizers of megatron.dataprep: GPT-2 BPE semantics, Unicode round trips, Null, HF."""

import json

import pytest
import regex
from megatron.core.tokenizers import MegatronTokenizerBase
from tokenizers import Tokenizer, processors

from megatron.dataprep.names import GPT2_EOD_TOKEN, TOKENIZER_TYPES
from megatron.dataprep.tokenizer import TokenizerError, build_tokenizer
from test_dataprep_fixtures import UNICODE_SAMPLES, gpt2, gpt2_files  # noqa: F401

# ---- an independent GPT-2 encoder: byte->unicode table, GPT-2 regex, merges by rank ----

GPT2_SPLIT = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


def byte_symbols():
    """GPT-2 maps each byte to a printable character; printable Latin-1 maps to itself."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def reference_encode(text, vocab, ranks):
    table = byte_symbols()
    ids = []
    for piece in GPT2_SPLIT.findall(text):
        word = [table[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            pairs = [(ranks.get((a, b), float("inf")), i) for i, (a, b) in enumerate(zip(word, word[1:]))]
            rank, _ = min(pairs)
            if rank == float("inf"):
                break
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and ranks.get((word[i], word[i + 1])) == rank:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        ids.extend(vocab[w] for w in word)
    return ids


def load_reference(gpt2_files):
    vocab_path, merges_path = gpt2_files
    with open(vocab_path, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(merges_path, encoding="utf-8") as f:
        lines = [l.rstrip("\n") for l in f if l.strip() and not l.startswith("#version")]
    ranks = {tuple(l.split(" ")): r for r, l in enumerate(lines)}
    return vocab, ranks


def test_gpt2_matches_an_independent_gpt2_encoder(gpt2, gpt2_files):
    vocab, ranks = load_reference(gpt2_files)
    texts = UNICODE_SAMPLES + ["it's they're we've I'm you'll he'd", "x  =  1\n\n\n  y", "¡¬®ÿ\x7f\x00"]
    for text in texts:
        assert gpt2.tokenize(text) == reference_encode(text, vocab, ranks), text


@pytest.mark.parametrize("text", UNICODE_SAMPLES)
def test_gpt2_round_trips_unicode(gpt2, text):
    ids = gpt2.tokenize(text)
    assert ids and all(0 <= i < gpt2.vocab_size for i in ids)
    assert gpt2.detokenize(ids) == text
    assert gpt2.tokenize_batch([text, text]) == [ids, ids]


def test_gpt2_vocab_layout_and_eod(gpt2, gpt2_files):
    vocab, _ = load_reference(gpt2_files)
    assert gpt2.vocab_size == len(vocab) == 300
    assert gpt2.eod == vocab[GPT2_EOD_TOKEN] == 299  # last, as in GPT-2 (50256 of 50257)
    assert gpt2.detokenize([gpt2.eod]) == GPT2_EOD_TOKEN
    # A literal "<|endoftext|>" in a text is ordinary bytes, never the eod id (as in GPT-2).
    assert gpt2.eod not in gpt2.tokenize("a <|endoftext|> b")
    with pytest.raises(NotImplementedError):
        gpt2.pad  # no pad token: megatron-core's datasets then use their own sentinel


def test_tokenizers_are_megatron_core_tokenizers(gpt2):
    null = build_tokenizer("NullTokenizer", vocab_size=7)
    for tok in (gpt2, null):
        assert isinstance(tok, MegatronTokenizerBase)
        json.dumps(tok.unique_identifiers)  # hashed into megatron-core's cache names


def test_null_tokenizer_follows_megatron_lm():
    """As Megatron-LM 0.18+ (megatron-core's NullTokenizer, checked against 0.19.2's by
    hand): --vocab-size is the vocabulary, eod its last id unless given, no pad."""
    tok = build_tokenizer("NullTokenizer", vocab_size=10)
    assert (tok.vocab_size, tok.eod) == (10, 9)  # ids 0..9, eod = --vocab-size - 1
    with pytest.raises(NotImplementedError):
        tok.pad
    given = build_tokenizer("NullTokenizer", vocab_size=10, null_eod_id=0, null_pad_id=3)
    assert (given.vocab_size, given.eod, given.pad) == (10, 0, 3)
    with pytest.raises(TokenizerError, match="--null-tokenizer-eod-id 10: outside"):
        build_tokenizer("NullTokenizer", vocab_size=10, null_eod_id=10)
    assert tok.tokenize("1 2  3\n4\t9") == [1, 2, 3, 4, 9]
    assert tok.detokenize([1, 2, 3]) == "1 2 3"
    assert tok.tokenize("   ") == []
    with pytest.raises(ValueError, match="not an integer"):
        tok.tokenize("1 two")
    with pytest.raises(ValueError, match="outside 0..9"):
        tok.tokenize("10")


def bos_tokenizer_dir(tmp_path, gpt2_files):
    """(a directory holding a tokenizer.json whose post-processor adds a BOS, its BOS id)."""
    hf = Tokenizer.from_file(_gpt2_tokenizer_json(tmp_path, gpt2_files))
    hf.add_special_tokens(["<s>", "</s>"])
    hf.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", hf.token_to_id("<s>"))]
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return str(tmp_path), hf.token_to_id("<s>")


def test_huggingface_tokenizer_from_a_directory(tmp_path, gpt2_files):
    bos_tokenizer_dir(tmp_path, gpt2_files)
    hf = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert tok.eod == hf.token_to_id("</s>")
    assert tok.vocab_size == 302
    text = UNICODE_SAMPLES[1]
    assert tok.tokenize(text) == hf.encode(text).ids  # with the BOS its post-processor adds
    assert tok.tokenize(text)[0] == hf.token_to_id("<s>")
    assert tok.tokenize_batch([text]) == [tok.tokenize(text)]
    assert tok.detokenize(tok.tokenize(text)[1:]) == text
    plain = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path),
                            include_special_tokens=False)  # --tokenizer-hf-no-include-...
    assert plain.tokenize(text) == tok.tokenize(text)[1:]
    assert plain.tokenize_batch([text]) == [tok.tokenize(text)[1:]]


def test_huggingface_tokenizer_file_without_config_finds_endoftext(tmp_path, gpt2_files):
    path = _gpt2_tokenizer_json(tmp_path, gpt2_files)
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path)
    assert tok.eod == 299
    assert tok.tokenize("hello") == build_tokenizer("GPT2BPETokenizer", *gpt2_files).tokenize("hello")


def test_huggingface_tokenizer_makes_the_configs_special_tokens_whole(tmp_path, gpt2_files):
    """As transformers loads a tokenizer (Megatron-LM's HuggingFaceTokenizer): the special
    tokens tokenizer_config.json names are whole tokens in any text, also where
    tokenizer.json has them as ordinary vocabulary entries; one it lacks is appended."""
    _gpt2_tokenizer_json(tmp_path, gpt2_files)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|endoftext|>"}, "unk_token": "<unk>",
         "additional_special_tokens": ["<tool>"]}))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    gpt2 = build_tokenizer("GPT2BPETokenizer", *gpt2_files)
    assert tok.eod == gpt2.eod == 299 and tok.vocab_size == 302
    assert tok.tokenize("a <|endoftext|> b") == (gpt2.tokenize("a ") + [299]
                                                 + gpt2.tokenize(" b"))
    assert tok.tokenize("<unk><tool>") == [300, 301]
    assert gpt2.eod not in gpt2.tokenize("a <|endoftext|> b")  # GPT-2's files: bytes


def test_special_tokens_flag_adds_whole_tokens_as_megatron_lm(tmp_path, gpt2_files):
    """--tokenizer-special-tokens, as Megatron-LM's HuggingFaceTokenizer adds them (checked
    against megatron-core 0.19.2's with transformers, by hand: the same vocabulary size
    and ids for these texts): tokens the vocabulary lacks are appended in order, one it
    holds ("in", "<|endoftext|>") keeps its id and becomes a whole token in any text."""
    _gpt2_tokenizer_json(tmp_path, gpt2_files)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    special = ["<fim_prefix>", "<fim_middle>", "<|endoftext|>", "in", "<tool>"]
    plain = build_tokenizer("GPT2BPETokenizer", *gpt2_files)
    for tok in (build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path),
                                special_tokens=special),
                build_tokenizer("GPT2BPETokenizer", *gpt2_files, special_tokens=special)):
        in_id = plain.token_id("in")
        assert tok.vocab_size == plain.vocab_size + 3 == 303 and tok.eod == 299
        assert [tok.token_id(t) for t in special] == [300, 301, 299, in_id, 302]
        assert tok.tokenize("a<fim_prefix>b<fim_middle>c") == (
            plain.tokenize("a") + [300] + plain.tokenize("b") + [301] + plain.tokenize("c"))
        assert tok.tokenize("x <|endoftext|> y") == (plain.tokenize("x ") + [299]
                                                     + plain.tokenize(" y"))
        assert tok.tokenize("int") == [in_id] + plain.tokenize("t")
        assert tok.unique_identifiers["special_tokens"] == str(special)
    assert plain.tokenize("int") != [in_id] + plain.tokenize("t")  # one token, "int"
    with pytest.raises(TokenizerError, match="--tokenizer-special-tokens .* not to NullTokenizer"):
        build_tokenizer("NullTokenizer", vocab_size=10, special_tokens=["<x>"])


def _gpt2_tokenizer_json(directory, gpt2_files):
    path = str(directory / "tokenizer.json")
    build_tokenizer("GPT2BPETokenizer", *gpt2_files)._hf.save(path)
    return path


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(tokenizer_type="GPT2BPETokenizer"), "--vocab-file"),
        (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="nope.json", merge_file="m.txt"),
         "--vocab-file"),
        (dict(tokenizer_type="HuggingFaceTokenizer"), "--tokenizer-model"),
        (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/nonexistent"),
         "--tokenizer-model"),
        (dict(tokenizer_type="NullTokenizer"), "--vocab-size"),
        (dict(tokenizer_type="SentencePiece"), "--tokenizer-type"),
    ],
)
def test_build_tokenizer_errors_name_the_flag(kwargs, flag):
    with pytest.raises(TokenizerError, match=flag):
        build_tokenizer(**kwargs)


def test_vocab_without_endoftext_is_refused(tmp_path, gpt2_files):
    vocab = json.loads(open(gpt2_files[0], encoding="utf-8").read())
    del vocab[GPT2_EOD_TOKEN]
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    with pytest.raises(TokenizerError, match="<\\|endoftext\\|>"):
        build_tokenizer("GPT2BPETokenizer", str(tmp_path / "vocab.json"), gpt2_files[1])


def test_tokenizer_type_names():
    """Every --tokenizer-type Megatron-LM takes is built here or refused with its reason
    (in the trainer and tools/preprocess_data.py), never argparse's 'invalid choice'."""
    from megatron_lm_parser import megatron_lm_choices
    from megatron.dataprep.names import REFUSED_TOKENIZER_TYPES
    from megatron.trainer.arguments import ArgumentErrors, parse_args

    assert TOKENIZER_TYPES == ("GPT2BPETokenizer", "HuggingFaceTokenizer",
                               "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                               "Llama2Tokenizer", "NullTokenizer", "SFTTokenizer")
    theirs = megatron_lm_choices("--tokenizer-type")
    if theirs is not None:  # megatron-core 0.19 ships Megatron-LM's parser
        assert set(theirs) == set(TOKENIZER_TYPES) | set(REFUSED_TOKENIZER_TYPES)
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--train-iters", "1", "--mock-data",
            "--global-batch-size", "1"]
    for name, reason in REFUSED_TOKENIZER_TYPES.items():
        with pytest.raises(ArgumentErrors) as error:
            parse_args(base + ["--tokenizer-type", name], world_size=1, cuda_available=False,
                       check_files=False)
        assert f"--tokenizer-type {name} is refused: {reason}" in error.value.problems
