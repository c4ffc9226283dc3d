"""Every version-dependent megatron-core / torch name the project uses still holds.

One test per row of ``megatron.mcore_compat.TABLE``: on a megatron-core or torch
release that drops a name or changes the parameters we rely on, the failing test is
named after the row and its message says why we need the name and where it was checked.
"""

import importlib.metadata
import os
import types

import pytest
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from megatron import mcore_compat
from megatron.mcore_compat import TABLE, CompatError, Entry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("row", TABLE, ids=[row.name for row in TABLE])
def test_table_row_holds(row):
    installed = importlib.metadata.version("megatron-core")
    if not row.holds_on(installed):
        pytest.skip(f"checked on {row.checked}: the bridge uses another row on {installed}")
    try:
        mcore_compat.check(row)
    except CompatError as error:
        if row.optional_elsewhere and installed not in row.checked:
            pytest.skip(f"absent from megatron-core {installed}, where the bridge does "
                        f"without it: {error}")
        pytest.fail(str(error), pytrace=False)


def test_table_names_are_unique():
    names = [row.name for row in TABLE]
    assert len(names) == len(set(names))


def test_installed_megatron_core_is_supported():
    installed = Version(importlib.metadata.version("megatron-core"))
    assert installed in SpecifierSet(mcore_compat.SUPPORTED_MCORE), (
        f"megatron-core {installed} is outside {mcore_compat.SUPPORTED_MCORE}")


def test_requirements_carry_the_supported_range():
    with open(os.path.join(ROOT, "requirements.txt")) as handle:
        lines = [line.strip() for line in handle]
    assert f"megatron-core{mcore_compat.SUPPORTED_MCORE}" in lines


def test_checked_versions_lie_in_the_supported_range():
    supported = SpecifierSet(mcore_compat.SUPPORTED_MCORE)
    assert all(Version(v) in supported for v in mcore_compat.CHECKED_MCORE)


def test_a_row_of_one_checked_version_holds_on_that_version_only():
    row = Entry("megatron.core.utils:x", "why", checked="megatron-core 0.19.2")
    assert row.holds_on("0.19.2") and not row.holds_on("0.16.1")
    assert row.holds_on("0.18.0")  # an unchecked version: every row is checked there
    assert Entry("megatron.core.utils:x", "why").holds_on("0.16.1")


def test_a_missing_name_fails_with_its_row():
    row = Entry("megatron.core.utils:no_such_name", "why we would need it")
    with pytest.raises(CompatError, match="name missing: megatron.core.utils:no_such_name"
                                          r" \(megatron-core .*\): why we would need it"):
        mcore_compat.check(row)


def test_a_missing_module_fails_with_its_row():
    row = Entry("megatron.core.no_such_module:torch", "a CUDA call site")
    with pytest.raises(CompatError, match="module missing: megatron.core.no_such_module"):
        mcore_compat.check(row)


def test_a_changed_signature_fails_with_its_row():
    # the right names in the wrong order are a changed signature too
    row = Entry("megatron.core.pipeline_parallel.schedules:backward_step", "the executor",
                params=("config", "input_tensor"))
    with pytest.raises(CompatError, match=r"signature changed: .*backward_step.*"
                                          r"expected parameters \['config', 'input_tensor'\]"):
        mcore_compat.check(row)


def test_names_outside_the_table_are_refused():
    with pytest.raises(KeyError, match="add a row"):
        mcore_compat.get("utils:no_such_name")


def test_set_global_sets_a_rows_module_global_only(monkeypatch):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    row = "dist_checkpointing.strategies.filesystem_async:_results_queue"
    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    made = object()
    mcore_compat.set_global(row, made)
    assert filesystem_async._results_queue is made and mcore_compat.get(row) is made
    with pytest.raises(KeyError, match="add a row"):
        mcore_compat.set_global("utils:no_such_name", made)
    with pytest.raises(CompatError, match="not a module global"):  # a method: not set
        mcore_compat.set_global("models.gpt.gpt_model:GPTModel._preprocess", made)


def test_backward_step_bridge_returns_the_input_gradient():
    config = types.SimpleNamespace(timers=None, grad_scale_func=None,
                                   deallocate_pipeline_outputs=False)
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    output = (x * 3.0).sum()
    grad = mcore_compat.backward_step(x, output, None, config)
    assert torch.equal(grad, torch.tensor([3.0, 3.0]))


def test_cpu_support_stops_on_a_missing_call_site_module(monkeypatch):
    """A CUDA call site module missing from the installed megatron-core is an error that
    names it and the installed version, raised before anything is patched."""
    from megatron.core.tensor_parallel import random as mp_random
    from megatron import cpu_support

    sites = dict(mcore_compat.CUDA_CALL_SITES, no_such_module="a CUDA call site")
    monkeypatch.setattr(mcore_compat, "CUDA_CALL_SITES", sites)
    monkeypatch.setattr(cpu_support, "_APPLIED", False)
    tracker = mp_random.CudaRNGStatesTracker
    installed = importlib.metadata.version("megatron-core")
    with pytest.raises(CompatError, match=rf"megatron-core {installed} .*module missing: "
                                          r"megatron.core.no_such_module:torch"):
        cpu_support.apply(cuda=False)
    assert mp_random.CudaRNGStatesTracker is tracker  # nothing patched


def test_cpu_support_undo_puts_every_patched_name_back():
    """`patched()` applies the CPU patches for a block and puts every replaced name back
    after it, so a test or a library user can run megatron-core on CPU in-process and
    leave it as found."""
    import importlib

    from megatron.core.tensor_parallel import random as mp_random
    from megatron import cpu_support

    if cpu_support._APPLIED:
        pytest.skip("the CPU patches were applied earlier in this process")
    call_sites = [importlib.import_module("megatron.core." + m)
                  for m in mcore_compat.CUDA_CALL_SITES]
    tracker = mp_random.CudaRNGStatesTracker
    with cpu_support.patched(cuda=False) as active:
        assert active
        replaced = list(cpu_support._ORIGINALS)
        assert len(replaced) >= len(mcore_compat.CUDA_CALL_SITES) + 8
        assert all(getattr(owner, name) is not value for owner, name, value in replaced)
        assert all(module.torch is not torch for module in call_sites)
    assert all(getattr(owner, name) is value for owner, name, value in replaced)
    assert all(module.torch is torch for module in call_sites)
    assert mp_random.CudaRNGStatesTracker is tracker
    assert not cpu_support._APPLIED and not cpu_support._ORIGINALS
    with cpu_support.patched(cuda=True) as active:  # a CUDA run: nothing to patch
        assert not active and not cpu_support._ORIGINALS


@pytest.mark.parametrize("installed, expected", [
    ("0.16.1", None), ("0.19.2", None), ("0.18.0rc1", None),
    ("0.15.3", "megatron-core 0.15.3 is installed; this project runs on megatron-core "
               ">=0.16.1,<0.20 (0.16.1 and 0.19.2 tested in CI): pip install "
               "'megatron-core>=0.16.1,<0.20'"),
    ("0.20.0", "megatron-core 0.20.0 is installed; this project runs on megatron-core "),
    (None, "megatron-core is not installed: pip install 'megatron-core>=0.16.1,<0.20'"),
])
def test_an_unsupported_megatron_core_is_one_line_before_any_import(monkeypatch, installed,
                                                                    expected):
    """A container's own megatron-core outside the range (the project installed with
    --no-deps, or on PYTHONPATH) stops pretrain_gpt.py with one line before our modules
    import it (0.15.3 failed with an ImportError deep in megatron/seqsplit)."""
    def version(name):
        assert name == "megatron-core"
        if installed is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(importlib.metadata, "version", version)
    problem = mcore_compat.unsupported_megatron_core()
    if expected is None:
        assert problem is None
    else:
        assert problem.startswith(expected)
