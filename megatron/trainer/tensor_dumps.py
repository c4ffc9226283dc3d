"""Megatron-LM's --save-wgrads-interval and --save-params-interval: every N iterations each
model-parallel rank writes its parameters' names and gradients (``main_grad``, after the
data-parallel reduction) or values (after the optimizer step) to a file, so that two runs
can be compared tensor by tensor (e.g. Seq1F1B against 1F1B in the same layout).

--save-activations-interval and --save-dgrads-interval (Megatron-LM's too) write, for every
linear layer and router, the inputs and outputs of its forward, or the gradients of those,
for the iteration's last microbatch (Megatron-LM's hooks keep each module's last call; a
bias returned beside a layer's output is a parameter, whose gradient the wgrads hold).
Under sequence splits a microbatch's calls are its splits': they are joined along the
sequence (dim 0 of megatron-core's [s, b, h] layout and of the routers' [s * b, ...]
token rows), so the files equal an unsplit run's (``ActivationHooks``).

Megatron-LM's layout and format: ``SAVE/wgrads/iter_0000005/mp_rank_00_001.pth`` (TP rank,
then the PP rank when PP > 1 and the EP rank when EP > 1), a ``torch.save`` of
``{"model_chunk0": {parameter name: CPU tensor}, ...}``, written by the ranks of expert
data-parallel rank 0. Here each file is written under a temporary name and renamed, so a
run stopped mid-write leaves no half-written file under the final name."""

import os
from collections import defaultdict

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.router import Router
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.seqsplit.split_context import SplitContext
from megatron.trainer.checkpointing import unwrap_model

LABELS = {"main_grad": "wgrads", "data": "params"}
# the modules whose tensors Megatron-LM's activation and dgrad logging keep (its local-spec
# ones; Transformer Engine's layers are not built here)
LOGGED_TYPES = (torch.nn.Linear, torch.nn.Embedding, ColumnParallelLinear, RowParallelLinear,
                Router)


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
    tensors = {}
    for index, chunk in enumerate(model):
        tensors[f"model_chunk{index}"] = {
            name: getattr(param, attribute).detach().cpu().clone()
            for name, param in unwrap_model(chunk).named_parameters()
            if getattr(param, attribute, None) is not None}
    _write(args, LABELS[attribute], iteration, tensors)


def _write(args, label, iteration, tensors):
    """This rank's file of ``label`` (the ranks of expert data-parallel rank 0 write, as
    Megatron-LM's), under a temporary name first."""
    if parallel_state.get_expert_data_parallel_rank() != 0:
        return
    path = file_path(args.save, label, iteration)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = path + ".tmp"
    torch.save(tensors, partial)
    os.replace(partial, path)
    if torch.distributed.get_rank() == 0:
        print(f"  saved {label} of iteration {iteration} to {os.path.dirname(path)}",
              flush=True)


class ActivationHooks:
    """Forward hooks (and, for dgrads, gradient hooks on the tensors they see) on every
    logged module of ``model``, keyed by the microbatch and split they ran in: the
    model's forward and each transformer layer's (which a recomputation runs again in
    backward) name their SplitContext; without one (megatron-core's own 1F1B) each call
    is one whole microbatch and the last one is kept, as in Megatron-LM."""

    def __init__(self, model, activations: bool, dgrads: bool):
        self.activations = defaultdict(dict) if activations else None
        self.dgrads = defaultdict(dict) if dgrads else None
        self._unit = None
        self._calls = 0  # numbers the calls without a split, so the last one wins
        self._sequence_dim = {}  # key -> the dim its splits join along
        self._handles = []
        for index, chunk in enumerate(model):
            inner = unwrap_model(chunk)
            self._handles.append(inner.register_forward_pre_hook(self._enter, with_kwargs=True))
            for name, module in inner.named_modules():
                if isinstance(module, TransformerLayer):
                    self._handles.append(
                        module.register_forward_pre_hook(self._enter, with_kwargs=True))
                if isinstance(module, LOGGED_TYPES):
                    self._handles.append(module.register_forward_hook(
                        self._logger(f"model_chunk{index}", name, module), with_kwargs=True))

    def _enter(self, module, args, kwargs):
        split = kwargs.get("packed_seq_params")
        if isinstance(split, SplitContext) and split.num_splits > 1:
            self._unit = (split.microbatch_id, split.split_index)
        elif not isinstance(module, TransformerLayer):  # a whole microbatch's forward
            self._calls += 1
            self._unit = (self._calls, 0)

    def _logger(self, chunk, name, module):
        # an embedding's ids and rows are [b, s, ...]; the rest megatron-core's [s, b, ...]
        # or token rows in sequence order
        dim = 1 if isinstance(module, torch.nn.Embedding) else 0

        def hook(module, args, kwargs, output):
            unit = self._unit or (0, 0)
            tensors = [(f"input{i}", value) for i, value in enumerate(args)]
            tensors += [(f"output{i}", value) for i, value in enumerate(
                output if isinstance(output, tuple) else (output,))]
            tensors += list(kwargs.items())
            for label, value in tensors:
                if not isinstance(value, torch.Tensor):
                    continue
                key = f"{name}/{label}"
                # a parameter (a layer's bias returned beside its output) is the same in
                # every split: kept once, not joined
                self._sequence_dim[key] = None if isinstance(value, torch.nn.Parameter) else dim
                if self.activations is not None:
                    _keep(self.activations[chunk], key, unit, value)
                # a parameter's gradient is in the wgrads; a hook on it would outlive these
                if (self.dgrads is not None and value.requires_grad
                        and not isinstance(value, torch.nn.Parameter)):
                    value.register_hook(
                        lambda grad, chunk=chunk, key=key, unit=unit:
                        _keep(self.dgrads[chunk], key, unit, grad))
        return hook

    def remove(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def last_microbatch(self, kept):
        """{chunk: {key: tensor}}: each key's last microbatch, its splits joined in order."""
        joined = {}
        for chunk, keys in kept.items():
            joined[chunk] = {}
            for key, units in keys.items():
                last = max(microbatch for microbatch, _ in units)
                parts = [units[unit] for unit in sorted(units) if unit[0] == last]
                dim = self._sequence_dim[key]
                joined[chunk][key] = (parts[-1] if len(parts) == 1 or dim is None else
                                      torch.cat(parts, dim=dim))
        return joined


def _keep(kept, key, unit, tensor):
    """Keep ``tensor`` of ``unit`` (microbatch, split) for ``key`` when it is of the latest
    microbatch seen there (an earlier one's are dropped: only the last is written)."""
    units = kept.setdefault(key, {})
    latest = max((microbatch for microbatch, _ in units), default=unit[0])
    if unit[0] < latest:
        return
    if unit[0] > latest:
        units.clear()
    units[unit] = tensor.detach().cpu()


def start_activation_hooks(args, model, iteration):
    """The hooks of this iteration's --save-activations-interval / --save-dgrads-interval,
    or None when neither is due."""
    activations = due(args.save_activations_interval, iteration)
    dgrads = due(args.save_dgrads_interval, iteration)
    return ActivationHooks(model, activations, dgrads) if activations or dgrads else None


def save_activation_hooks(args, hooks, iteration):
    """Write what ``hooks`` kept (Megatron-LM's files: SAVE/activations/iter_N/ and
    SAVE/dgrads/iter_N/, as the wgrads) and remove them."""
    hooks.remove()
    for label, kept in (("activations", hooks.activations), ("dgrads", hooks.dgrads)):
        if kept is not None:
            _write(args, label, iteration, hooks.last_microbatch(kept))
