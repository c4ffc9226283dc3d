"""The optimizers --optimizer chooses (megatron-core builds them): which run here, what
each keeps per parameter, and the state megatron-core does not give SGD."""

# Megatron-LM's other --optimizer choices -> why they stop the run here
UNSUPPORTED_OPTIMIZERS = {
    name: ("needs NVIDIA's emerging-optimizers package (Python >= 3.12), which this "
           "project neither installs nor tests; use --optimizer adam or sgd")
    for name in ("muon", "dist_muon", "adaptive_muon", "lion", "soap")}


def optimizer_problems(args):
    if args.optimizer in UNSUPPORTED_OPTIMIZERS:
        return [f"--optimizer {args.optimizer} is not supported here: "
                f"{UNSUPPORTED_OPTIMIZERS[args.optimizer]}"]
    if args.optimizer == "sgd" and args.use_distributed_optimizer:
        # megatron-core's DistributedOptimizer asserts Adam (its checkpoint format)
        return ["--optimizer sgd does not run with --use-distributed-optimizer: "
                "megatron-core's distributed optimizer supports Adam only; drop one"]
    return []


def optimizer_states(args) -> int:
    """fp32 state tensors the optimizer keeps per parameter: Adam's m and v, SGD's
    momentum buffer (none at --sgd-momentum 0)."""
    if args.optimizer == "adam":
        return 2
    return 1 if args.sgd_momentum else 0


def give_sgd_momentum_buffers(optimizer):
    """Zero momentum buffers for SGD from the start, so that every checkpoint (also one
    saved before the first step) holds them and a load has a state to load into.

    megatron-core gives SGD no ``init_state_fn`` (0.16.1 to 0.19.2): loading any SGD
    checkpoint failed in it ("'NoneType' object is not callable"). A zero buffer steps
    exactly as torch's missing one (dampening 0: buffer = momentum x 0 + gradient)."""
    def fill(inner, config=None):
        for group in inner.param_groups:
            if group["momentum"] == 0:
                continue  # torch's SGD keeps no state then
            for param in group["params"]:
                inner.state[param].setdefault("momentum_buffer", param.new_zeros(param.shape))

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if part.optimizer is None:  # a stage without parameters of this kind
            continue
        fill(part.optimizer)
        part.init_state_fn = fill
