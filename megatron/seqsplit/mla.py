"""Multi-latent attention (DeepSeek-V2/V3's MLA) that runs sequence splits exactly.

megatron-core's ``MLASelfAttention`` makes its own rotary embedding (RoPE or YaRN) for
the decoupled rotary part of queries and keys, for positions ``0..len-1`` of whatever it
is given: a split at offset p must rotate positions p..p+l-1. The GPT model's offset
(``SeqSplitGPTModel``) does not reach it (megatron-core gives MLA no rotary embedding),
so here the attention's own embedding is asked for the split's offset.

MLA also reads ``packed_seq_params`` as THD packing (``squeeze(1)`` of the batch axis when
it is not None): the split context is kept from it and handed only to core attention,
which is ``SplitCausalAttention`` (the KV caches keep MLA's keys and values, decompressed,
at their own head sizes). megatron-core's own MLA up-projection recomputation
(``recompute_modules`` "mla_up_proj") is not offered here (--recompute-modules takes
core_attn only).

Tensor parallelism: megatron-core's local spec (0.16 and 0.19) makes the key/value
down-projection column-parallel, gathers its output over TP and takes the key's decoupled
rotary part from it. That rotary key is shared by every head, but each TP rank's heads
give it only their share of its gradient, and the gather's backward only splits: its
gradient was never summed over TP (TP=2 changed the down-projection's rotary rows'
gradient, and through the hidden states every earlier parameter's, while the losses
stayed equal). ``_kv_down_projection_output`` hands megatron-core the full output, in
the sequence-parallel layout where SP is on, with that sum in its backward.

Also at TP>1 without sequence parallelism, with --qk-layernorm and a query latent:
megatron-core's finalize_model_grads sums every ``q_layernorm`` parameter's gradient over
TP (right for standard attention, whose query norm sees only the rank's heads), but MLA's
query-latent norm sees the whole latent on every rank, so each rank already holds the
whole gradient and the sum doubled it at TP=2. ``_query_norm_shared_over_tp`` gives each
rank 1/TP of it.
"""

import contextlib

import torch
from megatron.core.extensions import transformer_engine as mcore_te
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron.seqsplit.context_parallel import rotary_embeddings_without_context_parallel
from megatron.seqsplit.recompute import checkpoint_kernel_not_core_attention
from megatron.seqsplit.split_context import SplitContext


def allow_mla_without_transformer_engine() -> None:
    """megatron-core 0.16's MLA module sets its ``HAVE_TE`` when its imports from
    ``extensions.transformer_engine`` succeed, which they do without Transformer Engine
    (a MagicMock stands in for it there): its constructor then fails on
    ``isinstance(..., TELinear)`` with a mock. Its flag follows whether TE imported."""
    if not getattr(mcore_te, "HAVE_TE", False):
        multi_latent_attention.HAVE_TE = False


class _SumGradientOverGroup(torch.autograd.Function):
    """Identity forward; backward: the gradient summed over ``group``. Not megatron-core's
    copy_to_tensor_model_parallel_region: on 0.16 its all-reduce works on a contiguous
    copy and returns the unreduced input when the gradient is a strided view (here it is
    a slice of the concatenation's gradient)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward: the gradient times ``factor``."""

    @staticmethod
    def forward(ctx, tensor, factor):
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class SplitMLASelfAttention(MLASelfAttention):
    """megatron-core's ``MLASelfAttention`` whose RoPE follows a split's offset; under
    selective recomputation the attention kernel is checkpointed after the KV-cache write
    (``recompute``), as for standard attention."""

    def __init__(self, *args, **kwargs):
        allow_mla_without_transformer_engine()
        with rotary_embeddings_without_context_parallel(multi_latent_attention):
            super().__init__(*args, **kwargs)
        checkpoint_kernel_not_core_attention(self)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    position_ids=None, packed_seq_params=None,
                                    inference_context=None, **kwargs):
        # a private method (an mcore_compat row): megatron-core's forward calls it with
        # these positional arguments on every checked version
        split = packed_seq_params if isinstance(packed_seq_params, SplitContext) else None
        with self._kv_down_projection_summed_over_tp(), self._query_norm_shared_over_tp():
            if split is None:
                return super().get_query_key_value_tensors(
                    hidden_states, key_value_states, position_ids, packed_seq_params,
                    inference_context=inference_context, **kwargs)
            return self._split_query_key_value_tensors(
                split, hidden_states, key_value_states, position_ids, inference_context,
                **kwargs)

    def _split_query_key_value_tensors(self, split, hidden_states, key_value_states,
                                       position_ids, inference_context, **kwargs):
        split.mark_consumed("positions")
        rotary = self.rotary_pos_emb
        unbound = type(rotary).forward

        def at_offset(max_seq_len, offset=0, packed_seq=False, **rest):
            # RotaryEmbedding / YarnRotaryEmbedding.forward(max_seq_len, offset, ...):
            # positions offset..offset+len-1 are the same floats as a slice of the
            # unsplit table (integer positions added before the product)
            rest.pop("cp_group", None)  # no zigzag slice (context_parallel.py)
            return unbound(rotary, max_seq_len, split.offset + offset, packed_seq, **rest)

        rotary.forward = at_offset  # instance attribute: nn.Module.__call__ reads it
        try:
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, position_ids, None,
                inference_context=inference_context, **kwargs)
        finally:
            del rotary.forward

    @contextlib.contextmanager
    def _kv_down_projection_summed_over_tp(self):
        """For one call, ``linear_kv_down_proj`` returns its whole output (see the module
        docstring); nothing changes at TP=1 or when its output is already whole (a
        duplicated Linear, as in the Transformer Engine spec)."""
        projection = self.linear_kv_down_proj
        if self.tp_group is None or self.tp_group.size() == 1:
            yield
            return
        unbound = type(projection).forward

        def whole_output(hidden_states, *args, **kwargs):
            output, bias = unbound(projection, hidden_states, *args, **kwargs)
            return self._kv_down_projection_output(output), bias

        projection.forward = whole_output  # instance attribute: nn.Module.__call__ reads it
        try:
            yield
        finally:
            del projection.forward

    def _kv_down_projection_output(self, shard):
        """The column-parallel down-projection's shard [s, b, (kv_lora_rank + rotary) / TP]
        -> [s, b, kv_lora_rank + rotary] ([s / TP, ...] under sequence parallelism), whose
        rotary part's gradient is summed over TP. megatron-core then takes the path it has
        for a whole (Linear) output: split latent / rotary key, and under SP gather the
        rotary key over the sequence, whose backward (a reduce-scatter) sums it."""
        rotary = self.config.qk_pos_emb_head_dim
        if shard.size(-1) == self.config.kv_lora_rank + rotary:
            return shard
        whole = gather_from_tensor_model_parallel_region(shard, group=self.tp_group)
        if self.config.sequence_parallel:
            return scatter_to_sequence_parallel_region(whole, group=self.tp_group)
        latent, rotary_key = torch.split(whole, [self.config.kv_lora_rank, rotary], dim=-1)
        rotary_key = _SumGradientOverGroup.apply(rotary_key, self.tp_group)
        return torch.cat([latent, rotary_key], dim=-1)

    @contextlib.contextmanager
    def _query_norm_shared_over_tp(self):
        """For one call, the query-latent norm's parameters get 1/TP of their gradient (the
        norm's output gradient divided by TP, its input gradient multiplied back): the
        TP sum megatron-core's finalize_model_grads applies to ``q_layernorm`` then gives
        the whole gradient once. Only where that sum is wrong: TP>1, --qk-layernorm, a
        query latent (a norm module), no sequence parallelism (under SP each rank
        normalises its own part of the sequence and the sum is right)."""
        tp = 1 if self.tp_group is None else self.tp_group.size()
        norm = getattr(self, "q_layernorm", None)
        if (tp == 1 or not self.config.qk_layernorm or self.config.sequence_parallel
                or self.config.q_lora_rank is None or norm is None
                or not any(True for _ in norm.parameters())):
            yield
            return
        unbound = type(norm).forward

        def shared(latent, *args, **kwargs):
            output = unbound(norm, _ScaleGradient.apply(latent, float(tp)), *args, **kwargs)
            return _ScaleGradient.apply(output, 1.0 / tp)

        norm.forward = shared  # instance attribute: nn.Module.__call__ reads it
        try:
            yield
        finally:
            del norm.forward
