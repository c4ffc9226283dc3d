"""TransformerConfig from flags, and the GPT model for one pipeline stage."""

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.activations import squared_relu
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron.model_shape import pad_vocab_size, vocab_divisible_by
from megatron.trainer import device
from megatron.trainer.agreed_stop import AgreedStop
from megatron.trainer.mla_arguments import mla_config_fields
from megatron.trainer.moe_arguments import moe_config_fields
from megatron.trainer.mtp_arguments import mtp_config_fields
from megatron.trainer.rope_arguments import yarn_config_attributes
from megatron.trainer.attention_arguments import attention_config_fields
from megatron.seqsplit.model import (
    SeqSplitGPTModel,
    split_aware_local_spec,
    split_aware_mtp_block_spec,
)


def params_dtype(args):
    if args.bf16:
        return torch.bfloat16
    if args.fp16:
        return torch.float16
    return torch.float32


def tanh_gelu(x):
    """GeLU's tanh approximation: what megatron-core's fused ``bias_gelu`` computes, which
    Megatron-LM runs by default (``--bias-gelu-fusion``) in a GeLU MLP with biased linear
    layers. Here unfused, as PyTorch's ``gelu(approximate="tanh")``."""
    return F.gelu(x, approximate="tanh")


def biased_gelu(args) -> bool:
    """Whether the MLP is GeLU with biased linear layers: the model Megatron-LM's
    bias+GeLU fusion applies to (it turns the fusion off without biases)."""
    return not (args.swiglu or getattr(args, "squared_relu", False)
                or getattr(args, "quick_geglu", False) or args.disable_bias_linear)


def activation_func(args):
    """The MLP activation as Megatron-LM computes it: SiLU (gated) with --swiglu, squared
    ReLU with --squared-relu, quick GeLU (gated) with --quick-geglu, else GeLU: its tanh
    approximation where Megatron-LM fuses bias and GeLU (biased linear layers, no
    --no-bias-gelu-fusion), else the exact (erf) one."""
    if args.swiglu:
        return F.silu
    if getattr(args, "squared_relu", False):
        return squared_relu
    if getattr(args, "quick_geglu", False):
        return quick_gelu  # megatron-core's: its gated MLP checks for this function
    if biased_gelu(args) and getattr(args, "bias_gelu_fusion", True):
        return tanh_gelu
    return F.gelu


def xavier_init_fields(args) -> dict:
    """--init-method-xavier-uniform: megatron-core's config with Xavier-uniform initial
    weights for the layers (and, unless --embedding-init-method-std differs, the embedding,
    as megatron-core falls back to the layers' method). Megatron-LM 0.19 means this but
    hands the output layers' method over as ``scaled_init_method``, which its
    TransformerConfig does not take (a TypeError); here it is
    ``output_layer_init_method``."""
    if not getattr(args, "init_method_xavier_uniform", False):
        return {}
    return {"init_method": torch.nn.init.xavier_uniform_,
            "output_layer_init_method": torch.nn.init.xavier_uniform_}


def transformer_config_from_args(args) -> TransformerConfig:
    on_gpu = device.on_cuda(args)
    dtype = params_dtype(args)
    mla = mla_config_fields(args)
    config = (MLATransformerConfig if mla else TransformerConfig)(
        num_layers=args.num_layers,
        # Megatron-LM's uneven split (None: even); megatron-core builds and numbers the layers
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        # megatron-core parses it again and builds each chunk's layers from it
        pipeline_model_parallel_layout=getattr(args, "pipeline_model_parallel_layout", None),
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.norm_epsilon,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu or getattr(args, "quick_geglu", False),
        activation_func=activation_func(args),
        glu_linear_offset=getattr(args, "glu_linear_offset", 0.0),
        activation_func_clamp_value=getattr(args, "activation_func_clamp_value", None),
        add_bias_linear=not args.disable_bias_linear,
        # Megatron-LM's meaning: QKV bias also without biased linear layers (Qwen2.5)
        add_qkv_bias=getattr(args, "add_qkv_bias", False) or not args.disable_bias_linear,
        qk_layernorm=getattr(args, "qk_layernorm", False),
        # recorded only: megatron-core's layer never reads it (the local spec's layer does)
        apply_residual_connection_post_layernorm=getattr(
            args, "apply_residual_connection_post_layernorm", False),
        rotary_interleaved=getattr(args, "rotary_interleaved", False),
        init_method_std=args.init_method_std,
        **xavier_init_fields(args),
        embedding_init_method_std=getattr(args, "embedding_init_method_std", None),
        no_rope_freq=getattr(args, "no_rope_freq", None),
        **attention_config_fields(args),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        microbatch_group_size_per_vp_stage=(
            args.microbatch_group_size_per_virtual_pipeline_stage
            or args.pipeline_model_parallel_size),
        sequence_parallel=args.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        disable_bf16_reduced_precision_matmul=getattr(
            args, "disable_bf16_reduced_precision_matmul", False),
        # megatron-core's CPU path initialises whole weights, then divides them over TP
        use_cpu_initialization=not on_gpu or args.use_cpu_initialization,
        perform_initialization=args.perform_initialization,
        # fused kernels need CUDA (and apex/TE); the unfused paths are exact everywhere
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        recompute_granularity=args.recompute_granularity,
        # megatron-core's default (core attention) unless given
        **({"recompute_modules": list(args.recompute_modules)}
           if args.recompute_granularity == "selective" and args.recompute_modules else {}),
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        calculate_per_token_loss=args.calculate_per_token_loss,
        deterministic_mode=getattr(args, "deterministic_mode", False),
        deallocate_pipeline_outputs=True,
        # Megatron-LM's defaults: interleaved schedules overlap p2p with compute through
        # unbatched isend/irecv. (Batched p2p with pp=2 pairs a gradient send with an
        # activation receive between the same two ranks: silently wrong data.)
        overlap_p2p_comm=bool(args.virtual_pipeline_model_parallel_size),
        batch_p2p_comm=not args.virtual_pipeline_model_parallel_size,
        batch_p2p_sync=on_gpu,  # the sync is a torch.cuda.synchronize
        timers=None,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,  # TP by default
        **moe_config_fields(args),
        **mtp_config_fields(args),
        **mla,
    )
    # YaRN of standard attention: attributes the config class does not declare, which
    # GPTModel and the attention read (set after construction, as Megatron-LM does)
    for attribute, value in yarn_config_attributes(args).items():
        setattr(config, attribute, value)
    return config


def layer_spec(args, config, vp_stage=None):
    if args.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm,
                                                          qk_l2_norm=config.qk_l2_norm)
    return split_aware_local_spec(config, normalization=args.normalization,
                                  attention_backend=args.attention_backend, vp_stage=vp_stage,
                                  kv_cache=args.seq1f1b_kv_cache,
                                  qk_layernorm=getattr(args, "qk_layernorm", False),
                                  residual_post_layernorm=getattr(
                                      args, "apply_residual_connection_post_layernorm", False),
                                  moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False))


def gpt_model_provider(args, config, pre_process=True, post_process=True, vp_stage=None):
    """The GPT model of this pipeline stage (with --mtp-num-layers, the last stage also
    holds the MTP layers, each built from the decoder's last layer spec, as Megatron-LM)."""
    decoder_spec = layer_spec(args, config, vp_stage)
    return SeqSplitGPTModel(
        config=config,
        transformer_layer_spec=decoder_spec,
        mtp_block_spec=split_aware_mtp_block_spec(
            config, decoder_spec,
            use_transformer_engine=args.transformer_impl == "transformer_engine",
            vp_stage=vp_stage),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        fp16_lm_cross_entropy=getattr(args, "fp16_lm_cross_entropy", False),
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=getattr(args, "use_rope_scaling", False),
        rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0),
        seq_len_interpolation_factor=getattr(args, "rotary_seq_len_interpolation_factor", None),
        vp_stage=vp_stage,
    )


def vocab_size_of_model(args, tokenizer_vocab_size: int) -> int:
    """--padded-vocab-size as given (Megatron-LM's meaning), else the tokenizer's size
    padded (model_shape.pad_vocab_size, the planner's rule too). A size below the
    tokenizer's is refused with one line (on rank 0)."""
    try:
        return pad_vocab_size(tokenizer_vocab_size, args.tensor_model_parallel_size,
                              vocab_divisible_by(args), args.padded_vocab_size)
    except ValueError as error:
        raise AgreedStop(str(error)) from None


def stage_flags():
    return (parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage())
