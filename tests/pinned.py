"""The pinned GPU releases (pyproject's `gpu` extra), downloaded as wheels and unpacked, never installed.

`pinned_source(name, cache)` runs `pip download --no-deps` for the version the extra pins, once per
cache (pytest's cache folder), and returns the unpacked tree: the releases' own source, to read
(the contract test) or to import the pure-python parts of (SpecForge's reader). SGLang's wheel is
platform-tagged; the CPython 3.11 manylinux one is asked for whatever interpreter runs the tests,
so every machine reads the same file.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLATFORM_ARGS = ["--only-binary=:all:", "--platform", "manylinux_2_34_x86_64", "--python-version", "3.11"]


def gpu_pins() -> dict[str, str]:
    """{"specforge": "0.2.0", "sglang": "0.5.14", ...} from pyproject.toml's gpu extra."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {}
    for req in extras["gpu"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+-]+)", req)
        assert m, f"pyproject gpu extra: {req!r} is not pinned with =="
        pins[m.group(1).lower()] = m.group(2)
    return pins


def pinned_source(name: str, cache: Path) -> Path:
    """The unpacked wheel of the pinned `name`; safe when several test runs share `cache` at once."""
    import os
    import shutil
    version = gpu_pins()[name]
    dest = cache / f"{name}-{version}"
    if (dest / ".complete").exists():
        return dest
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"{name}-{version}-*.whl"))
    if not found:
        mine = cache / f".download-{os.getpid()}"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
               f"{name}=={version}", "-d", str(mine)]
        if name == "sglang":
            cmd[4:4] = PLATFORM_ARGS
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        got = sorted(mine.glob(f"{name}-{version}-*.whl"))
        assert proc.returncode == 0 and got, (
            f"could not download the pinned {name}=={version} from PyPI (the contract and reader tests read "
            f"the released source):\n{proc.stderr[-2000:]}")
        os.replace(got[0], wheels / got[0].name)  # whole files only: another run may be reading wheels/
        shutil.rmtree(mine, ignore_errors=True)
        found = [wheels / got[0].name]
    tmp = cache / f".{name}-{version}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(found[0]) as z:
        z.extractall(tmp, members=[m for m in z.namelist() if m.endswith(".py") or m.endswith("METADATA")])
    (tmp / ".complete").write_text(found[0].name)
    try:
        tmp.rename(dest)
    except OSError:  # another run finished first (dest exists, complete) or left an incomplete one
        if not (dest / ".complete").exists():
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def read_with_specforge(run_dir: Path, specforge_tree: Path) -> dict:
    """tests/specforge_read.py on `run_dir` with the released SpecForge importable; its JSON answer.

    A subprocess, so that SpecForge's modules never mix with the test process's imports.
    """
    import json
    import os
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(specforge_tree), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "specforge_read.py"), str(run_dir)],
                          capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"SpecForge's reader refused {run_dir}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
