"""megatron.trainer.lazy_imports: a package in LAZY is found at import and runs its code
when one of its names is first read; one module object per name whatever the order of
imports. A throwaway package stands in for wandb (in this process: no process started)."""

import importlib
import sys

import pytest

from megatron.trainer import lazy_imports

PACKAGE = "lazy_probe_pkg"


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A package whose code counts its runs and imports its submodule, as wandb does."""
    root = tmp_path / PACKAGE
    root.mkdir()
    (root / "__init__.py").write_text(
        "import builtins\n"
        "builtins.lazy_probe_runs = getattr(builtins, 'lazy_probe_runs', 0) + 1\n"
        f"from {PACKAGE}.sub import value\n"
        "answer = value + 1\n")
    (root / "sub.py").write_text("value = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(lazy_imports, "LAZY", (*lazy_imports.LAZY, PACKAGE))
    import builtins
    monkeypatch.setattr(builtins, "lazy_probe_runs", 0, raising=False)
    yield lambda: builtins.lazy_probe_runs
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]


def test_the_code_runs_once_when_a_name_is_first_read(probe):
    module = importlib.import_module(PACKAGE)
    assert probe() == 0 and PACKAGE + ".sub" not in sys.modules
    importlib.import_module(PACKAGE)  # a second import statement reads __spec__ only
    assert probe() == 0
    assert module.answer == 42 and probe() == 1
    assert module.sub.value == 41 and probe() == 1
    with pytest.raises(AttributeError, match="has no attribute 'missing'"):
        module.missing  # noqa: B018


def test_a_submodule_imported_first_runs_the_package_once_and_is_one_object(probe):
    from lazy_probe_pkg import sub  # noqa: F401 - the import under test

    package = sys.modules[PACKAGE]
    assert probe() == 1
    assert package.sub is sys.modules[PACKAGE + ".sub"] is sub
    assert package.answer == 42 and probe() == 1
    assert sub.__spec__.loader.__class__.__name__ == "SourceFileLoader"  # restored


def test_a_missing_package_still_fails_at_import(monkeypatch):
    monkeypatch.setattr(lazy_imports, "LAZY", ("no_such_package_here",))
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("no_such_package_here")


def test_the_trainer_installs_it_once():
    assert sum(isinstance(f, lazy_imports._LazyFinder) for f in sys.meta_path) == 1
    lazy_imports.install()
    assert sum(isinstance(f, lazy_imports._LazyFinder) for f in sys.meta_path) == 1
