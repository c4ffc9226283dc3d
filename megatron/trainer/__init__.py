"""The Megatron-LM-like trainer: arguments, model, data, training loop, checkpoints."""

from megatron.trainer import lazy_fusions, lazy_imports

# before any module of ours imports megatron-core: see lazy_fusions and lazy_imports
lazy_fusions.install()
lazy_imports.install()
