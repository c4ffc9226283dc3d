"""Megatron-LM's rerun engine (``--rerun-mode``), run by megatron-core's own state machine.

megatron-core's ``RerunStateMachine`` decides; this module only wires it into our loop
the way Megatron-LM's ``training.py`` does:

* ``initialize``: the machine, with the mode, the error injector
  (``--error-injection-rate/-type``), the tracker file and the model-parallel RNG
  tracker as the extra state a rerun restores (Megatron-LM's ``initialize.py``);
* ``wrap``: the training iterators become ``RerunDataIterator``s, so a rerun replays
  the iteration's microbatches;
* ``validating``: Megatron-LM's ``loss_func`` checks (NaN, Inf, and
  ``--check-for-spiky-loss``) on each microbatch's loss sum, in the forward pass. Under
  Seq1F1B a microbatch is validated whole, at its last split, with its splits' sums
  added, so a NaN in any split is seen;
* ``decision``: after ``should_run_forward_backward`` let go, what
  ``should_checkpoint_and_exit`` asks (a ``Decision``: save or not, the exit code, one
  line saying what was found and where); the loop saves and raises ``RerunStop``;
* ``checkpoint_state`` / ``load_template`` / ``restore``: the ``rerun_state_machine``
  entry of a checkpoint (Megatron-LM's ``checkpointing.py``).

The gradient checks (NaN/Inf per DDP bucket, ``--check-for-large-grads``) are
megatron-core's DDP's own, switched on in its config (``ddp_checks``).

One part is refused on CPU: a result that reproduces when rerun in place is, in
Megatron-LM, saved and the job exits 16 so that a scheduler reruns it on another GPU. A
CPU run has no other device (its rerun would land on the same one, and exit 16 again,
for ever), so it stops there, with Megatron-LM's final exit code 17, without saving.
"""

import logging
import sys
from dataclasses import dataclass
from functools import partial

import torch

from megatron import mcore_compat

_RSM = "rerun_state_machine:"
_MACHINE_LOGGER = "megatron.core.rerun_state_machine"  # its announcements and reports
# Megatron-LM's pretrain_gpt.py: a loss 10x the largest of the first 100 is spiky
SPIKY_LOSS_FACTOR = 10


def _names():
    """megatron-core's rerun names, each a row of mcore_compat.TABLE."""
    return {name: mcore_compat.get(_RSM + name) for name in (
        "RerunMode", "RerunDiagnostic", "RerunErrorInjector", "RerunState",
        "RerunDataIterator", "initialize_rerun_state_machine",
        "destroy_rerun_state_machine", "get_rerun_state_machine",
        "EXIT_CODE_RESUME_TO_DISAMBIGUATE", "EXIT_CODE_FAILED_ON_RESULT_VALIDATION")}


def machine():
    return _names()["get_rerun_state_machine"]()


def initialize(args):
    """A fresh machine for this run (one process may train several runs in turn)."""
    from megatron.core import tensor_parallel

    names = _names()
    names["destroy_rerun_state_machine"]()

    # as Megatron-LM: dropout's model-parallel RNG streams, but copied both ways.
    # set_states keeps the dict it is given and every fork() writes into it, so
    # Megatron-LM's version lets the rerun's forks overwrite the saved streams: the state
    # restored after the rerun (and saved for a rerun on another GPU) was the rerun's end.
    def state_save_func():
        return {"rng_tracker_states": dict(tensor_parallel.get_cuda_rng_tracker().get_states())}

    def state_restore_func(state):
        if state["rng_tracker_states"]:
            tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["rng_tracker_states"]))

    # megatron-core announces every machine it makes with a warning; a disabled one (this
    # trainer's default) is not news, and would be a second line beside a run's error line
    announcer = logging.getLogger(_MACHINE_LOGGER)
    level = announcer.level
    if args.rerun_mode == "disabled":
        announcer.setLevel(logging.ERROR)
    try:
        names["initialize_rerun_state_machine"](
            state_save_func=state_save_func,
            state_restore_func=state_restore_func,
            mode=names["RerunMode"](mcore_mode(args.rerun_mode)),
            error_injector=names["RerunErrorInjector"](
                error_injection_rate=args.error_injection_rate,
                error_injection_type=names["RerunDiagnostic"](args.error_injection_type)),
            result_rejected_tracker_filename=args.result_rejected_tracker_filename,
        )
    finally:
        announcer.setLevel(level)
    _show_stats(args.rerun_mode == "report_stats")


def _show_stats(on):
    """report_stats' report is megatron-core's INFO lines (rank 0, every 2 iterations),
    which no handler would print: give its logger one on stdout for the run."""
    log = logging.getLogger(_MACHINE_LOGGER)
    for handler in [h for h in log.handlers if getattr(h, "rerun_stats", False)]:
        log.removeHandler(handler)
    if on:
        handler = logging.StreamHandler(sys.stdout)
        handler.rerun_stats = True
        handler.setLevel(logging.INFO)
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def mcore_mode(flag):
    """Megatron-LM's flag value -> megatron-core's RerunMode value."""
    return "report_determinism_stats" if flag == "report_stats" else flag


def enabled(args):
    return args.rerun_mode != "disabled"


def wrap(iterators):
    """The training iterator(s) as RerunDataIterators (a list stays a list)."""
    wrapper = _names()["RerunDataIterator"]
    if isinstance(iterators, list):
        return [wrapper(iterator) for iterator in iterators]
    return wrapper(iterators)


def ddp_checks(args):
    """megatron-core DDP's gradient checks (before the data-parallel reduction), as
    Megatron-LM sets them. With --rerun-mode disabled the NaN/inf check stays
    faults.IterationGuard's (one collective stop naming the rank), not DDP's exception."""
    return {"check_for_nan_in_grad": enabled(args) and args.check_for_nan_in_loss_and_grad,
            "check_for_large_grads": args.check_for_large_grads}


def validating(args, forward_step_func):
    """``forward_step_func`` whose loss function validates each microbatch's local loss
    sum as Megatron-LM's ``loss_func`` does, in the forward pass (before the backward's
    gradient checks). Under Seq1F1B the loss function runs once per split: the splits'
    sums are added and the microbatch is validated at its last split, whole, so a NaN in
    any split is seen, and the machine sees one result per microbatch as unsplit."""
    partial_sums = {}  # microbatch -> loss sum of its splits so far

    def forward_step(data_iterator, model):
        output_tensor, loss_func = forward_step_func(data_iterator, model)
        split = getattr(data_iterator, "split", None)

        def validated_loss_func(output):
            result = loss_func(output)
            loss = result[2]["lm loss"].view(-1)[0]  # the reported (detached) loss sum
            if split is not None:
                loss = partial_sums.pop(split.microbatch_id, 0.0) + loss
                if not split.is_last:
                    partial_sums[split.microbatch_id] = loss
                    return result
            _validate_loss(args, loss)
            return result

        return output_tensor, validated_loss_func

    return forward_step


def _validate_loss(args, loss):
    rsm = machine()
    # disabled: the NaN/inf stop is faults.IterationGuard's (the machine would raise)
    if args.check_for_nan_in_loss_and_grad and enabled(args):
        rsm.validate_result(result=loss, rejection_func=torch.isnan,
                            message="found NaN in local forward loss calculation",
                            tolerance=0.0, fatal=True)
        rsm.validate_result(result=loss, rejection_func=torch.isinf,
                            message="found Inf in local forward loss calculation",
                            tolerance=0.0, fatal=True)
    if args.check_for_spiky_loss:
        rsm.validate_result(result=loss,
                            rejection_func=partial(rsm.is_unexpectedly_large,
                                                   threshold=SPIKY_LOSS_FACTOR,
                                                   context="loss"),
                            message="Spiky loss", tolerance=0.0, fatal=False)


def injection_pending():
    """The error injector's pending injection, None if none. A pass after which it is
    set and was not before injected a rejection: the line then says so (the value itself
    was fine)."""
    return machine().error_injector.injected_error_type


class RerunStop(Exception):
    """The machine ended the run: ``code`` is Megatron-LM's exit code, ``message`` the
    line rank 0 prints."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


@dataclass
class Decision:
    """What should_checkpoint_and_exit asked, in our terms."""

    checkpoint: bool
    code: int
    message: str


def decision(args, iteration, on_cuda, injected=False):
    """None to go on with the optimizer step; else a Decision (collective: every rank
    calls it after the rerun loop, and the machine's answer is the same on all)."""
    names = _names()
    rsm = machine()
    checkpoint, stop, code = rsm.should_checkpoint_and_exit()
    if not stop:
        return None
    found = _what_was_found(rsm, injected)
    states = names["RerunState"]
    again = names["EXIT_CODE_RESUME_TO_DISAMBIGUATE"]
    failed = names["EXIT_CODE_FAILED_ON_RESULT_VALIDATION"]
    head = f"--rerun-mode {args.rerun_mode}: iteration {iteration}: {found}"
    if rsm.state == states.RERUNNING_IN_PLACE:
        return Decision(checkpoint, code, (
            f"{head}, was not reproduced when the iteration was rerun in place on the same "
            f"rank: a transient fault. Stopped before the optimizer step (exit {code}, "
            f"Megatron-LM's); restart the job to resume from the last checkpoint."))
    if rsm.state == states.WILL_RERUN_FROM_CHECKPOINT and not on_cuda:
        return Decision(False, failed, (
            f"{head}, was reproduced when the iteration was rerun in place: not a transient "
            f"fault. Megatron-LM would save and exit {again} to rerun the iteration on "
            f"another GPU; a CPU run has no other device, so it stops here (exit {failed}) "
            f"without saving; lower --lr, add --clip-grad or check the data."))
    if rsm.state == states.WILL_RERUN_FROM_CHECKPOINT:
        saved = ("saved a checkpoint holding the rerun" if args.save else
                 "nothing saved (no --save), so the rerun cannot be resumed")
        return Decision(checkpoint, code, (
            f"{head}, was reproduced when the iteration was rerun in place; {saved} (exit "
            f"{code}, Megatron-LM's): resume the job on other GPUs to tell a faulty GPU from "
            f"a true result."))
    if rsm.state == states.RERUNNING_AGAIN_FROM_CHECKPOINT:
        return Decision(checkpoint, code, (
            f"{head}: the rerun from the checkpoint landed on the same node and GPU as the "
            f"first run (exit {code}): resume again from the same checkpoint on other GPUs."))
    return Decision(checkpoint, code, (  # rerun from the checkpoint on another GPU: final
        f"{head}: rerun from the checkpoint on another GPU, the diagnosis is final (see the "
        f"lines of megatron.core.rerun_state_machine above; exit {code})."))


def _what_was_found(rsm, injected):
    """'<message> on rank R (value V), rank R2 (...)', gathered from the ranks that saw it."""
    call = rsm.failed_validation_call
    mine = None
    if call is not None:
        value = rsm.initial_result
        value = value.item() if torch.is_tensor(value) else value
        kind = rsm.error_injector.error_injection_type.value
        how = (f"injected by --error-injection-type {kind}; the value was {value}"
               if injected else f"value {value}")
        mine = (call.caller.message, f"rank {torch.distributed.get_rank()} ({how})")
    found = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(found, mine)
    by_message = {}
    for entry in found:
        if entry is not None:
            by_message.setdefault(entry[0], []).append(entry[1])
    if not by_message:
        return "a result was rejected"
    return "; ".join(f"{message} on {', '.join(where)}" for message, where in by_message.items())


def checkpoint_state(args, data_iterator):
    """The checkpoint's rerun_state_machine entry (None: nothing to save), as
    Megatron-LM's save_checkpoint asks the machine for it."""
    if not enabled(args):
        return None
    return machine().state_dict(data_iterator=data_iterator, ckpt_format="torch_dist")


def pending(args, common_entry):
    """Whether a checkpoint's common rerun entry holds a rerun to resume: only
    WILL_RERUN_FROM_CHECKPOINT, the state Megatron-LM saves a rerun in. (megatron-core
    0.16.1 also saves after a transient fault, in RERUNNING_IN_PLACE; resuming that state
    fails inside the machine, and that checkpoint is an ordinary one: it loads as one.)"""
    if not enabled(args) or not isinstance(common_entry, dict):
        return False
    return common_entry.get("state") == _names()["RerunState"].WILL_RERUN_FROM_CHECKPOINT


def load_template():
    """The sharded part of a checkpoint's rerun entry as a load request: what the
    machine's state_dict gives with a rerun pending (its per-rank object under the same
    key and shape), whatever this run's mode and state."""
    rsm = machine()
    before = rsm.mode, rsm.state
    names = _names()
    rsm.mode = names["RerunMode"].VALIDATE_RESULTS
    rsm.state = names["RerunState"].WILL_RERUN_FROM_CHECKPOINT
    try:
        return rsm.state_dict(data_iterator=None, ckpt_format="torch_dist")
    finally:
        rsm.mode, rsm.state = before


def restore(loaded_entry):
    """Load a pending rerun into the machine (its next iteration reruns the saved one)."""
    machine().load_state_dict(loaded_entry)


def start_at(iteration):
    """The machine counts iterations from 0; after a load it continues from ours."""
    rsm = machine()
    if rsm.state == _names()["RerunState"].NOT_RUNNING_YET:
        rsm.current_iteration = iteration - 1
