"""Where the run computes (CUDA or CPU) and which process-group backend it uses,
decided once from the flags, and the precision/attention choices that depend on it."""


def device_problems(args, cuda_available: bool) -> list:
    """Fill ``args.distributed_backend``; return one line per flag problem (empty: fine)."""
    problems = []
    if args.bf16 and args.fp16:
        problems.append("--bf16 and --fp16 are mutually exclusive; pick one")
    if not cuda_available:
        if args.fp16:
            problems.append("--fp16 needs a CUDA GPU (CPU training runs in fp32); drop --fp16")
        if args.bf16:
            problems.append("--bf16 needs a CUDA GPU (CPU training runs in fp32); drop --bf16")
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda_available else "gloo"
    if not cuda_available and args.distributed_backend != "gloo":
        problems.append("--distributed-backend nccl needs CUDA GPUs; use "
                        "--distributed-backend gloo on CPU")
    return problems
