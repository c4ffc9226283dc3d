"""Megatron-LM's --dataloader-inter-document-masking: the documents a sample was packed
from, taken from megatron-core's sample index rather than from end-of-document tokens.

Each sample gets ``document_ids`` ([seq_length] int32: which of the sample's document pieces
each token is in, counted from 0 in order) and ``position_ids`` that restart at 0 at each
piece, as megatron-core 0.19's GPTDataset computes its ``cu_seqlens`` for the flag: the
pieces are the parts of the documents the sample's tokens (and the label token after
them) come from; the extra label token is taken off the last piece, and the padding of a
short sample joins the last piece. The attention then keeps each piece to itself (the
document attention of --reset-attention-mask, megatron.seqsplit.documents). Data
preprocessed with --append-eod gives the same pieces as the end-of-document tokens do.
"""

import torch


def document_lengths(dataset, idx: int) -> list:
    """The lengths of the document pieces of sample `idx` of megatron-core's GPTDataset
    (or MockGPTDataset) `dataset`, in order, summing to the sequence length."""
    i = dataset.shuffle_index[idx]
    begin, begin_offset = (int(v) for v in dataset.sample_index[i])
    end, end_offset = (int(v) for v in dataset.sample_index[i + 1])
    extra = int(dataset.config.add_extra_token_to_sequence)

    def size(k):  # document k of the dataset's (shuffled, repeated) document order
        return int(dataset.dataset.sequence_lengths[dataset.document_index[k]])

    # what the low-level dataset's get() returns for each piece (cut at the document end)
    if begin == end:
        lengths = [min(end_offset - begin_offset + extra, size(begin) - begin_offset)]
    else:
        lengths = ([size(begin) - begin_offset] + [size(k) for k in range(begin + 1, end)]
                   + [min(end_offset + extra, size(end))])
    if extra:
        lengths[-1] -= 1
        if lengths[-1] == 0:
            lengths.pop()
    shortfall = dataset.config.sequence_length - sum(lengths)
    if shortfall > 0:
        if lengths:
            lengths[-1] += shortfall
        else:
            lengths.append(shortfall)
    return lengths


def ids_and_positions(lengths) -> tuple:
    """([L] int32 piece index of each token, [L] int64 position within its piece)."""
    sizes = torch.tensor(lengths, dtype=torch.int64)
    ids = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int64), sizes)
    starts = torch.cumsum(sizes, 0) - sizes
    positions = torch.arange(int(sizes.sum()), dtype=torch.int64) - starts[ids]
    return ids.to(torch.int32), positions


class SampleDocuments:
    """Mixed into megatron-core's GPTDataset / MockGPTDataset (``with_sample_documents``):
    every sample also carries its ``document_ids``, and position ids per document. A
    padding sample (idx None) is sample 0 with its loss masked, as megatron-core makes it."""

    def __getitem__(self, idx):
        sample = dict(super().__getitem__(idx))
        ids, positions = ids_and_positions(document_lengths(self, 0 if idx is None else idx))
        sample["document_ids"] = ids
        sample["position_ids"] = positions.to(torch.as_tensor(sample["position_ids"]).dtype)
        return sample


def with_sample_documents(dataset_class):
    """`dataset_class` (megatron-core's GPTDataset or MockGPTDataset) with SampleDocuments;
    its name is kept, so megatron-core's index cache is the one the plain class builds."""
    return type(dataset_class.__name__, (SampleDocuments, dataset_class), {})
