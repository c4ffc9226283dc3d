"""Megatron-LM's own parser, where the installed megatron-core ships it (0.19.2 does,
0.16.1 does not): what Megatron-LM makes of a command line, to compare ours with."""

import argparse
import typing

import pytest


def megatron_lm_args(flags):
    """Megatron-LM's parsed namespace for ``flags``, or None without its parser."""
    if not hasattr(typing, "override"):  # megatron/training uses it; Python 3.12+
        typing.override = lambda function: function
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("NO_VCS_VERSION", "1")  # else its package_info starts git on import
            from megatron.training.arguments import add_megatron_arguments
    except ImportError:
        return None
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return parser.parse_args(flags)
