"""Microbatches for this data-parallel rank, resumable from a sample count."""

import math

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model


def reads_batches(args, vp_stage=None) -> bool:
    """Whether this rank's model chunk reads the batch: the first stage (tokens), the last
    (labels and loss mask) and, with --reset-attention-mask, every stage (attention on
    each needs the document boundaries). With virtual stages, "first" and "last" are
    those of the model chunk (``vp_stage``)."""
    return (args.reset_attention_mask
            or parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            or parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage))


def skip_microbatches(args, iterators, model, count):
    """Read ``count`` microbatches on every model chunk that reads batches, as a training
    step would, without computing anything: --iterations-to-skip (Megatron-LM's
    dummy_train_step). Read from the readers under a rerun wrapper, so that the rerun
    machine never replays them."""
    iterators = iterators if isinstance(iterators, list) else [iterators]
    for chunk, iterator in zip(model, iterators):
        if not reads_batches(args, get_attr_wrapped_model(chunk, "vp_stage")):
            continue
        reader = getattr(iterator, "iterable", iterator)  # megatron-core's RerunDataIterator
        for _ in range(count):
            next(reader)


def as_list(iterators):
    """One data iterator, several (one per model chunk) or None, as a list."""
    return [] if iterators is None else iterators if isinstance(iterators, list) else [iterators]


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
    With ``num_workers > 0`` (--num-workers) a DataLoader reads ahead in that many
    worker processes; the order is the same.
    """

    def __init__(self, dataset, micro_batch_size, consumed_samples=0, num_microbatches=1,
                 num_workers=0):
        self.dataset = dataset
        self.mbs = micro_batch_size
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.next_index = consumed_samples  # first sample of the next (dp-wide) microbatch
        self.read = 0
        self.loader, self.loader_end = None, "dataset exhausted"
        if num_workers > 0:
            self.loader = iter(torch.utils.data.DataLoader(
                dataset, batch_sampler=_RankBatches(self), num_workers=num_workers,
                collate_fn=collate, worker_init_fn=_ignore_sigterm, persistent_workers=True,
                # its own generator: the workers' seeds must not draw from the global RNG,
                # which dropout uses (the losses would depend on --num-workers)
                generator=torch.Generator().manual_seed(0)))

    def __iter__(self):
        return self

    def close(self):
        """End the DataLoader's worker processes; the workers ignore SIGTERM, so nothing
        else would. Shut down explicitly: dropping this reference is not enough while an
        exception's traceback (a sample that failed in a worker) still holds the loader,
        and at exit multiprocessing would wait forever for the workers it signalled."""
        loader, self.loader = self.loader, None
        shutdown = getattr(loader, "_shutdown_workers", None)  # torch's multi-worker loader
        if shutdown is not None:
            shutdown()

    def next_indices(self):
        """The sample indices of this rank's next microbatch."""
        start = self.next_index + self.dp_rank * self.mbs
        self.next_index += self.mbs * self.dp_size
        if start + self.mbs > len(self.dataset):
            raise StopIteration(
                f"dataset exhausted at sample {start} of {len(self.dataset)}; build it with "
                "more samples (--train-iters x --global-batch-size)")
        return list(range(start, start + self.mbs))

    def __next__(self):
        self.read += 1
        if self.loader is not None:
            try:
                return next(self.loader)
            except StopIteration:  # the sampler ran out: say where, as the direct read does
                raise StopIteration(self.loader_end) from None
        return collate([self.dataset[index] for index in self.next_indices()])


class _RankBatches:
    """The DataLoader's batch sampler: the iterator's own index order, read ahead."""

    def __init__(self, iterator):
        self.iterator = iterator

    def __iter__(self):
        while True:
            try:
                yield self.iterator.next_indices()
            except StopIteration as end:
                self.iterator.loader_end = str(end)
                return


def _ignore_sigterm(_worker_id):
    # SLURM signals every process of the job: a worker must not die of it before the
    # trainer (--exit-signal-handler) has saved; the trainer ends the workers itself
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group


class GlobalBatchSizes:
    """Microbatches per iteration: constant, or growing with --rampup-batch-size by
    megatron-core's calculator (as Megatron-LM: the batch size follows the samples
    consumed so far, so a resumed run continues the ramp where it stopped)."""

    def __init__(self, args):
        self.unit = args.micro_batch_size * args.data_parallel_size
        self.global_batch = args.global_batch_size
        self.calculator = None
        # the calculators are asked for the batch as given and never round it (megatron-core
        # 0.19's step schedules refuse to): --decrease-batch-size-if-needed rounds it here
        self.check_divisible = not getattr(args, "decrease_batch_size_if_needed", False)
        self.steps = getattr(args, "step_batch_schedule", None)
        if args.rampup_batch_size is not None:
            self.calculator = rampup_calculator(args, torch.distributed.get_rank())

    def microbatches_at(self, consumed_samples: int) -> int:
        """The microbatches per rank of the iteration after `consumed_samples` samples
        (under --decrease-batch-size-if-needed those of the largest multiple of
        --micro-batch-size x DP below the global batch)."""
        return self.batch_at(consumed_samples) // self.unit

    def batch_at(self, consumed_samples: int) -> int:
        """The global batch in force after `consumed_samples` samples, as given (which
        --decrease-batch-size-if-needed may round down)."""
        if self.steps is not None:  # --step-batch-size-schedule
            from megatron.trainer.batch_schedule import batch_at

            return batch_at(self.steps, consumed_samples)
        if self.calculator is None:
            return self.global_batch
        self.calculator.update(consumed_samples, self.check_divisible)
        return self.calculator.get_current_global_batch_size()


def rampup_calculator(args, rank=0):
    """megatron-core's calculator for --rampup-batch-size START INCREMENT SAMPLES.

    megatron-core up to 0.16 has a ramp-up calculator; later releases replaced it with
    step schedules (``THRESHOLD:BATCH`` in samples), and the same ramp is then written
    as one: Megatron-LM's ramp adds INCREMENT every SAMPLES / ((GBS - START) / INCREMENT)
    consumed samples (a float), so batch START + k INCREMENT starts at the first whole
    sample count >= k times that."""
    from megatron.core import num_microbatches_calculator as calculators

    start, increment, samples = args.rampup_batch_size
    mbs, dp, gbs = args.micro_batch_size, args.data_parallel_size, args.global_batch_size
    if hasattr(calculators, "RampupBatchsizeNumMicroBatchesCalculator"):
        return calculators.RampupBatchsizeNumMicroBatchesCalculator(
            gbs, mbs, dp, False, rank, start, increment, samples)
    steps = (gbs - start) // increment
    per_step = samples / steps if steps else 0.0
    schedule = " ".join(f"{math.ceil(k * per_step)}:{start + k * increment}"
                        for k in range(steps + 1))
    return calculators.StepBatchsizeNumMicroBatchesCalculator(
        micro_batch_size=mbs, data_parallel_size=dp, decrease_batch_size_if_needed=False,
        rank=rank, schedule=schedule)
