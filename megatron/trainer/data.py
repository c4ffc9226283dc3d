"""Microbatches for this data-parallel rank, resumable from a sample count."""

import torch
from megatron.core import parallel_state


def collate(samples):
    """Stack a list of per-sample dicts of tensors into one batch dict."""
    return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in samples[0]}


class MicrobatchIterator:
    """Yields this rank's microbatches in Megatron-LM's order.

    Global batch ``g`` covers samples ``[g * gbs, (g + 1) * gbs)`` after the samples
    already consumed; within it, microbatch ``i`` of data-parallel rank ``d`` is
    ``mbs`` consecutive samples starting at ``(i * dp + d) * mbs`` (what Megatron-LM's
    pretraining sampler gives). Every rank reads its own samples: datasets are
    deterministic, so tensor-parallel peers read identical batches without a broadcast.
    """

    def __init__(self, dataset, micro_batch_size, consumed_samples=0, num_microbatches=1):
        self.dataset = dataset
        self.mbs = micro_batch_size
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.next_index = consumed_samples  # first sample of the next (dp-wide) microbatch
        self.read = 0

    def __iter__(self):
        return self

    def __next__(self):
        start = self.next_index + self.dp_rank * self.mbs
        self.next_index += self.mbs * self.dp_size
        if start + self.mbs > len(self.dataset):
            raise StopIteration(
                f"dataset exhausted at sample {start} of {len(self.dataset)}; build it with "
                "more samples (--train-iters x --global-batch-size)")
        self.read += 1
        return collate([self.dataset[start + k] for k in range(self.mbs)])
