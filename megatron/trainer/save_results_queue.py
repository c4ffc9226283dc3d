"""A synchronous save hands its write results back through an in-process queue.

megatron-core's torch_dist writer (``FileSystemWriterAsync``, used for synchronous saves
too) returns each rank's write results through a module-level queue that it makes on the
first save with ``multiprocessing.get_context("spawn").Manager().Queue()``: a server
process that re-imports the launching script (``pretrain_gpt.py``: torch and
megatron-core, about 2.5 s of CPU per rank on the CI machine), then stays up for the
rest of the run, one per rank. That process is there for asynchronous saves, whose write
runs in another process. A synchronous save puts its results and takes them in the
saving process (``write_preloaded_data_multiproc`` then ``retrieve_write_results``), so
a ``queue.Queue`` carries them without a process.
"""

import importlib
import queue

from megatron import mcore_compat

_ROW = "megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue"


def use_in_process_results_queue() -> None:
    """Give megatron-core's writer an in-process results queue unless it has a queue
    already (one made for an asynchronous save is kept)."""
    if mcore_compat.get(_ROW) is None:
        module = importlib.import_module(_ROW.split(":")[0])
        module._results_queue = queue.Queue()
