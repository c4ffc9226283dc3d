"""Megatron-LM's fill-in-the-middle data (--fim-data): samples of code rearranged so that
the model learns to write a middle part from the text before and after it.

Each sample of megatron-core's GPTDataset is cut at the end-of-document tokens
(--fim-eod-token); with probability --fim-rate a piece is decoded to text, cut at two
random characters into prefix, middle and suffix, encoded again and laid out as

    PSM: <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle
    SPM: <fim_prefix> <fim_suffix> suffix <fim_middle> prefix middle   (--fim-spm-rate)

With --fim-split-sample TOKEN a piece holding that token (e.g. a file separator in a
repository-level sample) is, with probability --fim-rate, rearranged fragment by fragment
(each with --fim-fragment-rate); --fim-no-prefix TEXT leaves pieces whose text starts with
TEXT as they are. The sample keeps its length: what the rearrangement adds is cut from
the end, what it saves is filled with <fim_pad>.

Unlike Megatron-LM, whose dataset draws every choice from one random stream in the order
the samples are read (so a sample's rearrangement depends on which samples were read
before it: data-loader workers, a resume), the choices of sample ``i`` come from a stream
seeded with (--seed, i): a resumed or re-read sample is the same sample. An empty piece
(two end-of-document tokens in a row) keeps its end-of-document token, which Megatron-LM
drops.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class FimSettings:
    rate: float
    spm_rate: float
    prefix_id: int
    middle_id: int
    suffix_id: int
    pad_id: int
    eod_id: int
    split_id: Optional[int] = None  # --fim-split-sample's token
    fragment_rate: Optional[float] = None
    no_prefix: Optional[str] = None


def fill_in_the_middle(sample, settings: FimSettings, tokenizer, rng) -> np.ndarray:
    """``sample`` (token ids) rearranged as above, as many ids long; ``tokenizer`` decodes
    and encodes the pieces, ``rng`` (a numpy Generator) makes the choices."""
    sample = np.asarray(sample, dtype=np.int64)
    pieces = []
    start = 0
    for end in np.flatnonzero(sample == settings.eod_id):
        pieces += [_rearrange(sample[start:end], settings, tokenizer, rng),
                   [settings.eod_id]]
        start = end + 1
    pieces.append(_rearrange(sample[start:], settings, tokenizer, rng))
    result = np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces])
    if len(result) >= len(sample):
        return result[:len(sample)]
    return np.concatenate([result, np.full(len(sample) - len(result), settings.pad_id,
                                           dtype=np.int64)])


def _rearrange(piece, settings, tokenizer, rng):
    if len(piece) == 0:
        return piece
    if settings.split_id is None or not np.any(piece == settings.split_id):
        return _permute(piece, settings.rate, settings, tokenizer, rng)
    if not rng.binomial(1, settings.rate):
        return piece
    fragments = []
    start = 0
    for end in np.flatnonzero(piece == settings.split_id):
        if end > start:
            fragments += [_permute(piece[start:end], settings.fragment_rate, settings,
                                   tokenizer, rng), [settings.split_id]]
        start = end + 1
    fragments.append(_permute(piece[start:], settings.fragment_rate, settings, tokenizer, rng))
    return np.concatenate([np.asarray(f, dtype=np.int64) for f in fragments])


def _permute(piece, rate, settings, tokenizer, rng):
    if not rng.binomial(1, rate):
        return piece
    text = tokenizer.text_without_special_tokens(piece)
    if settings.no_prefix is not None and text.startswith(settings.no_prefix):
        return piece
    # each cut may fall at either end: a part may be empty
    first, second = sorted(int(c) for c in rng.integers(0, len(text) + 1, size=2))

    def encoded(part):
        return np.asarray(tokenizer.tokenize(part), dtype=np.int64)

    prefix, middle, suffix = (encoded(text[:first]), encoded(text[first:second]),
                              encoded(text[second:]))
    s = settings
    if rng.binomial(1, s.spm_rate):
        return np.concatenate([[s.prefix_id, s.suffix_id], suffix, [s.middle_id], prefix,
                               middle])
    return np.concatenate([[s.prefix_id], prefix, [s.suffix_id], suffix, [s.middle_id],
                           middle])


class FillInTheMiddle:
    """Mixed into megatron-core's GPTDataset (``with_fim``): every sample's token ids go
    through ``fill_in_the_middle`` with its own random stream. The class attribute
    ``fim_settings`` holds the FimSettings."""

    fim_settings: FimSettings = None

    def _query_document_sample_shuffle_indices(self, idx):
        # megatron-core returns (ids, document ids) or, from 0.19, also the documents'
        # lengths; only the ids change
        parts = super()._query_document_sample_shuffle_indices(idx)
        text = parts[0]
        # the padding megatron-core appends to a short last sample stays as it is
        kept = np.flatnonzero(text != self._pad_token_id)
        end = int(kept[-1]) + 1 if len(kept) else 0
        rng = np.random.default_rng([int(self.config.random_seed), int(idx)])
        text = np.concatenate([fill_in_the_middle(text[:end], self.fim_settings,
                                                  self.config.tokenizer, rng), text[end:]])
        return (text,) + tuple(parts[1:])


def with_fim(dataset_class, settings: FimSettings):
    """`dataset_class` (megatron-core's GPTDataset) with FillInTheMiddle; its name is kept,
    so megatron-core's index cache is the one the plain class builds."""
    return type(dataset_class.__name__, (FillInTheMiddle, dataset_class),
                {"fim_settings": settings})
