"""Train/valid/test GPT datasets from `--data-path` through megatron-core's builder.

`--data-path` is Megatron-style: one prefix, several prefixes (weighted by their size),
or `w1 p1 w2 p2 ...` (a weighted blend). A prefix names `<prefix>.bin` + `<prefix>.idx`
as written by tools/preprocess_data.py.
"""

import os
from typing import Callable, List, Optional, Sequence, Tuple


class DataPathError(ValueError):
    """`--data-path` (or a flag beside it) does not describe usable data."""


def parse_data_path(data_path: Sequence[str]) -> Tuple[List[str], Optional[List[float]]]:
    """(prefixes, weights or None). Weights must be all given or all omitted."""
    items = [str(x) for x in (data_path or [])]
    if not items:
        raise DataPathError("--data-path: no dataset given (a prefix, or 'w1 p1 w2 p2 ...')")
    if len(items) % 2 == 0 and all(_is_number(w) for w in items[0::2]):
        weights = [float(w) for w in items[0::2]]
        prefixes = items[1::2]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise DataPathError(f"--data-path: weights must be >= 0 with a positive sum, got "
                                f"{' '.join(items[0::2])}")
    else:
        weights, prefixes = None, items
    numeric = [p for p in prefixes if _is_number(p)]
    if numeric:
        raise DataPathError(f"--data-path: {' '.join(items)} mixes weights and prefixes; give "
                            f"either prefixes only or pairs 'weight prefix' (found {numeric[0]} "
                            f"where a prefix belongs)")
    for prefix in prefixes:
        _check_prefix(prefix)
    return prefixes, weights


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_prefix(prefix: str) -> None:
    for ext in (".bin", ".idx"):
        if prefix.endswith(ext):
            raise DataPathError(f"--data-path: give the prefix without {ext}: "
                                f"{prefix[: -len(ext)]}")
    missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
    if missing:
        raise DataPathError(f"--data-path: {' and '.join(missing)} not found (a prefix names "
                            f"the .bin/.idx pair written by tools/preprocess_data.py, e.g. "
                            f"data/corpus_content_document)")


def check_splits(prefixes: Sequence[str], split: str) -> None:
    """Refuse a split that gets no sequence of some prefix: megatron-core 0.16.1's
    GPTDataset loops forever on an empty split instead of failing."""
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
        count = IndexedDataset(prefix).sequence_lengths.shape[0]
        for part, bookends in zip(Split, matrix):
            if bookends is None:
                continue
            begin, end = (int(round(b * count)) for b in bookends)
            if end <= begin:
                raise DataPathError(
                    f"--split: {split!r} leaves the {part.name} split of {prefix} empty (it has "
                    f"{count} sequences); give {part.name} a 0 share or use more data")


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
):
    """(train, valid, test) GPTDatasets (None for a split with no share in `split`).

    mock=True ignores data_path and builds megatron-core's MockGPTDataset. Under
    torch.distributed every rank must call this (the builder synchronises); pass
    is_built_on_rank to build on some ranks only (default: all).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    import torch

    blend = None if mock else parse_data_path(data_path)
    if blend is not None:
        check_splits(blend[0], split)
    if blend is not None and len(blend[0]) > 1 and not torch.distributed.is_initialized():
        # megatron-core 0.16.1's BlendedDataset asks torch.distributed for the rank whenever
        # it writes its cache; without a process group, build blends in memory instead.
        data_cache_path = None
    if data_cache_path is not None:
        os.makedirs(data_cache_path, exist_ok=True)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=split,
        path_to_cache=data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
    )
    builder = BlendedMegatronDatasetBuilder(
        MockGPTDataset if mock else GPTDataset,
        list(train_valid_test_num_samples),
        is_built_on_rank or (lambda: True),
        config,
    )
    train, valid, test = builder.build()
    return train, valid, test
