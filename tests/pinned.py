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
# Wheels with a platform tag: asked for the same platform whatever machine runs the tests. vLLM's are
# manylinux_2_31 (0.12, 0.13) or later; pip takes a platform only as named, so the older tags are named too.
PLATFORM_TAGGED = {
    "sglang": PLATFORM_ARGS,
    "vllm": ["--only-binary=:all:", "--platform", "manylinux_2_34_x86_64", "--platform", "manylinux_2_31_x86_64",
             "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64", "--python-version", "3.11"],
}


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
    return release_source(name, gpu_pins()[name], cache)


# vLLM's speculators (extract.format = "speculators"): the releases its reader and trainer config are checked
# against. hs-connectors 0.9.0 carries the FP8 backend of speculators' PR #1028 (hs_connectors/fp8_utils.py).
SPECULATORS_PINS = {"speculators": "0.9.0", "hs_connectors": "0.9.0"}


def speculators_path(cache: Path) -> str:
    """PYTHONPATH for the unpacked speculators and hs-connectors releases (downloaded once per cache)."""
    import os
    return os.pathsep.join(str(release_source(name, version, cache)) for name, version in SPECULATORS_PINS.items())


class Offline(Exception):
    """pip could not download a release (no network, no index): the tests reading it are skipped."""


def release_source(name: str, version: str, cache: Path, *, under: tuple[str, ...] = (),
                   drop_wheel: bool = False) -> Path:
    """The unpacked `.py` files (and METADATA) of the wheel of `name==version`, downloaded once per
    cache; `under`: only those whose path starts with one of these; `drop_wheel`: the wheel itself is not
    kept once unpacked (vLLM's are ~470 MB; the unpacked tree is the cache). Safe when several test
    runs share `cache` at once. Offline (pip cannot download it) when the index cannot be reached."""
    import os
    import shutil
    part = "-" + re.sub(r"[^A-Za-z0-9]+", "_", "+".join(under)).strip("_") if under else ""
    dest = cache / f"{name}-{version}{part}"  # a part of a wheel never stands for the whole of it
    if (dest / ".complete").exists():
        return dest
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"{name}-{version}-*.whl"))
    if not found:
        mine = cache / f".download-{os.getpid()}"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
               f"{name}=={version}", "-d", str(mine)]
        if name in PLATFORM_TAGGED:
            cmd[4:4] = PLATFORM_TAGGED[name]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        got = sorted(mine.glob(f"{name}-{version}-*.whl"))
        if proc.returncode != 0 or not got:
            shutil.rmtree(mine, ignore_errors=True)
            raise Offline(f"could not download {name}=={version} from PyPI (the contract tests read the released "
                          f"source):\n{proc.stderr[-2000:]}")
        os.replace(got[0], wheels / got[0].name)  # whole files only: another run may be reading wheels/
        shutil.rmtree(mine, ignore_errors=True)
        found = [wheels / got[0].name]
    tmp = cache / f".{name}-{version}{part}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(found[0]) as z:
        z.extractall(tmp, members=[m for m in z.namelist() if m.startswith(under or "")
                                   and (m.endswith(".py") or m.endswith("METADATA"))])
    (tmp / ".complete").write_text(found[0].name)
    try:
        tmp.rename(dest)
    except OSError:  # another run finished first (dest exists, complete) or left an incomplete one
        if not (dest / ".complete").exists():
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if drop_wheel:
        found[0].unlink(missing_ok=True)
    return dest


def run_with_specforge(script: str, arg: Path, specforge_tree: Path, refused: str, *more: str) -> dict:
    """tests/`script` on `arg` (and `more` arguments) with the released SpecForge importable; the JSON of
    its last line, or an AssertionError "`refused` `arg`:" and its stderr when it fails.

    A subprocess, so that SpecForge's modules never mix with the test process's imports.
    """
    import json
    import os
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(specforge_tree), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / script), str(arg), *more],
                          capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"{refused} {arg}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def read_with_specforge(run_dir: Path, specforge_tree: Path) -> dict:
    """tests/specforge_read.py on `run_dir` with the released SpecForge importable; its JSON answer."""
    return run_with_specforge("specforge_read.py", run_dir, specforge_tree, "SpecForge's reader refused")
