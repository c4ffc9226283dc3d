"""Process groups from torchrun's environment, megatron-core parallel state and seeds."""

import datetime
import os
import random

import numpy as np
import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from megatron import cpu_support
from megatron.trainer import device


def initialize_distributed(args):
    """Create the default process group (torchrun's env) and megatron-core's groups."""
    device.use_device(args)  # the flags' device, before the CPU patches ask for it
    cpu_support.apply(cuda=device.on_cuda())
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if device.on_cuda():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=args.distributed_backend,
            world_size=world_size,
            rank=rank,
            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes),
        )
    # every group megatron-core creates (pipeline p2p, tensor, data, embedding ...) gets
    # the same timeout: its default of 30 minutes would let a hung peer stall the job
    parallel_state.initialize_model_parallel(
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
        # TP by default, as Megatron-LM (check_moe_args fills it in)
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        # Megatron-LM's rank orders: data parallelism outside pipelines by default,
        # pipelines outermost with --use-tp-pp-dp-mapping
        order="tp-cp-ep-pp-dp" if args.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp",
    )
    args.rank = rank


def set_seeds(seed: int, data_parallel_random_init: bool = False):
    """Megatron-LM's seeding: pipeline stages differ, TP ranks get their own stream; with
    --data-parallel-random-init data-parallel ranks differ too (their dropout; the weights
    are data-parallel rank 0's, broadcast after the model is built)."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    if data_parallel_random_init:
        seed += 10 * parallel_state.get_data_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel():
    """Drop megatron-core's groups and RNG tracker; the default process group stays."""
    from megatron.core.tensor_parallel import random as mp_random

    parallel_state.destroy_model_parallel()
    mp_random.initialize_rng_tracker(force_reset=True)


def destroy_default_group():
    """At the end of a training process (pretrain_gpt.py), stopped or not: a process group
    left up at interpreter exit keeps c10d threads running while C++ destructors run,
    which now and then aborts the process after its last line ("terminate called without
    an active exception", seen after a data check's one-line stop)."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def destroy_groups_except(keep=()):
    """Destroy every process group but the default one and those in `keep`.

    ``pretrain`` leaves the default group up so that one process can train several
    configurations, and megatron-core's ``destroy_model_parallel`` only forgets its
    groups: they stay registered in torch.distributed, and every gloo group keeps its
    I/O threads (some of them polling). Over a few dozen configurations in one process
    that is thousands of threads competing for the cores.
    """
    import gc

    from torch.distributed import distributed_c10d as c10d

    default = c10d._get_default_group()
    for group in list(c10d._world.pg_map.keys()):
        if group is not default and all(group is not k for k in keep):
            c10d.destroy_process_group(group)
    gc.collect()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
