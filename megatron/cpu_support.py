"""Run megatron-core on machines without CUDA (gloo, fp32).

megatron-core assumes CUDA in a handful of places on the training path. This
module neutralises exactly those call sites, each patch named after the
megatron-core module it answers, and is applied only for a CPU run:
``apply()`` returns at once on a GPU machine, so the GPU path never sees it.
``undo()`` puts every patched name back (``patched()`` is both as a context), so a
library user or a test can run megatron-core on CPU and leave it as it found it.

With it, pipeline, tensor and data parallel training runs over gloo on any
laptop or CI machine, which makes pipeline schedules debuggable without GPUs.
"""

import contextlib
import importlib
import importlib.metadata
import sys
import types

import torch

from megatron import mcore_compat

_APPLIED = False
_ORIGINALS = []  # (owner, attribute name, value before the patch), in patching order


def _patch(owner, name: str, value) -> None:
    """Set ``owner.name`` to ``value``, remembering the original for ``undo``."""
    _ORIGINALS.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


class _CpuStream:
    """A side stream on the CPU: work is already ordered, so every wait is a no-op
    (the MoE all-to-all dispatcher copies its split sizes device-to-host on one)."""

    def wait_stream(self, other):
        return None

    def record_event(self, *args, **kwargs):
        return self

    def synchronize(self):
        return None


class _CudaOnCpu(types.SimpleNamespace):
    """Stands in for ``torch.cuda`` inside one megatron-core module."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def synchronize(*args, **kwargs):
        return None

    @staticmethod
    def is_available():
        return False

    @staticmethod
    def empty_cache():
        return None

    @staticmethod
    def current_stream(*args, **kwargs):
        return None

    @staticmethod
    def default_stream(*args, **kwargs):
        return None

    @staticmethod
    def Stream(*args, **kwargs):  # noqa: N802 (torch.cuda.Stream)
        return _CpuStream()

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    # the rerun state machine saves and restores the "CUDA" generator around a rerun:
    # on CPU that is the CPU generator, which it also saves itself
    @staticmethod
    def get_rng_state(*args, **kwargs):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, *args, **kwargs):
        torch.set_rng_state(state)


def _cpu_device(device):
    if device is None:
        return None
    text = str(device)
    if text.startswith("cuda") or isinstance(device, int):
        return torch.device("cpu")
    return device


class _TorchOnCpu(types.ModuleType):
    """Stands in for ``torch`` inside one megatron-core module: tensors the module
    creates on ``device="cuda"`` (or ``torch.cuda.current_device()``) land on the CPU."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like",
                  "empty_like", "ones_like", "randn", "rand")

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CudaOnCpu()

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in self._FACTORIES:
            def factory(*args, _fn=attr, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _cpu_device(kwargs["device"])
                return _fn(*args, **kwargs)
            return factory
        return attr


def _redirect_torch(module_name: str):
    """Point a megatron-core module's global ``torch`` at the CPU stand-in."""
    module = importlib.import_module(module_name)
    _patch(module, "torch", _TorchOnCpu())


# --- megatron/core/tensor_parallel/random.py: the model-parallel RNG tracker ---------

def _patch_tensor_parallel_random():
    from megatron.core.tensor_parallel import random as mp_random

    class CpuRNGStatesTracker(mp_random.CudaRNGStatesTracker):
        """Same bookkeeping as megatron-core's tracker, over the CPU generator."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            original = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)

        @contextlib.contextmanager
        def fork(self, name=mcore_compat.get(
                "tensor_parallel.random:_MODEL_PARALLEL_RNG_TRACKER_NAME")):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            original = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(original)

    _patch(mp_random, "CudaRNGStatesTracker", CpuRNGStatesTracker)
    _patch(mp_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    _patch(mp_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    # torch.cuda.manual_seed & co. in model_parallel_cuda_manual_seed
    _patch(mp_random, "torch", _TorchOnCpu())


# --- megatron/core/optimizer/clip_grads.py: grads asserted to be torch.cuda.FloatTensor -

def _patch_clip_grads():
    from megatron.core.optimizer import clip_grads, optimizer

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        grads = []
        for param in parameters:
            grad = param.decoupled_grad if use_decoupled_grad else param.grad
            if grad is not None:
                grads.append(grad.detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            for grad in grads:
                grad.mul_(clip_coeff)

    _patch(clip_grads, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_fp32)
    _patch(optimizer, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_fp32)


# --- megatron/core/models/common/language_module/language_module.py: weight.data.cuda() --
# (tied embeddings are all-reduced between the first and last stage at model build)

@contextlib.contextmanager
def _tensor_cuda_stays_on_cpu():
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _patch_language_module():
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self, *args, **kwargs):
        with _tensor_cuda_stays_on_cpu():
            return original(self, *args, **kwargs)

    _patch(LanguageModule, "setup_embeddings_and_output_layer", setup_embeddings_and_output_layer)


# --- megatron/core/optimizer/distrib_optimizer.py: param.type() == 'torch.cuda.FloatTensor' --

@contextlib.contextmanager
def _cpu_tensor_types_read_as_cuda():
    original = torch.Tensor.type

    def type_(self, dtype=None, *args, **kwargs):
        if dtype is None:
            name = original(self)
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
        return original(self, dtype, *args, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _patch_distributed_optimizer():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.__init__

    def __init__(self, *args, **kwargs):
        with _cpu_tensor_types_read_as_cuda():
            original(self, *args, **kwargs)

    _patch(DistributedOptimizer, "__init__", __init__)


# --- megatron/core/transformer/moe/token_dispatcher.py: split sizes moved to host ------
# The all-to-all dispatcher hands its split sizes to all_to_all_single as numpy arrays,
# which maybe_move_tensor_to_cpu makes only from CUDA tensors: on CPU they would stay
# tensors, which all_to_all_single does not take.

def _patch_token_dispatcher():
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _patch(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)


# --- megatron/core/jit.py: jit_fuser is torch.compile -------------------------------------
# megatron-core decorates small routing helpers (the MoE router's expert-bias count, ...)
# with torch.compile at import. On CPU, inductor's C++ build of them costs 5-10 s per
# process, for kernels that gain nothing at CPU sizes: they run eagerly instead (the
# same operations; the eager ones are the reference the fused ones are checked against).

def _patch_jit_fuser():
    # megatron.trainer defers those decorations (megatron/trainer/lazy_fusions.py: eager
    # on CPU tensors) and never loads torch._dynamo, whose import costs ~1 s per process;
    # only where megatron-core was imported without it is there anything to disable
    if "torch._dynamo" not in sys.modules:
        return
    import torch._dynamo

    _patch(torch._dynamo.config, "disable", True)


# The megatron-core names patched above, each a row of mcore_compat.TABLE, and the
# modules of mcore_compat.CUDA_CALL_SITES: a version that lacks one, or changed its
# signature, stops `apply` with that row before anything is patched, instead of failing
# later in a CUDA call. No module is skipped: the table states on which versions each
# was checked.
_PATCHED_NAMES = (
    "tensor_parallel.random:CudaRNGStatesTracker.add",
    "tensor_parallel.random:CudaRNGStatesTracker.fork",
    "tensor_parallel.random:_get_cuda_rng_state",
    "tensor_parallel.random:_set_cuda_rng_state",
    "tensor_parallel.random:_MODEL_PARALLEL_RNG_TRACKER_NAME",
    "optimizer.clip_grads:clip_grad_by_total_norm_fp32",
    "optimizer.optimizer:clip_grad_by_total_norm_fp32",
    "models.common.language_module.language_module:"
    "LanguageModule.setup_embeddings_and_output_layer",
    "optimizer.distrib_optimizer:DistributedOptimizer.__init__",
    "transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu",
)


def _installed_mcore() -> str:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _check_patched_names() -> None:
    """Every megatron-core name and module this module patches, resolved and checked;
    CompatError naming the row and the installed megatron-core otherwise."""
    try:
        mcore_compat.require(*_PATCHED_NAMES)
        for module in mcore_compat.CUDA_CALL_SITES:
            mcore_compat.check(mcore_compat.cuda_call_site(module))
    except mcore_compat.CompatError as error:
        raise mcore_compat.CompatError(
            f"cannot run megatron-core {_installed_mcore()} on CPU: {error}; supported: "
            f"megatron-core{mcore_compat.SUPPORTED_MCORE}") from error


def apply(cuda: bool = None) -> bool:
    """Apply the CPU patches for a CPU run. Returns whether they are active.

    ``cuda``: whether the run computes on CUDA (the trainer passes its flags' choice:
    gloo on a GPU machine is a CPU run); None: whether CUDA is available."""
    global _APPLIED
    if cuda is None:
        cuda = torch.cuda.is_available()
    if cuda:
        return False
    if _APPLIED:
        return True
    _check_patched_names()
    _patch_tensor_parallel_random()
    _patch_clip_grads()
    _patch_language_module()
    _patch_distributed_optimizer()
    _patch_jit_fuser()
    _patch_token_dispatcher()
    for module_name in mcore_compat.CUDA_CALL_SITES:
        _redirect_torch("megatron.core." + module_name)
    _APPLIED = True
    return True


def undo() -> None:
    """Put back every megatron-core name ``apply`` replaced (last patched, first
    restored). Objects made while patched keep what they were made with (e.g. an RNG
    tracker built over the CPU generator)."""
    global _APPLIED
    while _ORIGINALS:
        owner, name, value = _ORIGINALS.pop()
        setattr(owner, name, value)
    _APPLIED = False


@contextlib.contextmanager
def patched(cuda: bool = None):
    """``apply(cuda)`` for the duration of a block, then ``undo()`` (if it applied)."""
    already = _APPLIED
    active = apply(cuda)
    try:
        yield active
    finally:
        if active and not already:
            undo()
