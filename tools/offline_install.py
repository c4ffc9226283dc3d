"""Install megatron-core (and the other carried wheels) on a machine without network.

The lent GPU machines have Python 3.12 and PyTorch but no megatron-core and no network:
the wheels travel in the working tree (``.whl/``, see tools/gpu_checks.sh). This picks,
among the carried ``megatron_core-*.whl``, the newest release inside the range
requirements.txt supports that fits this interpreter, and installs it with the other
carried wheels into a target folder. An installed megatron-core inside the range is kept.

The target may hold an earlier install (a warm machine, or an older carried wheel): pip
runs with --upgrade so that the chosen wheel replaces it, the older megatron-core's
metadata is removed, and the version read back from the target is the one reported (an
error if it is not the chosen one). A target already holding exactly the chosen version
is left as it is.

    python3 tools/offline_install.py --wheels .whl --target /tmp/site
    # prints the folder to put on PYTHONPATH (nothing when nothing was needed)
"""

import argparse
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys

try:
    from packaging.requirements import Requirement
    from packaging.tags import sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # a bare GPU image may lack `packaging`; pip always carries a copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.tags import sys_tags
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def supported_range(requirements=os.path.join(ROOT, "requirements.txt")):
    """The megatron-core requirement of requirements.txt (one source of truth)."""
    with open(requirements) as handle:
        for line in handle:
            line = line.split("#")[0].strip()
            if line and canonicalize_name(re.split(r"[<>=!~ ]", line)[0]) == "megatron-core":
                return Requirement(line)
    raise SystemExit(f"error: {requirements} names no megatron-core requirement")


def pick_wheel(paths, requirement, tags=None):
    """The newest megatron-core wheel among `paths` inside `requirement` whose tags this
    interpreter accepts; None if there is none."""
    accepted = set(tags if tags is not None else sys_tags())
    best = None
    for path in paths:
        name, version, _, wheel_tags = parse_wheel_filename(os.path.basename(path))
        if name != "megatron-core" or version not in requirement.specifier:
            continue
        if not accepted & set(wheel_tags):
            continue
        if best is None or version > best[0]:
            best = (version, path)
    return best[1] if best else None


def installed_version():
    try:
        return Version(importlib.metadata.version("megatron-core"))
    except importlib.metadata.PackageNotFoundError:
        return None


def target_versions(target):
    """The megatron-core versions whose metadata lies in `target` (a pip --target folder)."""
    if not os.path.isdir(target):
        return []
    return sorted(Version(dist.version)
                  for dist in importlib.metadata.distributions(path=[target])
                  if canonicalize_name(dist.metadata["Name"] or "") == "megatron-core")


def remove_stale_metadata(target, keep):
    """pip --target --upgrade replaces the package folders but leaves the metadata of the
    version it replaced (its dist-info has another name): remove every megatron-core
    dist-info but `keep`'s, so that importlib.metadata sees one version."""
    for entry in os.listdir(target):
        match = re.fullmatch(r"megatron[_-]core-(.+)\.dist-info", entry, re.IGNORECASE)
        if match and Version(match.group(1)) != keep:
            shutil.rmtree(os.path.join(target, entry))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", default=".whl", help="folder of carried wheels")
    parser.add_argument("--target", required=True, help="folder to install into")
    args = parser.parse_args(argv)
    requirement = supported_range()
    have = installed_version()
    if have is not None and have in requirement.specifier:
        print(f"megatron-core {have} is installed and supported ({requirement})",
              file=sys.stderr)
        return 0
    wheels = sorted(os.path.join(args.wheels, f) for f in os.listdir(args.wheels)
                    if f.endswith(".whl")) if os.path.isdir(args.wheels) else []
    chosen = pick_wheel(wheels, requirement)
    if chosen is None:
        found = ", ".join(os.path.basename(w) for w in wheels) or "no wheels"
        raise SystemExit(
            f"error: no megatron-core wheel for this Python inside {requirement} in "
            f"{args.wheels} ({found}); installed: {have or 'none'}. Carry one: see "
            "tools/gpu_checks.sh's header")
    version = parse_wheel_filename(os.path.basename(chosen))[1]
    if target_versions(args.target) == [version]:
        print(f"megatron-core {version} (newest carried inside {requirement}) is already in "
              f"{args.target}", file=sys.stderr)
        print(os.path.abspath(args.target))
        return 0
    others = [w for w in wheels
              if parse_wheel_filename(os.path.basename(w))[0] != "megatron-core"]
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                    "--no-deps", "--upgrade", "--target", args.target, chosen, *others],
                   check=True)
    remove_stale_metadata(args.target, version)
    found = target_versions(args.target)
    if found != [version]:
        raise SystemExit(f"error: installed {os.path.basename(chosen)} into {args.target}, "
                         f"but it holds megatron-core {', '.join(map(str, found)) or 'none'}; "
                         f"remove {args.target} and rerun")
    print(f"installed megatron-core {found[0]} ({os.path.basename(chosen)}, newest carried "
          f"inside {requirement})" + (f" and {len(others)} other wheel(s)" if others else "")
          + f" into {args.target}", file=sys.stderr)
    print(os.path.abspath(args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
