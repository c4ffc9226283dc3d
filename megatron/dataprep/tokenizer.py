"""Tokenizers for preprocessing and training, behind one entry point: `build_tokenizer`.

All three subclass megatron-core's `MegatronTokenizerBase` (the type `GPTDatasetConfig`
expects) and carry `unique_identifiers`, which megatron-core's datasets hash into their
cache file names. Nothing here downloads anything.
"""

import json
import os
from collections import OrderedDict
from typing import List, Optional, Sequence

from megatron.core.tokenizers import MegatronTokenizerBase
from megatron.dataprep.names import (
    GPT2_EOD_TOKEN,
    SENTENCEPIECE_TYPES,
    TOKENIZER_TYPES,
    tokenizer_option_problems,
)

# Tried in order when a tokenizer.json says nothing about its end-of-document token.
_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
_PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")


class TokenizerError(ValueError):
    """A tokenizer cannot be built from the given files or options."""


class _Tokenizer(MegatronTokenizerBase):
    """What every tokenizer here shares: batch encoding and megatron-core's identifiers."""

    def __init__(self, path: Optional[str], **identity) -> None:
        super().__init__(path, {})
        self._identity = identity

    @property
    def unique_identifiers(self) -> OrderedDict:
        ids = OrderedDict(cls=type(self).__name__, path=self.path)
        ids.update((k, str(v)) for k, v in self._identity.items())
        return ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Encode many texts; the same ids as `tokenize` on each."""
        return [self.tokenize(t) for t in texts]

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} has no chat template")

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def pad(self) -> int:
        # megatron-core's datasets fall back to their own pad sentinel when this raises.
        raise NotImplementedError(f"{type(self).__name__} has no pad token")

    def token_id(self, token: str) -> Optional[int]:
        """The id of one vocabulary entry (e.g. a special token such as <fim_prefix>), or
        None where the vocabulary has no such entry."""
        return None

    def text_without_special_tokens(self, ids) -> str:
        """The text of `ids` with the special tokens (BOS, EOS, added control tokens) left
        out: what fill-in-the-middle cuts into pieces and encodes again."""
        return self.detokenize(ids)


class _HFTokenizer(_Tokenizer):
    """Wraps a `tokenizers.Tokenizer`."""

    def __init__(self, hf, path, eod: Optional[int], pad: Optional[int], **identity):
        super().__init__(path, **identity)
        self._hf = hf
        self._eod = eod
        self._pad = pad
        self._add_special = True

    def tokenize(self, text: str) -> List[int]:
        return self._hf.encode(text, add_special_tokens=self._add_special).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        # encode_batch_fast skips offset bookkeeping; the ids are identical.
        encs = self._hf.encode_batch_fast(list(texts), add_special_tokens=self._add_special)
        return [e.ids for e in encs]

    def detokenize(self, ids) -> str:
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_id(self, token: str) -> Optional[int]:
        return self._hf.token_to_id(token)

    def text_without_special_tokens(self, ids) -> str:
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def vocab(self) -> dict:
        return self._hf.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> dict:
        return {i: t for t, i in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        if self._eod is None:
            # NotImplementedError: what megatron-core's datasets expect of a missing token.
            raise NotImplementedError(
                f"tokenizer {self.path} has no end-of-document token "
                f"(looked for eos_token in tokenizer_config.json and {', '.join(_EOD_CANDIDATES)})"
            )
        return self._eod

    @property
    def pad(self) -> int:
        if self._pad is None:
            return super().pad
        return self._pad


class GPT2BPETokenizer(_HFTokenizer):
    """GPT-2's byte-level BPE from `vocab.json` + `merges.txt`.

    As in GPT-2's own encoder (and Megatron-LM's), `<|endoftext|>` is only the eod id: a
    literal "<|endoftext|>" inside a text is encoded as ordinary bytes, so a document can
    never smuggle an end-of-document into the middle of itself.
    """

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        _require_file(vocab_file, "--vocab-file", "GPT-2 vocab.json")
        _require_file(merge_file, "--merge-file", "GPT-2 merges.txt")
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as exc:  # the Rust error names neither flag nor file
            raise TokenizerError(
                f"--vocab-file/--merge-file: cannot read {vocab_file} + {merge_file} as GPT-2 "
                f"BPE files: {exc}"
            ) from exc
        hf = Tokenizer(model)
        # GPT-2's pre-tokenisation regex on the byte-to-unicode alphabet, no prefix space.
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.decoder = decoders.ByteLevel()
        eod = hf.token_to_id(GPT2_EOD_TOKEN)
        if eod is None:
            raise TokenizerError(
                f"--vocab-file: {vocab_file} has no {GPT2_EOD_TOKEN} token; GPT-2 vocabularies "
                f"end with it (tools/train_tokenizer.py adds it)"
            )
        super().__init__(hf, vocab_file, eod=eod, pad=None, merge_file=merge_file)


class HuggingFaceTokenizer(_HFTokenizer):
    """Any HF `tokenizer.json` (a file, or a directory holding one).

    Encoding applies the tokenizer's own post-processor (e.g. a BOS), as Megatron-LM's
    HuggingFaceTokenizer does. The eod id is `eos_token` from a `tokenizer_config.json`
    beside it, else the first of a few usual end tokens found in the vocabulary.
    """

    def __init__(self, tokenizer_model: str):
        from tokenizers import Tokenizer

        path = tokenizer_model
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        _require_file(path, "--tokenizer-model", "a HF tokenizer.json or a directory with one")
        try:
            hf = Tokenizer.from_file(path)
        except Exception as exc:
            raise TokenizerError(f"--tokenizer-model: cannot load {path}: {exc}") from exc
        config = _read_tokenizer_config(os.path.dirname(path))
        special = _special_token_texts(config)
        _register_special_tokens(hf, special)
        eod = _special_id(hf, special.get("eos_token"), _EOD_CANDIDATES)
        pad = _special_id(hf, special.get("pad_token"), _PAD_CANDIDATES)
        super().__init__(hf, path, eod=eod, pad=pad)
        self.tokenizer_config, self.special_tokens = config, special


class SentencePieceTokenizer(_Tokenizer):
    """A SentencePiece ``.model`` as Megatron-LM's SentencePieceTokenizer reads it: the
    model's pieces, then the special tokens it lacks (<CLS> <SEP> <EOD> <MASK>) appended
    with the next ids; documents end with <EOD>. Needs the sentencepiece package."""

    _SPECIALS = ("<CLS>", "<SEP>", "<EOD>", "<MASK>")

    def __init__(self, model_file: str):
        _require_file(model_file, "--tokenizer-model", "SentencePiece .model file")
        try:
            import sentencepiece
        except ImportError:
            raise TokenizerError(f"--tokenizer-type {type(self).__name__} needs the "
                                 "sentencepiece package: pip install sentencepiece") from None
        super().__init__(model_file)
        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self._added = {}
        for token in self._specials():
            if self._sp.piece_to_id(token) == self._sp.unk_id() and token != "<unk>":
                self._added[token] = self._sp.get_piece_size() + len(self._added)

    def _specials(self):
        return self._SPECIALS

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode(text)

    def detokenize(self, ids) -> str:
        pieces = [int(i) for i in ids if int(i) < self._sp.get_piece_size()]
        return self._sp.decode(pieces)

    def token_id(self, token: str) -> Optional[int]:
        if token in self._added:
            return self._added[token]
        piece = self._sp.piece_to_id(token)
        unknown = piece == self._sp.unk_id() and token != self._sp.id_to_piece(piece)
        return None if unknown else piece

    def text_without_special_tokens(self, ids) -> str:
        size = self._sp.get_piece_size()
        return self._sp.decode([int(i) for i in ids
                                if int(i) < size and not self._sp.is_control(int(i))])

    @property
    def vocab(self):
        vocab = {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}
        vocab.update(self._added)
        return vocab

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size() + len(self._added)

    @property
    def eod(self) -> int:
        return self._added.get("<EOD>", self._sp.piece_to_id("<EOD>"))


class Llama2Tokenizer(SentencePieceTokenizer):
    """Llama-2's SentencePiece model as Megatron-LM's Llama2Tokenizer uses it: every text
    starts with <s> (bos), documents end with </s> (eos); no tokens are added."""

    def _specials(self):
        return ()

    def tokenize(self, text: str) -> List[int]:
        return [self._sp.bos_id()] + self._sp.encode(text)

    @property
    def eod(self) -> int:
        return self._sp.eos_id()


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """A SentencePiece ``.model`` as Megatron-LM's GPTSentencePieceTokenizer reads it (the
    Nemotron and GPT SentencePiece models): the model's pieces, no tokens added, texts
    encoded without a BOS, documents end with its eos (</s>)."""

    def _specials(self):
        return ()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()


class NullTokenizer(_Tokenizer):
    """Text is whitespace-separated integer ids, as Megatron-LM's NullTokenizer.

    Megatron-LM's (0.18 and later) convention: `--vocab-size N` is the vocabulary, ids
    0..N-1, and the end-of-document id is N - 1 unless `--null-tokenizer-eod-id` gives
    another; `--null-tokenizer-pad-id` a pad id (-1, the default: none). (Megatron-LM 0.17
    and before added the end-of-document token: N + 1 entries, eod N.)
    """

    def __init__(self, vocab_size: int, eod_id: Optional[int] = None, pad_id: int = -1):
        if vocab_size is None or int(vocab_size) < 1:
            raise TokenizerError("--vocab-size: NullTokenizer needs --vocab-size N (N >= 1)")
        self._n = int(vocab_size)
        self._eod = self._n - 1 if eod_id is None else int(eod_id)
        self._pad = int(pad_id)
        super().__init__(None, vocab_size=self._n, eod_id=self._eod, pad_id=self._pad)

    def tokenize(self, text: str) -> List[int]:
        ids = []
        for word in text.split():
            try:
                i = int(word)
            except ValueError:
                raise ValueError(f"NullTokenizer: {word[:20]!r} is not an integer id") from None
            if not 0 <= i < self._n:
                raise ValueError(f"NullTokenizer: id {i} outside 0..{self._n - 1} (--vocab-size)")
            ids.append(i)
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab(self):
        raise NotImplementedError("NullTokenizer has no vocabulary")

    @property
    def vocab_size(self) -> int:
        return self._n

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        if self._pad == -1:
            return super().pad
        return self._pad


def build_tokenizer(
    tokenizer_type: str,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    tokenizer_model: Optional[str] = None,
    vocab_size: Optional[int] = None,
    include_special_tokens: bool = True,
    special_tokens: Optional[Sequence[str]] = None,
    null_eod_id: Optional[int] = None,
    null_pad_id: int = -1,
):
    """Build one of TOKENIZER_TYPES but SFTTokenizer (built with its prompt format by
    megatron.dataprep.sft_tokenizer); raises TokenizerError naming the flag to fix.
    ``include_special_tokens=False`` (--tokenizer-hf-no-include-special-tokens): HF
    tokenizers encode without their special tokens. ``null_eod_id`` / ``null_pad_id``
    (--null-tokenizer-eod-id / -pad-id): NullTokenizer's. ``special_tokens``
    (--tokenizer-special-tokens): added to an HF or GPT-2 tokenizer as Megatron-LM adds
    them (``add_special_tokens``)."""
    problems = tokenizer_option_problems(tokenizer_type, vocab_size, special_tokens,
                                         null_eod_id, null_pad_id)
    if problems:
        raise TokenizerError("; ".join(problems))
    if tokenizer_type == "NullTokenizer":
        tokenizer = NullTokenizer(vocab_size, null_eod_id, null_pad_id)
    else:
        tokenizer = _build(tokenizer_type, vocab_file, merge_file, tokenizer_model)
    if isinstance(tokenizer, _HFTokenizer):
        tokenizer._add_special = include_special_tokens
    if special_tokens:
        _add_special_tokens(tokenizer, special_tokens)
    return tokenizer


def _add_special_tokens(tokenizer, tokens: Sequence[str]) -> None:
    """--tokenizer-special-tokens, as Megatron-LM's HuggingFaceTokenizer (its GPT-2
    tokenizer too) adds them: each becomes a whole token in any text, one the vocabulary
    lacks appended after it (the vocabulary grows by those)."""
    _register_special_tokens(tokenizer._hf, {"additional_special_tokens": list(tokens)})
    tokenizer._identity["special_tokens"] = list(tokens)


def _build(tokenizer_type, vocab_file, merge_file, tokenizer_model):
    if tokenizer_type == "GPT2BPETokenizer":
        if not vocab_file or not merge_file:
            raise TokenizerError(
                "--vocab-file/--merge-file: GPT2BPETokenizer needs both (vocab.json and "
                "merges.txt; tools/train_tokenizer.py writes a pair)"
            )
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise TokenizerError(
                "--tokenizer-model: HuggingFaceTokenizer needs a tokenizer.json file or a "
                "directory holding one (nothing is downloaded)"
            )
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type in SENTENCEPIECE_TYPES:
        if not tokenizer_model:
            raise TokenizerError(f"--tokenizer-model: {tokenizer_type} needs a SentencePiece "
                                 ".model file")
        cls = {"SentencePieceTokenizer": SentencePieceTokenizer,
               "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
               "Llama2Tokenizer": Llama2Tokenizer}[tokenizer_type]
        return cls(tokenizer_model)
    if tokenizer_type == "SFTTokenizer":
        raise TokenizerError("--tokenizer-type SFTTokenizer is built with its prompt format: "
                             "megatron.dataprep.sft_tokenizer.SFTTokenizer")
    raise TokenizerError(
        f"--tokenizer-type: unknown {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}"
    )


def _require_file(path: str, flag: str, what: str) -> None:
    if not os.path.isfile(path):
        raise TokenizerError(f"{flag}: {path} does not exist (expected {what})")


def _read_tokenizer_config(directory: str) -> dict:
    """tokenizer_config.json beside a tokenizer.json ({} where there is none)."""
    try:
        with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")


def _special_token_texts(config: dict) -> dict:
    """The special tokens a tokenizer_config.json names (bos_token, eos_token, ...,
    additional_special_tokens), as texts (they appear as strings or {"content": ...})."""
    def text(value):
        return value.get("content") if isinstance(value, dict) else value

    out = {name: text(config[name]) for name in _SPECIAL_TOKEN_NAMES
           if isinstance(text(config.get(name)), str)}
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        out["additional_special_tokens"] = [t for t in map(text, extra) if isinstance(t, str)]
    return out


def _register_special_tokens(hf, special: dict) -> None:
    """The special tokens tokenizer_config.json names become whole tokens in any text, as
    transformers (Megatron-LM's HuggingFaceTokenizer) makes them on loading, also where
    tokenizer.json lists them as ordinary vocabulary entries; one it lacks is appended,
    as transformers appends it."""
    from tokenizers import AddedToken

    texts = [t for name, t in special.items() if name != "additional_special_tokens"]
    texts += special.get("additional_special_tokens", [])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in texts if t])


def _special_id(hf, preferred: Optional[str], candidates: Sequence[str]) -> Optional[int]:
    for token in ((preferred,) if preferred else ()) + tuple(candidates):
        token_id = hf.token_to_id(token)
        if token_id is not None:
            return token_id
    return None
