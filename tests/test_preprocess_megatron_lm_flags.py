"""Every flag of Megatron-LM's tools/preprocess_data.py is answered by ours: implemented,
accepted without effect (a note) or refused with the reason, never "unrecognized
arguments", and each takes as many values as Megatron-LM's.

Megatron-LM's own flags of the tool (its get_args, which the megatron-core wheel does not
ship) are listed here; its tokenizer flags come from megatron.training.arguments'
_add_tokenizer_args where megatron-core ships it (0.19; skipped on 0.16.1)."""

import argparse

import pytest

from megatron.dataprep import preprocess_flags
from megatron.dataprep.preprocess import build_parser

# Megatron-LM's tools/preprocess_data.py get_args (core_r0.19): flag -> values it takes
TOOL_FLAGS = {
    "--input": 1, "--json-keys": "+", "--split-sentences": 0, "--keep-newlines": 0,
    "--append-eod": 0, "--lang": 1, "--output-prefix": 1, "--workers": 1,
    "--find-optimal-num-workers": 0, "--workers-to-check": "+", "--max-documents": 1,
    "--performance-dir": 1, "--partitions": 1, "--log-interval": 1,
    "--keep-sequential-samples": 0,
}
GOOD = ["--input", "in.jsonl", "--output-prefix", "out", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "10"]


def _takes(nargs):
    return {0: 0, None: 1, 1: 1, "?": 1}.get(nargs, "+")


def megatron_lm_tokenizer_flags():
    import typing

    if not hasattr(typing, "override"):
        typing.override = lambda function: function
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("NO_VCS_VERSION", "1")
            from megatron.training.arguments import _add_tokenizer_args
    except ImportError as error:
        pytest.skip(f"this megatron-core has no megatron/training: {error}")
    parser = _add_tokenizer_args(argparse.ArgumentParser())
    return {flag: _takes(action.nargs) for action in parser._actions
            for flag in action.option_strings if flag.startswith("--") and flag != "--help"}


def ours():
    return {flag: _takes(action.nargs) for action in build_parser()._actions
            for flag in action.option_strings if flag != "--help"}


def _parses_the_same(ours_takes, theirs):
    # several values where Megatron-LM takes one (--input: files and globs) read a
    # Megatron-LM command line the same: it has no positional arguments
    return ours_takes == theirs or (ours_takes == "+" and theirs == 1)


def test_megatron_lm_tool_flags_are_answered_with_their_values():
    ours_now = ours()
    for flag, takes in TOOL_FLAGS.items():
        assert flag in ours_now, f"{flag} is unknown to tools/preprocess_data.py"
        assert _parses_the_same(ours_now[flag], takes), (flag, ours_now[flag], takes)


def test_megatron_lm_tokenizer_flags_are_answered_with_their_values():
    ours_now = ours()
    # Megatron-LM's tool reads every tokenizer flag of its trainer
    missing = {flag: takes for flag, takes in megatron_lm_tokenizer_flags().items()
               if flag not in ours_now or not _parses_the_same(ours_now[flag], takes)}
    assert not missing, f"not answered (or with another value count) here: {missing}"


@pytest.mark.parametrize("flag", sorted(preprocess_flags.REFUSED))
def test_each_refused_flag_says_why(flag):
    takes = preprocess_flags.REFUSED[flag][0]
    args = build_parser().parse_args(GOOD + [flag] + (["7"] if takes else []))
    (line,) = preprocess_flags.refused(args)
    assert line.startswith(f"{flag}: ") and len(line) > len(flag) + 20
