"""tools/offline_install.py: the GPU machine's offline megatron-core install picks the newest
carried wheel inside requirements.txt's range that fits the interpreter, and installs it."""

import os
import subprocess
import sys
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.tags import Tag

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
sys.path.insert(0, TOOLS)
import offline_install  # noqa: E402

CP312 = [Tag("cp312", "cp312", "manylinux_2_28_x86_64"), Tag("py3", "none", "any")]
CP311 = [Tag("cp311", "cp311", "manylinux_2_28_x86_64"), Tag("py3", "none", "any")]
WHEELS = ["megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl",
          "megatron_core-0.19.2-cp312-cp312-manylinux_2_28_x86_64.whl",
          "megatron_core-0.19.2-cp311-cp311-manylinux_2_28_x86_64.whl",
          "megatron_core-0.20.0-cp312-cp312-manylinux_2_28_x86_64.whl",
          "psutil-7.0.0-cp36-abi3-manylinux_2_28_x86_64.whl"]


def test_newest_supported_wheel_for_this_interpreter():
    supported = offline_install.supported_range()
    assert str(supported.specifier) == str(Requirement("megatron-core>=0.16.1,<0.20").specifier)
    assert offline_install.pick_wheel(WHEELS, supported, CP312) == WHEELS[1]  # not 0.20.0
    assert offline_install.pick_wheel(WHEELS, supported, CP311) == WHEELS[2]
    assert offline_install.pick_wheel(WHEELS[:1], supported, CP312) == WHEELS[0]
    assert offline_install.pick_wheel(WHEELS[3:], supported, CP312) is None


def _fake_wheel(folder, name, version):
    """A minimal valid pure-Python wheel holding one module `<name>_probe`."""
    dist = f"{name}-{version}"
    path = os.path.join(folder, f"{dist}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name}_probe.py", f"VERSION = {version!r}\n")
        wheel.writestr(f"{dist}.dist-info/METADATA",
                       f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(f"{dist}.dist-info/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                       "Tag: py3-none-any\n")
        wheel.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def _run_without_megatron_core(wheels, target):
    """The script in its own interpreter, as if megatron-core were not installed."""
    code = ("import offline_install, sys;"
            "offline_install.installed_version = lambda: None;"
            f"sys.exit(offline_install.main(['--wheels', {str(wheels)!r}, "
            f"'--target', {str(target)!r}]))")
    return subprocess.run([sys.executable, "-c", code], cwd=TOOLS, capture_output=True,
                          text=True, timeout=300)


def test_installs_the_chosen_wheel_without_network(tmp_path):
    """The script as the GPU machine runs it, on a machine without megatron-core
    (installed_version stubbed to None): real pip, --no-index, into a target folder."""
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _fake_wheel(str(wheels), "megatron_core", "0.17.0")
    _fake_wheel(str(wheels), "megatron_core", "0.19.2")
    _fake_wheel(str(wheels), "megatron_core", "0.21.0")
    _fake_wheel(str(wheels), "helper_pkg", "1.0")
    target = tmp_path / "site"
    proc = _run_without_megatron_core(wheels, target)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(target)
    assert "megatron_core-0.19.2" in proc.stderr
    assert (target / "megatron_core_probe.py").read_text() == "VERSION = '0.19.2'\n"
    assert (target / "helper_pkg_probe.py").exists()


def test_upgrade_replaces_an_older_megatron_core_in_the_target(tmp_path):
    """A target left by an earlier install (a warm machine, an older carried wheel) gets the
    chosen version, with one megatron-core's metadata, and the version read back from the
    target is what the script reports; a rerun leaves the target as it is."""
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    _fake_wheel(str(old), "megatron_core", "0.17.0")
    _fake_wheel(str(new), "megatron_core", "0.19.2")
    target = tmp_path / "site"
    assert _run_without_megatron_core(old, target).returncode == 0
    assert (target / "megatron_core_probe.py").read_text() == "VERSION = '0.17.0'\n"

    proc = _run_without_megatron_core(new, target)
    assert proc.returncode == 0, proc.stderr
    assert "installed megatron-core 0.19.2" in proc.stderr
    assert (target / "megatron_core_probe.py").read_text() == "VERSION = '0.19.2'\n"
    assert sorted(p.name for p in target.glob("*.dist-info")) == [
        "megatron_core-0.19.2.dist-info"]
    assert [str(v) for v in offline_install.target_versions(str(target))] == ["0.19.2"]

    again = _run_without_megatron_core(new, target)
    assert again.returncode == 0, again.stderr
    assert "megatron-core 0.19.2" in again.stderr and "is already in" in again.stderr
    assert again.stdout.strip() == str(target)


def test_no_usable_wheel_is_one_clear_line(tmp_path):
    proc = _run_without_megatron_core(tmp_path, tmp_path / "site")
    assert proc.returncode != 0
    assert proc.stderr.startswith("error: no megatron-core wheel for this Python inside")
