"""What stops a training run on purpose: non-finite values, SIGTERM, the wall clock, timeouts.

Megatron-LM's behaviour, in one collective per iteration: after the backward passes and
before ``optimizer.step()`` every rank contributes a few numbers (its loss sum, its
gradient sum, whether it received SIGTERM, whether --exit-duration-in-mins has passed)
to one ``all_gather``. Every rank then holds the same table and reaches the same
decision, so the whole job stops together: no rank waits for a peer that left.

* A non-finite loss or gradient stops the run before the optimizer applies it and
  before any checkpoint is written (``--check-for-nan-in-loss-and-grad``, on by
  default). The grad norm the optimizer returns is the same on every rank, so it is
  checked without a collective.
* SIGTERM with ``--exit-signal-handler`` (what SLURM preemption and torchrun send), and
  ``--exit-duration-in-mins``: finish the iteration, save, exit 0.
* A timed-out collective or p2p transfer (a peer stopped, dead or hung) becomes one line
  saying what the rank was doing when it timed out.
"""

import contextlib
import math
import os
import signal
import sys
import time

import torch

from megatron.core import parallel_state

from megatron.dataprep.sft_dataset import ConversationFileError
from megatron.trainer import async_save, device
from megatron.trainer.agreed_stop import AgreedStop, stop_every_rank
from megatron.trainer.rerun import RerunStop
from megatron.trainer.stop_signals import Interrupted, StopSignals


class NonFiniteError(RuntimeError):
    """A loss or gradient that is NaN or infinite; the message names where."""


class TrainingTimeout(RuntimeError):
    """A collective or p2p step outlived --distributed-timeout-minutes."""


class _SignalFlag:
    """Records --exit-signal instead of dying at once (--exit-signal-handler)."""

    def __init__(self, name):
        self.name = name
        self.received = False
        self._signum = getattr(signal, name)
        self._previous = signal.signal(self._signum, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def restore(self):
        signal.signal(self._signum, self._previous)


# columns of the per-rank row gathered every iteration
_LOSS, _GRAD, _SIGTERM, _OVERTIME, _PP, _TP, _DP = range(7)


class IterationGuard:
    """One all_gather per iteration decides, on every rank alike, whether to stop."""

    def __init__(self, args, start_time):
        self.args = args
        self.start_time = start_time
        self.check_values = args.check_for_nan_in_loss_and_grad
        # with fp16 loss scaling, overflowing gradients are expected: the optimizer skips
        # the step and lowers the scale (counted as skipped iterations), so only the
        # (unscaled) loss is checked
        self.check_grads = self.check_values and not args.fp16
        self.sigterm = _SignalFlag(args.exit_signal) if args.exit_signal_handler else None
        self.stop_signals = StopSignals(args)
        self.device = device.compute_device()

    @property
    def needed(self):
        return (self.check_values or self.sigterm is not None
                or self.args.exit_duration_in_mins is not None)

    def close(self):
        if self.sigterm is not None:
            self.sigterm.restore()
            self.sigterm = None
        self.stop_signals.restore()

    def check(self, iteration, losses_reduced, model):
        """Gather this iteration's health from every rank. Raises ``NonFiniteError`` on a
        non-finite loss or gradient; returns the reason to exit after this iteration
        (``"sigterm"``, ``"duration"``) or None."""
        if not self.needed:
            return None
        row = torch.zeros(7, dtype=torch.float64, device=self.device)
        if self.check_values and losses_reduced:
            row[_LOSS] = torch.stack([x["lm loss"].view(-1)[0].double()
                                      for x in losses_reduced]).sum()
        if self.check_grads:
            row[_GRAD] = _gradient_sum(model, self.device)
        row[_SIGTERM] = float(self.sigterm is not None and self.sigterm.received)
        minutes = (time.time() - self.start_time) / 60.0
        row[_OVERTIME] = float(self.args.exit_duration_in_mins is not None
                               and minutes > self.args.exit_duration_in_mins)
        row[_PP] = parallel_state.get_pipeline_model_parallel_rank()
        row[_TP] = parallel_state.get_tensor_model_parallel_rank()
        row[_DP] = parallel_state.get_data_parallel_rank()
        rows = [torch.empty_like(row) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(rows, row)
        table = torch.stack(rows).cpu().tolist()
        if self.check_values:
            _raise_on_non_finite(iteration, table)
        if any(r[_SIGTERM] for r in table):
            return "sigterm"
        if any(r[_OVERTIME] for r in table):
            return "duration"
        return None

    def check_grad_norm(self, iteration, grad_norm):
        """The optimizer's grad norm is reduced over the model: equal on every rank, so
        every rank raises alike without another collective."""
        if self.check_values and grad_norm is not None and not math.isfinite(grad_norm):
            raise NonFiniteError(
                f"grad norm is {grad_norm} at iteration {iteration} (every loss and gradient "
                f"was finite: the norm overflowed). {_NAN_ADVICE}")


_NAN_ADVICE = ("Stopped before the optimizer step, without saving. "
               "Lower --lr, add --clip-grad, or check the data; "
               "--no-check-for-nan-in-loss-and-grad turns this check off.")


def _gradient_sum(model, device):
    """Sum of every gradient this rank holds: NaN or inf if any element is (a finite
    sum of finite gradients stays finite in float64)."""
    sums = [param.main_grad.sum(dtype=torch.float64)
            for chunk in model for param in chunk.parameters()
            if getattr(param, "main_grad", None) is not None]
    return torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.float64,
                                                             device=device)


def _where(rank, row):
    return (f"rank {rank} (pipeline stage {int(row[_PP])}, tensor rank {int(row[_TP])}, "
            f"data rank {int(row[_DP])})")


def _raise_on_non_finite(iteration, table):
    problems = []
    for rank, row in enumerate(table):
        if not math.isfinite(row[_LOSS]):
            problems.append(f"lm loss {row[_LOSS]} on {_where(rank, row)}")
    for rank, row in enumerate(table):
        if not math.isfinite(row[_GRAD]):
            problems.append(f"gradients {row[_GRAD]} on {_where(rank, row)}")
            break  # every rank behind a bad loss has bad gradients: name the first
    if problems:
        raise NonFiniteError(f"non-finite values at iteration {iteration}: "
                             f"{'; '.join(problems)}. {_NAN_ADVICE}")


def _latest_checkpoint(args):
    """Where the last good state is, for the non-finite message."""
    from megatron.trainer.checkpointing import (MANIFEST_FILE, CheckpointError,
                                                checkpoint_dir, latest_iteration)

    try:
        iteration = latest_iteration(args.save) if args.save else None
    except CheckpointError:
        iteration = None
    if iteration is None:
        return "No checkpoint of this run was saved."
    # only a checkpoint whose files were verified is known good: one loaded without its
    # checksums.json (--load-unverified-checkpoint) may hold what went wrong
    if not os.path.isfile(os.path.join(checkpoint_dir(args.save, iteration), MANIFEST_FILE)):
        return (f"The latest checkpoint, iteration {iteration} in --save {args.save}, is "
                f"unverified (no {MANIFEST_FILE}): it may hold the bad values; an earlier "
                f"one may be the last good state.")
    return f"The last good state is the checkpoint of iteration {iteration} in --save {args.save}."


def timeout_error(error, step, args):
    """A ``TrainingTimeout`` naming what this rank was doing, if ``error`` is a
    torch.distributed timeout; None otherwise."""
    text = str(error)
    if "timed out" not in text.lower() and "timeout" not in text.lower():
        return None
    detail = text.strip().splitlines()[-1] if text.strip() else type(error).__name__
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return TrainingTimeout(
        f"rank {rank}: {step} did not complete within --distributed-timeout-minutes "
        f"{args.distributed_timeout_minutes:g}: a peer rank is stopped, dead or hung "
        f"(check its log and its node); the job stops. ({detail.strip()[:300]})")


def _publish_saves_in_flight(args):
    """--async-save: the saves still being written hold earlier iterations' states, each
    checked finite before its step, so a non-finite stop (raised alike on every rank)
    waits for them and publishes them instead of abandoning them. A write that fails has
    already said so in its own line; the stop goes on."""
    try:
        async_save.maybe_finalize(args, blocking=True)
    except SystemExit:
        pass


def _abandoned_saves():
    """What a stop does to the asynchronous saves still being written (--async-save): they
    are abandoned (the trainer's exit kills their writers and removes their directories)."""
    saves = async_save.in_flight()
    if not saves:
        return ""
    many = len(saves) > 1
    iterations = " and ".join(str(iteration) for iteration, _ in saves)
    directories = ", ".join(staging for _, staging in saves)
    return (f"; the asynchronous save{'s' if many else ''} of iteration{'s' if many else ''} "
            f"{iterations}, still being written, {'are' if many else 'is'} abandoned and "
            f"{directories} removed")


def _interrupted(args, progress, signum):
    """Every rank stops; rank 0 says where and what is saved. Exit 0 with
    --exit-signal-handler-for-training (Megatron-LM's orderly shutdown), else 128 + the
    signal number, as a shell reports a process ended by it."""
    name = signal.Signals(signum).name
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    code = 0 if args.exit_signal_handler_for_training else 128 + signum
    if rank == 0:
        advice = ("" if args.exit_signal_handler and args.exit_signal == name else
                  f" To finish the iteration and save on {name}, pass --exit-signal-handler"
                  + (f" --exit-signal {name}" if name != "SIGTERM" else ""))
        print(f"{'error' if code else 'note'}: {name} received during {progress.step}: "
              f"stopped without saving{_abandoned_saves()}. {_latest_checkpoint(args)}"
              f"{advice}", file=sys.stderr, flush=True)
    sys.exit(code)


@contextlib.contextmanager
def stops_cleanly(args, progress, guard=None):
    """Turn the run's deliberate stops into one line and a non-zero exit: an agreed stop
    (a checkpoint that cannot load, a data problem) or a non-finite value (every rank
    raises alike; rank 0 prints, the others exit after it: agreed_stop), a timed-out distributed step (each
    rank that timed out prints its own line: it names the rank and what it was doing),
    SIGINT (Ctrl-C; also SIGTERM with --exit-signal-handler-for-training)."""
    stop_signals = guard.stop_signals if guard is not None else None
    try:
        yield
    except AgreedStop as stop:  # raised alike on every rank (a checkpoint load, the data)
        stop_every_rank(stop.line, stop.exit_code)
    except NonFiniteError as error:
        _publish_saves_in_flight(args)
        stop_every_rank(f"error: {error} {_latest_checkpoint(args)}", 1)
    except RerunStop as stop:  # --rerun-mode: every rank stops alike, with Megatron-LM's code
        stop_every_rank(f"error: {stop} {_latest_checkpoint(args)}", stop.code)
    except Interrupted as interrupt:
        _interrupted(args, progress, interrupt.signum)
    except ConversationFileError as error:  # --sft: a record read on this rank failed
        # (a DataLoader worker's error comes with its traceback: its last line says it)
        line = str(error).strip().splitlines()[-1]
        print(f"error: {line.split('ConversationFileError: ')[-1]}", file=sys.stderr,
              flush=True)
        sys.exit(1)
    except RuntimeError as error:  # DistBackendError and gloo's errors are RuntimeErrors
        if stop_signals is not None and stop_signals.settle():
            # a peer stopping on the same signal closed its connections first
            _interrupted(args, progress, stop_signals.received)
        timeout = timeout_error(error, progress.step, args)
        if timeout is None:
            raise
        print(f"error: {timeout}", file=sys.stderr, flush=True)
        sys.exit(1)
