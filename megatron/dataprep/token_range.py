"""The largest token id of a `.bin`, checked against the model's vocabulary before training.

Data tokenized with another (larger) tokenizer than the run's otherwise dies at the first
embedding lookup with a bare ``IndexError: index out of range in self`` (an id at or
above the padded vocabulary), or trains silently on rows of the embedding that no token
of the run's tokenizer uses (an id between the tokenizer's vocabulary and the padded
size). One pass over each `.bin` finds the largest id; the result is cached next to the
index (``<prefix>.maxid.json``), keyed by the `.bin`'s size and modification time, so a
later run of the same data reads one small file.
"""

import json
import os

import numpy

# megatron-core's IndexedDataset token type codes (the byte at offset 17 of the .idx)
_DTYPES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64,
           6: numpy.float64, 7: numpy.float32, 8: numpy.uint16}
_DTYPE_OFFSET = 9 + 8  # after the magic and the version
_BLOCK = 1 << 24  # tokens per block of the scan (bounded memory)
CACHE_SUFFIX = ".maxid.json"


def _token_dtype(prefix):
    with open(prefix + ".idx", "rb") as stream:
        stream.seek(_DTYPE_OFFSET)
        return _DTYPES[stream.read(1)[0]]


def _scan(bin_path, dtype):
    count = os.path.getsize(bin_path) // numpy.dtype(dtype).itemsize
    if count == 0:
        return -1
    tokens = numpy.memmap(bin_path, dtype=dtype, mode="r", shape=(count,))
    return max(int(tokens[begin:begin + _BLOCK].max()) for begin in range(0, count, _BLOCK))


def largest_token_id(prefix):
    """The largest id in ``<prefix>.bin`` (cached; the cache is rewritten when the .bin's
    size or modification time changes, and skipped where the directory is read-only)."""
    bin_path = prefix + ".bin"
    stat = os.stat(bin_path)
    key = {"bin_size": stat.st_size, "bin_mtime_ns": stat.st_mtime_ns}
    cache = prefix + CACHE_SUFFIX
    try:
        with open(cache) as handle:
            saved = json.load(handle)
        if {k: saved.get(k) for k in key} == key and isinstance(saved.get("max_id"), int):
            return saved["max_id"]
    except (OSError, ValueError, AttributeError):
        pass
    largest = _scan(bin_path, _token_dtype(prefix))
    tmp = f"{cache}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as handle:
            json.dump(dict(key, max_id=largest), handle)
        os.replace(tmp, cache)
    except OSError:  # a read-only data directory: scan again next time
        try:
            os.remove(tmp)
        except OSError:
            pass
    return largest


def token_id_problems(flag_of_prefix, vocab_size, padded_vocab_size, tokenizer_flags):
    """(error or None, [warnings]) for the largest id of each prefix's .bin;
    ``flag_of_prefix`` maps each prefix to the option it came from, named in the lines."""
    warnings = []
    for prefix, flag in flag_of_prefix.items():
        largest = largest_token_id(prefix)
        if largest >= padded_vocab_size:
            return (f"{flag}: {prefix}.bin holds token id {largest} but the model's "
                    f"vocabulary has {padded_vocab_size} entries ({tokenizer_flags}: "
                    f"{vocab_size} tokens, padded to {padded_vocab_size}): the data was "
                    f"tokenized with another tokenizer; give the tokenizer it was made with, "
                    f"or preprocess it again with this one"), warnings
        if largest >= vocab_size:
            warnings.append(
                f"warning: {flag}: {prefix}.bin holds token id {largest}, beyond the "
                f"tokenizer's {vocab_size} tokens ({tokenizer_flags}; the model pads to "
                f"{padded_vocab_size}, so it trains): was the data tokenized with another "
                f"tokenizer?")
    return None, warnings
