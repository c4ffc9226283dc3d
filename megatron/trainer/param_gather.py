"""``--overlap-param-gather`` as Megatron-LM's training loop runs it.

With the distributed optimizer, each data-parallel rank updates only its shard of the
parameters; the other shards arrive by an all-gather. With ``overlap_param_gather``
megatron-core's DDP does not gather after ``optimizer.step()``: forward pre-hooks on
every module dispatch each bucket's all-gather lazily and wait for it just before the
module's next forward, so the gather overlaps the forward compute. Whenever parameters
are read outside a training forward, they must be gathered first, so the loop:

* keeps the hooks off for the first iteration (a bad checkpoint load or initialisation
  is not spread to every rank by a gather) and turns them on once a step succeeded;
* turns them off around evaluation, after one synchronous gather (``pause``/``resume``);
* gathers synchronously before a checkpoint save (``sync``);
* turns them off at the end, after one synchronous gather, so the final parameters are
  whole (``stop``).
"""


class ParamGatherHooks:
    """The forward pre-hooks of every model chunk; inert without overlapped gather."""

    def __init__(self, model):
        # megatron-core's DDP registers the hooks at construction when it uses them
        # (use_distributed_optimizer and overlap_param_gather)
        self.model = [chunk for chunk in model if getattr(chunk, "use_forward_hook", False)]
        self.enabled = bool(self.model)
        self.paused_enabled = None
        self._off(param_sync=False)  # the first iteration gathers nothing

    def step_succeeded(self):
        """After a successful optimizer step: from now on, forwards gather lazily."""
        self._on()

    def pause(self):
        """Before evaluation: parameters gathered now, hooks off until ``resume``."""
        self.paused_enabled = self.enabled
        self._off(param_sync=True)

    def resume(self):
        if self.paused_enabled:
            self._on()
        self.paused_enabled = None

    def sync(self):
        """Before a checkpoint save: the parameters of the last step, gathered."""
        for chunk in self.model:
            chunk.start_param_sync(force_sync=True)

    def stop(self):
        """After training: parameters gathered, hooks off."""
        self._off(param_sync=True)

    def _on(self):
        if not self.enabled:
            for chunk in self.model:
                chunk.enable_forward_pre_hook()
            self.enabled = bool(self.model)

    def _off(self, param_sync):
        if self.enabled:
            for chunk in self.model:
                chunk.disable_forward_pre_hook(param_sync=param_sync)
            self.enabled = False
