"""Write one `.bin/.idx` pair with megatron-core's builder, appearing only when complete.

The builder writes to temporary names in the destination directory; `finalize` completes
them (index written, both synced) and `publish` renames them into place, `.idx` last, after
removing any older `.idx` first. A run that dies at any point therefore never leaves a
`.bin` beside an `.idx` that does not describe it. With several outputs, finalize them all
before publishing any, so that a late failure rarely leaves some published and some not.
A run killed outright (SIGKILL, power loss) leaves its temporary files behind, named after
its process id; `leftover_temporaries` finds them for the next run to remove.
"""

import glob
import os
from typing import List, Sequence, Tuple

import numpy


_TMP_TAG = ".tmp-"


class AtomicIndexedWriter:
    def __init__(self, path_prefix: str, dtype) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self.bin_path = path_prefix + ".bin"
        self.idx_path = path_prefix + ".idx"
        tag = f"{_TMP_TAG}{os.getpid()}"
        self._tmp_bin = self.bin_path + tag
        self._tmp_idx = self.idx_path + tag
        self._builder = IndexedDatasetBuilder(self._tmp_bin, dtype=dtype)
        self.documents = 0
        self.tokens = 0
        self.removed_previous_index = False  # publish removed an older .idx of this prefix
        self.published = False

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
            self.removed_previous_index = True
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(self._tmp_idx, self.idx_path)
        _fsync(os.path.dirname(os.path.abspath(self.idx_path)))
        self.published = True

    def left_behind(self) -> str:
        """What a failed run leaves of this output after `abort`, for its error line; ""
        when nothing of it changed."""
        if self.published:
            return f"{self.bin_path} and {self.idx_path} written in full"
        if self.removed_previous_index:
            return (f"the previous {self.idx_path} was already removed (the .bin beside it is "
                    f"no dataset without it): rerun to write both")
        return ""

    def abort(self) -> None:
        """Drop everything not yet published; safe to call at any point."""
        data_file = getattr(self._builder, "data_file", None)
        if data_file is not None and not data_file.closed:
            try:
                data_file.close()
            except OSError:  # its buffer does not fit either (a full disk): drop it
                pass
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)


def leftover_temporaries(path_prefix: str) -> List[Tuple[str, int, bool]]:
    """(path, pid, pid still running) of each temporary file some run left for this prefix."""
    found = []
    for ext in (".bin", ".idx"):
        pattern = glob.escape(path_prefix + ext + _TMP_TAG) + "*"
        for path in sorted(glob.glob(pattern)):
            pid = path.rsplit(_TMP_TAG, 1)[1]
            if pid.isdigit():
                found.append((path, int(pid), _running(int(pid))))
    return found


def _running(pid: int) -> bool:
    if pid == os.getpid():  # an earlier run in this same process (tests): not a live writer
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
