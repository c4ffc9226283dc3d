"""GPT model and layer spec that run sequence splits exactly.

Two things differ from megatron-core's ``GPTModel`` with the local spec:

* core attention is ``SplitCausalAttention`` (KV-prefix cache across splits);
* RoPE uses each split's absolute positions: megatron-core computes rotary
  embeddings for positions ``0..len-1`` of whatever it is given, so for a split the
  embedding is recomputed from ``offset``. Learned absolute embeddings need nothing:
  they read the split's (absolute) ``position_ids``.
"""

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron.seqsplit.core_attention import SplitCausalAttention
from megatron.seqsplit.split_context import SplitContext


def split_aware_local_spec(normalization: str = "LayerNorm", attention_backend: str = "auto"):
    """megatron-core's local GPT layer spec with split-aware core attention."""
    spec = get_gpt_layer_local_spec(normalization=normalization)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=SplitCausalAttention, params={"backend_name": attention_backend})
    return spec


class SeqSplitGPTModel(GPTModel):
    """``GPTModel`` whose rotary embedding follows a split's offset."""

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None, **kwargs):
        outputs = super()._preprocess(
            input_ids, position_ids, decoder_input=decoder_input,
            inference_context=inference_context, packed_seq_params=packed_seq_params,
            padding_mask=padding_mask, **kwargs)
        split = packed_seq_params if isinstance(packed_seq_params, SplitContext) else None
        if split is None or split.offset == 0 or outputs[1] is None:
            return outputs
        if self.position_embedding_type != "rope":
            return outputs
        rotary_pos_emb = self.rotary_pos_emb(split.length, offset=split.offset)
        return (outputs[0], rotary_pos_emb) + tuple(outputs[2:])
