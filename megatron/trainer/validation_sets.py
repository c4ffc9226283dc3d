"""The validation sets an evaluation reads.

Megatron-LM's default is one set read on: each evaluation takes --eval-iters steps where
the previous one stopped (``ContinuingSet``). With --full-validation each evaluation
reads the whole set from its first sequence (``WholeSet``), and with
--multiple-validation-sets each --valid-data-path prefix is a set of its own, logged
with the suffix ``-NAME``.

A whole set rarely fills its last evaluation step; Megatron-LM's full-validation sampler
then wraps around (the first sequences count twice). Here the step is filled with copies
whose loss mask is zero: losses are sums over the loss mask divided by its count, so the
copies add nothing and every sequence counts once."""

import contextlib

from megatron.trainer.data import as_list


class ContinuingSet:
    """--eval-iters steps per evaluation through one iterator for the whole run."""

    suffix = ""

    def __init__(self, iterators, steps):
        self.iterators, self.steps = iterators, steps

    @contextlib.contextmanager
    def read(self, batch):
        yield self.iterators, self.steps

    def close(self):
        for iterator in as_list(self.iterators):
            iterator.close()


class WholeSet:
    """--full-validation: every sequence of ``dataset`` at each evaluation.
    ``make_iterators(dataset)`` gives the run's data iterators over a dataset, read from
    its start."""

    def __init__(self, suffix, dataset, make_iterators):
        self.suffix, self.dataset, self.make_iterators = suffix, dataset, make_iterators

    @contextlib.contextmanager
    def read(self, batch):
        """(iterators, steps) over the set padded to a multiple of ``batch`` (the
        evaluation's global batch)."""
        padded = PaddedToBatches(self.dataset, batch)
        iterators = self.make_iterators(padded)
        try:
            yield iterators, len(padded) // batch
        finally:
            for iterator in as_list(iterators):
                iterator.close()

    def close(self):
        pass  # each evaluation closes its own iterators


class PaddedToBatches:
    """``dataset`` followed by as few copies of its first samples as make its length a
    multiple of ``batch``; a copy's loss mask is zero, so it adds to no loss."""

    def __init__(self, dataset, batch):
        self.dataset, self.size = dataset, len(dataset)
        if self.size == 0:
            raise ValueError("the validation set is empty: --full-validation has nothing "
                             "to evaluate")
        self.length = -(-self.size // batch) * batch

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        if not 0 <= index < self.length:
            raise IndexError(index)
        if index < self.size:
            return self.dataset[index]
        sample = dict(self.dataset[index - self.size])
        sample["loss_mask"] = sample["loss_mask"] * 0  # its dtype and shape, no loss
        return sample


def suffixes(args, count):
    """Each set's suffix in logs and TensorBoard keys, as Megatron-LM: '' for one set,
    '-NAME' (--validation-set-names) or '-INDEX' with --multiple-validation-sets."""
    if not args.multiple_validation_sets:
        return [""]
    names = args.validation_set_names or [str(index) for index in range(count)]
    return [f"-{name}" for name in names]
