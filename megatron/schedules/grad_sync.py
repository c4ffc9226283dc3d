"""When data-parallel gradient reduction may start under a split schedule, as
megatron-core's schedules decide it (``--overlap-grad-reduce``)."""

import contextlib

from megatron.schedules.actions import Unit


class GradSync:
    """When the data-parallel gradient reduction may start, as megatron-core's schedules
    decide it (``--overlap-grad-reduce``: megatron-core's DDP launches each bucket's
    reduction from the backward hooks once sync is on; ``finalize_model_grads`` waits).

    ``config.no_sync_func`` is active for every backward unit of this rank except the
    last one of each model chunk: with splits the last microbatch has one backward unit
    per split, and only its final one (split 0) may sync, so the reductions start while
    the rest of the pipeline still runs but only once every gradient is complete. A
    list of ``no_sync`` (one per chunk, as Megatron-LM sets it for virtual stages) is
    left chunk by chunk; one shared ``no_sync`` is left for each chunk's last unit and
    entered again after it, as megatron-core's interleaved schedule does. With
    ``config.grad_sync_func`` (Megatron-LM's align-grad-reduce) the hooks stay off and
    it is called for each chunk right after that chunk's last backward unit.
    """

    def __init__(self, config, chunks, actions):
        self.chunks = chunks
        self.final = {}  # chunk -> its last backward unit on this rank
        self.last = None  # the last backward unit of all
        for action in actions:
            if isinstance(action, Unit) and not action.is_forward:
                self.final[action.chunk] = self.last = action
        self.no_sync = config.no_sync_func or contextlib.nullcontext
        self.per_chunk = isinstance(self.no_sync, list)
        if self.per_chunk and len(self.no_sync) != len(chunks):
            raise ValueError(f"config.no_sync_func has {len(self.no_sync)} entries for "
                             f"{len(chunks)} model chunks")
        grad_sync_func = config.grad_sync_func
        if grad_sync_func is not None and not isinstance(grad_sync_func, list):
            grad_sync_func = [grad_sync_func] * len(chunks)
        self.grad_sync_func = grad_sync_func
        self.entered = {}  # chunk index (or None: the shared one) -> entered no_sync
        for key in (range(len(chunks)) if self.per_chunk else [None]):
            if self.final:  # forward-only runs have no backward and keep sync as it is
                self._enter(key)

    def _enter(self, key):
        context = self.no_sync[key]() if self.per_chunk else self.no_sync()
        context.__enter__()
        self.entered[key] = context

    def _leave(self, key):
        context = self.entered.pop(key, None)
        if context is not None:
            context.__exit__(None, None, None)

    def before_backward(self, unit: Unit):
        if self.grad_sync_func is None and self.final.get(unit.chunk) == unit:
            self._leave(unit.chunk if self.per_chunk else None)

    def after_backward(self, unit: Unit):
        if self.final.get(unit.chunk) != unit:
            return
        if self.grad_sync_func is not None:
            self.grad_sync_func[unit.chunk](self.chunks[unit.chunk].parameters())
        elif not self.per_chunk and unit != self.last:
            self._enter(None)  # the other chunks' gradients are not complete yet

    def close(self):
        for key in list(self.entered):
            self._leave(key)
