"""Optional packages that megatron-core imports at start-up load on their first use.

megatron-core imports ``wandb`` at module level (its timers and inference engine, inside
``try: import wandb``) in every process, whether or not the run logs to Weights & Biases:
about 0.35 s of CPU per process on the CI machine, paid by every rank of every run. With
``install()``, the modules in ``LAZY`` are imported through a loader that defers running the module:
``import wandb`` still succeeds or fails as before (the package is found, or not, at
once), but its code runs when one of its names is first read, e.g. ``wandb.init`` under
``--wandb-project``.
"""

import copy
import importlib.abc
import importlib.machinery
import sys
import types

LAZY = ("wandb",)


class _DeferredModule(types.ModuleType):
    """A module whose code runs when a name it does not hold yet is first read.

    The import system's own attributes (``__spec__``, ``__path__``, ...) are set as for any
    module, so a second ``import wandb`` does not run it (``importlib.util.LazyLoader``
    does on Python 3.11: the import statement reads ``__spec__``)."""

    def __getattr__(self, name):
        if not self.run_deferred_code():
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        return getattr(self, name)

    def run_deferred_code(self) -> bool:
        """Run the module's code if it has not run yet; whether it ran now."""
        loader = self.__dict__.pop("_deferred_loader", None)
        if loader is None:
            return False
        loader.exec_module(self)
        return True


class _DeferredLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return _DeferredModule(spec.name)

    def exec_module(self, module):
        module.__dict__["_deferred_loader"] = self._loader


class _LazyFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in LAZY:
            return self._submodule_of_deferred(name)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec  # not installed (ImportError as before), or not plain Python source
        spec.loader = _DeferredLoader(spec.loader)
        return spec

    @staticmethod
    def _submodule_of_deferred(name):
        """``import wandb.sdk`` before any name of ``wandb`` was read: the package's code
        runs first (as it would have at its import), which may import the submodule
        itself; then that module object is the one returned, not a second copy."""
        package = sys.modules.get(name.partition(".")[0])
        if not isinstance(package, _DeferredModule) or not package.run_deferred_code():
            return None
        module = sys.modules.get(name)
        if module is None:
            return None  # the package did not import it: found and run as usual
        # the import system takes the spec of a module already in sys.modules from the
        # module: for the length of this import it names a loader that returns the module
        spec = copy.copy(module.__spec__)
        spec.loader = _AlreadyRun(module, module.__spec__)
        module.__spec__ = spec
        return spec


class _AlreadyRun(importlib.abc.Loader):
    def __init__(self, module, original_spec):
        self._module = module
        self._original_spec = original_spec

    def create_module(self, spec):
        return self._module

    def exec_module(self, module):
        module.__spec__ = self._original_spec


def install():
    """Before megatron-core is imported (a package already imported stays as it is)."""
    if not any(isinstance(finder, _LazyFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LazyFinder())
