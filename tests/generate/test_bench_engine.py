"""benchmarks/bench_engine.py's A/B rows run the other checkout's code: `--ab-code DIR` with DIR a copy of
the packages (as a `git archive` has them: `core`, `tui`, ... with no `draftgen/` folder), and a row whose
draftgen.core is not DIR's stops the benchmark."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_engine.py"


def _load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("draftgen_bench_engine", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_ab_row_runs_the_other_checkouts_engine(tmp_path):
    """The engine_ab row's engine is the copy's (the figures say which checkout's draftgen.core ran),
    the engine row's this checkout's: the editable install's finder does not win over DIR."""
    other = tmp_path / "other"
    for name in ("core", "tui", "cli", "simulator", "headless"):
        shutil.copytree(ROOT / name, other / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, str(BENCH), "--n", "30", "--concurrency", "3", "--no-concurrency",
                          "--rows", "bare,engine,engine_ab", "--ab-code", str(other)],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"engine: {ROOT}; engine_ab: {other.resolve()}" in out.stdout.splitlines(), out.stdout


def test_a_row_that_imported_other_code_stops_the_benchmark(tmp_path, monkeypatch):
    """A child told to run DIR's code checks where its draftgen.core came from and stops, naming both."""
    bench = _load_bench()
    monkeypatch.setenv(bench.CODE_ENV, str(tmp_path))
    with pytest.raises(SystemExit, match=f"imported draftgen.core from {ROOT}.*not from {tmp_path}"):
        bench.check_code()
    monkeypatch.setenv(bench.CODE_ENV, str(ROOT))
    bench.check_code()  # this checkout's, as told


def test_ab_code_names_a_checkout(tmp_path):
    bench = _load_bench()
    (tmp_path / "ab").mkdir()
    with pytest.raises(SystemExit, match="neither a checkout"):
        bench.code_path(str(tmp_path / "nothing"), tmp_path / "ab")
    folder = Path(bench.code_path(str(ROOT), tmp_path / "ab"))
    assert (folder / "draftgen" / "core").resolve() == ROOT / "core"
    assert os.path.isfile(folder / "draftgen" / "__init__.py")
