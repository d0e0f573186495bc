"""Hidden-state extraction: the target model over merged/tokens, written in SpecForge's offline format.

File format: layout.py. Entry points: `extract()` (library, sync) and `extract_command()` (CLI).
Importing this package is cheap and needs no torch; the names below load their module (and
torch) on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "extract_command": "command", "parse_shard": "command",
    "extract": "runner", "ExtractStats": "stats", "plan_batches": "plan", "bytes_needed": "disk",
    "stats_path": "stats",
    "ExtractBackend": "backend", "make_backend": "backend",
    "KEYS": "layout", "ROWS_PER_DIR": "layout", "load_sample": "layout", "sample_path": "layout",
    "ModelDims": "model_info", "eagle3_layers": "model_info", "read_model_dims": "model_info",
    "resolve_aux_layers": "model_info",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
