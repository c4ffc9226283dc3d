"""megatron-core's fused functions load torch's compiler on their first call, not at import.

megatron-core decorates its fused bias/activation functions with ``jit_fuser``, which is
``torch.compile``, while it imports. ``torch.compile`` compiles on the first call anyway,
but the decoration itself imports ``torch._dynamo`` and ``torch._inductor``: about 1.4 s of
CPU in every process that imports megatron-core (a third of that import on CPU), paid also
by runs that never call a fused function (CPU runs: the fusions are off there); 0.19's MoE
router also decorates a method with ``@torch.compile`` (3 s there). With ``install()``, the
modules in ``DEFERRED`` see ``compile_on_first_call`` as ``torch.compile`` while they
execute, which calls ``torch.compile`` with the same options when the decorated function
first runs with CUDA tensors: what is compiled there, and when, is unchanged. With CPU
tensors the function runs eagerly: inductor's C++ build of each costs seconds per process
(5-12 s for the MoE router's helpers) for kernels that gain nothing at CPU sizes, and the
eager operations are the reference the fused ones are checked against. ``torch.compile``
itself is restored right after each module, for all other code.
"""

import functools
import importlib.abc
import importlib.machinery
import sys

# torch is imported where it is used: megatron.trainer installs this hook on import, and
# pretrain_gpt.py checks the command line before torch loads (arguments.check_flags_early)

# the megatron-core modules that call torch.compile while they import (absent ones: no-op)
DEFERRED = (
    "megatron.core.jit",  # jit_fuser = torch.compile, the fused bias/activation functions
    "megatron.core.transformer.moe.router",  # 0.19: @torch.compile _compiled_topk_routing
)


def compile_on_first_call(model=None, **options):
    """``torch.compile``'s signature; a function is compiled when it is first called with
    CUDA tensors, and runs eagerly on CPU tensors."""
    import torch

    if model is None:  # the @torch.compile(mode=...) form
        return functools.partial(compile_on_first_call, **options)
    if isinstance(model, torch.nn.Module):
        return _torch_compile()(model, **options)
    compiled = None

    @functools.wraps(model)
    def call(*args, **kwargs):
        nonlocal compiled
        if not on_cuda(args, kwargs):
            return model(*args, **kwargs)
        if compiled is None:
            compiled = _torch_compile()(model, **options)
        return compiled(*args, **kwargs)

    return call


def on_cuda(args, kwargs) -> bool:
    """Whether a call's tensors are on a CUDA device (its compiled form is run then)."""
    import torch

    return any(torch.is_tensor(value) and value.is_cuda
               for value in (*args, *kwargs.values()))


def _torch_compile():
    import torch

    return _original_compile or torch.compile


_original_compile = None  # torch.compile while a DEFERRED module executes


class _SwapCompileLoader(importlib.abc.Loader):
    """Executes a module with ``torch.compile`` swapped for ``compile_on_first_call``."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        import torch

        global _original_compile
        if _original_compile is not None:  # one DEFERRED module importing another
            return self._loader.exec_module(module)
        _original_compile = torch.compile
        torch.compile = compile_on_first_call
        try:
            self._loader.exec_module(module)
        finally:
            torch.compile, _original_compile = _original_compile, None

    def __getattr__(self, name):  # get_source, get_filename, ...: the file loader's
        return getattr(self._loader, name)


class _DeferredModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in DEFERRED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _SwapCompileLoader(spec.loader)
        return spec


def install():
    """Before megatron-core is imported (a no-op once it is): see the module's docstring."""
    if any(isinstance(finder, _DeferredModuleFinder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _DeferredModuleFinder())
