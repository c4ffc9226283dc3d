"""megatron-core's GPTDataset / BlendedDataset over preprocess_data.py output."""

import numpy
import pytest
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.dataprep.gpt_datasets import DataPathError, build_gpt_datasets, parse_data_path
from megatron.dataprep.tokenizer import build_tokenizer
from test_dataprep_fixtures import gpt2, gpt2_args, gpt2_files, run_preprocess, write_jsonl  # noqa: F401

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

VOCAB = 1001  # NullTokenizer: text ids 0..999, eod 1000 (its last id)
HALF = 500  # prefix "a" uses ids below, prefix "b" ids from here


def null_prefix(tmp_path, name, first_id, count, seed):
    """`count` documents of increasing ids starting at first_id: each id appears once."""
    rng = numpy.random.default_rng(seed)
    docs, at = [], first_id
    for _ in range(count):
        n = int(rng.integers(1, 9))
        docs.append(list(range(at, at + n)))
        at += n
    assert at <= first_id + HALF
    src = write_jsonl(tmp_path / f"{name}.jsonl", [{"text": " ".join(map(str, d))} for d in docs])
    assert run_preprocess("--input", src, "--output-prefix", tmp_path / name, "--append-eod",
                          "--tokenizer-type", "NullTokenizer", "--vocab-size", VOCAB) == 0
    return str(tmp_path / f"{name}_text_document"), docs


def window(sample):
    """The seq_length + 1 tokens a sample was cut from."""
    tokens, labels = sample["tokens"].tolist(), sample["labels"].tolist()
    assert tokens[1:] == labels[:-1]
    return tokens + labels[-1:]


def assert_cut_from_documents(win, docs, eod):
    """Between eods, a window holds pieces of whole documents, in document order."""
    pieces, piece = [], []
    for t in win:
        if t == eod:
            pieces.append((piece, True))
            piece = []
        else:
            piece.append(t)
    pieces.append((piece, False))
    for i, (piece, ends_doc) in enumerate(pieces):
        if not piece:
            continue
        owner = next(d for d in docs if piece[0] in d)  # every id belongs to one document
        start = owner.index(piece[0])
        assert owner[start:start + len(piece)] == piece
        if ends_doc:
            assert start + len(piece) == len(owner)  # an eod follows the document's last id
        if i > 0:
            assert start == 0  # after an eod, a document starts from its beginning


def test_gpt_dataset_samples_are_the_documents(tmp_path):
    tok = build_tokenizer("NullTokenizer", vocab_size=VOCAB)
    prefix, docs = null_prefix(tmp_path, "a", 0, 20, seed=1)
    train, valid, test = build_gpt_datasets(
        [prefix], "100,0,0", 16, 1234, tok, [40, 0, 0], data_cache_path=str(tmp_path / "cache"))
    assert isinstance(train, GPTDataset) and valid is None and test is None
    assert len(train) >= 40
    seen = set()
    for i in range(len(train)):
        win = window(train[i])
        assert len(win) == 17
        assert_cut_from_documents(win, docs, tok.eod)
        seen.update(t for t in win if t != tok.eod)
    assert seen == {t for d in docs for t in d}  # several epochs: every token is used
    assert list((tmp_path / "cache").iterdir())  # indices cached for the next run


def test_reset_position_ids_and_eod_mask_loss(tmp_path):
    tok = build_tokenizer("NullTokenizer", vocab_size=VOCAB)
    prefix, _ = null_prefix(tmp_path, "a", 0, 20, seed=2)
    train, _, _ = build_gpt_datasets([prefix], "1", 24, 7, tok, [10, 0, 0],
                                     reset_position_ids=True, eod_mask_loss=True)
    for i in range(len(train)):
        s = train[i]
        tokens, pos, loss = s["tokens"].tolist(), s["position_ids"].tolist(), s["loss_mask"]
        for k in range(1, len(tokens)):
            assert pos[k] == (0 if tokens[k - 1] == tok.eod else pos[k - 1] + 1)
        assert (loss[s["tokens"] == tok.eod] == 0).all()


def test_pad_equal_to_eod_is_masked_only_when_allowed(tmp_path):
    """--allow-ambiguous-pad-tokens: a tokenizer whose pad id is its EOD's (as some HF
    tokenizers set pad = EOS). megatron-core masks no pad by default then (EOD stays a
    token and a target); with the flag the pad id is masked out of the loss, in each
    sample at its own positions (megatron-core's cached loss mask carried the first
    sample's masked positions into every later one: gpt_datasets.py turns the cache off)."""
    tok = build_tokenizer("NullTokenizer", vocab_size=VOCAB)
    tok.__class__ = type("PadIsEod", (type(tok),), {"pad": property(lambda self: self.eod)})
    prefix, _ = null_prefix(tmp_path, "a", 0, 20, seed=2)

    def build(allow):
        train = build_gpt_datasets([prefix], "1", 24, 7, tok, [10, 0, 0],
                                   allow_ambiguous_pad_tokens=allow)[0]
        assert train.config.allow_ambiguous_pad_tokens == allow
        return [train[i] for i in range(len(train))]

    eod_targets = 0
    for kept, masked in zip(build(False), build(True)):  # the same samples (same seed)
        at_eod = kept["labels"] == tok.eod
        eod_targets += int(at_eod.sum())
        assert (kept["loss_mask"][at_eod] == 1).all()
        # megatron-core masks the pad id out of the loss (and writes 0 in its place)
        assert (masked["loss_mask"][at_eod] == 0).all() and (masked["labels"][at_eod] == 0).all()
        assert (masked["loss_mask"][~at_eod] == 1).all()
    assert eod_targets > 0


def test_mid_level_dataset_surplus_reaches_the_blend(tmp_path):
    tok = build_tokenizer("NullTokenizer", vocab_size=VOCAB)
    a, _ = null_prefix(tmp_path, "a", 0, 25, seed=3)
    b, _ = null_prefix(tmp_path, "b", HALF, 25, seed=4)
    sizes = {}
    for surplus in (0.005, 0.5):
        train = build_gpt_datasets(["0.25", a, "0.75", b], "100,0,0", 8, 5, tok, [400, 0, 0],
                                   mid_level_dataset_surplus=surplus)[0]
        assert train.config.mid_level_dataset_surplus == surplus
        sizes[surplus] = [len(dataset) for dataset in train.datasets]
    # each prefix's dataset is built that much larger than its share of the blend
    assert all(big > small for big, small in zip(sizes[0.5], sizes[0.005])), sizes


def test_weighted_blend_of_two_prefixes(tmp_path):
    tok = build_tokenizer("NullTokenizer", vocab_size=VOCAB)
    a, docs_a = null_prefix(tmp_path, "a", 0, 25, seed=3)
    b, docs_b = null_prefix(tmp_path, "b", HALF, 25, seed=4)
    train, _, _ = build_gpt_datasets(["0.25", a, "0.75", b], "100,0,0", 8, 5, tok, [400, 0, 0],
                                     data_cache_path=str(tmp_path / "cache"))
    assert isinstance(train, BlendedDataset) and len(train) == 400
    from_a = 0
    for i in range(len(train)):
        win = window(train[i])
        ids = [t for t in win if t != tok.eod]
        source = train.dataset_index[i]
        assert all((t < HALF) == (source == 0) for t in ids)  # each sample from one prefix
        assert_cut_from_documents(win, docs_a if source == 0 else docs_b, tok.eod)
        from_a += source == 0
    assert from_a == pytest.approx(100, abs=2)


def test_gpt2_output_reads_back(tmp_path, gpt2, gpt2_args):
    texts = [f"document {i}: def f{i}(x):\n    return x + {i}\n" for i in range(30)]
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    assert run_preprocess("--input", src, "--output-prefix", tmp_path / "gpt", *gpt2_args,
                          "--append-eod") == 0
    prefix = str(tmp_path / "gpt_text_document")
    train, valid, _ = build_gpt_datasets([prefix], "90,10,0", 32, 1, gpt2, [20, 4, 0])
    assert len(train) >= 20 and len(valid) >= 4
    indexed = IndexedDataset(prefix)  # alive while its mmap-backed arrays are read
    stream = numpy.concatenate([indexed[i] for i in range(len(texts))]).tolist()
    for ds in (train, valid):
        for i in range(len(ds)):
            win = window(ds[i])
            text = gpt2.detokenize(win)
            assert any(piece in "".join(texts) for piece in text.split("<|endoftext|>") if piece)
            assert set(win) <= set(stream)


def test_mock_datasets(gpt2):
    train, valid, test = build_gpt_datasets(None, "98,1,1", 16, 1, gpt2, [8, 2, 2], mock=True)
    assert isinstance(train, MockGPTDataset)
    assert train[0]["tokens"].shape == (16,)


def test_data_path_parsing_and_errors(tmp_path):
    tok = build_tokenizer("NullTokenizer", vocab_size=VOCAB)
    a, _ = null_prefix(tmp_path, "a", 0, 3, seed=5)
    assert parse_data_path([a]) == ([a], None)
    assert parse_data_path(["1", a, "3", a]) == ([a, a], [1.0, 3.0])
    assert parse_data_path([a, a]) == ([a, a], None)
    with pytest.raises(DataPathError, match="--data-path: .*missing.bin and .*missing.idx"):
        parse_data_path([str(tmp_path / "missing")])
    with pytest.raises(DataPathError, match="--data-path: give the prefix without .bin"):
        parse_data_path([a + ".bin"])
    with pytest.raises(DataPathError, match="--data-path"):
        parse_data_path(["0.5", a, a])
    with pytest.raises(DataPathError, match="--data-path"):
        parse_data_path([])
    # 3 documents cannot give each of train, valid and test some: an error, not a hang.
    with pytest.raises(DataPathError, match="--split: .*valid split"):
        build_gpt_datasets([a], "98,1,1", 8, 1, tok, [4, 1, 1])
    with pytest.raises(DataPathError, match="--split"):
        build_gpt_datasets([a], "0,0,0", 8, 1, tok, [4, 1, 1])
