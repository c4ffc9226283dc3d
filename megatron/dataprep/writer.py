"""Write one `.bin/.idx` pair with megatron-core's builder, appearing only when complete.

The builder writes to temporary names in the destination directory; `finalize` completes
them (index written, both synced) and `publish` renames them into place, `.idx` last, after
removing any older `.idx` first. A run that dies at any point therefore never leaves a
`.bin` beside an `.idx` that does not describe it. With several outputs, finalize them all
before publishing any, so that a late failure rarely leaves some published and some not.
"""

import os
from typing import Sequence

import numpy


class AtomicIndexedWriter:
    def __init__(self, path_prefix: str, dtype) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self.bin_path = path_prefix + ".bin"
        self.idx_path = path_prefix + ".idx"
        tag = f".tmp-{os.getpid()}"
        self._tmp_bin = self.bin_path + tag
        self._tmp_idx = self.idx_path + tag
        self._builder = IndexedDatasetBuilder(self._tmp_bin, dtype=dtype)
        self.documents = 0
        self.tokens = 0

    def add_document(self, ids: numpy.ndarray, sequence_lengths: Sequence[int]) -> None:
        """One document made of consecutive sequences (one, or one per sentence)."""
        self._builder.add_document(ids, list(sequence_lengths))
        self.documents += 1
        self.tokens += int(ids.size)

    def finalize(self) -> None:
        self._builder.finalize(self._tmp_idx)
        for path in (self._tmp_bin, self._tmp_idx):
            _fsync(path)

    def publish(self) -> None:
        if os.path.exists(self.idx_path):
            os.remove(self.idx_path)
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(self._tmp_idx, self.idx_path)
        _fsync(os.path.dirname(os.path.abspath(self.idx_path)))

    def abort(self) -> None:
        """Drop everything not yet published; safe to call at any point."""
        data_file = getattr(self._builder, "data_file", None)
        if data_file is not None and not data_file.closed:
            data_file.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
