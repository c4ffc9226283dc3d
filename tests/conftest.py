"""Suite-wide setup: multi-rank tests run over gloo on CPU, also on a GPU machine, and
every test that starts a process says so.

The distributed tests start real processes (tests/dist_runner.py's forked ranks, torchrun,
pretrain_gpt.py, torch.multiprocessing) and compare them with single-process CPU
references. On a GPU machine those processes would see the GPU, default to NCCL, and
2-4 ranks would share one device (NCCL: "Duplicate GPU detected"). So child processes
see no GPU (CUDA_VISIBLE_DEVICES is empty in the environment they inherit) and run on
gloo/CPU as on a laptop, while this process, which claimed its GPUs before the change,
still runs the CUDA tests on the device.

The ``distributed`` marker: every test that starts a process (torchrun,
torch.multiprocessing, a subprocess running Python, pretrain_gpt.py, a tool or a
shell script) carries it, so that ``python -m pytest -m "not distributed" tests`` is
the quick in-process unit run (docs/testing.md). The marking cannot be forgotten: while
a test without the marker sets up, runs or tears down, starting a process raises
``UnmarkedProcessStart`` (subprocess.Popen and multiprocessing's Process.start are
guarded, which is what subprocess.run, torch.multiprocessing.spawn and
multiprocessing pools go through).
"""

import multiprocessing.process
import os
import subprocess

import pytest
import torch

import megatron.trainer  # noqa: F401 - before any test imports megatron-core (lazy_fusions)

# megatron-core 0.19's package_info runs `git rev-parse` when it is imported, unless this
# is set: a process start inside whichever unit test first imports megatron-core (the
# tripwire below would refuse it), and one more process in every launched rank
os.environ.setdefault("NO_VCS_VERSION", "1")

HIDDEN_FROM_CHILD_PROCESSES = ""  # CUDA_VISIBLE_DEVICES for child processes
DISTRIBUTED = "distributed"


class UnmarkedProcessStart(RuntimeError):
    """A test without the ``distributed`` marker tried to start a process."""


def _claim_gpus_for_this_process():
    """Initialise CUDA here and cache the device count, so that emptying
    CUDA_VISIBLE_DEVICES afterwards changes only what child processes see (the driver
    and torch read it at initialisation; torch caches the count once initialised)."""
    if torch.cuda.is_available():
        torch.cuda.init()
        torch.cuda.device_count()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"{DISTRIBUTED}: the test starts processes (torchrun, torch.multiprocessing,"
        " a Python/pretrain_gpt.py/tool/shell subprocess); deselect with"
        f" -m 'not {DISTRIBUTED}' for the in-process unit run")
    if _xdist_controller(config):
        return  # runs no test: its workers claim the GPUs, then hide them from their children
    _claim_gpus_for_this_process()
    os.environ["CUDA_VISIBLE_DEVICES"] = HIDDEN_FROM_CHILD_PROCESSES


# --- pytest-xdist (-n 2): which tests share a worker ------------------------------------

def _xdist_controller(config):
    return (getattr(config.option, "dist", "no") != "no"
            and not hasattr(config, "workerinput"))


EXACTNESS_GROUP = "exactness"
TESTS = os.path.dirname(os.path.abspath(__file__))


def _shares_exactness_runs(path):
    """Whether the test file at `path` (relative to the root) uses `exactness_runs`."""
    with open(os.path.join(os.path.dirname(TESTS), path)) as handle:
        return "exactness_runs" in handle.read()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist, whole groups go to a worker: a module's tests (their module
    fixtures are built once), and every module using `exactness_runs` together (one
    session fixture trains all their runs). Groups are handed out in collection order,
    which puts the longest first (`pytest_collection_modifyitems`), so that the two
    workers end together. (xdist's own --dist loadgroup marks do not reach the
    scheduler with pytest 9.)"""
    from xdist.scheduler import LoadScopeScheduling

    groups = {}

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split("::")[0]
            if path not in groups:
                groups[path] = EXACTNESS_GROUP if _shares_exactness_runs(path) else path
            return groups[path]

    config.option.loadscopereorder = False  # keep the order below, not by test count
    return GroupScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """In an xdist worker (they collect; the scheduler follows their order): the tests
    sharing `exactness_runs` first, then the other modules that start processes, then
    the in-process ones, each module's tests together."""
    if not hasattr(config, "workerinput"):
        return
    starts_processes = {item.nodeid.split("::")[0] for item in items
                        if item.get_closest_marker(DISTRIBUTED)}

    def rank(item):
        path = item.nodeid.split("::")[0]
        return (0 if "exactness_runs" in item.fixturenames
                else 1 if path in starts_processes else 2)

    items.sort(key=rank)  # stable: a module's tests stay in their order


# --- the tripwire: no process from a test without the marker -----------------------------

_unmarked_test = None  # node id of the unmarked test now in setup/call/teardown, if any
_popen_init = subprocess.Popen.__init__
_process_start = multiprocessing.process.BaseProcess.start


def _refuse(what):
    raise UnmarkedProcessStart(
        f"{_unmarked_test} starts a process ({what}) but has no @pytest.mark.{DISTRIBUTED}: "
        f"mark it (or its module: pytestmark = pytest.mark.{DISTRIBUTED}) so that the unit "
        f"run, pytest -m 'not {DISTRIBUTED}', stays free of processes")


def check_process_start(what):
    """Raise `UnmarkedProcessStart` if the test now running has no `distributed` marker
    (for processes started without Popen or multiprocessing: tests/forked_cli.py)."""
    if _unmarked_test is not None:
        _refuse(what)


def _guarded_popen_init(self, args, *rest, **kwargs):
    if _unmarked_test is not None:
        _refuse(args if isinstance(args, str) else " ".join(map(str, args))[:200])
    _popen_init(self, args, *rest, **kwargs)


def _guarded_process_start(self):
    if _unmarked_test is not None:
        _refuse(f"multiprocessing {self.name}")
    return _process_start(self)


subprocess.Popen.__init__ = _guarded_popen_init
multiprocessing.process.BaseProcess.start = _guarded_process_start


def _guard(item):
    global _unmarked_test
    _unmarked_test = None if item.get_closest_marker(DISTRIBUTED) else item.nodeid
    try:
        yield
    finally:
        _unmarked_test = None


# setup covers module- and session-scoped fixtures, which set up with their first test
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _guard(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _guard(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _guard(item)


# --- the exactness suites' runs, shared ------------------------------------------------

@pytest.fixture(scope="session")
def exactness_runs(request, tmp_path_factory):
    """{module name: {run name: results}} for every selected test module that defines
    `plan(tmp, corpus)` (a `distributed.Plan`) and whose tests use this fixture: their
    runs train in one launch per world size (`distributed.run_plans`), started when the
    first of those tests sets up. Only the modules with a selected test take part, so
    `pytest tests/test_x.py` trains test_x's runs alone."""
    from distributed import run_plans
    from packed_documents import write_document_corpus

    modules = {}
    for item in request.session.items:
        if "exactness_runs" in item.fixturenames and hasattr(item.module, "plan"):
            modules.setdefault(item.module.__name__, item.module)
    tmp = tmp_path_factory.mktemp("exactness")
    corpus = str(tmp / "documents")  # the packed-document corpus every suite trains on
    write_document_corpus(corpus, vocab_size=200)
    plans = {}
    for name, module in modules.items():
        directory = tmp / name
        directory.mkdir()
        plans[name] = module.plan(directory, corpus)
    return run_plans(tmp, plans)
