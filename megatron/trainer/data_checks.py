"""Checks of the training data that need the tokenizer (so they run after it is built,
before iteration 1): every rank stops together on a problem, rank 0 says it."""

import sys

import torch


def _tokenizer_flags(args):
    if args.tokenizer_type == "NullTokenizer":
        return f"--tokenizer-type NullTokenizer --vocab-size {args.vocab_size}"
    source = args.vocab_file or args.tokenizer_model
    return f"--tokenizer-type {args.tokenizer_type}" + (f" of {source}" if source else "")


def check_token_ids(args, vocab_size, padded_vocab_size):
    """Collective: the largest token id of every --data-path .bin against the vocabulary
    (rank 0 scans or reads the cache; see megatron/dataprep/token_range.py)."""
    if args.mock_data or not args.data_path:
        return
    found = [None]
    if torch.distributed.get_rank() == 0:
        from megatron.dataprep.gpt_datasets import parse_data_path
        from megatron.dataprep.token_range import token_id_problems

        prefixes, _ = parse_data_path(args.data_path)
        found[0] = token_id_problems(prefixes, vocab_size, padded_vocab_size,
                                     _tokenizer_flags(args))
    torch.distributed.broadcast_object_list(found, src=0)
    error, warnings = found[0]
    if torch.distributed.get_rank() == 0:
        for warning in warnings:
            print(warning, flush=True)
        if error:
            print(f"error: {error}", file=sys.stderr, flush=True)
    if error:
        sys.exit(2)
