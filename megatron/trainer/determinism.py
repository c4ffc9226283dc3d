"""--deterministic-mode with Megatron-LM's meaning (megatron/training/determinism.py):
the environment NCCL, cuBLAS and Transformer Engine read for reproducible kernels, and
torch's deterministic algorithms. A value set by the launcher that is known not to be
deterministic is refused; an unset one gets the canonical value."""

import torch

DEFAULTS = {
    "NCCL_ALGO": "Ring",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
}
NCCL_ALGOS = {"Ring", "CollnetDirect", "CollnetChain", "^NVLS"}  # Megatron-LM's accepted set
EXACT_VALUES = {
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": {"0"},
    "CUBLAS_WORKSPACE_CONFIG": {":4096:8", ":16:8"},
}


def environment_problems(env) -> list:
    """One line per environment variable that contradicts --deterministic-mode."""
    problems = []
    algo = env.get("NCCL_ALGO")
    if algo is not None:
        tokens = [t.strip() for t in algo.split(",") if t.strip()]
        if not tokens or any(t not in NCCL_ALGOS for t in tokens):
            problems.append(f"--deterministic-mode: NCCL_ALGO={algo!r} is not deterministic; "
                            f"unset it or use one of {sorted(NCCL_ALGOS)}")
    for name, accepted in EXACT_VALUES.items():
        value = env.get(name)
        if value is not None and value not in accepted:
            problems.append(f"--deterministic-mode: {name}={value!r} is not deterministic; "
                            f"unset it or use one of {sorted(accepted)}")
    return problems


def apply(env):
    """Before any NCCL communicator or cuBLAS handle exists: the canonical environment
    where unset, and torch's deterministic algorithms."""
    for name, value in DEFAULTS.items():
        env.setdefault(name, value)
    torch.use_deterministic_algorithms(True)
