"""Checkpoints through megatron.core.dist_checkpointing, in Megatron-LM's directory layout.

``<dir>/iter_0000010/`` holds one distributed checkpoint (model, optimizer,
scheduler, iteration, consumed samples, model-shape flags, RNG states) and
``<dir>/latest_checkpointed_iteration.txt`` names the latest. A checkpoint saved
with one parallel layout loads into another when megatron-core can reshard it
(the RNG states are then not restored); another model shape is refused with the
flags that differ.

With ``--use-distributed-optimizer`` the optimizer state is saved in megatron-core's
``fully_reshardable`` format: one tensor per parameter in the model's own sharding, so
it reshards across tensor, pipeline and data-parallel sizes like the model does, and
across DDP bucket layouts (--overlap-grad-reduce, bucket sizes). megatron-core's save of
that format cuts parameters at the wrong places of model chunks with several buckets
(``_in_buffer_space`` corrects it); a load warns when the optimizer state's main weights
differ from the model weights, as in such checkpoints saved before the correction
(``--no-load-optim`` then resumes from the right weights). A checkpoint only loads its
optimizer state into a run with the same optimizer kind (``--no-load-optim`` loads the
weights into either).

What a save guarantees, in order:

1. Every rank writes into ``iter_N.incomplete/`` (rank 0 first clears any leftover of
   a killed save there).
2. Every rank hashes a share of the files; rank 0 writes ``checksums.json`` (name ->
   size and sha256 of every file) into it.
3. Rank 0 renames the directory to ``iter_N/`` (replacing an older ``iter_N/``), then
   replaces the tracker file atomically.

So a save that dies half-way is never the latest checkpoint, never looks like a
finished ``iter_N/``, and does not stop the next save of the same iteration. A load
checks sizes and checksums first and names the damaged file in one line. An ``iter_N/``
without ``checksums.json`` comes from an older version of this code (the manifest is
written before the rename): under a tracker it was completed, so it loads after a
structural check (every file ``.metadata`` references is present and long enough) with
a printed "not verified" warning.

The ``--save`` directory belongs to one run at a time: ``claim_save_dir`` takes an
exclusive ``flock`` on ``<dir>/.lock`` (the kernel drops it when the holder dies, so a
killed run never leaves the directory stuck) and refuses to write into a directory
holding checkpoints that this run neither resumes from nor can identify.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import socket
import time
from types import SimpleNamespace

import numpy as np
import torch

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject
from torch.distributed.checkpoint.api import CheckpointException
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from megatron import mcore_compat
from megatron.model_shape import no_rope_pattern, window_layer_pattern
from megatron.trainer import (async_save, checkpoint_names, rerun, save_failure,
                              save_results_queue, stop_signals)
from megatron.trainer.agreed_stop import AgreedStop
from megatron.trainer.model import biased_gelu
from megatron.trainer.schedule_check import schedule_decision

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MANIFEST_FILE = "checksums.json"
LOCK_FILE = ".lock"
STAGING_SUFFIX = ".incomplete"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
# the distributed optimizer's format that reshards across tp, pp and dp
DISTRIBUTED_OPTIMIZER_FORMAT = "fully_reshardable"

# Flags that define the model's shape: a checkpoint only loads into the same values.
MODEL_SHAPE_FLAGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
    "num_query_groups", "kv_channels", "padded_vocab_size", "position_embedding_type",
    "swiglu", "normalization", "untie_embeddings_and_output_weights", "disable_bias_linear",
    "max_position_embeddings", "apply_layernorm_1p",
    # the math of attention and the MLP: a checkpoint trained with them means other weights
    "qk_layernorm", "add_qkv_bias", "squared_relu", "rotary_interleaved", "use_rope_scaling",
    "rope_scaling_factor", "apply_residual_connection_post_layernorm",
    "num_experts", "multi_latent_attention", "rotary_seq_len_interpolation_factor",
    "no_rope_freq", "quick_geglu", "glu_linear_offset", "activation_func_clamp_value",
    "softmax_type", "window_size", "window_attn_skip_freq", "qk_l2_norm",
    "attention_output_gate", "mtp_num_layers",
)
# YaRN's settings of standard attention (rope_arguments), saved with
# --position-embedding-type yarn
YARN_SHAPE_FLAGS = ("rotary_scaling_factor", "yarn_original_max_position_embeddings",
                    "yarn_beta_fast", "yarn_beta_slow", "mscale", "mscale_all_dim",
                    "yarn_correction_range_round_to_int")
# how RoPE reads positions, not what the weights are: extending the context of a
# checkpoint changes them, which --finetune allows (position_embedding_type only between
# rope and yarn)
POSITION_SCALING_FLAGS = frozenset(("position_embedding_type", "use_rope_scaling",
                                    "rope_scaling_factor",
                                    "rotary_seq_len_interpolation_factor") + YARN_SHAPE_FLAGS)
# flags that shape the model only when their gate (a MODEL_SHAPE_FLAGS entry) is set: saved
# then, so a dense model's unused MoE/MLA defaults never stop a resume
GATED_SHAPE_FLAGS = {
    "num_experts": ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                    "moe_layer_freq", "moe_router_topk", "moe_router_score_function"),
    "multi_latent_attention": ("q_lora_rank", "kv_lora_rank", "qk_head_dim",
                               "qk_pos_emb_head_dim", "v_head_dim"),
    "mtp_num_layers": ("mtp_use_repeated_layer",),
}


def model_shape(args) -> dict:
    """What a checkpoint records of the model's shape (compared at load, restored by
    --use-checkpoint-args)."""
    shape = {flag: getattr(args, flag, None) for flag in MODEL_SHAPE_FLAGS}
    for gate, flags in GATED_SHAPE_FLAGS.items():
        if shape[gate]:
            shape.update({flag: getattr(args, flag) for flag in flags})
    if biased_gelu(args):  # which GeLU: the fused one's tanh approximation, or erf
        shape["bias_gelu_fusion"] = getattr(args, "bias_gelu_fusion", True)
    if shape["position_embedding_type"] == "yarn":
        shape.update({flag: getattr(args, flag) for flag in YARN_SHAPE_FLAGS})
    if isinstance(shape.get("no_rope_freq"), int) and shape["num_layers"]:
        # N and its per-layer pattern are one model
        shape["no_rope_freq"] = list(no_rope_pattern(shape["no_rope_freq"],
                                                     shape["num_layers"]))
    if shape.get("window_size") is None:
        shape["window_attn_skip_freq"] = None  # no window: which layers is moot
    else:  # as a list (what a reload gives back), its layers as their pattern
        shape["window_size"] = list(shape["window_size"])
        shape["window_attn_skip_freq"] = list(window_layer_pattern(
            shape["window_attn_skip_freq"], shape["num_layers"]))
    return shape


def with_legacy_gelu(saved: dict) -> dict:
    """A saved model shape, completed for checkpoints saved before --no-bias-gelu-fusion
    was honoured (2026-11-28): a GeLU model with biased linear layers trained then with
    the exact (erf) GeLU, as --no-bias-gelu-fusion computes it now."""
    if not saved or "bias_gelu_fusion" in saved:
        return saved
    flags = SimpleNamespace(**{flag: saved.get(flag) for flag in (
        "swiglu", "squared_relu", "disable_bias_linear")})
    return dict(saved, bias_gelu_fusion=False) if biased_gelu(flags) else saved


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run; the message says why."""


def checkpoint_dir(root, iteration):
    return os.path.join(root, f"iter_{iteration:07d}")


def _rank():
    return torch.distributed.get_rank()


def _exit(message):
    """Stop every rank with one printed line: every rank reached the same decision, and
    only rank 0 says it (agreed_stop: the others wait for its line)."""
    raise AgreedStop(message, rank=_rank())


def _agree(message):
    """Every rank stops if any rank has a message (the first rank's is printed)."""
    messages = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(messages, message)
    problems = [m for m in messages if m]
    if problems:
        _exit(problems[0])


def _layout():
    # the data-parallel coordinate counts the context-parallel ranks too (each its own
    # RNG streams); without context parallelism it is the data-parallel size
    return (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_data_parallel_world_size(with_context_parallel=True),
    )


def _rng_state():
    state = {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_rank()
    dp = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    pp_size, tp_size, dp_size = _layout()
    # one object per rank: RNG streams are per rank and reload only into the same layout
    return ShardedObject("rng_state", state, (pp_size, tp_size, dp_size), (pp, tp, dp),
                         replica_id=0)


def unwrap_model(module):
    """The GPTModel inside DDP / Float16Module wrappers (their keys carry no prefix then)."""
    while hasattr(module, "module"):
        module = module.module
    return module


def _model_key(model, index):
    return "model" if len(model) == 1 else f"model{index}"


def _fill_empty_adam_state(optimizer):
    """Zero Adam state for parameters that have not stepped yet, so that megatron-core's
    distributed optimizer can describe (and then load into) it: its state_dict() reads
    every parameter's "step", which torch's Adam only creates at the first step."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = part.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param].update(step=torch.tensor(0.0),
                                              exp_avg=torch.zeros_like(param),
                                              exp_avg_sq=torch.zeros_like(param))


def _optimizer_state(args, optimizer, model_sd, loading, avoid_prefix=True):
    if args.use_distributed_optimizer:
        if loading or args.optimizer == "adam":
            # a save before the first step (--train-iters 0, --moe-use-upcycling, a
            # weights-only resume saved at once) has no state to describe either: the
            # zeros are what Adam's first step starts from
            _fill_empty_adam_state(optimizer)
        # megatron-core's default for it stores flattened ranges, which torch_dist
        # checkpoints no longer support; this format is the model's own sharding.
        # "mem_efficient" gathers over the gloo data-parallel group (the other path
        # moves tensors to CUDA): data-parallel rank 0 writes the state
        metadata = {"distrib_optim_sharding_type": DISTRIBUTED_OPTIMIZER_FORMAT,
                    "distrib_optim_fully_reshardable_mem_efficient": True,
                    # as Megatron-LM: the keys of a chained optimizer's state (one
                    # optimizer per parameter kind at EP > 1) are the model's, so the
                    # state loads into another chain (_states_per_part)
                    "chained_optim_avoid_prefix": avoid_prefix}
        parts = [part for part in getattr(optimizer, "chained_optimizers", [optimizer])
                 if hasattr(part, "get_parameter_state_dp_zero")]
        for part in parts:
            part.get_parameter_state_dp_zero = _in_buffer_space(part)
        try:
            state = optimizer.sharded_state_dict(model_sd, is_loading=loading,
                                                 metadata=metadata)
            # a load builds the state on every rank: no None to mark
            return state if loading else _unsaved_off_dp_zero(state)
        finally:
            for part in parts:
                del part.get_parameter_state_dp_zero  # the class's method again
    return optimizer.sharded_state_dict(model_sd, is_loading=loading)


def _unsaved_off_dp_zero(state):
    """The optimizer's sharded state with the ``param_state`` of data-parallel ranks > 0
    marked unsaved. The mem-efficient save gives them ``None`` (data-parallel rank 0
    writes the state); as a plain value it would go into those ranks' common state dict,
    which then differs from rank 0's, and megatron-core warned on every save ("Rank 1
    common state dict differs from rank 0 common state dict ... param_state"). Its
    ``dp_zero`` format marks the same ``None`` non-persistent; so does this."""
    if isinstance(state, dict):
        for key, value in state.items():
            if key == "param_state" and value is None:
                state[key] = LocalNonpersistentObject(None)
            else:
                _unsaved_off_dp_zero(value)
    elif isinstance(state, list):  # a chained optimizer's parts
        for value in state:
            _unsaved_off_dp_zero(value)
    return state


def _in_buffer_space(part):
    """``part.get_parameter_state_dp_zero`` whose gathered tensors are indexed like the
    grad buffer, so that megatron-core's ``fully_reshardable`` save slices the right
    elements for every parameter.

    megatron-core (0.16.1 to 0.19.2, its "issue #504") gathers each buffer's state as the
    concatenation of its buckets *without* the padding at the end of each bucket, then
    cuts every parameter out of it at ``buffer.param_index_map``'s offsets, which count
    that padding. With one bucket the two agree; with several (--overlap-grad-reduce
    makes them) every parameter after the first bucket got another parameter's elements
    (shifted by the padding before it) as its main weights and Adam moments, and its
    load then copied those wrong main weights into the model. Here each bucket's
    elements are put back at the bucket's offset in the buffer."""
    gather = part.get_parameter_state_dp_zero  # the bound method of the class

    def get_parameter_state_dp_zero(*args, **kwargs):
        state = gather(*args, **kwargs)
        if state is None:  # a data-parallel rank that does not write
            return state
        for gbuf_idx, by_dtype in state.items():
            if not isinstance(gbuf_idx, int):  # "buckets_coalesced"
                continue
            buffer = part.buffers[gbuf_idx]
            for world in by_dtype.values():
                for key, tensor in list(world.items()):
                    if isinstance(tensor, torch.Tensor):
                        world[key] = _bucket_padding_restored(buffer, tensor)
        return state

    return get_parameter_state_dp_zero


def _bucket_padding_restored(buffer, packed):
    """The buckets' unpadded elements, concatenated in ``packed``, at their offsets in a
    tensor of the (padded) buffer's size."""
    lengths = [bucket.numel_unpadded for bucket in buffer.buckets]
    if packed.dim() != 1 or packed.numel() != sum(lengths):
        raise RuntimeError(
            f"megatron-core's gathered distributed-optimizer state has {packed.numel()} "
            f"elements, its buckets {sum(lengths)}: a megatron-core version whose layout "
            f"this project does not know (see megatron/mcore_compat.py)")
    spread = torch.zeros(buffer.numel, dtype=packed.dtype, device=packed.device)
    start = 0
    for bucket, length in zip(buffer.buckets, lengths):
        spread[bucket.offset:bucket.offset + length] = packed[start:start + length]
        start += length
    return spread


def _load_optimizer(args, model, optimizer, state):
    if not args.use_distributed_optimizer:
        optimizer.load_state_dict(state)
        return
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    states = _states_per_part(state, parts)
    names = {param: name for i, chunk in enumerate(model)
             for name, param in unwrap_model(chunk).named_parameters()}
    disagreeing = []
    for part, part_state in zip(parts, states):
        # megatron-core (0.16 to 0.19) copies every Adam state entry of a parameter, "step"
        # included, from the fully_reshardable tensors, which hold no "step": load the
        # param groups (the steps), then the tensors with the steps set aside
        param_state = part_state.pop("param_state")
        part_state.pop("param_state_sharding_type")
        disagreeing += _weights_disagreeing(part, param_state, names)
        part.load_state_dict(part_state)
        steps = {param: entry.pop("step") for param, entry in part.optimizer.state.items()
                 if "step" in entry}
        try:
            part.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            # its load gives every parameter one shared "step" tensor, which torch's
            # (single-tensor) Adam would then advance once per parameter per step
            for param, step in steps.items():
                part.optimizer.state[param]["step"] = step.clone()
    _warn_if_disagreeing(args, disagreeing)


def _states_per_part(state, parts):
    """The loaded distributed-optimizer state of each of this run's chained optimizers.

    Its tensors come back where this run asked for them (one "param_state" per part,
    keyed by the model's keys); its other entries (param groups with the step) as they
    were saved: one dict per saved part, under 0, 1, ... when the saving run chained
    several. With as many parts as saved, each part takes its own; across an
    expert-parallel change (megatron-core chains a dense and an expert optimizer at EP
    > 1, one optimizer at EP 1) each part takes the saved param groups of the same
    settings, marked with its own ``is_expert_parallel`` (megatron-core's loader pairs
    groups by their identifier keys): the hyperparameters and the step of every saved
    part are the same numbers."""
    saved = ([state[key] for key in sorted(k for k in state if isinstance(k, int))
              if "optimizer" in state[key]] or [state])
    asked = [state] if len(parts) == 1 else [state[i] for i in range(len(parts))]
    if len(saved) == len(parts):
        return asked
    groups = [group for part in saved for group in part["optimizer"]["param_groups"]]
    states = []
    for part, own in zip(parts, asked):
        states.append({"optimizer": {"param_groups": [_saved_group(group, groups)
                                                      for group in part.optimizer.param_groups]},
                       "param_state": own["param_state"],
                       "param_state_sharding_type": saved[0]["param_state_sharding_type"],
                       **({"grad_scaler": saved[0]["grad_scaler"]}
                          if "grad_scaler" in saved[0] else {})})
    return states


def _saved_group(group, saved_groups):
    """The saved param group of ``group``'s settings (its identifier keys but
    ``is_expert_parallel``), relabelled with ``group``'s ``is_expert_parallel``."""
    keys = [key for key in mcore_compat.get("optimizer.optimizer:param_group_identifier_keys")
            if key != "is_expert_parallel"]
    for saved in saved_groups:
        if all(saved.get(key) == group.get(key) for key in keys):
            return {**saved, "is_expert_parallel": group.get("is_expert_parallel", False)}
    raise CheckpointError(f"the checkpoint's optimizer has no param group with the settings "
                          f"{ {key: group.get(key) for key in keys} } of this run's; pass "
                          f"--no-load-optim to load the weights only")


def _weights_disagreeing(part, param_state, names):
    """(name, largest difference) of the parameters whose loaded model weights differ from
    the fp32 main weights in the loaded optimizer state: a checkpoint saves both from the
    same numbers. Runs before the load copies the main weights into the model."""
    found = []
    index = 0  # megatron-core's order of the fully_reshardable entries
    for buffer in part.buffers:
        for model_param in buffer.param_index_map:
            saved = param_state[index].get("param")
            index += 1
            if saved is None:
                continue
            saved = saved.to(device=model_param.device)
            weights = model_param.detach()
            # a checkpoint of another precision (--bf16 / --fp16) saved weights rounded
            # from the main weights: equal in one of them is agreeing
            if saved.shape != weights.shape or not any(
                    torch.equal(saved.to(dtype), weights.to(dtype))
                    for dtype in (weights.dtype, torch.bfloat16, torch.float16)):
                difference = ((saved.float().reshape(-1) - weights.float().reshape(-1))
                              .abs().max().item() if saved.numel() == weights.numel()
                              else float("nan"))
                found.append((names.get(model_param, "a parameter"), difference))
    return found


def _warn_if_disagreeing(args, disagreeing):
    """Collective: rank 0 prints one line if any rank's optimizer state disagreed."""
    where = (parallel_state.get_pipeline_model_parallel_rank(),
             parallel_state.get_tensor_model_parallel_rank())
    found = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(found, [(where, name, difference)
                                                for name, difference in disagreeing])
    # data-parallel replicas check the same parameters: each one once
    found = {(where, name): difference for entries in found
             for where, name, difference in entries}
    if found and _rank() == 0:
        (stage, _), name = worst = max(found, key=lambda key: found[key])
        print(f"  warning: --load {args.load}: the optimizer state's main weights of "
              f"{len(found)} parameter(s) differ from the checkpoint's model weights (e.g. "
              f"{name} of pipeline stage {stage}, by {found[worst]:.3g}), which they "
              f"overwrite: a distributed-optimizer "
              f"checkpoint saved by an older version of this project from model chunks with "
              f"several DDP buckets (--overlap-grad-reduce) holds wrong optimizer state; if "
              f"this one was, resume it with --no-load-optim (its model weights are right)",
              flush=True)


def _sharded_state_dict(args, model, optimizer, scheduler, iteration, consumed, with_rng,
                        loading=False, with_optimizer=True, avoid_prefix=True,
                        saved_keys=None):
    """``avoid_prefix``: the chained optimizer's keys without megatron-core's
    ``chained_<i>.`` prefix (what this project saves; a load asks for the keys the
    checkpoint has: earlier saves of chained optimizers carry the prefix).
    ``saved_keys`` (a load): the checkpoint's tensor keys; norms it holds under
    megatron-core's local-spec names are asked for under those (checkpoint_names)."""
    # Megatron-LM's keys: "model", or "model0", "model1", ... with virtual stages (their
    # tensors carry global layer numbers, so a checkpoint reshards across layouts)
    # metadata as a dict that megatron-core fills with its data-parallel group: 0.16's
    # GPTModel reads that group from the dict it passed down (MTP's embedding copy), which
    # stays None when none is given
    model_sd = {_model_key(model, i): unwrap_model(chunk).sharded_state_dict(metadata={})
                for i, chunk in enumerate(model)}
    if saved_keys is not None:  # before the optimizer's state, whose keys are these
        checkpoint_names.ask_for_saved_names(model_sd, saved_keys)
    state = {
        **model_sd,
        "opt_param_scheduler": scheduler.state_dict(),
        "iteration": iteration,
        "consumed_samples": consumed,
        # Megatron-LM's skipped_train_samples (--iterations-to-skip,
        # --decrease-batch-size-if-needed): the count goes on after a resume
        "skipped_samples": getattr(args, "skipped_train_samples", 0),
        # what --override-ckpt-iteration compares: sample offsets count in this batch size
        "global_batch_size": args.global_batch_size,
        "model_shape": model_shape(args),
        "layout": list(_layout()),
        # what --use-mp-args-from-checkpoint-args takes besides the layout's PP and TP
        "virtual_pipeline_model_parallel_size": args.virtual_pipeline_model_parallel_size,
        "distributed_optimizer": bool(args.use_distributed_optimizer),
        "optimizer_type": args.optimizer,
        # megatron-core chains one optimizer per parameter kind with expert parallelism;
        # its sharded keys then carry a chained_<i> prefix that another chain cannot load
        "optimizer_parts": optimizer_parts(optimizer),
        "expert_model_parallel_size": getattr(args, "expert_model_parallel_size", 1),
        "chained_optim_avoid_prefix": bool(args.use_distributed_optimizer),
        # what --no-save-optim / --no-save-rng left out, so a load can say so
        "has_optimizer": with_optimizer,
        "has_rng": with_rng,
    }
    if with_optimizer:
        state["optimizer"] = _optimizer_state(
            args, optimizer, model_sd["model"] if len(model) == 1 else model_sd, loading,
            avoid_prefix)
    if with_rng:
        state["rng_state"] = _rng_state()
    return state


# ---------------------------------------------------------------- manifest (checksums)

def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _checkpoint_files(directory):
    return sorted(name for name in os.listdir(directory)
                  if name != MANIFEST_FILE and os.path.isfile(os.path.join(directory, name)))


def _my_share(names):
    """The files this rank hashes: the work is spread over all ranks."""
    return names[_rank()::torch.distributed.get_world_size()]


def _write_manifest(directory):
    """Collective: every rank hashes its share, rank 0 writes ``checksums.json``."""
    names = [_checkpoint_files(directory) if _rank() == 0 else None]
    torch.distributed.broadcast_object_list(names, src=0)
    mine = {}
    for name in _my_share(names[0]):
        path = os.path.join(directory, name)
        mine[name] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    shares = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(shares, mine)
    if _rank() == 0:
        files = {name: entry for share in shares for name, entry in share.items()}
        _write_atomically(os.path.join(directory, MANIFEST_FILE),
                          json.dumps({"files": files}, indent=1, sort_keys=True))


def _write_atomically(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)  # never a torn file


def _file_problem(directory, name, entry):
    """What is wrong with one file the manifest lists, or None."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return f"{name} is missing"
    size = os.path.getsize(path)
    if size != entry["size"]:
        kind = "truncated" if size < entry["size"] else "longer than saved"
        return f"{name} is {kind} ({size} bytes, the save wrote {entry['size']})"
    if _sha256(path) != entry["sha256"]:
        return f"{name} does not match its checksum (its bytes changed after the save)"
    return None


def _read_manifest(directory):
    """(files, problem): the manifest's entries, None if there is none, or a problem."""
    path = os.path.join(directory, MANIFEST_FILE)
    if not os.path.exists(path):
        return None, None
    try:
        with open(path) as handle:
            files = json.load(handle)["files"]
        if not all(isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
                   for e in files.values()):
            raise ValueError("bad entry")
        return files, None
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None, f"{MANIFEST_FILE} is unreadable"


def _structure_problem(directory):
    """For a checkpoint without manifest: what dist_checkpointing's files miss, or None."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        with open(os.path.join(directory, "metadata.json")) as handle:
            if "sharded_backend" not in json.load(handle):
                raise ValueError
    except FileNotFoundError:
        return "metadata.json is missing (not a dist_checkpointing checkpoint)"
    except (OSError, ValueError, TypeError):
        return "metadata.json is unreadable (not a dist_checkpointing checkpoint)"
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception:  # any unpickling error: the file is damaged
        return ".metadata is missing or unreadable"
    # megatron-core <= 0.18 keeps the common (non-tensor) state in common.pt; 0.19 saves it
    # as a "common_state" object among the torch_dist files
    if not os.path.isfile(os.path.join(directory, "common.pt")) and not any(
            key.startswith("common_state") for key in metadata.state_dict_metadata):
        return "common.pt is missing"
    storage = metadata.storage_data
    needed = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0),
                                         info.offset + info.length)
    for name, length in sorted(needed.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if os.path.getsize(path) < length:
            return (f"{name} is truncated ({os.path.getsize(path)} bytes, .metadata "
                    f"needs {length})")
    return None


def _written_here(path):
    """Whether this project saved the checkpoint (its common state holds the model-shape
    flags, which Megatron-LM's does not); such a save always writes checksums.json."""
    try:
        return "model_shape" in dist_checkpointing.load_common_state_dict(path)
    except Exception:  # unreadable: the load itself will say so
        return False


def _unverified_problem(path, allow):
    """Rank 0, for a checkpoint without checksums.json: None (it loads, with a warning)
    or why it is refused."""
    if _written_here(path) and not allow:
        return (f"{MANIFEST_FILE} is missing, but this project wrote the checkpoint and "
                f"writes one with every save (was it deleted? a file may be damaged too): "
                f"pass --load-unverified-checkpoint to load it unverified")
    print(f"  warning: {path} has no {MANIFEST_FILE} ("
          f"{'loaded with --load-unverified-checkpoint' if allow else 'saved by Megatron-LM'}"
          f"): its files are not verified", flush=True)
    return None


def _verify(root, path, allow_unverified=False, flag="--load"):
    """Collective: check the checkpoint's files before any rank reads them; every rank
    stops together on a damaged one."""
    found = [None]
    if _rank() == 0:
        files, problem = _read_manifest(path)
        if problem is None and files is None:
            problem = (_structure_problem(path)
                       or _unverified_problem(path, allow_unverified))
        found[0] = (files or {}, problem, _legacy_torch_format(path))
    torch.distributed.broadcast_object_list(found, src=0)
    files, problem, legacy = found[0]
    if legacy:  # not damaged: a format this trainer does not read
        _exit(f"{flag} {path} is a Megatron-LM checkpoint in the legacy torch format "
              f"({legacy}), which is not read here (torch_dist only): convert it with "
              f"Megatron-LM's pretrain_gpt.py and this run's model flags plus --ckpt-format "
              f"torch --load {root} --ckpt-convert-format torch_dist --ckpt-convert-save NEW, "
              f"then --load NEW/torch_dist here")
    names = sorted(files)
    problems = [p for p in (_file_problem(path, n, files[n]) for n in _my_share(names)) if p]
    _agree(_damaged(root, path, problem or (problems[0] if problems else None), flag))


def _legacy_torch_format(path):
    """The file that marks a Megatron-LM checkpoint of --ckpt-format torch (one
    mp_rank_*/model_optim_rng.pt per model-parallel rank), or None."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return None
    for name in names:
        if name.startswith("mp_rank_") and os.path.isfile(
                os.path.join(path, name, "model_optim_rng.pt")):
            return os.path.join(name, "model_optim_rng.pt")
    return None


def _damaged(root, path, problem, flag="--load"):
    if problem is None:
        return None
    others = [str(int(_ITER_DIR.match(n).group(1))) for n in _iteration_dirs(root)
              if n != os.path.basename(path)]
    choice = (f"write another saved iteration ({', '.join(others)}) into "
              f"{os.path.join(root, TRACKER_FILE)}" if others else
              f"start again without this {flag}")
    return f"{flag} {root}: checkpoint {path} is damaged: {problem}; {choice}"


# ---------------------------------------------------------------- save

def _remove(path):
    if os.path.lexists(path):
        shutil.rmtree(path)


def _move_into_place(staging, final):
    """Rank 0: the finished checkpoint takes its name (replacing an older one of the
    same iteration, e.g. a --train-iters 0 run saving what it loaded)."""
    old = final + ".replaced"
    _remove(old)
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(staging, final)
    _remove(old)


def save_checkpoint(args, iteration, consumed_samples, model, optimizer, scheduler,
                    data_iterator=None):
    """Save (collective). With --async-save the tensors are written in the background
    and the checkpoint is published later, by async_save.maybe_finalize.
    ``data_iterator``: the training iterator(s), whose microbatches a pending rerun
    (--rerun-mode) saves."""
    final = checkpoint_dir(args.save, iteration)
    staging = final + STAGING_SUFFIX
    previous = _tracked_iteration(args.save)
    needed = save_failure.checkpoint_bytes(
        args, model, checkpoint_dir(args.save, previous) if previous is not None else None)
    save_failure.warn_if_short(args, iteration, needed, _rank())
    with _failing_save(args, iteration, staging, needed):
        if _rank() == 0:
            _remove(staging)  # what a killed save left behind
            os.makedirs(staging)
        torch.distributed.barrier()
        state = _sharded_state_dict(args, model, optimizer, scheduler, iteration,
                                    consumed_samples, with_rng=not args.no_save_rng,
                                    with_optimizer=not args.no_save_optim)
        rerun_state = rerun.checkpoint_state(args, data_iterator)
        if rerun_state is not None:  # Megatron-LM's key
            state["rerun_state_machine"] = rerun_state
        if args.async_save:
            # one background write at a time: megatron-core's writers return their results
            # through one shared queue, so a write that failed fast could hand its failure
            # to an earlier save still being written (and that save's success to itself)
            async_save.maybe_finalize(args, blocking=True)
            async_save.use_forked_results_queue()
            request = dist_checkpointing.save(state, staging, async_sharded_save=True,
                                              **async_save.strategy_kwargs())
            async_save.schedule(
                args, iteration, staging, needed, request,
                publish=lambda: _publish(args, iteration, staging, final, needed),
                fail=lambda error: save_failure.fail(args, iteration, staging, error, needed,
                                                     _tracked_iteration(args.save),
                                                     TRACKER_FILE))
            return
        save_results_queue.use_in_process_results_queue()  # no spawned Manager process
        dist_checkpointing.save(state, staging)
    _publish(args, iteration, staging, final, needed)


def _publish(args, iteration, staging, final, needed):
    """Collective, once every rank's files are written: checksums, the rename, then the
    tracker; the previous checkpoint goes if --save-retain-interval says so."""
    previous = _tracked_iteration(args.save)
    with _failing_save(args, iteration, staging, needed):
        torch.distributed.barrier()
        _write_manifest(staging)
        if _rank() == 0:
            _move_into_place(staging, final)
            _write_atomically(os.path.join(args.save, TRACKER_FILE), str(iteration))
            print(f"  saved checkpoint at iteration {iteration} to {final}", flush=True)
    if _rank() == 0:  # after the save: a problem here is no failed save
        _drop_unretained(args, previous, iteration)
    torch.distributed.barrier()


@contextlib.contextmanager
def _failing_save(args, iteration, staging, needed):
    """A failure inside becomes save_failure's one line (SystemExit), after the partial
    directory is removed; Ctrl-C removes it too."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        save_failure.remove_partial(staging)  # Ctrl-C: never leave a half-written save
        raise
    except BaseException as error:  # OSError, torch's CheckpointException (a BaseException)
        signum = stop_signals.stop_signal_received()
        if signum is not None:  # a peer stopped on Ctrl-C mid-save: not a disk problem
            save_failure.remove_partial(staging)
            raise stop_signals.Interrupted(signum) from None
        save_failure.fail(args, iteration, staging, error, needed,
                          _tracked_iteration(args.save), TRACKER_FILE)


def _tracked_iteration(root):
    """The iteration the tracker names now, or None (missing or unreadable)."""
    try:
        return _latest_iteration(root)
    except (CheckpointError, OSError):
        return None


def _drop_unretained(args, previous, iteration):
    """Rank 0, --save-retain-interval, as Megatron-LM: once the tracker names the new
    checkpoint, the one it named before goes unless its iteration is a multiple of the
    interval. Renamed first (out of the iter_N pattern, so no load can pick it up half
    deleted), then removed; a symbolic link is left alone, as Megatron-LM does."""
    retain = args.save_retain_interval
    if retain is None or not previous or previous == iteration or previous % retain == 0:
        return
    path = checkpoint_dir(args.save, previous)
    if os.path.islink(path) or not os.path.isdir(path):
        return
    doomed = path + ".deleting"
    try:
        _remove(doomed)  # what a killed deletion left
        os.rename(path, doomed)
        _remove(doomed)
    except OSError as error:  # the new checkpoint is saved: a leftover is no reason to stop
        print(f"  warning: --save-retain-interval: could not delete {path} "
              f"({error.strerror}); delete it by hand", flush=True)
        return
    print(f"  deleted checkpoint of iteration {previous} (--save-retain-interval {retain})",
          flush=True)


# ---------------------------------------------------------------- load

def _iteration_dirs(root):
    if not os.path.isdir(root):
        return []
    return sorted(name for name in os.listdir(root)
                  if _ITER_DIR.match(name) and os.path.isdir(os.path.join(root, name)))


def _same_dir(a, b):
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def latest_iteration(root):
    """The iteration the tracker in ``root`` names, None without a tracker; raises
    CheckpointError on a tracker that names none."""
    return _latest_iteration(root)


def _latest_iteration(root):
    tracker = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(tracker):
        return None
    with open(tracker, "rb") as handle:  # bytes: the file may hold anything
        raw = handle.read(200)
    # ASCII digits only: str.isdigit() also takes "³" and other scripts' digits
    if not re.fullmatch(rb"\s*[0-9]+\s*", raw):
        try:
            shown = repr(raw.strip()[:60].decode("utf-8"))
        except UnicodeDecodeError:  # binary: shown as bytes
            shown = repr(raw.strip()[:60])
        saved = [str(int(_ITER_DIR.match(n).group(1))) for n in _iteration_dirs(root)]
        what = (f"write the iteration to resume from ({', '.join(saved)} saved) into it"
                if saved else "remove it or write an iteration into it")
        raise CheckpointError(f"--load {root}: {TRACKER_FILE} holds {shown}, not an "
                              f"iteration: {what}")
    return int(raw)


def _no_tracker(root):
    """The one-line refusal for checkpoints without a tracker file naming the latest."""
    found = _iteration_dirs(root)
    return (f"{root} holds {', '.join(found)} but no {TRACKER_FILE} (a save was interrupted "
            f"or the file was deleted): write the iteration to resume from (e.g. "
            f"{int(_ITER_DIR.match(found[-1]).group(1))}) into {os.path.join(root, TRACKER_FILE)}"
            f", or use another --save")


def _warn_of_newer(args, iteration, override=None):
    """Rank 0: a tracker set back to an older iteration (deliberately, to leave a bad
    stretch behind, or by mistake), or --override-ckpt-iteration below the checkpoint's,
    lets the next saves replace the newer iter_* of the same numbers: name them before
    anything is replaced."""
    if _rank() != 0 or not _same_dir(args.load, args.save):
        return
    newer = [name for name in _iteration_dirs(args.load)
             if int(_ITER_DIR.match(name).group(1)) > iteration]
    if newer and override is not None:
        print(f"  warning: --override-ckpt-iteration {override}: {', '.join(newer)} in --save "
              f"{args.save} are newer, and saves of this run at those iterations will "
              f"replace them; to keep them, move them away or use another --save",
              flush=True)
    elif newer:
        print(f"  warning: --load {args.load}: {TRACKER_FILE} names iteration {iteration} but "
              f"{', '.join(newer)} are newer: saves of this run at those iterations will "
              f"replace them; to keep them, move them away or use another --save (to resume "
              f"from the newest instead, write its iteration into "
              f"{os.path.join(args.load, TRACKER_FILE)})", flush=True)


def _check_model_shape(args, path, common, flag="--load"):
    saved_shape, now = with_legacy_gelu(common.get("model_shape", {})), model_shape(args)
    changed = [flag for flag in now if flag in saved_shape and saved_shape[flag] != now[flag]]
    differ = [f"--{flag.replace('_', '-')} saved {saved_shape[flag]!r}, now {now[flag]!r}"
              for flag in changed]
    if not differ:
        return
    rescaled = set(changed) <= POSITION_SCALING_FLAGS and {
        saved_shape.get("position_embedding_type"), now["position_embedding_type"]} <= {
        "rope", "yarn"}
    if rescaled and getattr(args, "finetune", False):
        if _rank() == 0:
            print(f"  note: {flag} {path}: RoPE reads positions differently from that "
                  f"checkpoint's run ({'; '.join(differ)}): its weights start this run "
                  f"(--finetune), as when extending the context", flush=True)
        return
    hint = ""
    if saved_shape.get("bias_gelu_fusion") is False and now.get("bias_gelu_fusion"):
        hint = (" (that checkpoint's MLP computes the exact GeLU: add "
                "--no-bias-gelu-fusion, or --use-checkpoint-args, to continue it)")
    elif changed == ["padded_vocab_size"] and getattr(args, "tokenizer_type", None) == \
            "NullTokenizer":
        hint = (f" (NullTokenizer's --vocab-size is its whole vocabulary since 2026-12-08, as "
                f"in Megatron-LM 0.18+; a checkpoint saved before with --vocab-size "
                f"{args.vocab_size} held {args.vocab_size + 1} entries, the last the "
                f"end-of-document: give --vocab-size {args.vocab_size + 1} to continue it)")
    elif rescaled:
        hint = (" (only RoPE's position scaling differs: to extend the context from this "
                "checkpoint, start a run from its weights with --finetune; to resume it, "
                "give its settings or --use-checkpoint-args)")
    _exit(f"{flag} {path} holds another model shape: " + "; ".join(differ) + hint)


def _check_optimizer_kind(args, path, common):
    """For a load of the optimizer state: the same optimizer, plain or distributed."""
    # checkpoints saved before --optimizer sgd existed here are Adam's
    saved_type = common.get("optimizer_type", "adam")
    if saved_type != args.optimizer:
        _exit(f"--load {path} holds the state of --optimizer {saved_type} and this run uses "
              f"--optimizer {args.optimizer}: it does not load; use --optimizer "
              f"{saved_type}, or pass --no-load-optim to load the weights only")
    saved_format = _saved_optimizer_format(common.get("optimizer"))
    # Megatron-LM's checkpoints do not record the flag: its state's format says it
    saved = bool(common.get("distributed_optimizer", saved_format is not None))
    if saved and saved_format == "dp_reshardable" and args.use_distributed_optimizer:
        _exit(f"--load {path} holds distributed-optimizer state in megatron-core's "
              f"dp_reshardable format (Megatron-LM's default): per data-parallel rank "
              f"flattened gradient buckets, which load only into the exact data-parallel "
              f"size and bucket layout of the run that saved them; this project reads the "
              f"fully_reshardable format. Pass --no-load-optim to load the weights only, or "
              f"have Megatron-LM save it with --dist-ckpt-optim-fully-reshardable")
    if saved == bool(args.use_distributed_optimizer):
        return
    with_, without = "with", "without"
    _exit(f"--load {path} was saved {with_ if saved else without} "
          f"--use-distributed-optimizer and this run is {without if saved else with_} it: "
          f"its optimizer state does not load; match the flag, or pass --no-load-optim to "
          f"load the weights only")


def _saved_optimizer_format(optimizer_common):
    """megatron-core's distributed-optimizer state format a checkpoint's common optimizer
    state records ("fully_reshardable", "dp_reshardable", ...; in any chained part), or
    None (a plain optimizer's state)."""
    if isinstance(optimizer_common, dict):
        found = optimizer_common.get("param_state_sharding_type")
        if isinstance(found, str):
            return found
        values = optimizer_common.values()
    elif isinstance(optimizer_common, (list, tuple)):
        values = optimizer_common
    else:
        return None
    for value in values:
        found = _saved_optimizer_format(value)
        if found is not None:
            return found
    return None


def optimizer_parts(optimizer) -> int:
    """How many optimizers megatron-core chained (1: not a ChainedOptimizer)."""
    return len(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _saved_without_prefix(common) -> bool:
    """Whether a distributed-optimizer checkpoint's keys carry no ``chained_<i>.``
    prefix: saved so since this project records it, and never for one optimizer (this
    project's earlier checkpoints and Megatron-LM's, which record nothing, otherwise)."""
    return bool(common.get("chained_optim_avoid_prefix", common.get("optimizer_parts", 1) <= 1))


def _check_optimizer_parts(args, path, common, optimizer):
    """Optimizer state across an expert-parallel change (another number of chained
    optimizers) loads from a distributed-optimizer checkpoint whose keys carry no
    chain prefix (``_states_per_part``); refused otherwise, with the way out."""
    saved = common.get("optimizer_parts")
    if saved is None or saved == optimizer_parts(optimizer):
        return
    if _saved_without_prefix(common) and args.use_distributed_optimizer:
        return
    why = ("the non-distributed optimizer's state keeps one list of param groups per "
           "chained optimizer" if not args.use_distributed_optimizer else
           "its keys carry megatron-core's per-optimizer prefix (saved by an earlier "
           "version of this project)")
    saved_ep = common.get("expert_model_parallel_size", "?")
    _exit(f"--load {path}: its optimizer state is {saved} chained optimizer(s) (saved with "
          f"--expert-model-parallel-size {saved_ep}) and this run builds "
          f"{optimizer_parts(optimizer)} (--expert-model-parallel-size "
          f"{getattr(args, 'expert_model_parallel_size', 1)}): {why}, so it does not load "
          f"across that change; keep the flag, or pass --no-load-optim to load the weights "
          f"(they reshard)")


def _check_schedule(args, path, scheduler, saved):
    """Megatron-LM's rule for a checkpoint's learning-rate schedule (schedule_check)."""
    if saved is None:  # not in the common state: megatron-core's own assert still applies
        return
    refusal, note = schedule_decision(args, path, scheduler, saved)
    if refusal is not None:
        _exit(refusal)
    if note is not None and _rank() == 0:
        print(note, flush=True)


# --dist-ckpt-strictness values under which every key the model asks for was loaded
STRICT_LOADS = ("assume_ok_unexpected", "raise_unexpected", "raise_all")


_ABSENT_KEY = re.compile(r"([\w./]+) from model not in state dict")
_KEY_SET = re.compile(r"(Unexpected|Missing) keys \(for [a-z ]+\): (\{[^}]*\})")


def _key_mismatch(path, error, strictness):
    """A load refused for keys the checkpoint lacks or holds beyond the model's: one
    line naming them and the flag, else None (another fault)."""
    text = str(error) + "".join(str(e) for _, e in getattr(error, "failures", {}).items())
    absent = _ABSENT_KEY.search(text)
    if absent and strictness == "assume_ok_unexpected":
        return (f"--load {path}: the checkpoint lacks {absent.group(1)}, which the model "
                f"asks for (another model?); to load the rest and keep such weights at "
                f"their initial values, pass --dist-ckpt-strictness log_unexpected")
    found = dict(_KEY_SET.findall(text))
    if strictness.startswith("raise_") and found:
        return (f"--load {path}: the checkpoint's keys differ from the model's "
                f"(--dist-ckpt-strictness {strictness}): the model asks for keys the "
                f"checkpoint lacks: {found.get('Unexpected', '{}')}; the checkpoint holds "
                f"keys the model does not use: {found.get('Missing', '{}')}"[:4000])
    return None


def _unreadable(root, path, error, strictness=None, flag="--load"):
    if strictness is not None:
        mismatch = _key_mismatch(path, error, strictness)
        if mismatch:
            return mismatch
    detail = str(error).strip().splitlines()
    detail = detail[-1] if detail else type(error).__name__
    return _damaged(root, path, f"{type(error).__name__}: {detail[:300]}", flag)


def _note_mismatch(path, missing, unexpected):
    """--dist-ckpt-strictness return_*: Megatron-LM hands the keys to its caller; here
    rank 0 names them, so a partial load is never silent."""
    if _rank() == 0 and (missing or unexpected):
        print(f"  warning: {path}: keys the model asks for but the checkpoint lacks "
              f"(left at their initial values): {sorted(unexpected)}; keys in the "
              f"checkpoint the model does not use: {sorted(missing)}", flush=True)


def has_checkpoint(directory) -> bool:
    """Whether ``directory`` (None: no) names a latest checkpoint (its tracker file)."""
    return bool(directory) and os.path.isfile(os.path.join(directory, TRACKER_FILE))


def load_source(args):
    """(directory, flag) a run loads from: --load, or --pretrained-checkpoint where --load
    holds no checkpoint or is not given, as Megatron-LM decides."""
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if pretrained is not None and not has_checkpoint(args.load):
        return pretrained, "--pretrained-checkpoint"
    return args.load, "--load"


def resume_iteration(args):
    """The iteration a run will resume after, told before anything loads (0: a start, a
    --finetune or --pretrained-checkpoint run); what depends on it is built before the
    load (a phase's dataset) and checked against load_checkpoint's answer. A checkpoint
    that will not load answers 0 here: the load then stops on it."""
    if args.load is None and getattr(args, "pretrained_checkpoint", None) is None:
        return 0
    load_dir, flag = load_source(args)
    if flag == "--pretrained-checkpoint" or args.finetune:
        return 0
    override = getattr(args, "override_ckpt_iteration", None)
    if override is not None:
        return override
    if args.ckpt_step is not None:
        return args.ckpt_step
    try:
        return (_latest_iteration(load_dir) if os.path.isdir(load_dir) else None) or 0
    except CheckpointError:
        return 0


def load_checkpoint(args, model, optimizer, scheduler):
    """Restore a checkpoint. Returns (iteration, consumed_samples); (0, 0) if none exists.
    ``optimizer`` None (a model without one: --moe-use-upcycling's dense model, with
    --finetune) takes the weights only and leaves saying so to the caller."""
    load_dir, flag = load_source(args)
    override = getattr(args, "override_ckpt_iteration", None)
    if override is not None and flag == "--pretrained-checkpoint":
        _exit(f"--override-ckpt-iteration {override}: --load {args.load} holds no checkpoint "
              f"to resume, and --pretrained-checkpoint starts at iteration 0 with the weights "
              f"only: drop --override-ckpt-iteration, or give --load a run's checkpoints")
    if flag == "--pretrained-checkpoint":
        args.finetune = True  # as Megatron-LM: its weights start this run
        if _rank() == 0:
            where = f"--load {args.load} holds no checkpoint" if args.load else "no --load"
            print(f"  {where}: starting from the weights of --pretrained-checkpoint "
                  f"{load_dir}", flush=True)
    try:
        iteration = _latest_iteration(load_dir) if os.path.isdir(load_dir) else None
    except CheckpointError as error:
        if args.ckpt_step is None:
            _exit(str(error))
    if args.ckpt_step is not None:  # as Megatron-LM: this iteration, whatever the tracker
        iteration = args.ckpt_step
        if not os.path.isdir(checkpoint_dir(load_dir, iteration)):
            saved = ", ".join(str(int(_ITER_DIR.match(n).group(1)))
                              for n in _iteration_dirs(load_dir)) or "none"
            _exit(f"--ckpt-step {iteration}: {checkpoint_dir(load_dir, iteration)} does not "
                  f"exist (iterations saved in {flag} {load_dir}: {saved})")
    if iteration is None:
        if _iteration_dirs(load_dir):
            _exit(f"{flag} {_no_tracker(load_dir)}")
        if flag == "--pretrained-checkpoint":  # checked before start; deleted since?
            _exit(f"--pretrained-checkpoint {load_dir}: no checkpoint there ({TRACKER_FILE} "
                  f"missing)")
        # as Megatron-LM: a warning and a start from random (its CI's first runs rely on
        # it), fatal with --exit-on-missing-checkpoint; claim_save_dir has already refused
        # a --save whose checkpoints this run would overwrite
        if override is not None:
            _exit(f"--override-ckpt-iteration {override}: --load {args.load} holds no "
                  f"checkpoint ({TRACKER_FILE} missing), so there is nothing to resume at "
                  f"iteration {override}: check the path, or drop the flag to start from "
                  f"random")
        if args.exit_on_missing_checkpoint:
            _exit(f"--load {args.load}: no checkpoint there ({TRACKER_FILE} missing) and "
                  f"--exit-on-missing-checkpoint is set; check the path, or drop the flag to "
                  f"start from random")
        if not args.perform_initialization:
            _exit(f"--load {args.load}: no checkpoint there ({TRACKER_FILE} missing), and "
                  f"--no-initialization left the weights uninitialised: check the path, or "
                  f"drop --no-initialization to start from random")
        if _rank() == 0:
            print(f"  warning: could not find the metadata file "
                  f"{os.path.join(args.load, TRACKER_FILE)}: no checkpoint is loaded and "
                  f"training starts from random", flush=True)
        return 0, 0
    path = checkpoint_dir(load_dir, iteration)
    if not os.path.isdir(path):
        _exit(f"{flag} {load_dir}: {TRACKER_FILE} names iteration "
              f"{iteration} but {path} does not exist")
    _verify(load_dir, path, args.load_unverified_checkpoint, flag)
    if flag == "--load":
        _warn_of_newer(args, iteration if override is None else override, override)
    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except Exception as error:  # verified files that still do not load: say which
        _exit(_unreadable(load_dir, path, error, flag=flag))
    _check_model_shape(args, path, common, flag)
    if override is not None:
        _check_saved_batch(args, path, common, f"--override-ckpt-iteration {override}",
                           f"the samples of iteration {override} would not be the ones "
                           f"that run read")
    elif getattr(args, "phase_transitions", None) and not args.finetune:
        _check_saved_batch(args, path, common, "--phase-transition-iterations",
                           "the phases' iterations would not hold the samples they held")
    # --finetune: the weights only, from iteration 0 (as Megatron-LM)
    load_optim = not (args.no_load_optim or args.finetune)
    if load_optim and not common.get("has_optimizer", True):
        _exit(f"--load {path} holds no optimizer state (saved with --no-save-optim): pass "
              f"--no-load-optim or --finetune to load the weights only")
    if load_optim:
        _check_optimizer_kind(args, path, common)
        _check_optimizer_parts(args, path, common, optimizer)
        _check_schedule(args, path, scheduler, common.get("opt_param_scheduler"))
    same_layout = list(common.get("layout", [])) == list(_layout())
    load_rng = (same_layout and not args.no_load_rng and not args.finetune
                and common.get("has_rng", True))
    try:
        saved_keys = checkpoint_names.saved_tensor_keys(path)
    except Exception as error:
        _exit(_unreadable(load_dir, path, error, flag=flag))
    template = _sharded_state_dict(args, model, optimizer, scheduler, 0, 0, with_rng=load_rng,
                                   loading=True, with_optimizer=load_optim,
                                   avoid_prefix=_saved_without_prefix(common),
                                   saved_keys=saved_keys)
    # as Megatron-LM: a rerun saved by --rerun-mode resumes in the same layout only; its
    # per-rank object is read whenever the layout allows, so that a strict load
    # (--dist-ckpt-strictness raise_*) does not call it unexpected
    rerun_entry = common.get("rerun_state_machine")
    read_rerun = same_layout and not args.finetune and isinstance(rerun_entry, dict)
    if read_rerun:
        template["rerun_state_machine"] = rerun.load_template()
    strictness = getattr(args, "dist_ckpt_strictness", "assume_ok_unexpected")
    try:
        state = dist_checkpointing.load(template, path, strict=strictness)
    except (Exception, CheckpointException) as error:  # the latter is a BaseException
        _exit(_unreadable(load_dir, path, error, strictness, flag))
    if strictness.startswith("return_"):  # the keys come back instead of being logged
        state, missing, unexpected = state
        _note_mismatch(path, missing, unexpected)
    # keys the checkpoint lacks were taken out of the request by the modes that allow
    # it; those weights keep their initial values (Megatron-LM's non-strict fallback)
    strict_model = strictness in STRICT_LOADS
    for i, chunk in enumerate(model):
        unwrap_model(chunk).load_state_dict(state[_model_key(model, i)], strict=strict_model)
    if load_optim:
        try:
            _load_optimizer(args, model, optimizer, state["optimizer"])
        except CheckpointError as error:
            _exit(f"--load {path}: {error}")
        scheduler.load_state_dict(state["opt_param_scheduler"])
    elif optimizer is not None:
        optimizer.reload_model_params()  # fp32 main copies follow the loaded weights
    if load_rng:
        _restore_rng(state["rng_state"])
    if read_rerun and rerun.pending(args, rerun_entry):
        rerun.restore(state["rerun_state_machine"])
    if args.finetune:
        if _rank() == 0 and optimizer is not None:
            print(f"  loaded the weights of {path} (--finetune): training starts at "
                  "iteration 0 with a fresh optimizer", flush=True)
        return 0, 0
    if _rank() == 0:
        note = "" if same_layout else " (parallel layout changed: resharded, RNG not restored)"
        print(f"  loaded checkpoint from {path} at iteration {state['iteration']}{note}",
              flush=True)
    if override is not None:  # as Megatron-LM, the count of skipped samples starts over
        return _overridden_position(args, state, override)
    args.skipped_train_samples = common.get("skipped_samples", 0)
    return state["iteration"], state["consumed_samples"]


def _check_saved_batch(args, path, common, flag, why):
    """As Megatron-LM, --override-ckpt-iteration and --phase-transition-iterations refuse a
    checkpoint saved with another global batch size: their sample offsets count
    iterations x the batch."""
    saved_batch = common.get("global_batch_size")  # absent from older checkpoints
    if saved_batch is not None and saved_batch != args.global_batch_size:
        _exit(f"{flag}: --load {path} was saved with --global-batch-size {saved_batch}, "
              f"this run has {args.global_batch_size}: {why}; use its global batch size")


def _overridden_position(args, state, iteration):
    """--override-ckpt-iteration: (iteration, the samples this run's batch sizes consume
    in that many iterations)."""
    from megatron.trainer.data import GlobalBatchSizes

    batches = GlobalBatchSizes(args)
    consumed = 0
    for _ in range(iteration):  # the batch grows with the samples consumed (rampup)
        consumed += batches.microbatches_at(consumed) * batches.unit
    if _rank() == 0:
        print(f"  --override-ckpt-iteration {iteration}: resuming as at iteration {iteration} "
              f"(consumed samples {consumed}; the checkpoint's: iteration {state['iteration']}, "
              f"{state['consumed_samples']} samples); weights, optimizer state and "
              f"learning-rate schedule are the checkpoint's", flush=True)
    return iteration, consumed


def saved_common_state(load_dir, flag="--load"):
    """The common state of the latest checkpoint in ``load_dir`` (for --use-checkpoint-args,
    before any process group exists); raises CheckpointError."""
    iteration = _latest_iteration(load_dir) if os.path.isdir(load_dir) else None
    if iteration is None:
        raise CheckpointError(f"--use-checkpoint-args: {flag} {load_dir} holds no checkpoint "
                              f"({TRACKER_FILE} missing)")
    path = checkpoint_dir(load_dir, iteration)
    try:
        return dict(dist_checkpointing.load_common_state_dict(path))
    except Exception as error:
        raise CheckpointError(f"--use-checkpoint-args: {path} does not load: "
                              f"{type(error).__name__}: {str(error)[:200]}") from None


def saved_model_shape(common, args=None):
    """The model-shape flags recorded in a checkpoint's common state: this project's
    record, or, in a checkpoint Megatron-LM saved, read from its ``args`` (the run's
    parsed flags; those it lacks, an older Megatron-LM's, are taken from ``args``)."""
    if "model_shape" in common or common.get("args") is None or args is None:
        return with_legacy_gelu(dict(common.get("model_shape", {})))
    return model_shape(_as_our_args(common["args"], args))


def _megatron_lm_query_groups(saved):
    # Megatron-LM keeps --num-query-groups' default (1) without --group-query-attention,
    # where every head has its own keys
    if getattr(saved, "group_query_attention", True):
        return saved.num_query_groups
    return saved.num_attention_heads


# the model-shape flags that Megatron-LM's saved args hold otherwise: ours -> (the dests
# it may hold them under, newest first; how the saved args read as ours)
_MEGATRON_LM_DESTS = {
    "disable_bias_linear": (("add_bias_linear",), lambda saved, value: not value),
    "apply_layernorm_1p": (("layernorm_zero_centered_gamma", "apply_layernorm_1p"),
                           lambda saved, value: bool(value)),
    "num_query_groups": (("num_query_groups",),
                         lambda saved, value: _megatron_lm_query_groups(saved)),
}


def _as_our_args(saved, args):
    """``args`` with the model-shape flags of Megatron-LM's saved namespace ``saved``."""
    ours = SimpleNamespace(**vars(args))
    flags = (MODEL_SHAPE_FLAGS + YARN_SHAPE_FLAGS + ("bias_gelu_fusion",)
             + tuple(flag for gated in GATED_SHAPE_FLAGS.values() for flag in gated))
    for flag in flags:
        dests, read = _MEGATRON_LM_DESTS.get(flag, ((flag,), lambda saved, value: value))
        for dest in dests:
            if hasattr(saved, dest):
                setattr(ours, flag, read(saved, getattr(saved, dest)))
                break
    return ours


def saved_parallel_sizes(common):
    """The model-parallel sizes a checkpoint was saved with, as flags' dests (for
    --use-mp-args-from-checkpoint-args; the virtual stages only where recorded, since
    2026-12-07), or Megatron-LM's saved ``args``; None where neither is recorded."""
    saved = common.get("args")
    if "layout" not in common and saved is not None:  # a checkpoint Megatron-LM saved
        return {dest: getattr(saved, dest) for dest in (
            "pipeline_model_parallel_size", "tensor_model_parallel_size",
            "expert_model_parallel_size", "virtual_pipeline_model_parallel_size")
            if hasattr(saved, dest)}
    if "layout" not in common:
        return None
    pp, tp = common["layout"][:2]
    sizes = {"pipeline_model_parallel_size": pp, "tensor_model_parallel_size": tp,
             "expert_model_parallel_size": common.get("expert_model_parallel_size", 1)}
    if "virtual_pipeline_model_parallel_size" in common:
        sizes["virtual_pipeline_model_parallel_size"] = common[
            "virtual_pipeline_model_parallel_size"]
    return sizes


def _restore_rng(rng):
    random.setstate(rng["random"])
    np.random.set_state(rng["np"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    get_cuda_rng_tracker().set_states(rng["tracker"])


# ---------------------------------------------------------------- the --save directory

_held = {}  # absolute --save path -> the open lock file (rank 0 only)


def _take_lock(directory):
    """Rank 0: flock <dir>/.lock for this process's lifetime, or say who holds it."""
    path = os.path.join(directory, LOCK_FILE)
    handle = open(path, "a+")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "a process that has not written its name yet"
        handle.close()
        return (f"--save {directory} is in use by another run ({holder}, holding "
                f"{path}): wait for it to end, or use another --save")
    handle.seek(0)
    handle.truncate()
    handle.write(f"host {socket.gethostname()}, pid {os.getpid()}, since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    _held[os.path.abspath(directory)] = handle
    return None


def _overwrite_problem(args):
    """Rank 0: why this run must not write into --save, or None."""
    found = _iteration_dirs(args.save)
    if not found:
        return None
    if not has_checkpoint(args.save):
        return f"--save {_no_tracker(args.save)}"
    if not _same_dir(args.load, args.save):
        loads = f"--load {args.load}" if args.load else "no --load"
        return (f"--save {args.save} already holds checkpoints ({', '.join(found)}) and this "
                f"run ({loads}) does not resume from them, so it would overwrite them: pass "
                f"--load {args.save} to resume, or use another --save")
    return None


def claim_save_dir(args):
    """Collective, before loading: make --save this run's (lock, no foreign checkpoints).
    Every rank stops together, with one line, if it cannot."""
    if not args.save:
        return
    problem = None
    if _rank() == 0:
        _release_all()  # a previous run of this process that stopped without releasing
        try:
            os.makedirs(args.save, exist_ok=True)
            problem = _take_lock(args.save) or _overwrite_problem(args)
        except OSError as error:
            problem = f"--save {args.save}: cannot use it ({error.strerror}); check the path"
        if problem is not None:
            _release_all()
    _agree(problem)


def release_save_dir(args):
    """Give --save back (the same process may train another configuration next)."""
    if args.save and torch.distributed.is_initialized() and _rank() == 0:
        handle = _held.pop(os.path.abspath(args.save), None)
        if handle is not None:
            _unlock(handle)


def _release_all():
    while _held:
        _unlock(_held.popitem()[1])


def _unlock(handle):
    fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    handle.close()
