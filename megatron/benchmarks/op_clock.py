"""Per-operator CPU time: torch.profiler's self times are wall-clock, so on a shared CPU
they count the waiting for a core as well as the work; this counts only the work.

A dispatch mode times every aten operator that reaches the CPU kernels (below autograd,
so forward and backward alike; a composite operator is timed through the operators it
decomposes into) with ``time.process_time``, this process's CPU time. The mode's own
Python per operator runs outside the timed interval.
"""

import time
from collections import defaultdict

from torch.utils._python_dispatch import TorchDispatchMode


class OpCpuTimes(TorchDispatchMode):
    """``seconds[op]`` / ``calls[op]`` per ``aten::name`` while active."""

    def __init__(self):
        super().__init__()
        self.seconds = defaultdict(float)
        self.calls = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = "aten::" + func.__name__.split(".")[0]
        start = time.process_time()
        out = func(*args, **(kwargs or {}))
        self.seconds[name] += time.process_time() - start
        self.calls[name] += 1
        return out
