"""Checkpoints through megatron.core.dist_checkpointing, in Megatron-LM's directory layout.

``<dir>/iter_0000010/`` holds one distributed checkpoint (model, optimizer,
scheduler, iteration, consumed samples, model-shape flags, RNG states) and
``<dir>/latest_checkpointed_iteration.txt`` names the latest. A checkpoint saved
with one parallel layout loads into another when megatron-core can reshard it
(the RNG states are then not restored); another model shape is refused with the
flags that differ.
"""

import os
import random

import numpy as np
import torch

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel import get_cuda_rng_tracker

TRACKER_FILE = "latest_checkpointed_iteration.txt"

# Flags that define the model's shape: a checkpoint only loads into the same values.
MODEL_SHAPE_FLAGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
    "num_query_groups", "kv_channels", "padded_vocab_size", "position_embedding_type",
    "swiglu", "normalization", "untie_embeddings_and_output_weights", "disable_bias_linear",
    "max_position_embeddings",
)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run; the message says why."""


def checkpoint_dir(root, iteration):
    return os.path.join(root, f"iter_{iteration:07d}")


def _layout():
    return (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_data_parallel_world_size(),
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
    dp = parallel_state.get_data_parallel_rank()
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


def _sharded_state_dict(args, model, optimizer, scheduler, iteration, consumed, with_rng,
                        loading=False, with_optimizer=True):
    # Megatron-LM's keys: "model", or "model0", "model1", ... with virtual stages (their
    # tensors carry global layer numbers, so a checkpoint reshards across layouts)
    model_sd = {_model_key(model, i): unwrap_model(chunk).sharded_state_dict()
                for i, chunk in enumerate(model)}
    state = {
        **model_sd,
        "opt_param_scheduler": scheduler.state_dict(),
        "iteration": iteration,
        "consumed_samples": consumed,
        "model_shape": {flag: getattr(args, flag) for flag in MODEL_SHAPE_FLAGS},
        "layout": list(_layout()),
    }
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd["model"] if len(model) == 1 else model_sd, is_loading=loading)
    if with_rng:
        state["rng_state"] = _rng_state()
    return state


def save_checkpoint(args, iteration, consumed_samples, model, optimizer, scheduler):
    path = checkpoint_dir(args.save, iteration)
    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    state = _sharded_state_dict(args, model, optimizer, scheduler, iteration, consumed_samples,
                                with_rng=True)
    dist_checkpointing.save(state, path)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        tmp = os.path.join(args.save, TRACKER_FILE + ".tmp")
        with open(tmp, "w") as handle:
            handle.write(str(iteration))
        os.replace(tmp, os.path.join(args.save, TRACKER_FILE))  # atomic: never a torn tracker
        print(f"  saved checkpoint at iteration {iteration} to {path}", flush=True)
    torch.distributed.barrier()


def _latest_iteration(root):
    tracker = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"--load {root}: {TRACKER_FILE} holds {text!r}, not an iteration")
    return int(text)


def load_checkpoint(args, model, optimizer, scheduler):
    """Restore a checkpoint. Returns (iteration, consumed_samples); (0, 0) if none exists."""
    iteration = _latest_iteration(args.load) if os.path.isdir(args.load) else None
    if iteration is None:
        # --load == --save is Megatron-LM's resume-or-start idiom; anything else is a mistake
        if args.exit_on_missing_checkpoint or os.path.abspath(args.load) != os.path.abspath(
                args.save or ""):
            raise SystemExit(f"error: --load {args.load}: no checkpoint there "
                             f"({TRACKER_FILE} missing); check the path or drop --load")
        if torch.distributed.get_rank() == 0:
            print(f"  no checkpoint in --load {args.load} yet; starting from scratch",
                  flush=True)
        return 0, 0
    path = checkpoint_dir(args.load, iteration)
    if not os.path.isdir(path):
        raise SystemExit(f"error: --load {args.load}: {TRACKER_FILE} names iteration "
                         f"{iteration} but {path} does not exist")
    common = dist_checkpointing.load_common_state_dict(path)
    saved_shape = common.get("model_shape", {})
    differ = [f"--{flag.replace('_', '-')} saved {saved_shape[flag]!r}, now "
              f"{getattr(args, flag)!r}"
              for flag in MODEL_SHAPE_FLAGS
              if flag in saved_shape and saved_shape[flag] != getattr(args, flag)]
    if differ:
        raise SystemExit(f"error: --load {path} holds another model shape: " + "; ".join(differ))
    same_layout = list(common.get("layout", [])) == list(_layout())
    load_rng = same_layout and not args.no_load_rng
    template = _sharded_state_dict(args, model, optimizer, scheduler, 0, 0, with_rng=load_rng,
                                   loading=True, with_optimizer=not args.no_load_optim)
    state = dist_checkpointing.load(template, path)
    for i, chunk in enumerate(model):
        unwrap_model(chunk).load_state_dict(state[_model_key(model, i)])
    if not args.no_load_optim:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["opt_param_scheduler"])
    else:
        optimizer.reload_model_params()  # fp32 main copies follow the loaded weights
    if load_rng:
        rng = state["rng_state"]
        random.setstate(rng["random"])
        np.random.set_state(rng["np"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        get_cuda_rng_tracker().set_states(rng["tracker"])
    if torch.distributed.get_rank() == 0:
        note = "" if same_layout else " (parallel layout changed: resharded, RNG not restored)"
        print(f"  loaded checkpoint from {path} at iteration {state['iteration']}{note}",
              flush=True)
    return state["iteration"], state["consumed_samples"]
