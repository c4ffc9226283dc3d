"""--async-save: the checkpoint's tensors are written in the background, as Megatron-LM does.

megatron-core's torch_dist strategy does the work: ``dist_checkpointing.save(...,
async_sharded_save=True)`` writes the common state at once and returns an
``AsyncRequest`` for the tensors, which megatron-core's ``AsyncCallsQueue`` runs in a
forked process (the fork is the snapshot: training goes on changing its own copy of the
parameters). The request's finalize functions, run on every rank when every rank's
writer is done, gather the write results and write ``.metadata`` (megatron-core's), then
publish the checkpoint (this project's, unchanged from a synchronous save: checksums,
rename of ``iter_N.incomplete/`` to ``iter_N/``, the tracker, --save-retain-interval).
So the tracker never names a checkpoint whose background write has not finished and
been verified.

``maybe_finalize`` is Megatron-LM's ``maybe_finalize_async_save``: every iteration
(non-blocking: publishes the saves whose writers are done), and blocking before the run
ends. A write that failed in the background (disk full, the writer killed) raises
megatron-core's ``CheckpointException`` on every rank there; it becomes the same one
line as a failed synchronous save, naming the checkpoint. A run that stops on an error
or a signal abandons what is in flight: the writers are killed and their
``iter_N.incomplete/`` removed; the tracker still names the last published checkpoint.
With --use-persistent-ckpt-worker one writer per rank serves the whole run
(persistent_writer.py).
"""

import contextlib
import ctypes
import functools
import inspect
import multiprocessing
import os
import signal
import threading

import torch

from megatron.trainer import save_failure, save_results_queue

_queue = None  # megatron-core's AsyncCallsQueue, made at the first asynchronous save
_pending = {}  # call index -> (iteration, staging directory) of a scheduled save
_finishing = [None]  # the save whose finalize functions run now (for a failure's line)
_persistent = None  # --use-persistent-ckpt-worker's writer (persistent_writer.py)


def _calls_queue(args):
    global _queue, _persistent
    if _queue is None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        _queue = AsyncCallsQueue(persistent=False)
        if args.use_persistent_ckpt_worker:  # one caller, its worker forked once
            from megatron.trainer.persistent_writer import PersistentWriter

            # writer looked up when called: the fault tests replace it after this
            _persistent = PersistentWriter(writer_setup, lambda *a, **k: writer(*a, **k))
            _queue._get_async_caller = lambda: _persistent
    return _queue


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _stop_signals_held():
    """SIGINT and SIGTERM wait while a writer or the queue's server is forked, then get
    the trainer's handlers. Without this, a Ctrl-C there raised in the trainer between
    the fork and megatron-core recording the writer (which abandon() then could not kill:
    the trainer's exit waited for it), and ran the trainer's handler in the child before
    its setup ignored the signal (a traceback from the writer). Held, the child starts
    with a handler that only records, until its setup ignores the signals."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers are the main thread's; the trainer forks its writers there
        return
    held = []
    previous = {signum: signal.signal(signum, lambda signum, frame: held.append(signum))
                for signum in _STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)  # as if it came now


def _queue_server_setup():
    """The results queue's server lives as long as its trainer (multiprocessing's server
    ignores SIGINT already): it ignores SIGTERM too, and dies with the trainer."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()


def use_forked_results_queue():
    """The writer runs in a forked process and hands its results back through
    megatron-core's module-level queue: a Manager queue (a pipe-backed one would block a
    writer with many results until the trainer reads it, which it does only after the
    writer ended). Forked, as Megatron-LM makes it for its persistent worker: a spawned
    Manager re-imports the launching script."""
    global _manager
    import queue
    from multiprocessing.managers import SyncManager

    current = save_results_queue.results_queue()
    if current is None or isinstance(current, queue.Queue):  # the synchronous save's
        _manager = SyncManager(ctx=multiprocessing.get_context("fork"))
        with _stop_signals_held():
            _manager.start(initializer=_queue_server_setup)
        save_results_queue.set_results_queue(_manager.Queue())


_manager = None  # the results queue's server process (kept: it stops when collected)


_pid_before_fork = [None]  # the forking process's pid, as the parent saw it


def _remember_forking_pid():
    _pid_before_fork[0] = os.getpid()


os.register_at_fork(before=_remember_forking_pid)


def _die_with_parent():
    """In a process forked for the save: end with the trainer (SIGKILL when it dies), so a
    killed run leaves no writer or queue server behind holding its output."""
    # the pid recorded before the fork, not getppid() here: the parent may be gone already
    parent = _pid_before_fork[0] if _pid_before_fork[0] is not None else os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: such a process may outlive the run
        return
    if os.getppid() != parent:  # the trainer died before prctl took effect
        os._exit(1)


def writer_setup():
    """In a writer process: the trainer decides what a stop signal does to its save (a
    SIGTERM handled by --exit-signal-handler lets it finish; Ctrl-C abandons it), so the
    writer ignores both instead of inheriting the trainer's handlers, in a process group
    of its own (abandoning the save ends its per-file writers too; a terminal's Ctrl-C no
    longer reaches it), and it dies with its trainer."""
    _die_with_parent()
    # and so do the per-file processes it forks (megatron-core 0.16 writes each file in
    # one): orphaned, one would block for ever on a full results pipe it holds both ends of
    os.register_at_fork(after_in_child=_die_with_parent)
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def writer(write, *args, **kwargs):
    """Runs one save's write in a writer process (set up by writer_setup)."""
    write(*args, **kwargs)


def _temporal_writer(write, *args, **kwargs):
    """The process megatron-core forks for one save."""
    writer_setup()
    writer(write, *args, **kwargs)


def strategy_kwargs():
    """megatron-core 0.19's save picks an async strategy, "nvrx" by default (it needs
    nvidia-resiliency-ext); megatron-core's own is "mcore", the only one on 0.16."""
    from megatron.core import dist_checkpointing

    params = inspect.signature(dist_checkpointing.save).parameters
    return {"async_strategy": "mcore"} if "async_strategy" in params else {}


def pending():
    """How many saves are scheduled and not yet published (the same on every rank)."""
    return 0 if _queue is None else _queue.get_num_unfinalized_calls()


def in_flight():
    """(iteration, staging directory) of every save scheduled and not yet published,
    oldest first: what a stop now abandons."""
    return sorted((info[0], info[1]) for info in _pending.values())


def schedule(args, iteration, staging, needed, request, publish, fail):
    """Run ``request``'s write in the background; ``publish()`` (collective) runs after
    megatron-core's own finalize functions once every rank's write is done; ``fail(error)``
    reports a failed write (save_failure's one line)."""
    info = (iteration, staging, needed, fail)
    if request.async_fn is not None and not args.use_persistent_ckpt_worker:
        request = request._replace(
            async_fn=functools.partial(_temporal_writer, request.async_fn))
    request.finalize_fns.insert(0, lambda: _finishing.__setitem__(0, info))
    request.finalize_fns.append(publish)
    with _stop_signals_held():  # the writer is forked here (the persistent one once)
        call = _calls_queue(args).schedule_async_request(request)
        _pending[call] = info
    if torch.distributed.get_rank() == 0:
        print(f"  scheduled an asynchronous checkpoint save at iteration {iteration} to "
              f"{staging}", flush=True)


def maybe_finalize(args, blocking=False):
    """Collective: publish the saves whose background writes are done on every rank
    (all of them, waiting, with ``blocking``). A failed write stops the run with one
    line (save_failure); raises SystemExit then."""
    if _queue is None or not _queue.get_num_unfinalized_calls():
        return
    if blocking and torch.distributed.get_rank() == 0:
        print(f"  waiting for {pending()} asynchronous checkpoint save(s) to finish",
              flush=True)
    _finishing[0] = None
    try:
        done = _queue.maybe_finalize_async_calls(blocking=blocking)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # torch's CheckpointException is a BaseException
        if _finishing[0] is None:
            raise
        _, staging, _, fail = _finishing[0]
        for other in _forget_all(kill=True):  # later saves, still being written
            if other != staging and torch.distributed.get_rank() == 0:
                save_failure.remove_partial(other)
        fail(error)
    for call in done:
        _pending.pop(call, None)


def _forget_all(kill):
    """Drop every scheduled save; ``kill``: end their writer processes first."""
    global _queue, _persistent
    if _persistent is not None:  # no save left for it (or abandoned): end the worker
        _persistent.kill()
        _persistent = None
    if _queue is not None and kill:
        for active in list(_queue.async_calls):
            process = getattr(active.async_caller, "process", None)
            if process is not None and process.is_alive():
                try:  # the writer and the per-file processes it forked: its group
                    os.killpg(process.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    process.kill()
                process.join()
    _queue = None
    staging = [info[1] for info in _pending.values()]
    _pending.clear()
    return staging


def abandon():
    """The run stops before its pending saves were published (an error, a signal): kill
    their writers and remove their iter_N.incomplete/ (rank 0); the tracker is
    untouched, so it still names the last published checkpoint."""
    if _queue is None and not _pending and _persistent is None:
        return
    for staging in _forget_all(kill=True):
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            save_failure.remove_partial(staging)
