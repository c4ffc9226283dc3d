"""--apply-residual-connection-post-layernorm: the residual is the norm's output.

Megatron-LM's legacy transformer layer (the meaning of the flag) computes

    y = x_n + attention(x_n),   x_n = input_norm(x)
    z = y_n + mlp(y_n),         y_n = post_attention_norm(y)

while megatron-core's TransformerLayer adds the attention and MLP outputs to the norms'
inputs (x and y); TransformerConfig has the flag but no layer reads it. Here the layer's
two norms move out of megatron-core's reach (its input_layernorm and pre_mlp_layernorm
become identities) and are applied to the hidden states before megatron-core takes its
residual, so the residual is the normalised tensor. A norm is per token, so it is exact
under sequence splits and sequence parallelism like megatron-core's own.
"""

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayer


class PostNormResidualLayer(TransformerLayer):
    """TransformerLayer whose residuals are its norms' outputs (legacy Megatron-LM)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the legacy layer's names; megatron-core's own slots keep an identity
        self.input_norm, self.input_layernorm = self.input_layernorm, IdentityOp()
        self.post_attention_norm, self.pre_mlp_layernorm = self.pre_mlp_layernorm, IdentityOp()

    def _forward_attention(self, *args, **kwargs):
        # megatron-core passes hidden_states by keyword from its block, positionally else
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = self.input_norm(kwargs["hidden_states"])
        else:
            args = (self.input_norm(args[0]),) + tuple(args[1:])
        return super()._forward_attention(*args, **kwargs)

    def _forward_mlp(self, hidden_states, *args, **kwargs):
        return super()._forward_mlp(self.post_attention_norm(hidden_states), *args, **kwargs)
