"""Megatron-LM's multi-token prediction loss logging (its ``training_log`` calls
``MTPLossLoggingHelper.track_mtp_metrics``): each iteration, per depth k, the MTP loss
``mtp_k loss`` that megatron-core's loss code added to its tracker (each microbatch's
mean over its tokens; under splits each split's share of that mean, which add up to it;
under context parallelism each rank's part's share, summed over the ranks), averaged over
the data-parallel ranks, times 1 / microbatches, then cleared.

The reduction is ours: gloo has no AVG, which megatron-core's reduction uses. Only the
last pipeline stage holds MTP layers and so the tracker's values; it prints them."""

import torch

from megatron import mcore_compat
from megatron.core import parallel_state
from megatron.trainer.moe_metrics import IntervalMeans


class MTPLossLog:
    """One training run's MTP losses: ``report`` after each step, the interval means for
    the iteration line, ``clear`` before each pass (a pass the rerun machine repeats
    counts once) and after an evaluation."""

    def __init__(self, args):
        self.depths = args.mtp_num_layers or 0
        self.window = IntervalMeans()
        if self.depths:  # entries of an earlier run in this process (another depth count)
            mcore_compat.reset_mtp_losses()

    def report(self, num_microbatches, writers, iteration):
        """This iteration's losses, 'mtp_k loss' -> float, on the ranks that hold MTP
        layers (empty elsewhere), written to TensorBoard/wandb."""
        values = mcore_compat.mtp_loss_values() if self.depths else None
        if values is None:
            return {}
        values = values.detach().float().clone()
        context = parallel_state.get_context_parallel_group()
        if context.size() > 1:  # each part's share of its microbatch's mean
            torch.distributed.all_reduce(values, group=context)
        group = parallel_state.get_data_parallel_group()
        if group is not None and group.size() > 1:  # gloo has no AVG
            torch.distributed.all_reduce(values, group=group)
            values /= group.size()
        losses = {f"mtp_{depth + 1} loss": value / num_microbatches
                  for depth, value in enumerate(values.tolist())}
        for name, value in losses.items():
            writers.add(name, value, iteration)
        self.window.add(losses)
        mcore_compat.clear_mtp_losses()
        return losses

    def interval_means(self):
        return self.window.means()

    def clear(self):
        if self.depths:
            mcore_compat.clear_mtp_losses()
