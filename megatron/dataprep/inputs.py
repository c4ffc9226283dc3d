"""Find the input documents (`--input`) and cut them into chunks for the encoding workers.

Two kinds of source: JSON-lines files (plain or .gz; given by path or glob) and a
directory written by HF `datasets`' `save_to_disk`. Chunks carry raw lines (bytes) or
rows (dicts), so decoding and JSON parsing happen in the workers, in parallel.
"""

import glob
import gzip
import os
from dataclasses import dataclass
from typing import Iterator, List, Sequence, Union


# A chunk also ends at this much raw input, so that a few large documents do not leave
# one worker busy at the end while the others idle.
CHUNK_BYTES = 256 * 1024


class InputError(ValueError):
    """`--input` does not name usable data."""


@dataclass(frozen=True)
class Source:
    path: str
    kind: str  # "jsonl" or "arrow"

    def where(self, number: int) -> str:
        """Human location of line `number` (1-based) or row `number` (0-based)."""
        return f"{self.path}:{number}" if self.kind == "jsonl" else f"{self.path}[row {number}]"


@dataclass
class Chunk:
    source: int  # index into the list of sources
    first: int  # line number (1-based) or row index (0-based) of items[0]
    items: List[Union[bytes, dict]]


def resolve_inputs(patterns: Sequence[str]) -> List[Source]:
    """Expand paths and globs, in the order given (each glob sorted); no duplicates."""
    sources, seen = [], set()
    for pattern in patterns:
        for source in _resolve_one(pattern):
            real = os.path.realpath(source.path)
            if real not in seen:
                seen.add(real)
                sources.append(source)
    return sources


def _resolve_one(pattern: str) -> List[Source]:
    if glob.has_magic(pattern):
        paths = sorted(p for p in glob.glob(pattern) if os.path.isfile(p) or _is_saved_dataset(p))
        if not paths:
            raise InputError(f"--input: no file matches {pattern!r} (check the path)")
        return [_source(p) for p in paths]
    if not os.path.exists(pattern):
        raise InputError(f"--input: {pattern} does not exist (give JSONL files, a glob, "
                         f"or a directory written by datasets' save_to_disk)")
    return [_source(pattern)]


def _source(path: str) -> Source:
    if not os.path.isdir(path):
        return Source(path, "jsonl")
    if os.path.exists(os.path.join(path, "dataset_dict.json")):
        splits = sorted(
            d for d in os.listdir(path) if _is_saved_dataset(os.path.join(path, d))
        )
        raise InputError(f"--input: {path} holds several splits ({', '.join(splits)}); "
                         f"pass one of them, e.g. --input {os.path.join(path, splits[0] if splits else 'train')}")
    if not _is_saved_dataset(path):
        raise InputError(f"--input: {path} is a directory but not a dataset written by "
                         f"save_to_disk; pass JSONL files or a glob such as '{path}/*.jsonl'")
    return Source(path, "arrow")


def _is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and os.path.exists(os.path.join(path, "state.json"))


def check_columns(sources: Sequence[Source], keys: Sequence[str]) -> None:
    """A saved dataset lacking a requested column is a flag mistake, not bad data."""
    for source in sources:
        if source.kind != "arrow":
            continue
        columns = _load_dataset(source.path).column_names
        missing = [k for k in keys if k not in columns]
        if missing:
            raise InputError(f"--json-keys: {source.path} has no column {', '.join(missing)} "
                             f"(its columns: {', '.join(columns)})")


def input_bytes(sources: Sequence[Source]) -> int:
    total = 0
    for source in sources:
        if source.kind == "jsonl":
            total += os.path.getsize(source.path)
        else:
            for root, _, files in os.walk(source.path):
                total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def iter_chunks(sources: Sequence[Source], keys: Sequence[str], chunk_size: int) -> Iterator[Chunk]:
    for index, source in enumerate(sources):
        if source.kind == "jsonl":
            yield from _jsonl_chunks(index, source.path, chunk_size)
        else:
            yield from _arrow_chunks(index, source.path, keys, chunk_size)


def _jsonl_chunks(index: int, path: str, chunk_size: int) -> Iterator[Chunk]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        items, first, size = [], 1, 0
        for number, line in enumerate(f, start=1):
            items.append(line)
            size += len(line)
            if len(items) == chunk_size or size >= CHUNK_BYTES:
                yield Chunk(index, first, items)
                items, first, size = [], number + 1, 0
        if items:
            yield Chunk(index, first, items)


def _arrow_chunks(index: int, path: str, keys: Sequence[str], chunk_size: int) -> Iterator[Chunk]:
    dataset = _load_dataset(path).select_columns(list(keys))
    first = 0
    for batch in dataset.iter(batch_size=chunk_size):
        n = len(batch[keys[0]])
        yield Chunk(index, first, [{k: batch[k][i] for k in keys} for i in range(n)])
        first += n


def _load_dataset(path: str):
    try:
        import datasets
    except ImportError as exc:
        raise InputError(f"--input: {path} is a dataset written by save_to_disk; reading it "
                         f"needs the datasets package: pip install datasets ({exc})") from None

    try:
        return datasets.load_from_disk(path)
    except Exception as exc:
        raise InputError(f"--input: cannot open {path} as a saved dataset: {exc}") from exc
