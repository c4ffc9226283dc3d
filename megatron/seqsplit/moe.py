"""Mixture-of-experts layers that are exact across sequence splits.

Routing is per token, so the experts' outputs of a split are those of the same tokens
unsplit. What is not per token are the router's auxiliary losses: each one weighs a
token's routing scores by statistics of the whole microbatch (tokens per expert, token
count), which megatron-core computes from the tokens of one forward call. Under Seq1F1B
one call is one split.

What makes it exact: every auxiliary loss is linear in the routing scores with weights
that carry no gradient (counts), ``loss = sum_e P_e * w_e(counts)``, ``P_e`` the scores
summed over the tokens. The split run's loss is therefore the sum over the splits of
``P_e(split) * w_e(whole microbatch)``, and its gradient is ``w_e(whole microbatch)``
for each of the split's tokens. A microbatch's splits all run forward on a stage before
its first backward there, so the counts are complete when the gradient is needed:
``SplitRouter`` records each split's counts in the iteration's ``RoutingStatistics``
(keyed by layer, microbatch and split, so recomputation overwrites rather than adds),
and ``_DeferredAuxLoss``'s backward turns the totals into the weights.

* aux_loss: ``w_e = coeff * E / (k * T^2) * F_e`` over the microbatch (T tokens, F_e of
  them routed to expert e, summed over the TP group as megatron-core does);
* seq_aux_loss: the same per sequence of the microbatch, divided by the batch size;
* global_aux_loss: ``F_e`` is the running mean of the counts of the microbatches up to
  this one (summed over TP and data parallel), ``T`` this microbatch's tokens there;
* z-loss: ``coeff / T`` on each token's ``logsumexp(logits)^2``;
* expert bias: counts summed over all forward calls of the step, exact as it is.

The split run's loss values (for logging) are the same sums, each split's share
``P_e(split) . w_e`` added in its backward to megatron-core's MoE loss tracker, where
the unsplit router records the microbatch's value in forward: the trainer reports both
the same way (``megatron/trainer/moe_metrics.py``).
"""

from dataclasses import dataclass, field

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron import mcore_compat
from megatron.seqsplit.split_context import SplitContext

AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


def allow_router_without_transformer_engine() -> None:
    """megatron-core's router gating reads ``moe_utils.te_general_gemm``, a name defined
    only when Transformer Engine imports (NameError otherwise, on GPU as on CPU):
    without TE it is None, which selects the torch matmul."""
    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@dataclass
class _Record:
    """One split's routing counts in one layer (all without gradient)."""

    tokens: int  # tokens of this split on this rank
    tokens_reduced: int  # the same over the loss's reduce group (TP [x DP for global])
    counts: dict = field(default_factory=dict)  # loss type -> reduced tokens per expert


class RoutingStatistics:
    """Per-split routing counts of one forward-backward pass (one per iteration, like the
    KV cache), keyed by (layer, microbatch, split)."""

    def __init__(self):
        self._records = {}

    def record(self, layer, microbatch, split, record: _Record) -> None:
        self._records[(layer, microbatch, split)] = record

    def _of(self, layer, microbatch):
        return [r for (l, m, _), r in self._records.items() if l == layer and m == microbatch]

    def tokens(self, layer, microbatch, reduced=False) -> int:
        return sum(r.tokens_reduced if reduced else r.tokens
                   for r in self._of(layer, microbatch))

    def counts(self, layer, microbatch, kind) -> torch.Tensor:
        return sum(r.counts[kind] for r in self._of(layer, microbatch))

    def microbatches(self, layer):
        return sorted({m for (l, m, _) in self._records if l == layer})

    def clear(self) -> None:
        self._records.clear()


class _DeferredAuxLoss(torch.autograd.Function):
    """Identity on ``activation``; in backward, the gradient ``weights() * scale`` for
    ``partial`` (the split's scores summed over its tokens), where ``weights`` reads the
    microbatch's complete counts, known by then."""

    @staticmethod
    def forward(ctx, activation, partial, weights):
        ctx.weights = weights
        ctx.save_for_backward(partial)
        return activation

    @staticmethod
    def backward(ctx, grad_output):
        (partial,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        if scale is None:
            scale = torch.ones((), device=partial.device)
        weights = ctx.weights(partial)
        return grad_output, weights.to(partial.dtype) * scale.to(partial.dtype), None


class SplitRouter(TopKRouter):
    """megatron-core's top-k router whose auxiliary losses (and z-loss) are those of the
    whole microbatch when it runs one split of it (see the module docstring).

    ``split`` is set by ``SplitTransformerLayer`` before each forward (also a recomputed
    one); unsplit (no split, or one split) it is megatron-core's router unchanged."""

    split = None

    def _split_mode(self):
        split = self.split
        return (isinstance(split, SplitContext) and split.num_splits > 1
                and split.routing_stats is not None)

    # --- statistics --------------------------------------------------------------------
    def _record(self, logits_count, routing_map, seq_length, bsz):
        split, stats = self.split, self.split.routing_stats
        record = _Record(tokens=routing_map.shape[0],
                         tokens_reduced=routing_map.shape[0] * self.tp_cp_group.size())
        with torch.no_grad():
            per_expert = routing_map.sum(dim=0).float()
            record.counts["tp"] = self._all_reduce(per_expert, self.tp_cp_group)
            per_sequence = routing_map.reshape(seq_length, -1).sum(dim=0).float()
            record.counts["seq"] = self._all_reduce(per_sequence, self.tp_cp_group)
            if self.get_aux_loss_coeff("global_aux_loss") > 0:
                record.counts["global"] = self._all_reduce(per_expert, self.tp_dp_cp_group)
                record.counts["global_tokens"] = routing_map.shape[0] * self.tp_dp_cp_group.size()
        stats.record(self._layer_key(), split.microbatch_id, split.split_index, record)

    @staticmethod
    def _all_reduce(tensor, group):
        tensor = tensor.clone()
        if group is not None and group.size() > 1:
            torch.distributed.all_reduce(tensor, group=group)
        return tensor

    def _stats(self):
        return self.split.routing_stats, self._layer_key(), self.split.microbatch_id

    def _is_mtp_layer(self):
        return getattr(self, "is_mtp_layer", False)  # megatron-core >= 0.17 sets it

    def _layer_key(self):
        """The statistics' key of this router: megatron-core >= 0.17 numbers MTP layers
        from 1, as decoder layers that may sit on the same stage."""
        return ("mtp", self.layer_number) if self._is_mtp_layer() else self.layer_number

    def _tracker_layer(self):
        """(layer number, layer count) under which megatron-core's router logs: MTP
        layers after the decoder's (0.16 numbers them so already, 0.17+ adds num_layers)."""
        number = self.layer_number + (self.config.num_layers if self._is_mtp_layer() else 0)
        return number, self.config.num_layers + (self.config.mtp_num_layers or 0)

    # --- the router's loss hooks (megatron-core names, rows of mcore_compat) -------------
    def routing(self, logits, padding_mask=None):
        if not self._split_mode():
            return super().routing(logits, padding_mask=padding_mask)
        if padding_mask is not None:
            raise ValueError("MoE padding masks are not supported with --seq1f1b-splits > 1")
        seq_length, bsz = logits.shape[:2]
        if self.training and self.is_aux_loss_enabled():
            # counts of the aux-loss routing (top-k of the scores, without expert bias)
            flat = logits.reshape(-1, self.config.num_moe_experts)
            routing_map, _ = moe_utils.compute_routing_scores_for_aux_loss(
                flat.detach(), self.topk, self.score_function, fused=False)
            self._record(flat, routing_map, seq_length, bsz)
        elif self.training and self.config.moe_z_loss_coeff is not None:
            flat = logits.reshape(-1, self.config.num_moe_experts)
            self._record(flat, torch.zeros_like(flat, dtype=torch.bool), seq_length, bsz)
        self._seq_shape = (seq_length, bsz)
        return super().routing(logits, padding_mask=padding_mask)

    def _attach(self, probs, partial, weights, name, coeff, **groups):
        """``groups``: the tracker's reduction groups of ``name``, megatron-core's."""

        per_token = self._per_token_loss_tokens()

        def weights_and_log(part):
            w = weights()
            # this split's share of the microbatch's loss value (megatron-core logs the
            # loss divided by its coefficient); the splits' shares add up to it
            share = (part.detach().float() * w.float()).sum() / coeff
            mcore_compat.record_moe_loss(name, share, *self._tracker_layer(), **groups)
            return w * per_token()

        return _DeferredAuxLoss.apply(probs, partial, weights_and_log)

    def _per_token_loss_tokens(self):
        """The factor (read in backward, when the counts are complete) by which the
        router's losses weigh under --calculate-per-token-loss: megatron-core multiplies
        each by its forward call's tokens (times the TP x CP size since 0.17:
        mcore_compat), which finalize_model_grads' division by the batch's loss tokens
        cancels; unsplit the call is the microbatch, so here the factor counts the whole
        microbatch's tokens, not the split's. 1 without the flag."""
        if not self.calculate_per_token_loss:
            return lambda: 1
        stats, layer, microbatch = self._stats()
        reduced = mcore_compat.per_token_router_loss_counts_tp_cp()
        return lambda: stats.tokens(layer, microbatch, reduced=reduced)

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        if not self._split_mode():
            return super()._apply_aux_loss(probs, scores_for_aux_loss, routing_map,
                                           with_padding_mask=with_padding_mask)
        coeff = self.get_aux_loss_coeff("aux_loss")
        if coeff == 0:
            return probs
        stats, layer, microbatch = self._stats()
        experts, topk = self.config.num_moe_experts, self.topk

        def weights():
            total = stats.tokens(layer, microbatch, reduced=True)
            return stats.counts(layer, microbatch, "tp") * (
                experts * coeff / (topk * total * total))

        return self._attach(probs, scores_for_aux_loss.sum(dim=0), weights,
                            "load_balancing_loss", coeff, reduce_group=self.tp_cp_group)

    def _apply_seq_aux_loss(self, probs, scores_for_aux_loss, routing_map, seq_length, bsz,
                            with_padding_mask=False):
        if not self._split_mode():
            return super()._apply_seq_aux_loss(probs, scores_for_aux_loss, routing_map,
                                               seq_length, bsz,
                                               with_padding_mask=with_padding_mask)
        coeff = self.get_aux_loss_coeff("seq_aux_loss")
        if coeff == 0:
            return probs
        stats, layer, microbatch = self._stats()
        experts, topk = self.config.num_moe_experts, self.topk

        def weights():
            # tokens of one sequence over the TP group: the microbatch's divided by bsz
            total = stats.tokens(layer, microbatch, reduced=True) // bsz
            return stats.counts(layer, microbatch, "seq") * (
                experts * coeff / (topk * total * total) / bsz)

        partial = scores_for_aux_loss.reshape(seq_length, -1).sum(dim=0)
        return self._attach(probs, partial, weights, "seq_load_balancing_loss", coeff,
                            reduce_group=self.tp_cp_group)

    def _apply_global_aux_loss(self, probs, scores_for_aux_loss, routing_map,
                               with_padding_mask=False):
        if not self._split_mode():
            return super()._apply_global_aux_loss(probs, scores_for_aux_loss, routing_map,
                                                  with_padding_mask=with_padding_mask)
        coeff = self.get_aux_loss_coeff("global_aux_loss")
        if coeff == 0:
            return probs
        stats, layer, microbatch = self._stats()
        experts, topk = self.config.num_moe_experts, self.topk

        def weights():
            # megatron-core's running mean over the step's microbatches up to this one
            seen = [m for m in stats.microbatches(layer) if m <= microbatch]
            running = sum(stats.counts(layer, m, "global") for m in seen) / len(seen)
            total = stats.counts(layer, microbatch, "global_tokens")
            return running * (experts * coeff / (topk * total * total))

        return self._attach(probs, scores_for_aux_loss.sum(dim=0), weights,
                            "global_load_balancing_loss", coeff,
                            reduce_group=self.tp_dp_cp_group, reduce_group_has_dp=True)

    def apply_z_loss(self, logits, padding_mask=None):
        if not self._split_mode():
            return super().apply_z_loss(logits, padding_mask=padding_mask)
        if not (self.config.moe_z_loss_coeff is not None and self.training
                and torch.is_grad_enabled()):
            return logits
        coeff = self.config.moe_z_loss_coeff / self.tp_cp_group.size()
        stats, layer, microbatch = self._stats()

        def weights():  # megatron-core: coeff * mean over the microbatch's tokens
            return torch.tensor(coeff / stats.tokens(layer, microbatch), device=logits.device)

        partial = torch.square(torch.logsumexp(logits, dim=-1)).sum()
        return self._attach(logits, partial, weights, "z_loss", coeff,
                            avg_group=self.tp_dp_cp_group)


def _output_of_its_own(module, inputs, output):
    """A biased expert's fc2 output, copied: megatron-core's expert MLP adds the bias to it
    in place, and at one TP rank the output is the input of the (identity) TP all-reduce,
    returned as-is by its autograd Function, which autograd forbids modifying in place."""
    out, bias = output
    return out.clone(), bias


class SplitMoELayer(MoELayer):
    """megatron-core's MoE layer whose recomputation (``--recompute-modules moe``,
    ``--moe-layer-recompute``) re-runs it with the split its forward ran.

    megatron-core checkpoints the layer's inner forward, which reads the router's split
    when it runs; in backward that is another split's, or none (``SplitTransformerLayer``
    hands the split over for one forward only), and the router would weigh the split's
    auxiliary losses by its own tokens alone. Here the layer checkpoints itself with the
    same megatron-core function, around a forward that sets the split first."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.recompute_with_split = self.moe_layer_recompute
        self.moe_layer_recompute = False  # megatron-core's own checkpoint: replaced below
        for expert in getattr(self.experts, "local_experts", ()):
            if getattr(expert.linear_fc2, "bias", None) is not None:
                expert.linear_fc2.register_forward_hook(_output_of_its_own)

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        if not (self.recompute_with_split and self.training):
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        split = self.router.split

        def forward_in_split(hidden):
            before, self.router.split = self.router.split, split
            try:
                return MoELayer.forward(self, hidden, intermediate_tensors, padding_mask)
            finally:
                self.router.split = before

        return tensor_parallel.checkpoint(forward_in_split, False, hidden_states)


class SplitTransformerLayer(TransformerLayer):
    """megatron-core's transformer layer that hands the split it runs (its
    ``packed_seq_params``) to its MoE router, on every forward including a recomputed
    one (the split is one of the checkpointed forward's arguments)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # megatron-core 0.17 tells only an mlp whose class is MoELayer itself that it is
        # in an MTP layer (0.18+ tells any): without this our SplitMoELayer's router would
        # count as the decoder layer of the same number (its split statistics shared with
        # that layer's, its losses logged there, --mtp-use-repeated-layer's scaling lost)
        if getattr(self, "is_mtp_layer", False) and isinstance(getattr(self, "mlp", None),
                                                                MoELayer):
            self.mlp.is_mtp_layer = True
            self.mlp.router.is_mtp_layer = True

    def forward(self, *args, **kwargs):
        router = getattr(getattr(self, "mlp", None), "router", None)
        if isinstance(router, SplitRouter):
            router.split = kwargs.get("packed_seq_params")
        try:
            return super().forward(*args, **kwargs)
        finally:
            if isinstance(router, SplitRouter):
                router.split = None
