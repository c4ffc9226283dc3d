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
"""

from megatron.core.extensions import transformer_engine as mcore_te
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron.seqsplit.recompute import checkpoint_kernel_not_core_attention
from megatron.seqsplit.split_context import SplitContext


def allow_mla_without_transformer_engine() -> None:
    """megatron-core 0.16's MLA module sets its ``HAVE_TE`` when its imports from
    ``extensions.transformer_engine`` succeed, which they do without Transformer Engine
    (a MagicMock stands in for it there): its constructor then fails on
    ``isinstance(..., TELinear)`` with a mock. Its flag follows whether TE imported."""
    if not getattr(mcore_te, "HAVE_TE", False):
        multi_latent_attention.HAVE_TE = False


class SplitMLASelfAttention(MLASelfAttention):
    """megatron-core's ``MLASelfAttention`` whose RoPE follows a split's offset; under
    selective recomputation the attention kernel is checkpointed after the KV-cache write
    (``recompute``), as for standard attention."""

    def __init__(self, *args, **kwargs):
        allow_mla_without_transformer_engine()
        super().__init__(*args, **kwargs)
        checkpoint_kernel_not_core_attention(self)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    position_ids=None, packed_seq_params=None,
                                    inference_context=None, **kwargs):
        # a private method (an mcore_compat row): megatron-core's forward calls it with
        # these positional arguments on every checked version
        split = packed_seq_params if isinstance(packed_seq_params, SplitContext) else None
        if split is None:
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, position_ids, packed_seq_params,
                inference_context=inference_context, **kwargs)
        split.mark_consumed("positions")
        rotary = self.rotary_pos_emb
        unbound = type(rotary).forward

        def at_offset(max_seq_len, offset=0, packed_seq=False, **rest):
            # RotaryEmbedding / YarnRotaryEmbedding.forward(max_seq_len, offset, ...):
            # positions offset..offset+len-1 are the same floats as a slice of the
            # unsplit table (integer positions added before the product)
            return unbound(rotary, max_seq_len, split.offset + offset, packed_seq, **rest)

        rotary.forward = at_offset  # instance attribute: nn.Module.__call__ reads it
        try:
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, position_ids, None,
                inference_context=inference_context, **kwargs)
        finally:
            del rotary.forward
