"""Issue 22, items 6-8: the run's device and backend follow the flags (not whether a GPU
exists), and flag combinations that would fail or compute the wrong attention on a GPU
are refused up front. All decided as pure functions of the flags, so checked on CPU for a
hypothetical GPU machine (``cuda_available=True``)."""

import pytest
import torch

from megatron.trainer import device
from megatron.trainer.arguments import ArgumentError, parse_args
from megatron.trainer.model import transformer_config_from_args

GOOD = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--train-iters", "2", "--mock-data", "--vocab-size", "128",
        "--micro-batch-size", "1", "--global-batch-size", "1"]


def parse(extra, cuda):
    return parse_args(GOOD + extra, world_size=1, cuda_available=cuda)


@pytest.mark.parametrize("flags, cuda, expected", [
    ([], True, ("cuda", "nccl")),
    ([], False, ("cpu", "gloo")),
    (["--distributed-backend", "gloo"], True, ("cpu", "gloo")),  # a CPU run on a GPU machine
    (["--distributed-backend", "nccl"], True, ("cuda", "nccl")),
    (["--distributed-backend", "gloo"], False, ("cpu", "gloo")),
])
def test_device_and_backend_follow_the_flags(flags, cuda, expected):
    args = parse(flags, cuda)
    assert (args.device, args.distributed_backend) == expected


@pytest.mark.parametrize("flags, cuda, names", [
    (["--distributed-backend", "nccl"], False, ["--distributed-backend nccl"]),
    (["--bf16", "--distributed-backend", "gloo"], True, ["--bf16", "--distributed-backend gloo"]),
    (["--fp16"], False, ["--fp16"]),
    (["--attention-backend", "flash"], True, ["--attention-backend flash", "--bf16"]),  # fp32
    (["--reset-attention-mask", "--transformer-impl", "transformer_engine", "--bf16"], True,
     ["--reset-attention-mask", "--transformer-impl local"]),
])
def test_refusals_name_the_flags(flags, cuda, names):
    with pytest.raises(ArgumentError) as error:
        parse(flags, cuda)
    lines = str(error.value).splitlines()  # one line per problem
    assert any(all(name in line for name in names) for line in lines), lines


def test_flash_with_half_precision_on_cuda_passes():
    args = parse(["--attention-backend", "flash", "--bf16"], cuda=True)
    assert args.device == "cuda"


@pytest.fixture
def gpu_machine(monkeypatch):
    """A machine where CUDA looks present (nothing here touches a GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device, "_chosen", None)


def test_gloo_on_a_gpu_machine_builds_a_cpu_model(gpu_machine):
    args = parse(["--distributed-backend", "gloo"], cuda=True)
    config = transformer_config_from_args(args)
    assert config.use_cpu_initialization and not config.batch_p2p_sync
    device.use_device(args)
    assert not device.on_cuda() and device.compute_device() == torch.device("cpu")


def test_nccl_run_computes_on_cuda(gpu_machine):
    args = parse([], cuda=True)
    assert not transformer_config_from_args(args).use_cpu_initialization
    device.use_device(args)
    assert device.on_cuda()


@pytest.mark.parametrize("flags, patched", [(["--distributed-backend", "gloo"], True),
                                             ([], False)])
def test_cpu_patches_follow_the_run_device(gpu_machine, monkeypatch, flags, patched):
    """megatron-core's CUDA call sites are redirected for a gloo run on a GPU machine
    and left alone for a CUDA run: initialize passes the run's device to
    `cpu_support.apply`."""
    from megatron import cpu_support

    monkeypatch.setattr(cpu_support, "_APPLIED", True)  # as if patched: nothing is re-applied
    device.use_device(parse(flags, cuda=True))
    assert cpu_support.apply(cuda=device.on_cuda()) is patched
