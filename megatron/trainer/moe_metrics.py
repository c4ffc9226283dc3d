"""Megatron-LM's MoE loss logging: each iteration, the auxiliary losses that the routers
recorded in megatron-core's MoE loss tracker, reduced over the ranks, averaged over the
microbatches and the MoE layers, then cleared (Megatron-LM's ``training_log``:
``get_moe_metrics_tracker().report(...)`` on megatron-core 0.19, ``track_moe_metrics``
on 0.16).

The tracker holds, per loss name and layer, the sum over the iteration's microbatches
of the layer's loss divided by its coefficient, on the ranks that hold the layer.
megatron-core's unsplit router adds each microbatch's value in its forward; under
sequence splits ``megatron.seqsplit.moe.SplitRouter`` adds each split's share of the
whole microbatch's value in its backward (the shares add up to the unsplit value), so
both runs report the same numbers, the same way.

The reduction is ours, with megatron-core 0.19's groups on every supported version:
0.16.1's ``track_moe_metrics`` allocates missing entries on "cuda", gloo has no AVG
reduction, and 0.16.1 does not average z_loss over tensor- and data-parallel ranks
(each rank would log its own tokens' value; 0.19 averages it).
"""

import torch

from megatron import mcore_compat
from megatron.core import parallel_state
from megatron.seqsplit.model import moe_layer_pattern

# Megatron-LM's logged name of each --moe-router-load-balancing-type
LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
              "global_aux_loss": "global_load_balancing_loss"}


def tracked_names(args):
    """The names Megatron-LM reports for these flags, in its order (none: dense)."""
    if getattr(args, "num_experts", None) is None:
        return []
    types = args.moe_router_load_balancing_type
    types = types if isinstance(types, list) else [types]
    names = [LOSS_NAMES[kind] for kind in LOSS_NAMES if kind in types]
    if args.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


def _sum(values, group):
    if group is not None and group.size() > 1:
        torch.distributed.all_reduce(values, group=group)


def _mean(values, group):
    if group is not None and group.size() > 1:
        torch.distributed.all_reduce(values, group=group)  # gloo has no AVG
        values /= group.size()


def _reduce(name, values):
    """megatron-core 0.19's reduction of one name's per-layer values (every rank calls
    it for the same names in the same order: collectives)."""
    _sum(values, parallel_state.get_pipeline_model_parallel_group())  # each layer once
    tp_dp_cp = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    if name == "z_loss":  # each rank's mean over its own tokens
        _mean(values, tp_dp_cp)
    elif name == "global_load_balancing_loss":  # counts already over TP x DP
        _sum(values, tp_dp_cp)
    else:  # each TP rank's share of its microbatch's loss; DP ranks hold other data
        _sum(values, parallel_state.get_tensor_and_context_parallel_group())
        _mean(values, parallel_state.get_data_parallel_group(with_context_parallel=False))


class IntervalMeans:
    """Each logged loss summed over the iterations since the last ``means()`` (the
    iteration line's interval, as Megatron-LM's total_loss_dict)."""

    def __init__(self):
        self.totals, self.iterations = {}, 0

    def add(self, losses: dict) -> None:
        for name, value in losses.items():
            self.totals[name] = self.totals.get(name, 0.0) + value
        self.iterations += 1

    def means(self) -> dict:
        means = {name: total / max(self.iterations, 1) for name, total in self.totals.items()}
        self.totals, self.iterations = {}, 0
        return means


class MoELossLog:
    """One training run's MoE losses: ``report`` after each step (collective), the
    interval means for the iteration line, ``clear`` after an evaluation."""

    def __init__(self, args, device):
        self.names = tracked_names(args)
        # MTP layers are counted after the decoder's, as Megatron-LM 0.19 counts them (its
        # MoE layer count adds them, MoE or not)
        mtp = getattr(args, "mtp_num_layers", None) or 0
        self.num_layers = args.num_layers + mtp
        self.num_moe_layers = sum(moe_layer_pattern(args)) + mtp if self.names else 0
        self.device = device
        self.per_layer = bool(getattr(args, "moe_per_layer_logging", False))
        self.window = IntervalMeans()
        if self.names:  # entries of an earlier run in this process (other layers, groups)
            mcore_compat.reset_moe_losses()

    def report(self, num_microbatches, writers, iteration):
        """This iteration's losses, name -> float (Megatron-LM's value: per layer summed
        over microbatches and ranks, times 1 / microbatches, averaged over the MoE
        layers), written to TensorBoard/wandb (every iteration, as Megatron-LM; with
        --moe-per-layer-logging each layer's value too); the tracker is zeroed for the
        next iteration."""
        if not self.names:
            return {}
        recorded = mcore_compat.moe_loss_values()
        losses = {}
        for name in self.names:
            values = recorded.get(name)
            values = (torch.zeros(self.num_layers, device=self.device) if values is None
                      else values.detach().float().clone())
            _reduce(name, values)
            losses[name] = (values.sum() / num_microbatches / self.num_moe_layers).item()
            writers.add(name, losses[name], iteration)
            if self.per_layer:  # every layer, a dense one's 0 too (Megatron-LM's tags)
                for layer, value in enumerate((values / num_microbatches).tolist()):
                    writers.add(f"moe/{name}_layer_{layer}", value, iteration)
        self.window.add(losses)
        mcore_compat.clear_moe_losses()
        return losses

    def interval_means(self):
        """The losses averaged over the iterations since the last call (the iteration
        line's interval, as Megatron-LM's total_loss_dict)."""
        return self.window.means()

    def clear(self):
        """Megatron-LM clears the tracker after an evaluation; the trainer also clears it
        before every forward/backward pass, so a pass the rerun machine repeats counts once."""
        if self.names:
            mcore_compat.clear_moe_losses()
