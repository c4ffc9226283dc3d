"""A synchronous save starts no Manager process for megatron-core's write results."""

import multiprocessing.context
import queue

import pytest

from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.trainer import save_results_queue


def _writers_queue():
    """The queue megatron-core's torch_dist writer takes for its results (its getter is
    private on 0.16 and public on 0.19)."""
    getter = (getattr(filesystem_async, "get_write_results_queue", None)
              or filesystem_async._get_write_results_queue)
    return getter()


def test_the_writer_takes_an_in_process_queue_and_starts_no_process(monkeypatch):
    monkeypatch.setattr(filesystem_async, "_results_queue", None)

    def no_manager(*args, **kwargs):
        raise AssertionError("a Manager process was started for the write results")

    monkeypatch.setattr(multiprocessing.context.BaseContext, "Manager", no_manager)
    with pytest.raises(AssertionError, match="Manager process"):
        _writers_queue()  # what megatron-core does on its own
    save_results_queue.use_in_process_results_queue()
    results = _writers_queue()
    assert isinstance(results, queue.Queue)
    results.put({"written": 1})  # the writer's put, then retrieve_write_results' get_nowait
    assert results.get_nowait() == {"written": 1}


def test_a_queue_already_made_is_kept(monkeypatch):
    made = object()  # e.g. a Manager queue an asynchronous save made
    monkeypatch.setattr(filesystem_async, "_results_queue", made)
    save_results_queue.use_in_process_results_queue()
    assert filesystem_async._results_queue is made
