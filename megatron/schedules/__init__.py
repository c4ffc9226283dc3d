"""Pipeline schedules: megatron-core's, Seq1F1B and SlimPipe.

The public names, imported on first use (so that the pure schedule modules, e.g.
``megatron.schedules.actions`` for the planner, do not pull in megatron-core)::

    from megatron.schedules import forward_backward_pipelining_seq1f1b, get_forward_backward_func

``forward_backward_pipelining_seq1f1b`` takes megatron-core's schedule arguments (the
split settings from the model config or the ``settings`` keyword);
``get_forward_backward_func`` is megatron-core's dispatcher plus Seq1F1B and SlimPipe.
"""

_PUBLIC = {
    "forward_backward_pipelining_seq1f1b": "megatron.schedules.executor",
    "ScheduleSettings": "megatron.schedules.executor",
    "get_forward_backward_func": "megatron.schedules.dispatch",
    "ScheduleChoiceError": "megatron.schedules.registry",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'megatron.schedules' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_PUBLIC[name]), name)
