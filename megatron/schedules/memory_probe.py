"""Measure a pipeline stage's activation memory, on CPU as on GPU.

On CPU there is no allocator counter for "activations", so the probe counts what
activations are: the tensors autograd saved for backward that are still alive.
During every forward unit it installs ``saved_tensors_hooks`` that register each
saved tensor's storage (parameters excluded) with a reference count, released when
autograd drops the saved tensor after backward. At every unit boundary it samples
the bytes of live storages; the peak over an iteration is the stage's activation
peak (the KV cache across splits is included: its buffers are what split attention
saves). Each sample also keeps its wall-clock time (``time.time``, the clock of the
timeline recorder), so a memory-over-time curve can be drawn under the timeline. The KV cache is counted from the executor's store itself (buffers and
gradient accumulators, once each), so it is included even when a recomputing
checkpoint runs the first forward without saving anything. On GPU it also reports
``torch.cuda.max_memory_allocated``.

It is an executor observer (``on_unit_start`` / ``on_unit_end``). The planner predicts
the same quantity (``megatron.planner.predict.boundary_activation_peaks``, with
``tools/plan.py ... --gpu cpu`` for a CPU run); tests/test_planner_memory_probe.py keeps
the two within 3% per stage.
"""

import json
import os
import time
import weakref

import torch

from megatron.seqsplit.kv_cache import storage_id


class _Registry:
    """The storages saved tensors keep, each counted once, at its size *now*: megatron-
    core's ``CheckpointWithoutOutput`` (``--recompute-modules layernorm``, ``mla_up_proj``)
    frees an output's storage in place after the forward (resized to 0) while autograd
    still holds the tensor, and refills it when the backward recomputes it."""

    def __init__(self):
        self.refs = {}  # storage_id -> [count, a saved tensor on that storage]

    def add(self, key, tensor):
        entry = self.refs.get(key)
        if entry is None:
            self.refs[key] = [1, tensor]
        else:
            entry[0] += 1

    def drop(self, key):
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self.refs[key]

    def live_bytes(self, skip=frozenset()):
        return sum(tensor.untyped_storage().nbytes()
                   for key, (_, tensor) in self.refs.items() if key not in skip)


class _Saved:
    """What autograd keeps instead of the tensor; its death releases the storage."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class ActivationMemoryProbe:
    def __init__(self, model=None):
        self.registry = _Registry()
        self.excluded = set()
        if model is not None:
            self.exclude_parameters(model)
        self.peak_bytes = 0
        self.samples = []  # (unit string, live bytes, time.time()) at each unit boundary
        self._hooks = None
        self.kv_store = None

    def exclude_parameters(self, model):
        for param in model.parameters():
            self.excluded.add(storage_id(param))

    def reset(self):
        self.peak_bytes = self._live_bytes()
        self.samples = []
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage_id(tensor)
        if key in self.excluded or storage.nbytes() == 0:
            return tensor
        self.registry.add(key, tensor)
        holder = _Saved(tensor)
        weakref.finalize(holder, self.registry.drop, key)
        return holder

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def attach_kv_store(self, store):
        """Called by the executor at the start of each schedule with its KV-cache store."""
        self.kv_store = store

    def _live_bytes(self):
        if self.kv_store is None:
            return self.registry.live_bytes()
        return (self.registry.live_bytes(skip=self.kv_store.storage_ids())
                + self.kv_store.cached_bytes())

    def _sample(self, label):
        live = self._live_bytes()
        self.samples.append((label, live, time.time()))
        self.peak_bytes = max(self.peak_bytes, live)

    # executor observer interface
    def on_unit_start(self, rank, unit):
        self._sample(f"before {unit}")
        if unit.is_forward:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()

    def on_unit_end(self, rank, unit):
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        self._sample(str(unit))

    def report(self):
        # times relative to the first sample: it is taken as the iteration's first unit
        # starts, which is where a recorded timeline's rank-0 row starts too
        origin = self.samples[0][2] if self.samples else 0.0
        out = {"activation_peak_bytes": self.peak_bytes,
               "samples": [[label, live] for label, live, _ in self.samples],
               "sample_times": [when - origin for _, _, when in self.samples]}
        if torch.cuda.is_available():
            out["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated()
        return out


def write_stage_report(path, probe, pp_rank, group=None):
    """Gather every pipeline rank's report; the group's rank 0 writes one JSON file."""
    gathered = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, (pp_rank, probe.report()), group=group)
    if torch.distributed.get_rank(group) == 0:
        stages = [report for _, report in sorted(gathered, key=lambda item: item[0])]
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as handle:
            json.dump({"stages": stages}, handle)
