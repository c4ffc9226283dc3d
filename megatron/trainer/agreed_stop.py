"""Stops that every rank decides alike (a checkpoint that cannot be loaded, a vocabulary
the data does not fit, a non-finite loss): rank 0 says why in one line, and no rank exits
before rank 0 has said it.

Why the wait: a launcher that sees one rank fail stops the others (torchrun sends SIGTERM
at once), so a rank that exits first can end rank 0 before its line is out, and the job
fails with no reason given. Rank 0 marks the line said in the default group's store; the
other ranks wait for that mark, at most WAIT_FOR_RANK_ZERO_S (rank 0 may be gone).
"""

import datetime
import sys

import torch

WAIT_FOR_RANK_ZERO_S = 30
_said = 0  # stops said in this process: one process may train several configurations


class AgreedStop(SystemExit):
    """Raised alike on every rank (``rank``: this one). ``faults.stops_cleanly`` prints
    rank 0's line and exits every rank with ``code`` after it; caught elsewhere (a tool, a
    unit test) it is a plain SystemExit whose code is the line on rank 0."""

    def __init__(self, message, code=1, rank=None):
        rank = _rank() if rank is None else rank
        super().__init__(f"error: {message}" if rank == 0 else code)
        self.line = f"error: {message}"
        self.exit_code = code


def _rank():
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def stop_every_rank(line, code):
    """Rank 0 prints ``line`` (stderr); every rank then exits with ``code``, the others
    only once rank 0's line is out (or WAIT_FOR_RANK_ZERO_S has passed)."""
    global _said
    _said += 1
    key = f"seq1f1b/agreed_stop/{_said}"
    store = default_store()
    if _rank() == 0:
        print(line, file=sys.stderr, flush=True)
        if store is not None:
            try:
                store.set(key, "said")
            except Exception:  # the store's host is gone: nobody is waiting
                pass
    elif store is not None:
        try:
            store.wait([key], datetime.timedelta(seconds=WAIT_FOR_RANK_ZERO_S))
        except Exception:  # rank 0 died, hung or the store is gone: stop anyway
            pass
    sys.exit(code)


def default_store():
    """The default process group's store, or None (no group, or its host is gone)."""
    if not torch.distributed.is_initialized():
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None
