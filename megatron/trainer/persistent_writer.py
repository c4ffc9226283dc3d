"""--use-persistent-ckpt-worker: one writer process per rank for the whole run.

megatron-core's ``PersistentAsyncCaller`` spawns its worker (re-importing the launching
script) and hands it the tensors through shared memory, where the worker copies them
device-to-host while the trainer waits. On CPU that copy is no copy (``.to("cpu")`` of a
CPU tensor is the tensor itself): the worker would write whatever training has made of
the parameters by then. This caller (megatron-core's ``AsyncCaller`` interface, used by
its ``AsyncCallsQueue``) forks its worker once, at the first save, and hands it copies
made in the trainer before training goes on: each write is a snapshot of its iteration.
The worker writes the saves in order and reports each; a worker that died counts as done,
and the finalization then finds its results missing (megatron-core's
``CheckpointException``: one line, as any failed write).
"""

import multiprocessing
import os
import queue
import signal

import torch


def _snapshot(value):
    """The write buckets with every tensor copied (training changes the originals)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    return value


def _loop(requests, done, setup, write_one):
    setup()  # dies with the trainer; its own group; ignores stop signals
    # a daemon (the trainer's exit never waits on it) whose writes start per-file
    # processes, which multiprocessing refuses to a daemon: this one may (they are its
    # group's, killed with it)
    multiprocessing.current_process()._config["daemon"] = False
    while True:
        item = requests.get()
        if item is None:
            return
        call, write, args, kwargs = item
        try:
            write_one(write, *args, **kwargs)
        finally:
            done.put(call)


class PersistentWriter:
    """One forked worker that writes every save of this rank, in order."""

    def __init__(self, setup, write_one):
        """``setup()`` prepares the worker process; ``write_one(write, *args, **kwargs)``
        runs one save's write there (async_save's, which the fault tests wrap)."""
        self._setup, self._write_one = setup, write_one
        self.process = None
        self._requests = self._done = None
        self._expected = []  # (call index, handed to the worker) in schedule order
        self._finished = []

    def schedule_async_call(self, request):
        handed = request.async_fn is not None
        if handed:
            args = list(request.async_fn_args)
            if request.preload_fn is not None:
                args[1] = request.preload_fn()
            args[1] = _snapshot(args[1])
            if self.process is None:
                context = multiprocessing.get_context("fork")
                self._requests, self._done = context.Queue(), context.Queue()
                self.process = context.Process(
                    target=_loop, args=(self._requests, self._done, self._setup,
                                        self._write_one),
                    daemon=True)
                self.process.start()
            self._requests.put((request.call_idx, request.async_fn, args,
                                request.async_fn_kwargs))
        self._expected.append((request.call_idx, handed))

    def _locally_done(self, blocking):
        call, handed = self._expected[0]
        while handed and call not in self._finished:
            try:
                self._finished.append(self._done.get(timeout=0.1 if blocking else 0.001))
                continue
            except queue.Empty:
                pass
            if not self.process.is_alive():
                return True  # died: the finalization reports the missing results
            if not blocking:
                return False
        return True

    def is_current_async_call_done(self, blocking=False, no_dist=False):
        local = self._locally_done(blocking)
        if no_dist:
            everywhere = local
        else:
            flag = torch.tensor([int(not local)], dtype=torch.int,
                                device=_reduce_device())
            torch.distributed.all_reduce(flag)
            everywhere = int(flag.item()) == 0
        if everywhere:
            call, _ = self._expected.pop(0)
            if call in self._finished:
                self._finished.remove(call)
        return everywhere

    def kill(self):
        """End the worker and what it forked (its own process group)."""
        if self.process is not None and self.process.is_alive():
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.process.kill()
            self.process.join()
        self.process = None
        for channel in (self._requests, self._done):
            if channel is not None:  # the exit must not wait to flush into a dead reader
                channel.cancel_join_thread()
                channel.close()
        self._requests = self._done = None

    def close(self, abort=False):
        if self.process is not None and self.process.is_alive() and not abort:
            self._requests.put(None)
            self.process.join(timeout=60)
        self.kill()


def _reduce_device():
    from megatron.trainer import device

    return device.compute_device()


