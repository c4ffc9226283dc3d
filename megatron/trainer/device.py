"""Where the run computes (CUDA or CPU) and which process-group backend it uses,
decided once from the flags, and the precision/attention choices that depend on it.

The flags decide, not ``torch.cuda.is_available()``: on a GPU machine
``--distributed-backend gloo`` is a CPU run (model, batches, buffers and megatron-core's
CUDA call sites all on the CPU), so CPU runs and tests behave the same on a laptop and
on a GPU node. ``validate_args`` fills ``args.device``; ``initialize_distributed`` calls
``use_device(args)`` once, and code without ``args`` at hand asks ``compute_device()``.
"""

import importlib

_HALF_ATTENTION_BACKENDS = ("flash",)  # kernels without an fp32 variant

_chosen = None  # "cuda" or "cpu", set by use_device; None: not initialised (tools, tests)


def choose_device(distributed_backend, cuda_available: bool) -> str:
    """"cuda" or "cpu" for a run with this --distributed-backend (None: not given).

    gloo means CPU even where a GPU exists (gloo's GPU collectives are not what this
    trainer uses); nccl means CUDA; no flag means CUDA when there is one."""
    if distributed_backend == "gloo":
        return "cpu"
    if distributed_backend == "nccl":
        return "cuda"
    return "cuda" if cuda_available else "cpu"


def device_problems(args, cuda_available: bool) -> list:
    """Fill ``args.distributed_backend`` and ``args.device``; return one line per flag
    problem (empty: fine)."""
    problems = []
    if args.bf16 and args.fp16:
        problems.append("--bf16 and --fp16 are mutually exclusive; pick one")
    if not cuda_available and args.distributed_backend == "nccl":
        problems.append("--distributed-backend nccl needs CUDA GPUs; use "
                        "--distributed-backend gloo on CPU")
    args.device = choose_device(args.distributed_backend, cuda_available)
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cpu":
        problems += _cpu_precision_problems(args, cuda_available)
    problems += _attention_problems(args)
    return problems


def _cpu_precision_problems(args, cuda_available):
    if cuda_available:  # a GPU is there, but --distributed-backend gloo runs on the CPU
        why = ("runs on the CUDA device, but --distributed-backend gloo runs on the CPU "
               "in fp32; use --distributed-backend nccl or drop {flag}")
    else:
        # megatron-core's mixed-precision optimizer accepts CUDA tensors only (tried: a
        # TypeError at optimizer construction), so a CPU run cannot be bf16 or fp16
        why = ("needs a CUDA GPU: megatron-core's mixed-precision optimizer takes CUDA "
               "tensors only (CPU training runs in fp32); drop {flag}")
    return [f"{flag} " + why.format(flag=flag)
            for flag, used in (("--fp16", args.fp16), ("--bf16", args.bf16)) if used]


def _attention_problems(args):
    """Attention choices that would fail at the first forward, or silently compute the
    wrong attention, refused before any work starts."""
    problems = []
    backend = getattr(args, "attention_backend", "auto")
    half = args.bf16 or args.fp16
    # (on CPU, the model build refuses it: flash-attn does not import there)
    if backend in _HALF_ATTENTION_BACKENDS and args.device == "cuda" and not half:
        problems.append(f"--attention-backend {backend} runs in fp16/bf16 only (flash-attn "
                        "has no fp32 kernels); add --bf16 or use --attention-backend auto")
    if (getattr(args, "transformer_impl", "local") == "transformer_engine"
            and getattr(args, "reset_attention_mask", False)):
        problems.append("--reset-attention-mask with --transformer-impl transformer_engine "
                        "would ignore document boundaries (its core attention gets no "
                        "per-document cu_seqlens here); use --transformer-impl local")
    return problems


class _LazyTorch:
    """torch, imported on first use: the flag checks (device_problems) run before torch
    loads (arguments.check_flags_early)."""

    def __getattr__(self, name):
        return getattr(importlib.import_module("torch"), name)


torch = _LazyTorch()


def use_device(args) -> None:
    """Make ``args.device`` (from ``validate_args``) the process's compute device."""
    global _chosen
    _chosen = getattr(args, "device", None) or choose_device(
        getattr(args, "distributed_backend", None), torch.cuda.is_available())


def on_cuda(args=None) -> bool:
    """Whether the run computes on CUDA: ``args.device`` when given and validated, else
    the process's ``use_device`` choice, else (tools, tests) whether CUDA exists."""
    chosen = getattr(args, "device", None) or _chosen
    return chosen == "cuda" if chosen is not None else torch.cuda.is_available()


def compute_device() -> "torch.device":
    """The device for this process's model, batches and buffers."""
    if on_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
