"""Suite-wide setup: multi-rank tests run over gloo on CPU, also on a GPU machine.

The distributed tests start real processes (torchrun over tests/dist_runner.py,
pretrain_gpt.py, torch.multiprocessing) and compare them with single-process CPU
references. On a GPU machine those processes would see the GPU, default to NCCL, and
2-4 ranks would share one device (NCCL: "Duplicate GPU detected"). So child processes
see no GPU (CUDA_VISIBLE_DEVICES is empty in the environment they inherit) and run on
gloo/CPU as on a laptop, while this process, which claimed its GPUs before the change,
still runs the CUDA tests on the device.
"""

import os

import torch

HIDDEN_FROM_CHILD_PROCESSES = ""  # CUDA_VISIBLE_DEVICES for child processes


def _claim_gpus_for_this_process():
    """Initialise CUDA here and cache the device count, so that emptying
    CUDA_VISIBLE_DEVICES afterwards changes only what child processes see (the driver
    and torch read it at initialisation; torch caches the count once initialised)."""
    if torch.cuda.is_available():
        torch.cuda.init()
        torch.cuda.device_count()


def pytest_configure(config):
    _claim_gpus_for_this_process()
    os.environ["CUDA_VISIBLE_DEVICES"] = HIDDEN_FROM_CHILD_PROCESSES
