"""The pipeline schedules by name: the one table that the command line
(``--pipeline-schedule``), the library's ``get_forward_backward_func``, the executor,
the lowering and the planner read.

``resolve`` turns what a caller asked for (a schedule name or none, split and slice
counts, a balance method) into the schedule that runs, with the command line's rules:
a name that is not in the table, or a combination that the command line refuses,
raises ``ScheduleChoiceError`` naming the valid choices, in the library too.
``rank_units`` gives every rank's compute units of a named schedule, the list the
executor lowers and runs and the planner times.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

from megatron.schedules import interleaved, seq1f1b, slimpipe
from megatron.schedules.actions import Unit
from megatron.seqsplit.split_lengths import BALANCE_METHODS  # --seq1f1b-balance-method


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule."""

    name: str  # --pipeline-schedule's value and the library's schedule= keyword
    summary: str  # one line for --help and error messages
    splits_microbatches: bool  # runs microbatches as sequence splits (slices)
    # the planner's name for this schedule over virtual stages (None: same name)
    interleaved_name: Optional[str] = None


SCHEDULES: Dict[str, Schedule] = {s.name: s for s in (
    Schedule("1f1b", "megatron-core's 1F1B on whole microbatches (interleaved with virtual "
                     "stages)", splits_microbatches=False, interleaved_name="interleaved-1f1b"),
    Schedule("seq1f1b", "Seq1F1B: each microbatch in --seq1f1b-splits splits (interleaved "
                        "with virtual stages)", splits_microbatches=True,
             interleaved_name="interleaved-seq1f1b"),
    Schedule("slimpipe", "SlimPipe: uniform --slimpipe-slices over virtual stages",
             splits_microbatches=True),
)}
NAMES = tuple(SCHEDULES)


class ScheduleChoiceError(ValueError):
    """An unknown schedule name or a combination of schedule settings that cannot run."""


def get(name: str) -> Schedule:
    """The schedule called ``name``; ``ScheduleChoiceError`` naming the choices otherwise."""
    if name not in SCHEDULES:
        raise ScheduleChoiceError(f"unknown pipeline schedule {name!r}: choose one of "
                                  f"{', '.join(NAMES)}")
    return SCHEDULES[name]


def planner_names() -> tuple:
    """tools/plan.py's ``--schedule`` choices: every schedule and its interleaved name."""
    return NAMES + tuple(s.interleaved_name for s in SCHEDULES.values() if s.interleaved_name)


def resolve(schedule: Optional[str] = None, *, seq1f1b_splits: int = 1,
            slices_flag: Optional[str] = None, balance_method: str = "average",
            attention_balance: bool = False) -> str:
    """The schedule that runs for these settings, by the command line's rules (its
    messages name the command-line flags; the library's keywords have the same names
    with underscores: ``schedule`` is ``--pipeline-schedule``).

    ``slices_flag``: the flag that gave SlimPipe slices (``--slimpipe-slices`` or
    ``--slimpipe-slice-length``), None if none. No name: ``slimpipe`` when slices are
    given, ``seq1f1b`` with more than one split, else ``1f1b``. Raises
    ``ScheduleChoiceError`` for an unknown name or balance method and for what the
    command line refuses: splits under ``1f1b``, slices outside ``slimpipe``, Seq1F1B
    splits or a balance method other than ``average`` under ``slimpipe``, attention
    balance outside ``slimpipe``. The slice count itself is checked where it is known
    (``check_slimpipe_shape``, the command line's slice flags)."""
    if schedule is None:
        schedule = ("slimpipe" if slices_flag is not None
                    else "seq1f1b" if seq1f1b_splits > 1 else "1f1b")
    if schedule not in SCHEDULES:
        raise ScheduleChoiceError(f"unknown pipeline schedule {schedule!r} "
                                  f"(--pipeline-schedule): choose one of {', '.join(NAMES)}")
    if balance_method not in BALANCE_METHODS:
        raise ScheduleChoiceError(f"unknown --seq1f1b-balance-method {balance_method!r}: "
                                  f"choose one of {', '.join(BALANCE_METHODS)}")
    if seq1f1b_splits < 1:
        raise ScheduleChoiceError(f"--seq1f1b-splits must be >= 1, got {seq1f1b_splits}")
    if schedule == "1f1b" and seq1f1b_splits != 1:
        raise ScheduleChoiceError(
            f"--pipeline-schedule 1f1b runs whole microbatches but --seq1f1b-splits is "
            f"{seq1f1b_splits}; drop --seq1f1b-splits or use --pipeline-schedule seq1f1b")
    if schedule != "slimpipe":
        if slices_flag is not None:
            raise ScheduleChoiceError(
                f"{slices_flag} belongs to --pipeline-schedule slimpipe, not "
                f"--pipeline-schedule {schedule}; drop it or use --pipeline-schedule slimpipe")
        if attention_balance:
            raise ScheduleChoiceError(
                f"--slimpipe-attention-balance belongs to --pipeline-schedule slimpipe, not "
                f"--pipeline-schedule {schedule}")
        return schedule
    if seq1f1b_splits != 1:
        raise ScheduleChoiceError(
            f"--seq1f1b-splits {seq1f1b_splits} does not combine with --pipeline-schedule "
            "slimpipe (its slices replace Seq1F1B's splits); drop --seq1f1b-splits or use "
            "--pipeline-schedule seq1f1b")
    if balance_method != "average":
        raise ScheduleChoiceError(
            f"SlimPipe slices are uniform; --seq1f1b-balance-method {balance_method} does not "
            "apply: drop it or use --pipeline-schedule seq1f1b")
    return schedule


def rank_units(name: str, pp_size: int, num_microbatches: int, num_chunks: int,
               num_splits: int, group_size: Optional[int] = None,
               forward_only: bool = False) -> List[List[Unit]]:
    """Every rank's compute units of the schedule ``name`` (``num_splits``: its splits or
    slices per microbatch; 1F1B is Seq1F1B with one split).

    ``1f1b`` and ``seq1f1b``: one chunk runs ``megatron.schedules.seq1f1b``'s order;
    virtual stages run megatron-core's interleaved order over splits
    (``megatron.schedules.interleaved``, with ``group_size``). ``slimpipe``:
    ``megatron.schedules.slimpipe`` (a group is one microbatch)."""
    get(name)
    if name == "slimpipe":
        if forward_only:
            return [slimpipe.slimpipe_forward_only_units(num_microbatches, num_chunks,
                                                         num_splits)] * pp_size
        return slimpipe.slimpipe_schedule(pp_size, num_microbatches, num_chunks, num_splits)
    if num_chunks == 1:
        if forward_only:
            return [seq1f1b.forward_only_rank_units(num_microbatches, num_splits)] * pp_size
        return seq1f1b.seq1f1b_schedule(pp_size, num_microbatches, num_splits)
    if forward_only:
        return [interleaved.interleaved_forward_only_units(
            num_microbatches, num_chunks, num_splits, pp_size, group_size)] * pp_size
    return interleaved.interleaved_schedule(pp_size, num_microbatches, num_chunks,
                                            group_size, num_splits)
