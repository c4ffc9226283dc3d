"""Seq1F1B and SlimPipe sequence-level pipeline parallelism on Megatron-Core."""
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).parent
REQUIREMENTS = [
    line.strip()
    for line in (HERE / "requirements.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#") and not line.startswith("pytest")
]

setup(
    name="seq1f1b-megatron",
    version="0.1.0",
    description="Sequence-level pipeline parallelism (Seq1F1B, SlimPipe) on Megatron-Core",
    license="BSD-3-Clause",
    python_requires=">=3.10",
    # `megatron` is a namespace package shared with megatron-core: list our own
    # subpackages only, never megatron/__init__.py, megatron/core or megatron/training.
    packages=[
        "megatron.trainer",
        "megatron.schedules",
        "megatron.seqsplit",
        "megatron.dataprep",
        "megatron.planner",
        "megatron.benchmarks",
    ],
    # our modules at the namespace's top (tests/test_packaging.py checks that the wheel
    # holds every module megatron/ has)
    py_modules=[
        "megatron.cpu_support",
        "megatron.mcore_compat",
        "megatron.model_shape",
        "megatron.pipeline_layers",
    ],
    install_requires=REQUIREMENTS,
    extras_require={"gpu": ["flash-attn", "transformer-engine"], "test": ["pytest", "pytest-xdist", "sentencepiece", "wandb"],
                    "sentencepiece": ["sentencepiece"]},
)
