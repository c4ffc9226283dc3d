"""Train/valid/test GPT datasets from `--data-path` through megatron-core's builder.

`--data-path` is Megatron-style: one prefix, several prefixes (weighted by their size),
or `w1 p1 w2 p2 ...` (a weighted blend), divided by `--split`. A prefix names
`<prefix>.bin` + `<prefix>.idx` as written by tools/preprocess_data.py. Instead, each part
may have its own blend, read whole (Megatron-LM's `--train-data-path`, `--valid-data-path`,
`--test-data-path`: megatron-core's `blend_per_split`).
"""

import os
import struct
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import numpy


class DataPathError(ValueError):
    """`--data-path` (or a flag beside it) does not describe usable data."""


def parse_data_path(data_path: Sequence[str], flag: str = "--data-path",
                    conversations: bool = False) -> Tuple[List[str], Optional[List[float]]]:
    """(prefixes, weights or None). Weights must be all given or all omitted. `flag` is the
    option the list came from, named in the errors. Each prefix's files are checked; with
    `conversations` (--sft) each "prefix" is a JSON-lines conversation file."""
    prefixes, weights = blend_of(data_path, flag)
    for prefix in prefixes:
        if conversations:
            _check_conversation_file(prefix, flag)
        else:
            _check_prefix(prefix, flag)
    return prefixes, weights


def blend_of(data_path: Sequence[str], flag: str = "--data-path"
             ) -> Tuple[List[str], Optional[List[float]]]:
    """(prefixes, weights or None) of a data-path list, without reading any file."""
    items = [str(x) for x in (data_path or [])]
    if not items:
        raise DataPathError(f"{flag}: no dataset given (a prefix, or 'w1 p1 w2 p2 ...')")
    if len(items) % 2 == 0 and all(_is_number(w) for w in items[0::2]):
        weights = [float(w) for w in items[0::2]]
        prefixes = items[1::2]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise DataPathError(f"{flag}: weights must be >= 0 with a positive sum, got "
                                f"{' '.join(items[0::2])}")
    else:
        weights, prefixes = None, items
    numeric = [p for p in prefixes if _is_number(p)]
    if numeric:
        raise DataPathError(f"{flag}: {' '.join(items)} mixes weights and prefixes; give "
                            f"either prefixes only or pairs 'weight prefix' (found {numeric[0]} "
                            f"where a prefix belongs)")
    return prefixes, weights


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_prefix(prefix: str, flag: str) -> None:
    for ext in (".bin", ".idx"):
        if prefix.endswith(ext):
            raise DataPathError(f"{flag}: give the prefix without {ext}: "
                                f"{prefix[: -len(ext)]}")
    missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
    if missing:
        raise DataPathError(f"{flag}: {' and '.join(missing)} not found (a prefix names "
                            f"the .bin/.idx pair written by tools/preprocess_data.py, e.g. "
                            f"data/corpus_content_document)")
    _check_pair(prefix, flag)


def _check_conversation_file(path: str, flag: str) -> None:
    if not os.path.isfile(path):
        hint = (" (a .bin/.idx prefix: --sft reads JSON-lines conversations, not "
                "preprocessed data)" if os.path.isfile(path + ".idx") else "")
        raise DataPathError(f"{flag}: {path} not found{hint}; with --sft each path names a "
                            f"JSON-lines file of {{\"messages\": [...]}} records")


# megatron-core's IndexedDataset index (.idx), version 1: a 34-byte header (magic, version,
# token dtype code, sequence count, document count), then int32 sequence lengths, int64
# sequence byte offsets into the .bin, int64 document boundaries (sequence indices), and
# for multimodal data one int8 mode per sequence.
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER = struct.Struct("<9sQBQQ")
_REDO = "re-run tools/preprocess_data.py or copy the file again"
_BLOCK = 1 << 22  # elements per block when comparing arrays: an .idx can be gigabytes


def _check_pair(prefix: str, flag: str) -> None:
    """The .bin holds exactly the bytes its .idx describes. Without this, a short .bin
    trains until a sample reaches its end (then a ValueError naming no file) and a long
    one (an .idx of another file) trains silently on part of it."""
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    expected = _described_bin_bytes(idx_path, flag)
    held = os.path.getsize(bin_path)
    if held != expected:
        why = "truncated copy?" if held < expected else "the .idx of another file?"
        raise DataPathError(f"{flag}: {bin_path} holds {held} bytes but {idx_path} "
                            f"describes {expected} ({why}); {_REDO}")


def _described_bin_bytes(idx_path: str, flag: str) -> int:
    """The .bin size an .idx describes, after checking the .idx is whole and consistent.
    Reads the header and memory-maps the arrays: the .bin is never read."""
    from megatron.core.datasets.indexed_dataset import DType

    def bad(what: str) -> DataPathError:
        return DataPathError(f"{flag}: {idx_path} {what}; {_REDO}")

    held = os.path.getsize(idx_path)
    if held == 0:
        raise bad("is empty (0 bytes)")
    with open(idx_path, "rb") as stream:
        header = stream.read(_IDX_HEADER.size)
    if header[:len(_IDX_MAGIC)] != _IDX_MAGIC:
        raise bad("is not a megatron-core index (it does not start with MMIDIDX)")
    if len(header) < _IDX_HEADER.size:
        raise bad(f"is truncated: {held} bytes, shorter than the {_IDX_HEADER.size}-byte header")
    _, version, code, sequences, documents = _IDX_HEADER.unpack(header)
    if version != 1:
        raise bad(f"has index version {version}; megatron-core reads version 1")
    try:
        itemsize = DType.size(code)
    except ValueError:
        raise bad(f"has an unknown token type code {code}") from None
    size = _IDX_HEADER.size + sequences * (4 + 8) + documents * 8
    if held < size:
        raise bad(f"is truncated: its header describes {sequences} sequences and {documents} "
                  f"documents ({size} bytes) but it holds {held} bytes")
    if held not in (size, size + sequences):  # + one int8 mode per sequence (multimodal)
        raise bad(f"holds {held} bytes, not the {size} its header describes")
    if sequences == 0:
        raise bad("describes no sequences (an empty dataset)")

    buffer = numpy.memmap(idx_path, mode="r")
    lengths = numpy.frombuffer(buffer, numpy.int32, sequences, _IDX_HEADER.size)
    pointers = numpy.frombuffer(buffer, numpy.int64, sequences,
                                _IDX_HEADER.size + lengths.nbytes)
    bounds = numpy.frombuffer(buffer, numpy.int64, documents,
                              _IDX_HEADER.size + lengths.nbytes + pointers.nbytes)
    _check_lengths(lengths, bad)
    if pointers[0] != 0 or not all(
            numpy.array_equal(numpy.diff(pointers[a:b + 1]),
                              lengths[a:b].astype(numpy.int64) * itemsize)
            for a, b in _blocks(sequences - 1)):
        raise bad("is malformed: its sequence offsets do not follow its sequence lengths")
    if documents == 0 or bounds[0] != 0 or bounds[-1] != sequences or not all(
            (numpy.diff(bounds[a:b + 1]) >= 0).all() for a, b in _blocks(documents - 1)):
        raise bad(f"is malformed: its document boundaries do not run from 0 to its "
                  f"{sequences} sequences")
    return int(pointers[-1]) + int(lengths[-1]) * itemsize


def _check_lengths(lengths: numpy.ndarray, bad: Callable[[str], DataPathError]) -> None:
    # megatron-core 0.16.1's GPTDataset spins forever over a zero-length sequence
    shortest = int(lengths.min())
    if shortest < 0:
        raise bad(f"is malformed: sequence {int(lengths.argmin())} has length {shortest}")
    if shortest == 0:
        raise bad(f"holds an empty sequence (number {int(lengths.argmin())}), on which "
                  f"megatron-core's GPT dataset loops forever")


def _blocks(count: int) -> Iterator[Tuple[int, int]]:
    """[begin, end) ranges covering range(count), _BLOCK at a time (bounded memory)."""
    for begin in range(0, count, _BLOCK):
        yield begin, min(begin + _BLOCK, count)


def check_splits(prefixes: Sequence[str], split: str,
                 used: Sequence[str] = ("train", "valid", "test"),
                 conversations: bool = False) -> None:
    """Refuse a split that gets no sequence of some prefix: megatron-core 0.16.1's
    GPTDataset loops forever on an empty split instead of failing. Only the parts in
    `used` are checked (the others are not built). With `conversations` (--sft) the
    prefixes are conversation files, split by record."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    try:
        vector = parse_and_normalize_split(split)
        if not all(0.0 <= v <= 1.0 for v in vector):  # NaN when every weight is 0
            raise ValueError(split)
        matrix = convert_split_vector_to_split_matrix(vector)
    except (AssertionError, ValueError, ZeroDivisionError):
        raise DataPathError(f"--split: {split!r} is not like '949,50,1' (train,valid,test "
                            f"weights, at least one positive)") from None
    for prefix in prefixes:
        if conversations:
            from megatron.dataprep.sft_dataset import count_records

            count = count_records(prefix)
        else:
            count = IndexedDataset(prefix).sequence_lengths.shape[0]
        unit = "records" if conversations else "sequences"
        for part, bookends in zip(Split, matrix):
            if bookends is None or part.name not in used:
                continue
            begin, end = (int(round(b * count)) for b in bookends)
            if end <= begin:
                raise DataPathError(
                    f"--split: {split!r} leaves the {part.name} split of {prefix} empty (it has "
                    f"{count} {unit}); give {part.name} a 0 share or use more data")


def smaller_than_a_sample(prefixes: Sequence[str], split: str, seq_length: int,
                          flag: str = "--data-path") -> List[str]:
    """Warnings for each prefix whose training split holds fewer tokens than one sample
    (``seq_length + 1``): megatron-core's GPT dataset then fills every sample by repeating
    those tokens, which trains without a word otherwise. Call after ``check_splits``."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    bookends = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))[0]
    warnings = []
    for prefix in prefixes:
        dataset = IndexedDataset(prefix)  # its lengths are a view of its memory map
        lengths = dataset.sequence_lengths
        begin, end = (int(round(b * lengths.shape[0])) for b in bookends or (0, 0))
        tokens = int(lengths[begin:end].astype(numpy.int64).sum())
        del lengths, dataset
        if 0 < tokens < seq_length + 1:
            warnings.append(
                f"warning: {flag}: the training split of {prefix} holds {tokens} "
                f"token(s), fewer than one sample (--seq-length {seq_length} + 1): every "
                f"sample repeats them about {(seq_length + 1) / tokens:.0f} times; use more "
                f"data or a shorter --seq-length")
    return warnings


def build_gpt_datasets(
    data_path: Optional[Sequence[str]],
    split: str,
    seq_length: int,
    seed: int,
    tokenizer,
    train_valid_test_num_samples: Sequence[Optional[int]],
    data_cache_path: Optional[str] = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    mock: bool = False,
    is_built_on_rank: Optional[Callable[[], bool]] = None,
    create_attention_mask: bool = True,
    mmap_bin_files: bool = True,
    data_path_per_split: Optional[Sequence[Optional[Sequence[str]]]] = None,
    multiple_validation_sets: bool = False,
    mid_level_dataset_surplus: float = 0.005,
    allow_ambiguous_pad_tokens: bool = False,
    sample_documents: bool = False,
    fim=None,
    sft: bool = False,
    context_parallel_size: int = 1,
):
    """(train, valid, test) GPTDatasets (None for a split with no share in `split`).

    data_path_per_split (instead of data_path and split): the train, valid and test blends,
    each read whole (None: that part is not built), as Megatron-LM's --train-data-path,
    --valid-data-path and --test-data-path.
    A part of None samples is built as one pass over its data (Megatron-LM's
    --full-validation); with multiple_validation_sets, a validation blend of several
    prefixes in data_path_per_split comes back as a list of one such dataset per prefix.
    sample_documents=True adds each sample's document ids and per-document positions,
    from the documents it was packed from (Megatron-LM's --dataloader-inter-document-masking,
    megatron.dataprep.sample_documents).
    fim (a megatron.dataprep.fim.FimSettings): fill-in-the-middle samples (--fim-data).
    sft=True: the paths are JSON-lines conversation files, packed into samples by the
    SFTTokenizer `tokenizer` (--sft, megatron.dataprep.sft_dataset); context_parallel_size
    sets its padding granule.
    mock=True ignores data_path and builds megatron-core's MockGPTDataset. Under
    torch.distributed every rank must call this (the builder synchronises); pass
    is_built_on_rank to build on some ranks only (default: all).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.datasets.utils import Split

    import torch

    used = [part.name for part, samples in zip(Split, train_valid_test_num_samples)
            if samples != 0]
    blend = blend_per_split = None
    if data_path_per_split is not None:
        # a part nobody reads (0 samples) is not built, as below
        blend_per_split = [
            parse_data_path(path, f"--{part.name}-data-path", conversations=sft)
            if path and part.name in used else None
            for part, path in zip(Split, data_path_per_split)]
        split = None  # megatron-core: each part's blend is read whole
        if not any(blend_per_split):  # nothing read (--train-iters 0): megatron-core would
            return None, None, None   # take the missing blends for mock data
    elif not mock:
        blend = parse_data_path(data_path, conversations=sft)
        check_splits(blend[0], split, used, conversations=sft)
    blended = [b for b in [blend] + (blend_per_split or []) if b is not None]
    if any(len(b[0]) > 1 for b in blended) and not torch.distributed.is_initialized():
        # megatron-core 0.16.1's BlendedDataset asks torch.distributed for the rank whenever
        # it writes its cache; without a process group, build blends in memory instead.
        data_cache_path = None
    if data_cache_path is not None:
        os.makedirs(data_cache_path, exist_ok=True)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
        path_to_cache=data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
        mmap_bin_files=mmap_bin_files,
        multiple_validation_sets=multiple_validation_sets,
        mid_level_dataset_surplus=mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=allow_ambiguous_pad_tokens,
        full_validation=train_valid_test_num_samples[1] is None,
        context_parallel_size=context_parallel_size,
    )
    if blend_per_split is None:
        # a part nobody reads (0 samples) is not built: an empty one would never finish
        config.split_matrix = [bookends if part.name in used else None
                               for part, bookends in zip(Split, config.split_matrix)]
    dataset_class = MockGPTDataset if mock else GPTDataset
    if sft:
        from megatron.dataprep.sft_dataset import SFTDataset

        dataset_class = SFTDataset
    if sample_documents:
        from megatron.dataprep.sample_documents import with_sample_documents

        dataset_class = with_sample_documents(dataset_class)
    if fim is not None:
        from megatron.dataprep.fim import with_fim

        dataset_class = with_fim(dataset_class, fim)
    builder = BlendedMegatronDatasetBuilder(
        dataset_class,
        list(train_valid_test_num_samples),
        is_built_on_rank or (lambda: True),
        config,
    )
    train, valid, test = builder.build()
    for dataset in _low_level_datasets([train, valid, test]):
        # megatron-core (0.16.1 to 0.19.2) caches the first sample's loss mask, then
        # zeroes that cached tensor in place where the sample's labels are the pad id, so
        # every later sample inherited the first one's masked positions (with a pad id
        # that occurs in the data: --allow-ambiguous-pad-tokens, pad = EOD). Each sample's
        # masks are computed afresh instead (a row of ones and a position range).
        dataset.masks_and_position_ids_are_cacheable = False
    return train, valid, test


def _low_level_datasets(datasets):
    """The GPT datasets inside ``datasets`` (blends' parts, lists of validation sets)."""
    for dataset in datasets:
        if dataset is None:
            continue
        if isinstance(dataset, list):
            yield from _low_level_datasets(dataset)
        elif hasattr(dataset, "datasets"):  # megatron-core's BlendedDataset
            yield from _low_level_datasets(dataset.datasets)
        else:
            yield dataset
