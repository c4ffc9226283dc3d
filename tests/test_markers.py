"""The ``distributed`` marker cannot be forgotten (tests/conftest.py): a test without it
that starts a process fails, naming the test and the marker; a marked one may."""

import multiprocessing
import subprocess
import sys

import pytest
from conftest import UnmarkedProcessStart


def test_unmarked_test_cannot_start_a_subprocess():
    with pytest.raises(UnmarkedProcessStart, match="test_markers.py::test_unmarked_test_cannot"
                       r".*pytest\.mark\.distributed"):
        subprocess.run([sys.executable, "-c", "pass"])


def test_unmarked_test_cannot_start_a_multiprocessing_process():
    process = multiprocessing.get_context("spawn").Process(target=print)
    with pytest.raises(UnmarkedProcessStart, match="pytest.mark.distributed"):
        process.start()


@pytest.mark.distributed
def test_marked_test_may_start_one():
    assert subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True,
                          text=True, check=True).stdout == "42\n"


def test_unmarked_test_cannot_fork_a_run_from_the_server():
    """tests/forked_cli.py starts runs without Popen: it asks the tripwire itself."""
    import forked_cli

    with pytest.raises(UnmarkedProcessStart, match="pytest.mark.distributed"):
        forked_cli.start(["pretrain_gpt.py", "--help"], env={})
