"""Worker side of preprocessing: one chunk of raw lines/rows in, token ids and skips out.

Every item either becomes a document for each key or is reported as skipped with its
line number and a reason from SKIP_REASONS; nothing is dropped silently. Token ids come
back as one flat numpy array per key, cheap to send between processes.
"""

import itertools
import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy

# Reason -> what it means, in the order summaries list them.
SKIP_REASONS = {
    "blank_line": "line holds no JSON value",
    "invalid_utf8": "not valid UTF-8, or a lone surrogate",
    "malformed_json": "not a JSON object",
    "missing_key": "key absent",
    "non_string": "value is not a string",
    "empty": "empty text",
    "empty_after_encoding": "no tokens after encoding",
    "encode_error": "tokenizer rejected the text",
}


@dataclass
class Skip:
    number: int  # line (1-based) or row (0-based) within the source
    reason: str
    key: Optional[str]  # None: the whole line is unusable, for every key
    detail: str = ""


@dataclass
class KeyOutput:
    ids: numpy.ndarray  # all tokens of the chunk's documents, back to back
    sequence_lengths: numpy.ndarray  # one per sentence (or per document)
    sequences_per_document: numpy.ndarray


@dataclass
class ChunkResult:
    source: int
    items: int
    text_bytes: int  # UTF-8 bytes of the text of the first key, the unit of MB/s
    outputs: Dict[str, KeyOutput]
    skips: List[Skip] = field(default_factory=list)


class ChunkEncoder:
    def __init__(self, tokenizer, keys: Sequence[str], dtype, append_eod=False, splitter=None):
        self.tokenizer = tokenizer
        self.keys = list(keys)
        self.dtype = dtype
        self.eod = tokenizer.eod if append_eod else None
        self.splitter = splitter

    def __call__(self, chunk) -> ChunkResult:
        skips: List[Skip] = []
        records = self._parse(chunk, skips)
        result = ChunkResult(chunk.source, len(chunk.items), 0, {}, skips)
        for n, key in enumerate(self.keys):
            texts, numbers, text_bytes = self._texts(records, key, skips)
            if n == 0:
                result.text_bytes = text_bytes
            result.outputs[key] = self._encode(texts, numbers, key, skips)
        skips.sort(key=lambda s: s.number)
        return result

    def _parse(self, chunk, skips: List[Skip]) -> List[Tuple[int, dict]]:
        records = []
        for number, item in enumerate(chunk.items, start=chunk.first):
            if isinstance(item, dict):  # a row of a saved dataset
                records.append((number, item))
                continue
            if not item.strip():
                skips.append(Skip(number, "blank_line", None))
                continue
            try:
                line = item.decode("utf-8")
            except UnicodeDecodeError as exc:
                skips.append(Skip(number, "invalid_utf8", None, f"byte {exc.start}"))
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                skips.append(Skip(number, "malformed_json", None, str(exc)))
                continue
            if not isinstance(record, dict):
                skips.append(Skip(number, "malformed_json", None, f"a JSON {type(record).__name__}"))
                continue
            records.append((number, record))
        return records

    def _texts(self, records, key: str, skips: List[Skip]):
        texts, numbers, text_bytes = [], [], 0
        for number, record in records:
            if key not in record:
                skips.append(Skip(number, "missing_key", key))
                continue
            text = record[key]
            if not isinstance(text, str):
                skips.append(Skip(number, "non_string", key, type(text).__name__))
                continue
            if not text:
                skips.append(Skip(number, "empty", key))
                continue
            try:
                text_bytes += len(text.encode("utf-8"))  # "\ud800" in JSON gives unencodable str
            except UnicodeEncodeError as exc:
                skips.append(Skip(number, "invalid_utf8", key, f"lone surrogate at char {exc.start}"))
                continue
            texts.append(text)
            numbers.append(number)
        return texts, numbers, text_bytes

    def _encode(self, texts, numbers, key, skips) -> KeyOutput:
        if self.splitter is None:
            pieces = [[t] for t in texts]
        else:
            pieces = [self.splitter.split(t) for t in texts]
        flat = list(itertools.chain.from_iterable(pieces))
        encoded = self._tokenize(flat, pieces, numbers, key, skips)

        docs: List[List[List[int]]] = []  # document -> sentences -> ids
        at = 0
        for number, parts in zip(numbers, pieces):
            parts_ids = encoded[at:at + len(parts)]
            at += len(parts)
            if any(s is None for s in parts_ids):
                continue  # reported as encode_error already
            sentences = [s for s in parts_ids if s]  # a sentence can encode to nothing
            if not sentences:
                skips.append(Skip(number, "empty_after_encoding", key))
                continue
            if self.eod is not None:
                sentences[-1] = sentences[-1] + [self.eod]
            docs.append(sentences)
        return _pack(docs, self.dtype)

    def _tokenize(self, flat, pieces, numbers, key, skips) -> List[Optional[List[int]]]:
        try:
            return self.tokenizer.tokenize_batch(flat)
        except Exception:
            pass
        # Find the culprits one document at a time (NullTokenizer rejects non-integers).
        out: List[Optional[List[int]]] = []
        for number, parts in zip(numbers, pieces):
            try:
                out.extend([self.tokenizer.tokenize(p) for p in parts])  # all or none
            except Exception as exc:
                skips.append(Skip(number, "encode_error", key, str(exc)))
                out.extend([None] * len(parts))
        return out


def _pack(docs: List[List[List[int]]], dtype) -> KeyOutput:
    sentences = [s for d in docs for s in d]
    lengths = numpy.fromiter((len(s) for s in sentences), numpy.int64, len(sentences))
    ids = numpy.fromiter(itertools.chain.from_iterable(sentences), dtype, int(lengths.sum()))
    per_doc = numpy.fromiter((len(d) for d in docs), numpy.int64, len(docs))
    return KeyOutput(ids, lengths, per_doc)
