"""GPT model and layer spec that run sequence splits exactly.

Two things differ from megatron-core's ``GPTModel`` with the local spec:

* core attention is ``SplitCausalAttention`` (KV-prefix cache across splits);
* RoPE (and YaRN) uses each split's absolute positions: megatron-core computes rotary
  embeddings for positions ``0..len-1`` of whatever it is given, so for a split the
  embedding is recomputed from ``offset``. Learned absolute embeddings need nothing:
  they read the split's (absolute) ``position_ids``.

The layer spec also swaps ``SelfAttention`` for ``SplitSelfAttention``, which under
selective recomputation checkpoints the attention kernel after the KV-cache write
rather than the whole core attention (``megatron.seqsplit.recompute``).
"""

import copy
import functools
import inspect

import torch
from megatron.core.models.gpt import GPTModel, gpt_model
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron.seqsplit.context_parallel import rotary_embeddings_without_context_parallel
from megatron.seqsplit.core_attention import SplitCausalAttention
from megatron.seqsplit.mla import SplitMLASelfAttention
from megatron.seqsplit.mtp import begin_split_rolls, end_split_rolls, install_split_roll
from megatron.seqsplit.moe import (
    SplitMoELayer,
    SplitRouter,
    SplitTransformerLayer,
    allow_router_without_transformer_engine,
)
from megatron.seqsplit.post_norm_residual import PostNormResidualLayer
from megatron.seqsplit.recompute import (
    SplitSelfAttention,
    prepare_output_discarding_checkpoints,
)
from megatron.seqsplit.split_context import SplitContext


class SequenceParallelTorchNorm:
    """PyTorch LayerNorm / RMSNorm usable under sequence parallelism.

    megatron-core's torch fallback (used without apex) refuses sequence parallel. A
    norm is per token, so it works on a sequence shard as it is; what sequence
    parallel needs is that each TP rank's weight gradient (from its own tokens) is
    summed over the TP group, which megatron-core's ``finalize_model_grads`` does for
    parameters marked ``sequence_parallel``.
    """

    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
                zero_centered_gamma=False, normalization="LayerNorm"):
        norm_classes = ({"LayerNorm": ZeroCenteredLayerNorm, "RMSNorm": ZeroCenteredRMSNorm}
                        if zero_centered_gamma or config.layernorm_zero_centered_gamma else
                        {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm})
        if config.normalization not in norm_classes:
            raise ValueError(f"--normalization {config.normalization} is not supported")
        norm = norm_classes[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """--apply-layernorm-1p: the stored weight is gamma - 1 (initialised to zero), so
    weight decay pulls gamma towards 1 instead of 0."""

    def reset_parameters(self):
        super().reset_parameters()
        torch.nn.init.zeros_(self.weight)

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1,
                                              self.bias, self.eps)


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """RMSNorm with the same zero-centred weight as ``ZeroCenteredLayerNorm``."""

    def reset_parameters(self):
        super().reset_parameters()
        torch.nn.init.zeros_(self.weight)

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight + 1,
                                            self.eps)


def transformer_engine_norm_names(multi_latent_attention, dense):
    """The checkpoint names of a layer's norms in megatron-core's Transformer Engine spec
    (Megatron-LM's default), which fuses a norm into the linear layer after it where it
    can and saves it as that layer's ``layer_norm_weight``/``layer_norm_bias``. The local
    spec's own map (for every layer: the QKV and fc1 fused names) is right for dense
    attention layers only: an MoE layer keeps a separate ``pre_mlp_layernorm`` under
    Transformer Engine, and MLA a separate ``input_layernorm`` while its query/key-value
    norms are fused into the up-projections (DeepSeek-V3's q_a/kv_a_layernorm). With
    these names a checkpoint of Megatron-LM's MoE and MLA models loads here and back
    (older checkpoints of this project: megatron.trainer.checkpoint_names)."""
    names = {}
    if multi_latent_attention:
        names["self_attention.q_layernorm."] = "self_attention.linear_q_up_proj.layer_norm_"
        names["self_attention.kv_layernorm."] = "self_attention.linear_kv_up_proj.layer_norm_"
    else:
        names["input_layernorm."] = "self_attention.linear_qkv.layer_norm_"
    if dense:
        names["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return names


def _swap_torch_norms(submodules):
    for name in ("input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm",
                 "kv_layernorm"):
        if getattr(submodules, name, None) is WrappedTorchNorm:
            setattr(submodules, name, SequenceParallelTorchNorm)


def _split_aware_layer_spec(normalization, attention_backend, kv_cache, qk_layernorm,
                            residual_post_layernorm=False, multi_latent_attention=False,
                            num_experts=None, moe_grouped_gemm=False, *, qk_l2_norm=False):
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                    normalization=normalization, qk_layernorm=qk_layernorm,
                                    multi_latent_attention=multi_latent_attention,
                                    qk_l2_norm=qk_l2_norm)
    if residual_post_layernorm:
        if num_experts is not None:  # both replace the layer class; no combined one yet
            raise ValueError("--apply-residual-connection-post-layernorm is not supported with "
                             "--num-experts: drop one of them")
        spec.module = PostNormResidualLayer
    # MLA: its own rotary part follows the split (mla.py); selective recomputation of
    # core attention keeps megatron-core's checkpoint (SplitSelfAttention's is for the
    # fused-QKV attention)
    spec.submodules.sharded_state_dict_keys_map = transformer_engine_norm_names(
        multi_latent_attention, dense=num_experts is None)
    spec.submodules.self_attention.module = (SplitMLASelfAttention if multi_latent_attention
                                             else SplitSelfAttention)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=SplitCausalAttention,
        params={"backend_name": attention_backend, "kv_cache": kv_cache})
    _swap_torch_norms(spec.submodules)
    _swap_torch_norms(spec.submodules.self_attention.submodules)
    if num_experts is not None:
        # the MoE router needs the split (its aux losses are over whole microbatches)
        spec.module = SplitTransformerLayer
        _moe_submodules(spec.submodules.mlp).router = SplitRouter
        spec.submodules.mlp = _with_moe_layer(spec.submodules.mlp, SplitMoELayer)
    return spec


def _moe_submodules(mlp):
    """The MoESubmodules of an MoE layer's spec: a ModuleSpec's up to 0.16, the keyword
    of a functools.partial(MoELayer, submodules=...) from 0.17 (an mcore_compat row)."""
    if isinstance(mlp, functools.partial):
        return mlp.keywords["submodules"]
    return mlp.submodules


def _with_moe_layer(mlp, layer_class):
    """The MoE layer's spec building ``layer_class`` instead of megatron-core's MoELayer
    (a ModuleSpec up to 0.16, a functools.partial from 0.17)."""
    if isinstance(mlp, functools.partial):
        return functools.partial(layer_class, *mlp.args, **mlp.keywords)
    mlp.module = layer_class
    return mlp


def moe_layer_pattern(config):
    """Megatron-LM's --moe-layer-freq: 1 for an MoE layer, 0 for a dense one, per layer."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    if len(freq) != config.num_layers:
        raise ValueError(f"--moe-layer-freq gives {len(freq)} layers, --num-layers is "
                         f"{config.num_layers}: give one 0/1 per layer")
    return list(freq)


def split_aware_local_spec(config, normalization: str = "LayerNorm",
                           attention_backend: str = "auto", vp_stage=None,
                           kv_cache: str = "buffer", qk_layernorm: bool = False,
                           residual_post_layernorm: bool = False,
                           moe_grouped_gemm: bool = False):
    """megatron-core's local GPT spec with split-aware core attention, as a block spec
    for this pipeline stage (its final norm, too, must support sequence parallel).
    `kv_cache`: the split attention's K/V prefix layout, "buffer" or "chunked".
    `qk_layernorm` (--qk-layernorm): per-head query and key norms, applied to each
    split's own tokens before RoPE and the KV cache (a norm is per token).
    `residual_post_layernorm` (--apply-residual-connection-post-layernorm): residuals taken
    after the norms (post_norm_residual).
    ``config.qk_l2_norm`` (--qk-l2-norm, Llama-4): megatron-core's weightless L2Norm on
    queries and keys in place of the qk norms, per token like them.
    With ``config.num_moe_experts`` the layers ``config.moe_layer_freq`` marks are
    mixture-of-experts layers whose router is split-exact (``megatron.seqsplit.moe``).
    With ``config.multi_latent_attention`` the attention is MLA (``megatron.seqsplit.mla``)."""
    build = functools.partial(_split_aware_layer_spec, normalization, attention_backend,
                              kv_cache, qk_layernorm, residual_post_layernorm,
                              getattr(config, "multi_latent_attention", False),
                              qk_l2_norm=getattr(config, "qk_l2_norm", False))
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    if config.num_moe_experts is None:
        return TransformerBlockSubmodules(layer_specs=[build()] * count,
                                          layer_norm=SequenceParallelTorchNorm)
    allow_router_without_transformer_engine()
    specs = {0: build(), 1: build(config.num_moe_experts, moe_grouped_gemm)}
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    pattern = moe_layer_pattern(config)[offset:offset + count]
    return TransformerBlockSubmodules(layer_specs=[specs[kind] for kind in pattern],
                                      layer_norm=SequenceParallelTorchNorm)


def split_aware_mtp_block_spec(config, decoder_spec, use_transformer_engine=False,
                               vp_stage=None):
    """megatron-core's multi-token prediction block spec (None on stages without MTP):
    each MTP layer's transformer layer is a copy of the decoder's last layer spec, so its
    attention is the split-aware one, with K/V caches of its own (``mtp_layer``:
    megatron-core >= 0.17 numbers MTP layers from 1, like decoder layers); its norms are
    the sequence-parallel torch norms where megatron-core would take its torch wrapper.
    Under splits its shifts read past the split (``mtp.py``)."""
    if not getattr(config, "mtp_num_layers", None):
        return None
    spec = get_gpt_mtp_block_spec(config, decoder_spec,
                                  use_transformer_engine=use_transformer_engine,
                                  vp_stage=vp_stage)
    if spec is None:
        return None
    install_split_roll()
    for layer_spec in spec.layer_specs:
        submodules = layer_spec.submodules
        for name in ("enorm", "hnorm", "layer_norm"):
            if getattr(submodules, name, None) is WrappedTorchNorm:
                setattr(submodules, name, SequenceParallelTorchNorm)
        # the decoder's layer spec, copied: its attention keeps MTP's own K/V caches
        # (the spec object is shared with the decoder's layers)
        name = ("mtp_model_layer" if hasattr(submodules, "mtp_model_layer")
                else "transformer_layer")  # megatron-core >= 0.17 / 0.16
        transformer_layer = copy.deepcopy(getattr(submodules, name))
        core_attention = transformer_layer.submodules.self_attention.submodules.core_attention
        if getattr(core_attention, "module", None) is SplitCausalAttention:
            core_attention.params = dict(core_attention.params, mtp_layer=True)
        setattr(submodules, name, transformer_layer)
    return spec


_GPT_FORWARD = inspect.signature(GPTModel.forward)


class SeqSplitGPTModel(GPTModel):
    """``GPTModel`` whose rotary embedding follows a split's offset, and whose
    multi-token prediction reads past a split's end.

    ``_preprocess`` is private megatron-core API (no public RoPE offset up to 0.19):
    its signature is a row of ``megatron.mcore_compat.TABLE``."""

    def __init__(self, config, *args, **kwargs):
        prepare_output_discarding_checkpoints(config)  # --recompute-modules layernorm, ...
        with rotary_embeddings_without_context_parallel(gpt_model):
            super().__init__(config, *args, **kwargs)

    def forward(self, *args, **kwargs):
        split = kwargs.get("packed_seq_params")
        if not (getattr(self, "mtp_process", False) and isinstance(split, SplitContext)):
            return super().forward(*args, **kwargs)
        given = _GPT_FORWARD.bind(self, *args, **kwargs).arguments
        begin_split_rolls(split, tokens=given.get("input_ids"),
                          position_ids=given.get("position_ids"), labels=given.get("labels"),
                          loss_mask=given.get("loss_mask"))
        try:
            return super().forward(*args, **kwargs)
        finally:
            end_split_rolls(split)

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None, **kwargs):
        outputs = super()._preprocess(
            input_ids, position_ids, decoder_input=decoder_input,
            inference_context=inference_context, packed_seq_params=packed_seq_params,
            padding_mask=padding_mask, **kwargs)
        split = packed_seq_params if isinstance(packed_seq_params, SplitContext) else None
        if split is not None:
            split.mark_consumed("positions")  # the executor checks it (split_context.CONSUMERS)
        if split is None or split.offset == 0 or outputs[1] is None:
            return outputs
        if self.position_embedding_type == "rope":
            rotary_pos_emb = self.rotary_pos_emb(split.length, offset=split.offset)
        elif self.position_embedding_type == "yarn":
            # YaRN's embedding comes with its concentration factor, which the attention
            # reads from the config (as megatron-core's _preprocess drops it)
            rotary_pos_emb, _ = self.rotary_pos_emb(split.length, offset=split.offset)
        else:
            return outputs
        return (outputs[0], rotary_pos_emb) + tuple(outputs[2:])
