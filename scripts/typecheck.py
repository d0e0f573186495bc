"""Type-check draftgen with mypy, as CI does: `python scripts/typecheck.py [folder ...]` (default: every
installed folder, core/ tui/ cli/ simulator/ headless/; a folder alone needs core/ with it, as it imports it).

The packages are mapped by setuptools' `package-dir` (`draftgen.core` is the folder `core/`), which an
editable install serves through an import hook mypy cannot follow, and there is no `draftgen/` folder
for mypy to find the modules under their real names. So this script lists the folder's files itself,
gives each its installed name (`core/live/hub.py` is `draftgen.core.live.hub`) and hands that list to
mypy, which reads everything else (levels per module, third-party modules) from `[tool.mypy]` in
pyproject.toml. Errors name the real files. Exit status: mypy's (0 clean, 1 errors, 2 a crash).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from mypy import util
from mypy.fscache import FileSystemCache
from mypy.main import process_options, run_build

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("core", "tui", "cli", "simulator", "headless")  # each is draftgen.<folder> once installed


def main(argv: list[str]) -> int:
    os.chdir(ROOT)  # folders, error paths and .mypy_cache/ are the repository's, wherever it is run from
    folders = argv or list(FOLDERS)
    unknown = [f for f in folders if f.split("/")[0] not in FOLDERS]
    if unknown:
        print(f"typecheck: {unknown} is not one of {FOLDERS} (or a folder under one)", file=sys.stderr)
        return 2
    t0 = time.time()
    fscache = FileSystemCache()
    sources, options = process_options(["--config-file", str(ROOT / "pyproject.toml"), *folders], fscache=fscache)
    for source in sources:
        rel = Path(source.path).resolve().relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        source.module = ".".join(("draftgen", *parts))
        source.base_dir = None
    _, messages, blockers = run_build(sources, options, fscache, t0, sys.stdout, sys.stderr)
    n_errors, n_notes, n_files = util.count_stats(messages)
    formatter = util.FancyFormatter(sys.stdout, sys.stderr, options.hide_error_codes)
    if n_errors:
        print(formatter.format_error(n_errors, n_files, len(sources), blockers=blockers))
        return 2 if blockers else 1
    print(formatter.format_success(len(sources)) + f" ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
