"""Helpers for the GPU-readiness tests (issue 22) that run on CPU."""

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that copy a value to the host, so on CUDA wait for the device (a
# "host sync"). Shapes that depend on values (nonzero, masked_select, boolean
# indexing) sync too.
_SYNC_METHODS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__",
                 "nonzero", "argwhere", "masked_select", "unique", "cpu", "numpy"}


class HostSyncCounter(TorchFunctionMode):
    """Counts the calls that would synchronise a CUDA stream with the host."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        index = args[1] if name == "__getitem__" and len(args) > 1 else None
        if name in _SYNC_METHODS or (torch.is_tensor(index) and index.dtype == torch.bool):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def relative_error(actual, reference):
    """Frobenius norm of the error over the reference's (float64)."""
    return ((actual.double() - reference).norm() / reference.norm()).item()
