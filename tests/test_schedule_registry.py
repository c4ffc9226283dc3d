"""One schedule registry (`megatron.schedules.registry`) that every list of schedule
names reads: the command line, the library's dispatcher, the executor's settings, the
lowering and the planner. An unknown name, or a combination the command line refuses,
raises in the library too, with the same message, naming the valid choices."""

import functools

import pytest

from megatron.schedules import registry
from megatron.schedules.dispatch import get_forward_backward_func
from megatron.schedules.executor import ScheduleSettings, forward_backward_pipelining_seq1f1b
from megatron.schedules.lowering import checked_programs, schedule_units
from megatron.schedules.registry import ScheduleChoiceError
from megatron.trainer.arguments import ArgumentError, build_parser, parse_args

GOOD = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--train-iters", "2", "--mock-data", "--vocab-size", "128",
        "--micro-batch-size", "1", "--global-batch-size", "4",
        "--pipeline-model-parallel-size", "2"]


def _choices(parser, flag):
    action, = [a for a in parser._actions if flag in a.option_strings]
    return tuple(action.choices)


def test_command_line_choices_are_the_registry():
    assert _choices(build_parser(), "--pipeline-schedule") == registry.NAMES
    assert _choices(build_parser(), "--seq1f1b-balance-method") == registry.BALANCE_METHODS
    help_text = build_parser().format_help()
    for schedule in registry.SCHEDULES.values():
        assert schedule.name in help_text


def test_planner_choices_are_the_registry():
    from megatron.planner.cli import build_parser as planner_parser
    from megatron.planner.predict import SCHEDULES as PLANNER_SCHEDULES

    assert _choices(planner_parser(), "--schedule") == registry.planner_names()
    assert set(PLANNER_SCHEDULES) <= set(registry.planner_names())
    assert set(registry.NAMES) <= set(PLANNER_SCHEDULES)


@pytest.mark.parametrize("name", registry.NAMES)
@pytest.mark.parametrize("chunks", [1, 2])
def test_every_name_lowers_and_runs_its_generator(name, chunks):
    splits = 1 if name == "1f1b" else 2
    units = schedule_units(name, 2, 4, chunks, splits)
    assert units == registry.rank_units(name, 2, 4, chunks, splits)
    assert all(len(rank) == 2 * 4 * chunks * splits for rank in units)
    checked_programs(2, 4, chunks, splits, schedule=name)  # raises on deadlock
    assert ScheduleSettings(schedule=name, num_splits=splits).schedule == name


UNKNOWN = ["slimpip", "interleaved", "1F1B", ""]


@pytest.mark.parametrize("name", UNKNOWN)
def test_an_unknown_name_raises_everywhere_naming_the_choices(name):
    expected = "choose one of 1f1b, seq1f1b, slimpipe"
    for call in (lambda: get_forward_backward_func(2, None, schedule=name),
                 lambda: get_forward_backward_func(2, None, schedule=name, seq1f1b_splits=4),
                 lambda: ScheduleSettings(schedule=name, num_splits=2),
                 lambda: schedule_units(name, 2, 4, 1, 2),
                 lambda: registry.get(name)):
        with pytest.raises(ScheduleChoiceError, match=expected):
            call()


# (library keywords, the same request as pretrain_gpt.py flags)
COMBINATIONS = [
    (dict(), []),
    (dict(seq1f1b_splits=4), ["--seq1f1b-splits", "4"]),
    (dict(seq1f1b_splits=4, balance_method="uniform_comp"),
     ["--seq1f1b-splits", "4", "--seq1f1b-balance-method", "uniform_comp"]),
    (dict(schedule="seq1f1b"), ["--pipeline-schedule", "seq1f1b"]),
    (dict(schedule="1f1b"), ["--pipeline-schedule", "1f1b"]),
    (dict(schedule="1f1b", seq1f1b_splits=4), ["--pipeline-schedule", "1f1b",
                                               "--seq1f1b-splits", "4"]),
    (dict(slimpipe_slices=4), ["--slimpipe-slices", "4"]),
    (dict(schedule="slimpipe", slimpipe_slices=4), ["--pipeline-schedule", "slimpipe",
                                                    "--slimpipe-slices", "4"]),
    (dict(schedule="slimpipe", slimpipe_slices=4, seq1f1b_splits=2),
     ["--pipeline-schedule", "slimpipe", "--slimpipe-slices", "4", "--seq1f1b-splits", "2"]),
    (dict(slimpipe_slices=4, balance_method="uniform_comp"),
     ["--slimpipe-slices", "4", "--seq1f1b-balance-method", "uniform_comp"]),
    (dict(schedule="seq1f1b", slimpipe_slices=4),
     ["--pipeline-schedule", "seq1f1b", "--slimpipe-slices", "4"]),
    (dict(schedule="1f1b", slimpipe_slices=4),
     ["--pipeline-schedule", "1f1b", "--slimpipe-slices", "4"]),
    (dict(seq1f1b_splits=2, attention_balance=True),
     ["--seq1f1b-splits", "2", "--slimpipe-attention-balance"]),
    (dict(seq1f1b_splits=0), ["--seq1f1b-splits", "0"]),
]


def _library_error(keywords):
    try:
        get_forward_backward_func(2, None, **keywords)
    except ScheduleChoiceError as error:
        return str(error)
    return None


def _command_line_errors(flags):
    try:
        parse_args(GOOD + flags, world_size=2, cuda_available=False)
    except ArgumentError as error:
        return str(error)
    return None


@pytest.mark.parametrize("keywords, flags", COMBINATIONS)
def test_library_refuses_what_the_command_line_refuses(keywords, flags):
    library, command_line = _library_error(keywords), _command_line_errors(flags)
    assert (library is None) == (command_line is None), (library, command_line)
    if library is not None:
        assert library in command_line  # the same line, among the command line's problems


@pytest.mark.parametrize("keywords, name", [
    (dict(seq1f1b_splits=4), "seq1f1b"), (dict(slimpipe_slices=4), "slimpipe"),
    (dict(schedule="seq1f1b", seq1f1b_splits=2), "seq1f1b")])
def test_split_schedules_return_forward_backward_pipelining_seq1f1b(keywords, name):
    func = get_forward_backward_func(2, None, **keywords)
    assert isinstance(func, functools.partial)
    assert func.func is forward_backward_pipelining_seq1f1b
    assert func.__name__ == "forward_backward_pipelining_seq1f1b"
    assert func.keywords["settings"].schedule == name


def test_settings_from_a_model_config():
    class Config:  # the attributes a user sets on the TransformerConfig
        seq1f1b_splits = 4
        seq1f1b_balance_method = "uniform_comp"

    settings = ScheduleSettings.from_config(Config())
    assert (settings.schedule, settings.num_splits, settings.balance_method) == (
        "seq1f1b", 4, "uniform_comp")
    Config.seq1f1b_splits, Config.slimpipe_slices = None, 4
    Config.seq1f1b_balance_method = None
    assert ScheduleSettings.from_config(Config()).schedule == "slimpipe"
    with pytest.raises(ValueError, match="config.seq1f1b_splits"):
        ScheduleSettings.from_config(object())
    Config.pipeline_schedule, Config.slimpipe_slices, Config.seq1f1b_splits = "1f1b", None, 2
    with pytest.raises(ScheduleChoiceError, match="runs whole microbatches"):
        ScheduleSettings.from_config(Config())
