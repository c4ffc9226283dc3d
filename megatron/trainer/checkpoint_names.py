"""Checkpoints whose norms carry megatron-core's local-spec names.

Since 2026-12-07 this project saves a layer's norms under the names of megatron-core's
Transformer Engine spec, Megatron-LM's default (``megatron.seqsplit.model.
transformer_engine_norm_names``). Checkpoints this project saved before, and those
Megatron-LM saves with ``--transformer-impl local``, name three kinds of norm otherwise:
an MoE layer's pre-MLP norm, an MLA layer's query/key-value norms, and a dense MLA layer's
pre-MLP norm. A load asks for the names the checkpoint holds: every tensor (model and
optimizer state, whose keys are the model's) keeps its own data, only its key changes.
"""

# (the name saved since 2026-12-07, the name megatron-core's local spec saves), as parts of
# a key; a key holds at most one of them
_LOCAL_SPEC_NAMES = (
    (".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_"),  # an MoE layer's
    (".mlp.linear_fc1.layer_norm_", ".pre_mlp_layernorm."),  # a dense MLA layer's
    (".self_attention.linear_q_up_proj.layer_norm_", ".self_attention.q_layernorm."),
    (".self_attention.linear_kv_up_proj.layer_norm_", ".self_attention.kv_layernorm."),
)


def saved_tensor_keys(path):
    """The tensor keys of the torch_dist checkpoint in ``path`` (its metadata only)."""
    from megatron.core import dist_checkpointing

    return set(dist_checkpointing.load_tensors_metadata(path))


def ask_for_saved_names(model_state, saved_keys):
    """Rename, in place, each sharded tensor of ``model_state`` (a model chunk's sharded
    state dict, or a dict of them) whose key ``saved_keys`` lacks to the local-spec name
    the checkpoint holds instead; returns how many were renamed."""
    renamed = 0
    for value in model_state.values():
        if isinstance(value, dict):
            renamed += ask_for_saved_names(value, saved_keys)
            continue
        key = getattr(value, "key", None)
        if not isinstance(key, str) or key in saved_keys:
            continue
        for ours, local in _LOCAL_SPEC_NAMES:
            if ours in key and key.replace(ours, local) in saved_keys:
                value.key = key.replace(ours, local)
                renamed += 1
                break
    return renamed
