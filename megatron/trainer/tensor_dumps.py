"""Megatron-LM's --save-wgrads-interval and --save-params-interval: every N iterations each
model-parallel rank writes its parameters' names and gradients (``main_grad``, after the
data-parallel reduction) or values (after the optimizer step) to a file, so that two runs
can be compared tensor by tensor (e.g. Seq1F1B against 1F1B in the same layout).

Megatron-LM's layout and format: ``SAVE/wgrads/iter_0000005/mp_rank_00_001.pth`` (TP rank,
then the PP rank when PP > 1 and the EP rank when EP > 1), a ``torch.save`` of
``{"model_chunk0": {parameter name: CPU tensor}, ...}``, written by the ranks of expert
data-parallel rank 0. Here each file is written under a temporary name and renamed, so a
run stopped mid-write leaves no half-written file under the final name."""

import os

import torch
from megatron.core import parallel_state

from megatron.trainer.checkpointing import unwrap_model

LABELS = {"main_grad": "wgrads", "data": "params"}


def due(interval, iteration: int) -> bool:
    """Whether 1-indexed `iteration` writes the tensors of a --save-*-interval."""
    return interval is not None and iteration % interval == 0


def file_path(save_dir: str, label: str, iteration: int) -> str:
    """This rank's file, named as Megatron-LM names it."""
    name = f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{parallel_state.get_pipeline_model_parallel_rank():03d}"
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        name += f"_{parallel_state.get_expert_model_parallel_rank():03d}"
    return os.path.join(save_dir, label, f"iter_{iteration:07d}", name + ".pth")


def save_named_tensors(args, model, attribute: str, iteration: int) -> None:
    """Write each parameter's `attribute` ("main_grad" or "data") of every model chunk."""
    label = LABELS[attribute]
    if parallel_state.get_expert_data_parallel_rank() != 0:
        return
    tensors = {}
    for index, chunk in enumerate(model):
        tensors[f"model_chunk{index}"] = {
            name: getattr(param, attribute).detach().cpu().clone()
            for name, param in unwrap_model(chunk).named_parameters()
            if getattr(param, attribute, None) is not None}
    path = file_path(args.save, label, iteration)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = path + ".tmp"
    torch.save(tensors, partial)
    os.replace(partial, path)
    if torch.distributed.get_rank() == 0:
        print(f"  saved {label} of iteration {iteration} to {os.path.dirname(path)}",
              flush=True)
