"""Checks of the training data that need the tokenizer (so they run after it is built,
before iteration 1): every rank stops together on a problem, rank 0 says it."""

import torch

from megatron.trainer.agreed_stop import AgreedStop


def _tokenizer_flags(args):
    if args.tokenizer_type == "NullTokenizer":
        return f"--tokenizer-type NullTokenizer --vocab-size {args.vocab_size}"
    source = args.vocab_file or args.tokenizer_model
    return f"--tokenizer-type {args.tokenizer_type}" + (f" of {source}" if source else "")


def check_token_ids(args, vocab_size, padded_vocab_size):
    """Collective: the largest token id of every --data-path (or --train/--valid/--test-
    data-path) .bin against the vocabulary (rank 0 scans or reads the cache; see
    megatron/dataprep/token_range.py)."""
    lists = [("--data-path", args.data_path)] + list(zip(
        ("--train-data-path", "--valid-data-path", "--test-data-path"),
        args.data_path_per_split or []))
    lists = [(flag, path) for flag, path in lists if path]
    if args.mock_data or args.sft or not lists:
        return  # --sft: the tokenizer makes the ids, from its own vocabulary
    found = [None]
    if torch.distributed.get_rank() == 0:
        from megatron.dataprep.gpt_datasets import parse_data_path
        from megatron.dataprep.token_range import token_id_problems

        flag_of_prefix = {}  # the first flag naming each prefix
        for flag, path in lists:
            for prefix in parse_data_path(path, flag)[0]:
                flag_of_prefix.setdefault(prefix, flag)
        found[0] = token_id_problems(flag_of_prefix, vocab_size, padded_vocab_size,
                                     _tokenizer_flags(args))
    torch.distributed.broadcast_object_list(found, src=0)
    error, warnings = found[0]
    if torch.distributed.get_rank() == 0:
        for warning in warnings:
            print(warning, flush=True)
    if error:
        raise AgreedStop(error, code=2)
