"""The GPT providers that ``pretrain_gpt.py`` hands to ``pretrain``: the model of one
pipeline stage, the datasets, and the forward step with its loss (Megatron-LM keeps
these in its pretrain_gpt.py; here they live in the package so that the installed
library and the benchmarks run the same code without the checkout).

``forward_step`` is the contract of ``megatron.schedules.dispatch.get_forward_backward_func``
in full: pipeline stages, packed documents, and the split passed to the model.
"""

import torch

from megatron.core.utils import get_attr_wrapped_model

from megatron.seqsplit.documents import DocumentIdsDataset
from megatron.seqsplit.split_context import SplitContext
from megatron.trainer.data import reads_batches
from megatron.trainer.device import compute_device
from megatron.trainer.model import gpt_model_provider


def model_provider(args, config, pre_process=True, post_process=True, vp_stage=None):
    """The GPT model of one pipeline stage (local or Transformer Engine layer spec)."""
    return gpt_model_provider(args, config, pre_process=pre_process,
                              post_process=post_process, vp_stage=vp_stage)


def datasets_provider(args):
    """(train, validation, test, tokenizer): megatron-core GPT datasets over --data-path, or
    mock; test is None where --split gives it nothing."""
    from megatron.dataprep.sft_dataset import ConversationFileError
    from megatron.trainer import phases
    from megatron.trainer.agreed_stop import AgreedStop
    from megatron.trainer.arguments import tokenizer_of
    from megatron.trainer.evaluation_schedule import evaluations_through

    tokenizer = tokenizer_of(args)
    # the periodic evaluations and the one after training
    evaluations = evaluations_through(args, args.train_iters) + 1
    # as Megatron-LM: the test set is evaluated once, --eval-iters batches, after training
    # --full-validation: one pass over the validation data (megatron-core sizes it)
    num_samples = [phases.train_samples_to_build(args),
                   None if args.full_validation else
                   evaluations * args.eval_iters * args.eval_global_batch_size,
                   args.eval_iters * args.eval_global_batch_size if _has_test_split(args)
                   else 0]
    try:
        train, valid, test = _build_datasets(args, tokenizer, num_samples)
    except ConversationFileError as error:  # every rank reads the same files: all stop
        raise AgreedStop(str(error), code=2) from None
    if args.reset_attention_mask and not _samples_carry_documents(args):
        # the documents from end-of-document tokens: per-token document ids, O(L) a row
        def with_ids(ds):
            return DocumentIdsDataset(ds, tokenizer.eod) if ds is not None else None

        train, test = with_ids(train), with_ids(test)
        valid = [with_ids(ds) for ds in valid] if isinstance(valid, list) else with_ids(valid)
    return train, valid, test, tokenizer


def _samples_carry_documents(args):
    """Whether the samples bring their documents and positions: from the dataset's packing
    (--dataloader-inter-document-masking, sample_documents) or as conversations (--sft),
    not from end-of-document tokens."""
    return args.dataloader_inter_document_masking or args.sft


def _build_datasets(args, tokenizer, num_samples):
    from megatron.dataprep.gpt_datasets import build_gpt_datasets
    from megatron.trainer.fim_arguments import fim_settings

    documents_given = _samples_carry_documents(args)
    by_packing = args.dataloader_inter_document_masking and not args.sft
    return build_gpt_datasets(
        data_path=args.data_path, data_path_per_split=args.data_path_per_split,
        split=args.split, seq_length=args.seq_length,
        seed=args.seed, tokenizer=tokenizer, train_valid_test_num_samples=num_samples,
        data_cache_path=args.data_cache_path,
        reset_position_ids=args.reset_position_ids and not documents_given,
        reset_attention_mask=args.reset_attention_mask and not documents_given,
        eod_mask_loss=args.eod_mask_loss, sample_documents=by_packing,
        mock=args.mock_data, mmap_bin_files=args.mmap_bin_files,
        create_attention_mask=False,  # the kernels mask causally
        multiple_validation_sets=args.multiple_validation_sets,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        fim=fim_settings(args, tokenizer) if args.fim_data else None,
        sft=args.sft, context_parallel_size=args.context_parallel_size)


def _has_test_split(args):
    """Whether there is a test set: --test-data-path, or a --split share of the test set
    that holds sequences of every --data-path prefix (Megatron-LM's default 969,30,1 does; a
    small corpus may leave its 0.1% empty, and an empty split is no test set rather than an
    error)."""
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    from megatron.dataprep.gpt_datasets import DataPathError, check_splits, parse_data_path

    if args.eval_iters == 0:
        return False
    if args.data_path_per_split is not None:
        return args.data_path_per_split[2] is not None
    if parse_and_normalize_split(args.split)[2] <= 0:
        return False
    if args.mock_data:
        return True
    try:
        check_splits(parse_data_path(args.data_path, conversations=args.sft)[0], args.split,
                     ["test"], conversations=args.sft)
    except DataPathError:
        return False
    return True


def get_batch(data_iterator, args, vp_stage=None):
    """This stage's share of the next batch (or split): tokens on the first stage,
    labels and loss mask on the last; every stage with --reset-attention-mask
    (``data.reads_batches``)."""
    if not reads_batches(args, vp_stage):
        return {}
    batch = next(data_iterator)
    device = compute_device()  # the flags' device (gloo on a GPU machine: the CPU)
    return {key: value.to(device, non_blocking=True) if torch.is_tensor(value) else value
            for key, value in batch.items()}


def loss_func(loss_mask, output_tensor):
    """Megatron's triple: (sum of token losses, token count, reported [sum, count])."""
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().to(torch.int)
    reported = torch.stack([loss_sum.detach(), loss_mask.sum().detach()])
    return loss_sum, num_tokens, {"lm loss": reported}


def forward_step(data_iterator, model, args=None):
    """One microbatch (or, under Seq1F1B, one split of one) through this stage."""
    split = getattr(data_iterator, "split", None)  # SplitContext under Seq1F1B
    batch = get_batch(data_iterator, args, get_attr_wrapped_model(model, "vp_stage"))
    if batch.get("document_ids") is not None:
        if split is None:  # unsplit: one "split" covering the whole sequence
            length = batch["document_ids"].shape[1]
            split = SplitContext(num_splits=1, offset=0, length=length, seq_length=length)
        split.document_ids = batch["document_ids"]
    output_tensor = model(
        batch.get("tokens"),
        batch.get("position_ids"),
        None,  # causal attention: the kernel applies the mask
        labels=batch.get("labels"),
        loss_mask=batch.get("loss_mask"),  # multi-token prediction's loss reads it
        packed_seq_params=split,
    )
    loss_mask = batch.get("loss_mask")
    return output_tensor, lambda output: loss_func(loss_mask, output)
