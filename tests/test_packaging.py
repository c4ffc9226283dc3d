"""The installed package works without the checkout: the wheel holds every module of
ours under megatron/, and the public names import from any directory.

The wheel is built from a copy of the project's package files, installed into a
temporary target, and imported by a Python that sees only that target and the
environment's site-packages (`-S`: no .pth files, so the editable install of this
checkout cannot stand in for a missing module), from a directory outside the checkout.
"""

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.distributed  # starts pip and a second Python


def _our_modules():
    """Every module of ours under megatron/, as a wheel path (megatron/core and
    megatron/training belong to megatron-core)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "megatron").rglob("*.py")
                  if "__pycache__" not in p.parts)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packaging")
    source = tmp / "source"
    source.mkdir()
    for name in ("setup.py", "requirements.txt", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "megatron", source / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = tmp / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                          str(source)], check=True, cwd=tmp, timeout=300)
    wheel, = wheels.glob("*.whl")
    target = tmp / "target"
    subprocess.run(pip + ["install", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, cwd=tmp, timeout=300)
    return {"wheel": wheel, "target": target, "cwd": tmp}


def test_the_wheel_holds_every_module_of_ours(installed):
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        names = set(wheel.namelist())
    missing = [m for m in _our_modules() if m not in names]
    assert not missing, f"setup.py leaves these out of the wheel: {missing}"
    assert "megatron/__init__.py" not in names  # megatron is a namespace package
    assert not any(n.startswith(("megatron/core/", "megatron/training/")) for n in names)


IMPORT_EVERYTHING = r"""
import importlib, json, sys
modules = json.loads(sys.argv[1])
from megatron.schedules import forward_backward_pipelining_seq1f1b, get_forward_backward_func
import megatron.schedules.dispatch
files = {}
for path in modules:
    name = path[:-3].replace("/", ".").removesuffix(".__init__")
    files[name] = importlib.import_module(name).__file__
print(json.dumps({"files": files,
                  "seq1f1b": forward_backward_pipelining_seq1f1b.__module__,
                  "dispatch": get_forward_backward_func.__module__}))
"""


def test_every_module_imports_from_the_installed_wheel_outside_the_checkout(installed):
    target = installed["target"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = os.pathsep.join([str(target)] + site.getsitepackages())
    env["PYTHONWARNINGS"] = "ignore"
    proc = subprocess.run(
        [sys.executable, "-S", "-c", IMPORT_EVERYTHING, json.dumps(_our_modules())],
        cwd=installed["cwd"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    outside = {name: path for name, path in result["files"].items()
               if not Path(path).resolve().is_relative_to(target.resolve())}
    assert not outside, f"imported from outside the installed wheel: {outside}"
    assert result["seq1f1b"] == "megatron.schedules.executor"
    assert result["dispatch"] == "megatron.schedules.dispatch"
