"""A checkpoint save that fails (disk full, quota, a read-only or vanished directory).

The user gets one line naming the directory, the iteration, the space the checkpoint
needs and the space free; the partial ``iter_N.incomplete/`` is removed (it would keep
the disk full, and the resumed run would fail at the same save); the previous checkpoint
and the tracker are untouched (the tracker only moves after a complete save).

A failure need not reach every rank the same way: rank 0 may fail writing
``common.pt`` before any collective of the save, while the other ranks wait inside
torch's checkpoint collectives. A collective to agree on the failure could then meet the
wrong peer, so the ranks agree through the process group's key-value store instead: the
first rank to fail counts itself there, prints the line and exits; the others are
released by their peer's exit (a closed connection) or by torchrun ending them, see the
count and exit without a second line.

A save that the free space will not hold is warned about before it starts.
"""

import errno
import os
import shutil
import sys

import torch

from megatron.trainer.agreed_stop import default_store

_STORE_PREFIX = "seq1f1b/save_failed"


def checkpoint_bytes(args, model, latest):
    """About how many bytes a checkpoint of this run takes (collective: every rank calls
    it): the parameters' bytes times what the optimizer keeps per parameter; on rank 0 the size of
    the latest checkpoint (``latest``, a directory) instead where there is one."""
    from megatron.core import parallel_state

    from megatron.trainer import device
    from megatron.trainer.optimizers import optimizer_states

    local = 0
    # data- and context-parallel replicas save once
    if parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0:
        params = sum(p.numel() for chunk in model for p in chunk.parameters())
        # weights as trained, the optimizer's fp32 states (and fp32 main weights with
        # bf16/fp16)
        per_param = (2 + 4 if (args.bf16 or args.fp16) else 4) + 4 * optimizer_states(args)
        local = params * per_param
    total = torch.tensor([float(local)], dtype=torch.float64, device=device.compute_device())
    torch.distributed.all_reduce(total)
    if torch.distributed.get_rank() == 0 and latest is not None and os.path.isdir(latest):
        return sum(os.path.getsize(os.path.join(latest, name)) for name in os.listdir(latest)
                   if os.path.isfile(os.path.join(latest, name)))
    return int(total.item())


def free_bytes(directory):
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def size_text(count):
    if count is None:
        return "unknown"
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if count < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1000.0


def warn_if_short(args, iteration, needed, rank):
    """Rank 0: one warning line when the free space will not hold the checkpoint."""
    free = free_bytes(args.save)
    if rank == 0 and free is not None and free < needed:
        print(f"  warning: --save {args.save} has {size_text(free)} free but the checkpoint "
              f"of iteration {iteration} needs about {size_text(needed)}: the save will "
              f"likely fail; free space or point --save elsewhere", flush=True)


def _chain(error):
    """``error`` and the exceptions it wraps (torch's failures, causes, contexts)."""
    seen, stack = set(), [error]
    while stack:
        current = stack.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        for wrapped in getattr(current, "failures", {}).values():
            stack.append(wrapped[0] if isinstance(wrapped, tuple) else wrapped)
        stack += [current.__cause__, current.__context__]


def advice_for(error, text):
    """What a failed save's line tells the user to do. An OSError is the disk's (or the
    file system's); another error (an assertion inside the checkpoint code) is no reason
    to free space. torch's writers may keep only its name or errno in their own message
    ("Worker failure: ... <class 'OSError'>")."""
    disk = ("[Errno" in text or "OSError" in text
            or any(isinstance(current, OSError) for current in _chain(error)))
    if disk:
        return "free space or point --save elsewhere, then resume"
    return ("the disk is not the cause (an error inside the checkpoint code: please report "
            "it with the command line); resume")


def cause(error):
    """(rank, text): the rank torch's CheckpointException names as failing (None if it
    names none) and the root cause in a few words (an OSError's errno if there is one,
    found through torch's wrapped exceptions and exception chains)."""
    failures = getattr(error, "failures", None) or {}
    rank = min(failures) if failures else None
    first = None
    for current in _chain(error):
        if isinstance(current, OSError) and current.errno is not None:
            where = f": {current.filename}" if current.filename else ""
            return rank, f"[Errno {current.errno}] {current.strerror}{where}"
        if first is None and not hasattr(current, "failures"):
            first = current
    first = first or error
    text = str(first).strip().splitlines()
    return rank, f"{type(first).__name__}: {text[-1][:200] if text else ''}".rstrip(": ")


def _first_failure(iteration, store):
    """Count this rank's failure in the store; True if it is the first of this save."""
    if store is None:
        return True
    try:
        return store.add(f"{_STORE_PREFIX}/{iteration}", 1) == 1
    except Exception:
        return True


def already_failed(iteration):
    """Whether another rank has counted a failure of this save (this rank's own error is
    then its consequence: a peer gone, the directory removed)."""
    store = default_store()
    if store is None:
        return False
    try:
        return store.add(f"{_STORE_PREFIX}/{iteration}", 0) > 0
    except Exception:
        return False


def remove_partial(staging):
    """Remove the partial checkpoint (idempotent: every failing rank tries)."""
    for _ in range(3):  # another rank may still be creating files in it
        shutil.rmtree(staging, ignore_errors=True)
        if not os.path.lexists(staging):
            return


def fail(args, iteration, staging, error, needed, previous, tracker):
    """Stop this rank after a failed save: the first failing rank prints the line at once.
    Raises SystemExit(1)."""
    rank, text = cause(error)
    rank = torch.distributed.get_rank() if rank is None else rank
    # torch's save raises the failure's details on its coordinator only; elsewhere its
    # exception names no rank: the coordinator speaks
    consequence = already_failed(iteration) or getattr(error, "failures", None) == {}
    first = not consequence and _first_failure(iteration, default_store())
    remove_partial(staging)
    if not first:
        raise SystemExit(1)
    full = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
    free = free_bytes(args.save)
    kept = (f"the checkpoint of iteration {previous} and {tracker} are intact"
            if previous is not None else "no earlier checkpoint was saved")
    advice = advice_for(error, text)
    # printed now, not as the SystemExit's message at interpreter exit: the other ranks
    # exit at once, and a launcher that sees them fail (torchrun) could end this rank first
    print(f"error: checkpoint save of iteration {iteration} into --save {args.save} failed "
          f"on rank {rank}: {text} (the checkpoint needs about {size_text(needed)}, "
          f"{size_text(free)} free{'; the disk is full' if full else ''}); removed "
          f"{staging}; {kept}: {advice} with --load {args.save}", file=sys.stderr, flush=True)
    raise SystemExit(1)
