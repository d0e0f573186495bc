"""A run's files as the long-run benchmarks write them (operator_run.py, bench_memory.py): a prompt file
and a config that asks it from a simulator, one dataset, the run directory `run/` beside them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from draftgen.core.config_values import toml_value


def _table(header: str, keys: dict[str, Any]) -> str:
    return f"[{header}]\n" + "".join(f"{key} = {toml_value(value)}\n" for key, value in keys.items())


def write_run(root: Path, url: str, *, dataset: str, n: int, concurrency: int, max_tokens: int,
              request_timeout_s: float, tables: dict[str, dict[str, Any]] | None = None,
              prompt: Callable[[int], str] = lambda i: f"Question {i}") -> Path:
    """`root`/p.jsonl (n prompts, ids p0000000 on, `prompt(i)` each) and `root`/c.toml, which asks them of
    `url` with the key in $BENCH_KEY; `tables`: the config's other tables ({"engine": {...}, ...}), each
    value written as TOML. Returns the config's path."""
    with open(root / "p.jsonl", "wb") as f:
        for i in range(n):
            f.write(orjson.dumps({"id": f"p{i:07d}", "prompt": prompt(i)}) + b"\n")
    path = root / "c.toml"
    path.write_text(
        _table("api", {"base_url": url, "api_key_env": "BENCH_KEY", "request_timeout_s": request_timeout_s})
        + "".join(_table(header, keys) for header, keys in (tables or {}).items())
        + _table("output", {"dir": "run"})
        + _table("[datasets]", {"name": dataset, "concurrency": concurrency, "max_tokens": max_tokens,
                                "prompts": "p.jsonl"}))
    return path
