"""The megatron-core and torch names whose presence or signature depends on the version.

The project supports megatron-core ``SUPPORTED_MCORE`` and overrides, patches or calls
private and version-dependent names of megatron-core and torch. Each of them is a row of
``TABLE``: the name, why we need it, the versions it was checked on and the parameters
we rely on. ``tests/test_mcore_compat.py`` resolves every row on the installed versions
and fails with the row when a name is gone or its signature no longer has those
parameters, so a new release breaks one named test instead of a training run.

Where two supported versions differ, the difference is bridged here, once
(``backward_step``, the MoE loss tracker), and the rest of the project calls the bridge.
A name that only some checked versions have is a row ``checked`` on those alone
(``Entry.holds_on``): the test checks it there and skips it on the others, where the
bridge uses another row.
"""

import functools
import importlib
import importlib.util
import inspect
from dataclasses import dataclass
from typing import Tuple

SUPPORTED_MCORE = ">=0.16.1,<0.20"
CHECKED_MCORE = ("0.16.1", "0.19.2")
CHECKED_TORCH = ("2.13.0",)

_BOTH = "megatron-core " + ", ".join(CHECKED_MCORE)
_TORCH = "torch " + ", ".join(CHECKED_TORCH)


def _config_field(field_name):
    """The installed megatron-core's TransformerConfig field ``field_name``, or None
    (imported here, not at the top: flag errors are reported before torch loads)."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    return next((f for f in dataclasses.fields(TransformerConfig) if f.name == field_name),
                None)


def config_has(field_name):
    """Whether the installed megatron-core's TransformerConfig has ``field_name``."""
    return _config_field(field_name) is not None


def moe_router_score_functions():
    """The MoE router score functions the installed megatron-core knows (its config's
    Literal: softmax and sigmoid; 0.19 adds sqrtsoftplus)."""
    import typing

    field = _config_field("moe_router_score_function")
    return set(typing.get_args(field.type)) or {"softmax", "sigmoid"}


def unsupported_megatron_core():
    """None if the installed megatron-core lies in SUPPORTED_MCORE, else the line saying
    what to install (read from the package's metadata: nothing is imported). A container's
    own megatron-core under a project installed with --no-deps, or on PYTHONPATH, would
    otherwise stop on an ImportError deep in our modules."""
    import importlib.metadata

    from packaging.specifiers import SpecifierSet

    install = f"pip install 'megatron-core{SUPPORTED_MCORE}'"
    try:
        installed = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return f"megatron-core is not installed: {install}"
    if SpecifierSet(SUPPORTED_MCORE).contains(installed, prereleases=True):
        return None
    return (f"megatron-core {installed} is installed; this project runs on megatron-core "
            f"{SUPPORTED_MCORE} ({' and '.join(CHECKED_MCORE)} tested in CI): {install}")


class CompatError(RuntimeError):
    """A table row no longer holds on the installed megatron-core / torch."""


@dataclass(frozen=True)
class Entry:
    """One version-dependent name.

    name: ``"module:attribute.path"``; the attribute may be a module global.
    why: what the project does with it.
    checked: the versions it was checked on.
    params: parameter names the project relies on, in signature order (others may sit
        between them); empty for names that are not called (classes subclassed for
        their attributes, module globals).
    """

    name: str
    why: str
    checked: str = _BOTH
    params: Tuple[str, ...] = ()
    # read with getattr where the installed megatron-core has it: on a version outside
    # ``checked`` its absence is bridged, not a failure (its presence is still checked)
    optional_elsewhere: bool = False

    def __str__(self):
        return f"{self.name} ({self.checked}): {self.why}"

    def holds_on(self, mcore_version: str) -> bool:
        """False for a row of a name that one checked megatron-core version has and this
        checked version does not (a bridge below picks the row of the installed one)."""
        prefix = "megatron-core "
        if not self.checked.startswith(prefix) or mcore_version not in CHECKED_MCORE:
            return True
        return mcore_version in self.checked[len(prefix):].split(", ")


def _mcore(name, why, *params, checked=_BOTH, optional_elsewhere=False):
    return Entry("megatron.core." + name, why, checked, tuple(params), optional_elsewhere)


def _torch(name, why, *params):
    return Entry(name, why, _TORCH, tuple(params))


# Modules whose global ``torch`` cpu_support swaps for a CPU stand-in: they create
# tensors on "cuda" / torch.cuda.current_device(), or call torch.cuda.synchronize /
# current_stream, on the training and checkpoint paths. Every one exists, with a global
# ``torch``, on each CHECKED_MCORE version (on 0.19.2 finalize_model_grads no longer
# creates a tensor on "cuda"; swapping its torch is harmless); a missing one stops
# cpu_support.apply with its row (``cuda_call_site``) before anything is patched.
CUDA_CALL_SITES = {
    "pipeline_parallel.p2p_communication": "receive buffers, shape handshake",
    "pipeline_parallel.schedules": "total_num_tokens on 'cuda'",
    "models.common.embeddings.rotary_pos_embedding": "inv_freq device",
    "models.common.embeddings.yarn_rotary_pos_embedding": "MLA's YaRN moves its inverse "
                                                         "frequencies to current_device()",
    "utils": "GlobalMemoryBuffer, l2 norm",
    "distributed.param_and_grad_buffer": "grad buffers",
    "distributed.distributed_data_parallel": "current_stream in grad sync",
    "distributed.finalize_model_grads": "num_tokens all-reduce",
    "transformer.utils": "default causal mask",
    "models.common.language_module.language_module": "tied embeddings",
    "optimizer.optimizer": "found_inf, scale buffers",
    "optimizer.clip_grads": "norm buffers",
    "optimizer.distrib_optimizer": "distributed optimizer buffers",
    "dist_checkpointing.strategies.state_dict_saver": "save-time buffers",
    "dist_checkpointing.strategies.filesystem_async": "synchronize on save",
    "dist_checkpointing.strategies.async_utils": "--async-save: the done check's and the "
                                                 "finalization's all-reduce buffers, "
                                                 "synchronize before the fork",
    "dist_checkpointing.exchange_utils": "shard exchange buffers",
    "tensor_parallel.mappings": "sequence-parallel gathers",
    "transformer.multi_token_prediction": "the MTP loss tracker's values on current_device()",
    "tensor_parallel.layers": "weight init device",
    "rerun_state_machine": "--rerun-mode: its all-reduces on device=\"cuda\", the CUDA RNG state "
                           "around a rerun, current_device in its lines",
    "timers": "Timer.start/stop synchronize, Timers' all-gather buffer (--timing-log-level)",
    "transformer.moe.router": "router gating moves its weight to current_device(); expert "
                              "bias and global aux-loss buffers",
    "transformer.moe.token_dispatcher": "all-to-all dispatcher's device-to-host stream",
}


def cuda_call_site(module: str) -> Entry:
    """The TABLE row of one ``CUDA_CALL_SITES`` module: its global ``torch``."""
    return _mcore(f"{module}:torch",
                  f"cpu_support swaps this module's torch on CPU: {CUDA_CALL_SITES[module]}")


_SCHEDULES = "pipeline_parallel.schedules:"
_MOE_UTILS = "transformer.moe.moe_utils:"
_MOE_LOGGING = "transformer.moe.moe_logging:"
_MTP = "transformer.multi_token_prediction:"
_P2P = "pipeline_parallel.p2p_communication:P2PCommunicator."
_RANDOM = "tensor_parallel.random:"

TABLE = (
    # --- GPT model and layer spec (megatron/seqsplit/model.py) -------------------------
    _mcore("models.gpt.gpt_model:GPTModel._preprocess",
           "overridden by SeqSplitGPTModel to recompute RoPE at a split's absolute offset "
           "(GPTModel has no public RoPE offset up to 0.19: it embeds positions 0..len-1; "
           "only 'mrope' reads position_ids); returns (decoder_input, rotary_pos_emb, ...)",
           "self", "input_ids", "position_ids", "decoder_input", "inference_context",
           "packed_seq_params", "padding_mask"),
    _mcore("models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.forward",
           "SeqSplitGPTModel calls rotary_pos_emb(length, offset=split offset)",
           "self", "max_seq_len", "offset"),
    # both constructors take cp_group; SeqSplitGPTModel and SplitMLASelfAttention build
    # them through these module names with none (context_parallel.py)
    _mcore("models.gpt.gpt_model:RotaryEmbedding",
           "GPTModel builds RoPE through this name (cp_group cleared while it builds)"),
    _mcore("models.gpt.gpt_model:YarnRotaryEmbedding",
           "GPTModel builds YaRN through this name (cp_group cleared while it builds)"),
    _mcore("transformer.multi_latent_attention:RotaryEmbedding",
           "MLA builds RoPE through this name (cp_group cleared while it builds)"),
    _mcore("transformer.multi_latent_attention:YarnRotaryEmbedding",
           "MLA builds YaRN through this name (cp_group cleared while it builds)"),
    _mcore("models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.__init__",
           "built with cp_group=None under --context-parallel-size", "self", "cp_group"),
    _mcore("models.common.embeddings.yarn_rotary_pos_embedding:YarnRotaryEmbedding.__init__",
           "built with cp_group=None under --context-parallel-size", "self", "cp_group"),
    _mcore("models.gpt.gpt_layer_specs:get_gpt_layer_local_spec",
           "the local (no Transformer Engine) layer spec we swap attention and norms in; "
           "multi_latent_attention=True gives MLASelfAttention's spec",
           "multi_latent_attention", "normalization"),
    # --- multi-latent attention (megatron/seqsplit/mla.py) ------------------------------
    _mcore("transformer.multi_latent_attention:MLASelfAttention.get_query_key_value_tensors",
           "overridden by SplitMLASelfAttention (private): MLA's forward calls it with these "
           "arguments; it makes MLA's own rotary table, which the override shifts to the "
           "split's offset, and reads packed_seq_params as THD packing (so it gets None); "
           "at TP>1 the override also gives, for the call, the column-parallel "
           "linear_kv_down_proj a forward returning its whole output (megatron-core's "
           "Linear branch then splits it and gathers the rotary key under SP) whose "
           "backward sums the shared rotary key's gradient over TP, which megatron-core's "
           "own gather only splits (wrong on 0.16.1 and 0.19.2), and q_layernorm 1/TP of "
           "its gradient without SP",
           "self", "hidden_states", "key_value_states", "position_ids", "packed_seq_params",
           "inference_context"),
    _mcore("distributed.finalize_model_grads:_allreduce_non_tensor_model_parallel_grads",
           "sums every 'q_layernorm' gradient over TP when qk_layernorm is set; MLA's "
           "query-latent norm holds the whole gradient on every rank without SP, so "
           "SplitMLASelfAttention gives it 1/TP of it (0.16.1 and 0.19.2 have the rule)",
           "model", "config"),
    _mcore("tensor_parallel.mappings:gather_from_tensor_model_parallel_region",
           "MLA's kv down-projection shard made whole (SplitMLASelfAttention)",
           "input_", "group"),
    _mcore("tensor_parallel.mappings:scatter_to_sequence_parallel_region",
           "that whole output cut to the rank's sequence part under SP", "input_", "group"),
    _mcore("transformer.multi_latent_attention:MLASelfAttention.__init__",
           "SplitMLASelfAttention subclasses it; reads self.rotary_pos_emb, "
           "self.checkpoint_core_attention and self.core_attention after super().__init__",
           "self", "config", "submodules", "layer_number"),
    _mcore("transformer.multi_latent_attention:HAVE_TE",
           "set False without Transformer Engine: on 0.16 it is True whenever the imports "
           "from extensions.transformer_engine succeed (a MagicMock stands in for TE "
           "there) and MLA's constructor then calls isinstance(..., <mock>)"),
    _mcore("extensions.transformer_engine:HAVE_TE",
           "whether Transformer Engine imported: MLA's HAVE_TE follows it"),
    _mcore("models.common.embeddings.yarn_rotary_pos_embedding:YarnRotaryEmbedding.forward",
           "MLA's YaRN table, called through the split's offset (same call as RoPE's); "
           "returns (embedding, mscale)",
           "self", "max_seq_len", "offset", "packed_seq"),
    _mcore("transformer.multi_latent_attention:MLASelfAttentionSubmodules",
           "the MLA spec's q_layernorm/kv_layernorm become SequenceParallelTorchNorm and its "
           "core_attention SplitCausalAttention (built with k_channels, v_channels; the "
           "field order differs between 0.16 and 0.19: core_attention is not checked here, "
           "tests/test_mla_flags.py builds the spec)",
           "q_layernorm", "kv_layernorm"),
    _mcore("transformer.transformer_config:MLATransformerConfig",
           "the config of an MLA model: --q-lora-rank ... --mscale-all-dim are its fields",
           "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
           "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim"),
    _mcore("transformer.transformer_block:get_num_layers_to_build",
           "layers of this pipeline stage / virtual stage for the block spec",
           "config", "vp_stage"),
    _mcore("transformer.transformer_block:TransformerBlockSubmodules",
           "block spec: our layer specs plus a sequence-parallel capable final norm",
           "layer_specs", "layer_norm"),
    _mcore("transformer.torch_norm:WrappedTorchNorm",
           "SequenceParallelTorchNorm replaces it and takes the same constructor arguments",
           "config", "hidden_size", "eps", "persist_layer_norm", "zero_centered_gamma",
           "normalization"),
    _mcore("transformer.attention:SelfAttention.__init__",
           "SplitSelfAttention subclasses it; reads self.checkpoint_core_attention and "
           "self.core_attention after super().__init__",
           "self", "config", "submodules", "layer_number", "attn_mask_type"),
    _mcore("transformer.attention:SelfAttention._checkpointed_attention_forward",
           "the selective recomputation of core attention that SplitSelfAttention "
           "replaces by a checkpoint of the kernel (tools/selective_saved_bytes.py finds "
           "it by this name in the stack)",
           "self", "query", "key", "value", "attention_mask"),
    _mcore("packed_seq_params:PackedSeqParams",
           "SplitContext subclasses it to ride megatron-core's packed_seq_params plumbing "
           "from GPTModel.forward down to core attention",
           "qkv_format", "cu_seqlens_q", "cu_seqlens_kv"),
    # --- mixture of experts (megatron/seqsplit/moe.py, megatron/seqsplit/model.py) -----
    _mcore("transformer.moe.moe_layer:MoESubmodules",
           "the MoE spec's router builder: SplitRouter replaces TopKRouter there (the "
           "spec's mlp is a ModuleSpec on 0.16.1, functools.partial(MoELayer, submodules=) "
           "on 0.19.2)",
           "experts", "shared_experts", "router"),
    _mcore("transformer.moe.router:TopKRouter.routing",
           "overridden by SplitRouter: records each split's routing counts before "
           "megatron-core's routing (reads self.topk, score_function, training)",
           "self", "logits", "padding_mask"),
    _mcore("transformer.moe.router:TopKRouter._apply_aux_loss",
           "overridden by SplitRouter (aux_loss over the whole microbatch under splits; "
           "reads self.tp_cp_group, layer_number)",
           "self", "probs", "scores_for_aux_loss", "routing_map", "with_padding_mask"),
    _mcore("transformer.moe.router:TopKRouter._apply_seq_aux_loss",
           "overridden by SplitRouter (seq_aux_loss over whole sequences under splits)",
           "self", "probs", "scores_for_aux_loss", "routing_map", "seq_length", "bsz",
           "with_padding_mask"),
    _mcore("transformer.moe.router:TopKRouter._apply_global_aux_loss",
           "overridden by SplitRouter (global_aux_loss's running counts per microbatch; "
           "reads self.tp_dp_cp_group)",
           "self", "probs", "scores_for_aux_loss", "routing_map", "with_padding_mask"),
    _mcore("transformer.moe.router:TopKRouter.apply_z_loss",
           "overridden by SplitRouter (z-loss as the whole microbatch's mean)",
           "self", "logits", "padding_mask"),
    _mcore("transformer.moe.router:TopKRouter.attach_and_log_load_balancing_loss",
           "read (its source) by per_token_router_loss_counts_tp_cp: how megatron-core "
           "scales the load-balancing losses under --calculate-per-token-loss",
           "self", "activation", "aux_loss_coeff", "aux_loss"),
    _mcore("transformer.moe.router:TopKRouter.get_aux_loss_coeff",
           "SplitRouter reads each load-balancing type's coefficient", "self", "aux_loss_type"),
    _mcore("transformer.moe.moe_utils:compute_routing_scores_for_aux_loss",
           "SplitRouter counts the aux-loss routing of each split as megatron-core does",
           "logits", "topk", "score_function", "fused"),
    _mcore("transformer.moe.moe_utils:MoEAuxLossAutoScaler.set_loss_scale",
           "the executor sets the aux losses' gradient scale as megatron-core's forward_step "
           "does; SplitRouter's deferred gradient reads main_loss_backward_scale", "scale"),
    _mcore("transformer.moe.moe_utils:HAVE_TE",
           "without Transformer Engine moe_utils never defines te_general_gemm, which router "
           "gating reads: megatron.seqsplit.moe sets it to None (the torch matmul)"),
    _mcore("transformer.transformer_layer:TransformerLayer.forward",
           "SplitTransformerLayer reads its packed_seq_params keyword (the split) for the "
           "MoE router; megatron-core's block passes it by keyword"),
    _mcore("transformer.transformer_layer:get_transformer_layer_offset",
           "the first global layer of a stage: which of its layers --moe-layer-freq makes "
           "MoE", "config", "vp_stage"),
    # the MoE loss tracker the router fills (logged by megatron/trainer/moe_metrics.py;
    # SplitRouter records its whole-microbatch values there): a dict of per-layer tensors
    # in moe_utils on 0.16.1, a MoEMetricsTracker in moe_logging since (0.19.2's moe_utils
    # keeps the old names as deprecated wrappers that warn on every call)
    _mcore(_MOE_UTILS + "get_moe_layer_wise_logging_tracker",
           "the global dict name -> {'values': per-layer tensor, groups}: read, zeroed and "
           "emptied by mcore_compat.moe_loss_values / clear / reset_moe_losses",
           checked="megatron-core 0.16.1"),
    _mcore(_MOE_UTILS + "save_to_aux_losses_tracker",
           "SplitRouter records a microbatch's aux losses (mcore_compat.record_moe_loss)",
           "name", "loss", "layer_number", "num_layers", "reduce_group", "avg_group",
           "reduce_group_has_dp", checked="megatron-core 0.16.1"),
    # (0.17 and 0.18 have no moe_logging module: the bridge then uses the rows above)
    _mcore(_MOE_LOGGING + "get_moe_metrics_tracker",
           "the global MoEMetricsTracker (mcore_compat.moe_loss_values and friends)",
           checked="megatron-core 0.19.2", optional_elsewhere=True),
    _mcore(_MOE_LOGGING + "MoEMetricsTracker.record",
           "SplitRouter records a microbatch's aux losses (mcore_compat.record_moe_loss)",
           "self", "name", "value", "layer_number", "num_layers", "reduce_group",
           "avg_group", "needs_dp_avg", checked="megatron-core 0.19.2",
           optional_elsewhere=True),
    _mcore(_MOE_LOGGING + "MoEMetricsTracker.metrics",
           "name -> MetricEntry(values: per-layer tensor, ...), the live dict: read, "
           "zeroed and emptied by mcore_compat", checked="megatron-core 0.19.2",
           optional_elsewhere=True),
    # --- multi-token prediction (megatron/seqsplit/mtp.py, megatron/trainer/mtp_metrics.py)
    _mcore(_MTP + "roll_tensor",
           "MTP's shift along the sequence, replaced by seqsplit.mtp.install_split_roll in "
           "this module (the MTP layers; 0.17+ also process_mtp_loss) so that a split reads "
           "past its end", "tensor", "shifts", "dims", "cp_group", "packed_seq_params"),
    _mcore("models.gpt.gpt_model:roll_tensor",
           "0.16.1's GPTModel._postprocess shifts the MTP labels and loss mask with its own "
           "import of roll_tensor (replaced as the row above, where the module has it: "
           "0.18.2 has not)", checked="megatron-core 0.16.1", optional_elsewhere=True),
    _mcore(_MTP + "MultiTokenPredictionLayer._checkpointed_forward",
           "whether full recomputation of an MTP layer runs: 0.18's forward passes "
           "padding_mask to this method, which does not take it "
           "(mtp_recompute_takes_its_arguments), and whether it takes its arguments by name "
           "and the split by closure (0.18+; mtp_recompute_passes_the_split_by_closure); its "
           "parameters are read, it is not called"),
    _mcore(_MTP + "MTPLossLoggingHelper.tracker",
           "the MTP losses of an iteration: 'values' (0.16.1) or 'loss_values' (0.19.2), a "
           "per-depth tensor read and zeroed by mcore_compat.mtp_loss_values"),
    _mcore(_MTP + "process_mtp_loss",
           "0.17+'s MTP loss, replaced in gpt_model by seqsplit.mtp's split-aware one (the "
           "per-token weight of the whole microbatch under splits; keyword call)",
           "hidden_states", "labels", "loss_mask", "config", "packed_seq_params",
           checked="megatron-core 0.19.2"),
    _mcore("models.gpt.gpt_model:process_mtp_loss",
           "GPTModel._postprocess's import of it (replaced as the row above)",
           checked="megatron-core 0.19.2"),
    _mcore(_MTP + "MTPLossAutoScaler",
           "a module global process_mtp_loss calls (.apply): seqsplit.mtp swaps it during "
           "a split's call to weigh the attached loss"),
    _mcore(_MTP + "MTPLossAutoScaler.set_loss_scale",
           "the executor sets the MTP loss gradient's scale, as megatron-core's forward_step",
           "scale"),
    # --- pipeline schedules (megatron/schedules, megatron/benchmarks/stage.py) ---------
    _mcore(_SCHEDULES + "backward_step",
           "the executor's backward of one unit; 0.16.1 takes an unused model_type before "
           "config, 0.17+ does not: call mcore_compat.backward_step",
           "input_tensor", "output_tensor", "output_tensor_grad", "config"),
    _mcore(_SCHEDULES + "deallocate_output_tensor",
           "frees a sent activation's data, as megatron's schedules do",
           "out", "deallocate_pipeline_outputs"),
    _mcore(_SCHEDULES + "get_forward_backward_func",
           "megatron-core's own schedule for one split without observers",
           "pp_size", "vp_size"),
    _mcore(_SCHEDULES + "get_pp_rank_microbatches",
           "tests compare our interleaved warmup counts with megatron-core's",
           "num_microbatches", "num_model_chunks", "microbatch_group_size_per_vp_stage"),
    _mcore(_SCHEDULES + "get_schedule_table",
           "tests compare our interleaved unit order with megatron-core's",
           "num_microbatches", "num_model_chunks", "microbatch_group_size_per_vp_stage"),
    _mcore(_P2P + "__init__", "megatron-core's training loop may pass one (p2p_communicator=); "
           "the executor reads its pp_group and sends with batch_isend_irecv itself",
           "self", "pp_group", "config"),
    # --- RNG (cpu_support, checkpointing, initialize, recompute) -----------------------
    _mcore(_RANDOM + "CudaRNGStatesTracker.add",
           "cpu_support subclasses the tracker over the CPU generator (uses seeds_, "
           "states_, _is_initialized)", "self", "name", "seed"),
    _mcore(_RANDOM + "CudaRNGStatesTracker.fork", "overridden by the CPU tracker",
           "self", "name"),
    _mcore(_RANDOM + "_get_cuda_rng_state", "replaced on CPU by torch.get_rng_state"),
    _mcore(_RANDOM + "_set_cuda_rng_state", "replaced on CPU by torch.set_rng_state",
           "new_state"),
    _mcore(_RANDOM + "_MODEL_PARALLEL_RNG_TRACKER_NAME",
           "the tracker state megatron's dropout forks; the CPU tracker's default name"),
    _mcore(_RANDOM + "initialize_rng_tracker",
           "destroy_model_parallel resets the tracker between runs in one process",
           "force_reset"),
    _mcore(_RANDOM + "model_parallel_cuda_manual_seed", "set_seeds, as Megatron-LM",
           "seed"),
    _mcore(_RANDOM + "checkpoint",
           "reentrant checkpoint of the attention kernel (same RNG handling as "
           "megatron's selective recomputation)", "function", "distribute_saved_activations"),
    # --- --recompute-modules layernorm / mla_up_proj (seqsplit/recompute.py) -----------
    _mcore(_RANDOM + "CheckpointWithoutOutput.__init__",
           "its fp8 attribute cleared after __init__ where Transformer Engine is missing "
           "(fp8 is not None holds for its default False)", "fp8"),
    _mcore(_RANDOM + "HAVE_TE", "whether Transformer Engine imported (the patch above)"),
    _mcore(_RANDOM + "_get_share_storage",
           "the C++ extension its recomputation builds at first use, built at the model "
           "build instead", checked="megatron-core 0.19.2"),
    # --- distributed-optimizer checkpoints (megatron/trainer/checkpointing.py) ---------
    _mcore("optimizer.distrib_optimizer:DistributedOptimizer.sharded_state_dict",
           "saved with metadata {'distrib_optim_sharding_type': 'fully_reshardable', "
           "'distrib_optim_fully_reshardable_mem_efficient': True} (the default format's "
           "flattened ranges no longer save; the other fully_reshardable path needs CUDA)",
           "self", "model_sharded_state_dict", "is_loading", "metadata"),
    _mcore("optimizer.distrib_optimizer:DistributedOptimizer.get_parameter_state_dp_zero",
           "shadowed per instance during a fully_reshardable sharded_state_dict: its "
           "gathered tensors (buckets concatenated without their end padding) are spread "
           "back to the buckets' offsets, which sharded_param_state_fully_reshardable "
           "slices them at (megatron-core's 'issue #504': with several DDP buckets it "
           "saved shifted main weights and Adam moments)",
           "self", "use_gloo_comm", "empty_data", "return_on_all_ranks"),
    _mcore("optimizer.distrib_optimizer:DistributedOptimizer."
           "sharded_param_state_fully_reshardable",
           "reached through sharded_state_dict; calls self.get_parameter_state_dp_zero and "
           "cuts each parameter at buffer.param_index_map's (padded) offsets",
           "self", "model_sharded_state_dict", "is_loading", "metadata"),
    _mcore("distributed.param_and_grad_buffer:_ParamAndGradBucket.__init__",
           "checkpointing reads bucket.offset and bucket.numel_unpadded (and buffer.buckets,"
           " buffer.numel) to put the gathered state back in buffer space",
           "self", "params", "param_data", "grad_data", "offset", "numel_unpadded"),
    _mcore("optimizer.distrib_optimizer:DistributedOptimizer."
           "load_parameter_state_from_fully_reshardable",
           "loads the Adam tensors with the per-parameter 'step' set aside (it would copy "
           "one shared step into every parameter)", "self", "state_dict"),
    _mcore("dist_checkpointing.strategies.filesystem_async:_results_queue",
           "set to an in-process queue before a synchronous save, to a forked Manager's "
           "queue before an asynchronous one (save_results_queue.py, async_save.py): "
           "left None, the torch_dist writer makes it with a 'spawn' Manager, a server "
           "process that re-imports the launching script (about 2.5 s of CPU per rank); "
           "the writer puts its results with put() and retrieve_write_results takes them "
           "with get_nowait()"),
    # --- --async-save (megatron/trainer/async_save.py) ----------------------------------
    _mcore("dist_checkpointing.serialization:save",
           "--async-save passes async_sharded_save=True and gets an AsyncRequest whose "
           "finalize_fns it extends (0.19 adds async_strategy, given 'mcore')",
           "sharded_state_dict", "checkpoint_dir", "async_sharded_save"),
    _mcore("dist_checkpointing.strategies.async_utils:AsyncCallsQueue.__init__",
           "--async-save's queue of background saves: persistent=False, one forked writer "
           "per save (TemporalAsyncCaller, whose .process async_save kills to abandon one)",
           "self", "persistent"),
    _mcore("dist_checkpointing.strategies.async_utils:AsyncCallsQueue._get_async_caller",
           "replaced on the queue's instance with --use-persistent-ckpt-worker: every save "
           "goes to the one PersistentWriter (persistent_writer.py)", "self"),
    _mcore("dist_checkpointing.strategies.async_utils:AsyncCallsQueue.schedule_async_request",
           "starts a save's background write", "self", "async_request"),
    _mcore("dist_checkpointing.strategies.async_utils:AsyncCallsQueue.maybe_finalize_async_calls",
           "every iteration (blocking at the end): runs the finalize functions of the saves "
           "done on every rank; raises CheckpointException for a failed write",
           "self", "blocking"),
    # --- CUDA-only call sites patched on CPU (megatron/cpu_support.py) ---------
    _mcore("optimizer.clip_grads:clip_grad_by_total_norm_fp32",
           "replaced on CPU: asserts grads are torch.cuda.FloatTensor",
           "parameters", "max_norm", "total_norm"),
    _mcore("optimizer.optimizer:clip_grad_by_total_norm_fp32",
           "optimizer.py imports it by name: replaced there too on CPU"),
    _mcore("models.common.language_module.language_module:"
           "LanguageModule.setup_embeddings_and_output_layer",
           "wrapped on CPU: tied embeddings call weight.data.cuda()", "self"),
    _mcore("optimizer.optimizer:param_group_identifier_keys",
           "the keys megatron-core's distributed optimizer pairs saved and current param "
           "groups by: a checkpoint's groups of another expert-parallel size are matched on "
           "them (all but is_expert_parallel) by checkpointing._saved_group"),
    _mcore("optimizer.distrib_optimizer:DistributedOptimizer.__init__",
           "wrapped on CPU: checks param.type() == 'torch.cuda.FloatTensor'", "self"),
    _mcore("transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu",
           "wrapped on CPU: the all-to-all split sizes become numpy arrays from CPU tensors "
           "too (all_to_all_single takes no tensor there)",
           "tensor", "as_numpy", "record_stream"),
    # --- the rerun engine, --rerun-mode (megatron/trainer/rerun.py) ------------------------
    _mcore("rerun_state_machine:RerunMode", "--rerun-mode's values"),
    _mcore("rerun_state_machine:RerunDiagnostic", "--error-injection-type's values"),
    _mcore("rerun_state_machine:RerunErrorInjector", "--error-injection-rate/-type",
           "error_injection_rate", "error_injection_type"),
    _mcore("rerun_state_machine:RerunState",
           "which decision should_checkpoint_and_exit made (the line says what was found)"),
    _mcore("rerun_state_machine:RerunDataIterator", "replays an iteration's microbatches",
           "iterable"),
    _mcore("rerun_state_machine:RerunStateMachine.should_run_forward_backward",
           "the train step's rerun loop", "self", "data_iterator"),
    _mcore("rerun_state_machine:RerunStateMachine.should_checkpoint_and_exit",
           "save and exit codes after the loop", "self"),
    _mcore("rerun_state_machine:RerunStateMachine.validate_result",
           "the loss checks of Megatron-LM's loss_func", "self", "result", "rejection_func",
           "message", "tolerance", "fatal"),
    _mcore("rerun_state_machine:RerunStateMachine.is_unexpectedly_large",
           "--check-for-spiky-loss", "self", "result", "threshold", "context"),
    _mcore("rerun_state_machine:RerunStateMachine.state_dict",
           "the checkpoint's rerun_state_machine entry (0.16.1: None unless a rerun is "
           "pending; 0.19: a sentinel in every save)", "self", "data_iterator", "ckpt_format"),
    _mcore("rerun_state_machine:RerunStateMachine.load_state_dict",
           "resume a rerun saved in a checkpoint", "self", "state_dict"),
    _mcore("rerun_state_machine:RerunStateMachine._maybe_report_stats",
           "--rerun-mode report_stats: 0.16.1's reads Caller.filename, which its Caller "
           "lacks (refused there)", "self"),
    _mcore("rerun_state_machine:Caller", "where a rejected result came from (its message)"),
    _mcore("rerun_state_machine:initialize_rerun_state_machine",
           "the machine of one run (0.19 copies the constructor's signature)"),
    _mcore("rerun_state_machine:destroy_rerun_state_machine",
           "one process trains several runs in turn"),
    _mcore("rerun_state_machine:get_rerun_state_machine", "the machine"),
    _mcore("rerun_state_machine:EXIT_CODE_RESUME_TO_DISAMBIGUATE",
           "exit 16: resume from the rerun checkpoint"),
    _mcore("rerun_state_machine:EXIT_CODE_FAILED_ON_RESULT_VALIDATION",
           "exit 17: validation failed"),
    _mcore("distributed.distributed_data_parallel_config:DistributedDataParallelConfig."
           "check_for_large_grads", "--check-for-large-grads: DDP's bucket check"),
    *(cuda_call_site(module) for module in CUDA_CALL_SITES),
    # --- torch ---------------------------------------------------------------------------
    _torch("torch.nn.attention.bias:causal_lower_right",
           "bottom-right causal mask of a split (lq != lk) for SDPA"),
    _torch("torch.nn.attention.flex_attention:_apply_kernel_options",
           "CPU flex backend: what flex_attention does before its CPU-backward refusal",
           "query", "key", "value", "return_lse", "kernel_options"),
    _torch("torch.nn.attention.flex_attention:_identity",
           "CPU flex backend: the identity score_mod flex_attention passes"),
    _torch("torch._higher_order_ops.flex_attention:flex_attention",
           "CPU flex backend: the higher-order op with an eager autograd"),
    _torch("torch._dynamo.config:disable",
           "cpu_support runs megatron-core's torch.compile'd jit_fuser helpers eagerly on CPU"),
    _torch("torch.distributed.distributed_c10d:_get_default_group",
           "destroy_groups_except keeps the default group"),
    _torch("torch.distributed.distributed_c10d:_world",
           "destroy_groups_except walks _world.pg_map to destroy leftover gloo groups"),
)


def _split(name):
    module_name, _, attribute = name.partition(":")
    return module_name, attribute


def resolve(entry: Entry):
    """The object a row names, or CompatError naming the row."""
    module_name, attribute = _split(entry.name)
    try:
        obj = importlib.import_module(module_name)
    except ImportError as error:
        raise CompatError(f"module missing: {entry} [{error}]") from error
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as error:
            raise CompatError(f"name missing: {entry} [{error}]") from error
    return obj


def _is_subsequence(wanted, names):
    remaining = iter(names)
    return all(name in remaining for name in wanted)


def check(entry: Entry):
    """Resolve a row and check its parameters; raises CompatError naming the row."""
    obj = resolve(entry)
    if not entry.params:
        return obj
    try:
        names = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError) as error:
        raise CompatError(f"no signature: {entry} [{error}]") from error
    if not _is_subsequence(entry.params, names):
        raise CompatError(f"signature changed: {entry}: expected parameters "
                          f"{list(entry.params)} in this order, found {names}")
    return obj


def entry(name: str) -> Entry:
    """The row for a name (with or without the ``megatron.core.`` prefix)."""
    for row in TABLE:
        if row.name in (name, "megatron.core." + name):
            return row
    raise KeyError(f"{name} is not in mcore_compat.TABLE: add a row for it")


def get(name: str):
    """The checked object for a table name: how the project reaches a row's name."""
    return check(entry(name))


def set_global(name: str, value) -> None:
    """Set a row's module global (one megatron-core reads when called, such as its
    writer's results queue). The row is checked first: on a release without the name
    this fails with the row instead of setting a global nothing reads."""
    row = entry(name)
    check(row)
    module_name, attribute = _split(row.name)
    if "." in attribute:
        raise CompatError(f"not a module global: {row}")
    setattr(importlib.import_module(module_name), attribute, value)


def require(*names: str) -> None:
    """Check several rows at once (a patching module's names, before it patches)."""
    for name in names:
        get(name)


# --- bridges between supported versions -------------------------------------------------

def rerun_report_stats_works() -> bool:
    """Whether megatron-core's --rerun-mode report_stats can report: 0.16.1's report
    logs ``caller.filename``, a field its ``Caller`` does not have (an AttributeError at
    the first report); 0.19 logs ``caller.message``."""
    report = get("rerun_state_machine:RerunStateMachine._maybe_report_stats")
    caller = get("rerun_state_machine:Caller")
    return "caller.filename" not in inspect.getsource(report) or "filename" in caller._fields


@functools.lru_cache(maxsize=None)
def _backward_step_takes_model_type() -> bool:
    mcore_backward = get(_SCHEDULES + "backward_step")
    return "model_type" in inspect.signature(mcore_backward).parameters


def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
    """megatron-core's ``backward_step`` on every supported version (0.16.1 takes a
    ``model_type`` that it ignores; 0.17+ dropped it)."""
    mcore_backward = get(_SCHEDULES + "backward_step")
    if _backward_step_takes_model_type():
        return mcore_backward(input_tensor, output_tensor, output_tensor_grad, None, config)
    return mcore_backward(input_tensor, output_tensor, output_tensor_grad, config)


@functools.lru_cache(maxsize=None)
def _moe_metrics_tracker_module() -> bool:
    """megatron-core's MoEMetricsTracker (moe_logging, 0.19.2) rather than 0.16.1's dict."""
    return importlib.util.find_spec("megatron.core.transformer.moe.moe_logging") is not None


def moe_loss_values() -> dict:
    """The MoE loss tracker's live per-layer tensors, by name ("load_balancing_loss", ...,
    "z_loss"): what megatron-core's router added since the tracker was last zeroed."""
    if _moe_metrics_tracker_module():
        return {name: entry.values
                for name, entry in get(_MOE_LOGGING + "get_moe_metrics_tracker")()
                .metrics.items()}
    return {name: entry["values"]
            for name, entry in get(_MOE_UTILS + "get_moe_layer_wise_logging_tracker")().items()}


def record_moe_loss(name, value, layer_number, num_layers, reduce_group=None,
                    avg_group=None, reduce_group_has_dp=False) -> None:
    """Add one layer's loss value (a tensor, divided by its coefficient) to the tracker,
    as megatron-core's router does (its own call on each version)."""
    if _moe_metrics_tracker_module():
        tracker = get(_MOE_LOGGING + "get_moe_metrics_tracker")()
        tracker.record(name, value, layer_number, num_layers, reduce_group=reduce_group,
                       avg_group=avg_group, needs_dp_avg=not reduce_group_has_dp)
    else:
        get(_MOE_UTILS + "save_to_aux_losses_tracker")(
            name, value, layer_number, num_layers, reduce_group=reduce_group,
            avg_group=avg_group, reduce_group_has_dp=reduce_group_has_dp)


def clear_moe_losses() -> None:
    """Zero the tracker's values (Megatron-LM's clear after each report and evaluation)."""
    for values in moe_loss_values().values():
        values.zero_()


def reset_moe_losses() -> None:
    """Drop every tracker entry: a new training run (a library caller training again)
    may have other layers, devices and groups than the entries were made for."""
    if _moe_metrics_tracker_module():
        get(_MOE_LOGGING + "get_moe_metrics_tracker")().metrics.clear()
    else:
        get(_MOE_UTILS + "get_moe_layer_wise_logging_tracker")().clear()


@functools.lru_cache(maxsize=None)
def per_token_router_loss_counts_tp_cp() -> bool:
    """Whether megatron-core's router, under --calculate-per-token-loss, multiplies its
    load-balancing and z-losses by the tokens of its forward call times the TP x CP size
    (0.19.2) or by the call's tokens alone (0.16.1): read from both methods' source,
    which must agree."""
    router = "transformer.moe.router:TopKRouter."
    found = {name: "num_local_tokens * self.tp_cp_group.size()"
             in inspect.getsource(get(router + name))
             for name in ("attach_and_log_load_balancing_loss", "apply_z_loss")}
    if len(set(found.values())) != 1:
        raise CompatError(f"megatron-core's router scales its per-token losses by the TP x "
                          f"CP size in some methods only ({found}): a version whose scaling "
                          f"megatron/seqsplit/moe.py does not know")
    return found["apply_z_loss"]


@functools.lru_cache(maxsize=None)
def mtp_recompute_passes_the_split_by_closure() -> bool:
    """Whether megatron-core's MTP layer, under full recomputation, hands non-tensor
    arguments (a sequence split) to the checkpoint by closure (0.18+: its checkpointed
    forward takes its arguments by name) rather than to save_for_backward with the tensors
    (0.16, 0.17: a TypeError with a split)."""
    method = get(_MTP + "MultiTokenPredictionLayer._checkpointed_forward")
    return "hidden_states" in inspect.signature(method).parameters


@functools.lru_cache(maxsize=None)
def mtp_recompute_takes_its_arguments() -> bool:
    """Whether megatron-core's MTP layer, under full recomputation, calls its checkpointed
    forward with arguments that method takes: 0.18's passes padding_mask to a
    _checkpointed_forward without it (a TypeError in the first forward, in Megatron-LM 0.18
    too); 0.16 passes none, 0.19 takes it."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    def takes(method):
        return "padding_mask" in inspect.signature(method).parameters

    return (not takes(MultiTokenPredictionLayer.forward)  # public: the layer's call
            or takes(get(_MTP + "MultiTokenPredictionLayer._checkpointed_forward")))


def mtp_loss_values():
    """The MTP loss tracker's per-depth tensor of this iteration (each microbatch's mean
    loss added per depth), or None where no MTP layer ran on this rank: the key is
    'values' on 0.16.1 and 'loss_values' (beside acceptance counts) since 0.17."""
    tracker = get(_MTP + "MTPLossLoggingHelper.tracker")
    return tracker.get("loss_values", tracker.get("values"))


def clear_mtp_losses() -> None:
    """Zero the MTP tracker's tensors (Megatron-LM clears them after each report)."""
    tracker = get(_MTP + "MTPLossLoggingHelper.tracker")
    for key in ("values", "loss_values", "correct_values", "total_values"):
        if key in tracker:
            tracker[key].zero_()


def reset_mtp_losses() -> None:
    """Drop the MTP tracker's entries: a new training run may have another depth count or
    device than they were made for."""
    get(_MTP + "MTPLossLoggingHelper.tracker").clear()
