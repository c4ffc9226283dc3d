"""Megatron-LM's own parser, where the installed megatron-core ships it (0.19.2 does,
0.16.1 does not): what Megatron-LM makes of a command line, to compare ours with. The
comparisons are with the parser of Megatron-LM 0.19 (CI's): an older one (0.17, 0.18) that
does not know a flag or a value yet gives None, as no parser does."""

import argparse
import typing

import pytest


def _megatron_lm_parser():
    """Megatron-LM's parser, or None where megatron-core ships no megatron/training."""
    if not hasattr(typing, "override"):  # megatron/training uses it; Python 3.12+
        typing.override = lambda function: function
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("NO_VCS_VERSION", "1")  # else its package_info starts git on import
            from megatron.training.arguments import add_megatron_arguments
    except ImportError:
        return None
    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False,
                                                          exit_on_error=False))


def megatron_lm_choices(flag):
    """The values Megatron-LM's parser allows for ``flag``, or None without its parser."""
    parser = _megatron_lm_parser()
    if parser is None:
        return None
    return next(tuple(action.choices) for action in parser._actions
                if flag in action.option_strings)


def megatron_lm_args(flags):
    """Megatron-LM's parsed namespace for ``flags``, or None without its parser."""
    parser = _megatron_lm_parser()
    if parser is None:
        return None
    try:
        parsed, unknown = parser.parse_known_args(flags)
    except argparse.ArgumentError:  # a value an older parser has no choice for
        return None
    return None if unknown else parsed
