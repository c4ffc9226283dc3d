"""The Megatron-LM-like trainer: arguments, model, data, training loop, checkpoints."""

from megatron.trainer import lazy_fusions

# before any module of ours imports megatron-core: see lazy_fusions
lazy_fusions.install()
