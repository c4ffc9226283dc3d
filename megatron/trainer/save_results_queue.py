"""A synchronous save hands its write results back through an in-process queue.

megatron-core's torch_dist writer (``FileSystemWriterAsync``, used for synchronous saves
too) returns each rank's write results through a module-level queue that it makes on the
first save with ``multiprocessing.get_context("spawn").Manager().Queue()``: a server
process that re-imports the launching script (``pretrain_gpt.py``: torch and
megatron-core, about 2.5 s of CPU per rank on the CI machine), then stays up for the
rest of the run, one per rank. That process is there for asynchronous saves, whose write
runs in another process. A synchronous save puts its results and takes them in the
saving process (``write_preloaded_data_multiproc`` then ``retrieve_write_results``), so
a ``queue.Queue`` carries them without a process. An asynchronous save (async_save.py)
sets a forked Manager's queue instead; both reach megatron-core's private global through
its one ``mcore_compat`` row, here.
"""

import queue

from megatron import mcore_compat

# the one row both save paths reach megatron-core's results queue through
_ROW = "megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue"


def results_queue():
    """The queue megatron-core's writer will take for its results (None: none made yet)."""
    return mcore_compat.get(_ROW)


def set_results_queue(results) -> None:
    """Give megatron-core's writer ``results`` as its results queue."""
    mcore_compat.set_global(_ROW, results)


def use_in_process_results_queue() -> None:
    """Give megatron-core's writer an in-process results queue unless it has a queue
    already (one made for an asynchronous save is kept)."""
    if results_queue() is None:
        set_results_queue(queue.Queue())
