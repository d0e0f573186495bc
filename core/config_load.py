"""Loading a config: the TOML file read, every table built from its keys (`config_values`) and checked
(`config_checks`), relative paths resolved against the file's folder, into one frozen `Config`.

Unknown keys and bad values raise ConfigError naming the file and the dotted key; the checks run in a
fixed order (the top level, each table's types, [request], each dataset, then the other tables), so
a file with several mistakes is told the same first one every time.
"""

from __future__ import annotations

import dataclasses
import stat
import tomllib
import typing
from pathlib import Path
from typing import Any

from draftgen.core.config import ApiConfig, Config
from draftgen.core.config_checks import check_cycles, check_dataset, check_tables, check_turns
from draftgen.core.config_tables import DatasetConfig, ExtractConfig, OutputConfig, TokenizerConfig
from draftgen.core.config_values import build_table
from draftgen.core.errors import ConfigError
from draftgen.core.request_keys import COMPLETION_LIMIT_KEYS, check_reasoning_budget, check_request_table, known_key


def _tables(*names: str) -> dict[str, type]:
    """Each table of `names` with the type of its field of `Config` (the dataclass it is built as)."""
    hints = typing.get_type_hints(Config)
    return {name: hints[name] for name in names}


# The file's tables but [request] and [[datasets]], in the order their keys' types are checked in.
_TABLES = _tables("api", "budget", "tokenizer", "output", "engine", "merge", "extract", "smoke", "validation",
                  "monitor")


def load_config(path: str | Path) -> Config:
    file = Path(path)
    try:
        raw = tomllib.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{file}: config file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{file}: not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"{file}: cannot read: {e.strerror}") from None
    return config_from_dict(raw, file)


def config_from_dict(raw: dict[str, Any], file: Path) -> Config:
    _check_top_level(raw, file)
    base = file.resolve().parent
    api_table, servers = _base_urls(raw.get("api", {}), file)
    parts = {name: build_table(cls, api_table if name == "api" else raw.get(name, {}), name, file)
             for name, cls in _TABLES.items()}
    api: ApiConfig = parts["api"]
    if servers:
        api = parts["api"] = dataclasses.replace(api, servers=servers)
    request, pass_through = _request_table(raw, file, api)
    datasets = _datasets(raw, file, base, api, request, pass_through)
    check_tables(file, parts)
    tokenizer: TokenizerConfig = parts["tokenizer"]
    extract: ExtractConfig = parts["extract"]
    # A local tokenizer folder is resolved against the config; an HF id (org/name) stays as written.
    tok_path = tokenizer.path
    if tok_path.startswith((".", "/", "~")) or _exists(base / tok_path):
        tokenizer = dataclasses.replace(tokenizer, path=str(base / Path(tok_path).expanduser()))
    if extract.model and (extract.model.startswith((".", "/", "~")) or _exists(base / extract.model)):
        extract = dataclasses.replace(extract, model=str(base / Path(extract.model).expanduser()))
    output: OutputConfig = parts["output"]
    out_dir = base / output.dir
    if _exists(out_dir) and not out_dir.is_dir():
        raise ConfigError(f"{file}: output.dir names {out_dir}, which is a file, not a folder: point output.dir "
                          f"at a folder (it is created if missing)")
    return Config(
        path=file, api=api, request=request, budget=parts["budget"], tokenizer=tokenizer,
        output=dataclasses.replace(output, dir=out_dir), datasets=tuple(datasets), engine=parts["engine"],
        merge=parts["merge"], extract=extract, smoke=parts["smoke"], validation=parts["validation"],
        monitor=parts["monitor"],
    )


def _check_top_level(raw: dict[str, Any], file: Path) -> None:
    """Only known tables and keys at the top, and no retired extract backend."""
    known = set(_TABLES) | {"request", "datasets"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{file}: unknown table or key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    extract_table = raw.get("extract")
    if isinstance(extract_table, dict) and extract_table.get("backend") == "sglang":
        raise ConfigError(f"{file}: extract.backend = \"sglang\" was replaced by \"specforge\" (SpecForge's maintained "
                          f"SGLang capture, pinned; see docs/gpu-extraction.md)")


def _base_urls(table: Any, file: Path) -> tuple[Any, tuple[str, ...]]:
    """The [api] table with `base_url` one URL (a list's first), and the list's URLs (() for one URL). A list
    is a fleet of self-hosted servers: each a string, none twice, and not OpenRouter's (one API, one URL)."""
    if not isinstance(table, dict) or not isinstance(urls := table.get("base_url"), list):
        return table, ()
    if not urls:
        raise ConfigError(f"{file}: api.base_url = [] names no server: give one URL, or a list of them")
    for i, url in enumerate(urls):
        if not isinstance(url, str):
            raise ConfigError(f"{file}: api.base_url[{i}] must be a string (a URL), not {url!r}")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"{file}: api.base_url[{i}] must start with http:// or https://, not {url!r}")
        if "openrouter.ai" in url or table.get("kind") == "openrouter":
            raise ConfigError(f"{file}: api.base_url[{i}] = {url!r}: a list of URLs is a fleet of self-hosted "
                              f"servers (vLLM, SGLang); OpenRouter is one API at one URL: give it as a string")
    seen = [url.rstrip("/") for url in urls]
    for i, url in enumerate(seen):
        if url in seen[:i]:
            raise ConfigError(f"{file}: api.base_url[{i}] = {urls[i]!r} is listed twice")
    servers = tuple(seen) if len(seen) > 1 else ()
    return {**table, "base_url": urls[0]}, servers


def _request_table(raw: dict[str, Any], file: Path, api: ApiConfig) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The [request] table, checked, and the keys api.request_pass_through lets through unchecked."""
    request = raw.get("request", {})
    if not isinstance(request, dict):
        raise ConfigError(f"{file}: [request] must be a table, not {request!r}")
    for i, key in enumerate(api.request_pass_through):
        if known_key(key):
            raise ConfigError(f"{file}: api.request_pass_through[{i}] = {key!r} is a request key draftgen knows "
                              f"(core/request_keys.py decides what it may do): remove it from the list")
    pass_through = tuple(api.request_pass_through)
    check_request_table(file, "request", request, openrouter=api.openrouter_for_sure, pass_through=pass_through)
    return request, pass_through


def _datasets(raw: dict[str, Any], file: Path, base: Path, api: ApiConfig, request: dict[str, Any],
              pass_through: tuple[str, ...]) -> list[DatasetConfig]:
    """Every [[datasets]] entry, checked, with its answer cap settled and its prompts path resolved."""
    raw_datasets = raw.get("datasets")
    if not raw_datasets:
        raise ConfigError(f"{file}: no [[datasets]] (at least one is needed)")
    if not isinstance(raw_datasets, list):
        raise ConfigError(f"{file}: datasets must be an array of tables ([[datasets]])")
    datasets = []
    names: set[str] = set()
    for i, table in enumerate(raw_datasets):
        ds: DatasetConfig = build_table(DatasetConfig, table, f"datasets[{i}]", file)
        own = f"datasets[{i}].request"
        check_request_table(file, own, ds.request, openrouter=api.openrouter_for_sure, pass_through=pass_through,
                            dataset=ds.name)
        check_dataset(file, i, ds, names)
        names.add(ds.name)
        ds = _completion_limit(file, i, ds, "max_tokens" in table, request)
        check_reasoning_budget(file, "request", request, ds.max_tokens, ds.name)
        check_reasoning_budget(file, own, ds.request, ds.max_tokens, ds.name)
        check_turns(file, i, ds, table)
        check_cycles(file, i, ds, table, request)
        prompts = base / ds.prompts
        _check_prompts_path(file, f"datasets[{i}].prompts", prompts)
        datasets.append(dataclasses.replace(ds, prompts=prompts))
    return datasets


def _completion_limit(file: Path, i: int, ds: DatasetConfig, explicit: bool, request: dict[str, Any]) -> DatasetConfig:
    """The dataset with the one answer cap its requests carry. An answer cap (`max_tokens`,
    `max_completion_tokens`, `max_output_tokens`, `max_new_tokens`: servers honour one name or another,
    so all are one cap) in [request] or the dataset's `request` must equal the dataset's `max_tokens`
    when that is set (the reservation and the token budget use it); set only in a request table, it is
    the dataset's."""
    found: dict[str, tuple[str, int]] = {}  # key -> (where, value), the dataset's table over [request] as in the body
    for where, table in (("request", request), (f"datasets[{i}].request", ds.request)):
        for key in COMPLETION_LIMIT_KEYS:
            if key not in table:
                continue
            value = table[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{file}: {where}.{key} must be a positive integer, not {value!r}")
            found[key] = (f"{where}.{key}", value)
    if not found:
        return ds
    caps = list(found.values())
    if explicit:
        for name, value in caps:
            if value != ds.max_tokens:
                raise ConfigError(f"{file}: {name} = {value} differs from datasets[{i}].max_tokens = {ds.max_tokens} "
                                  f"({ds.name}): the server would get {value} while the budgets reserve "
                                  f"{ds.max_tokens}; set one of them, or both to the same value")
        return ds
    (first, cap), *others = caps
    for name, value in others:
        if value != cap:
            raise ConfigError(f"{file}: {name} = {value} differs from {first} = {cap} ({ds.name}): the answer "
                              f"cap must be one number; set datasets[{i}].max_tokens instead")
    return dataclasses.replace(ds, max_tokens=cap)


def _check_prompts_path(file: Path, where: str, path: Path) -> None:
    """A prompt file must be a regular file: a FIFO blocks forever, a device never ends, a folder has no lines.
    A missing one is said when the dataset is read (a config may be written before its prompt files)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if stat.S_ISREG(mode):
        return
    kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "not a regular file")
    raise ConfigError(f"{file}: {where} names {path}, which is {kind}: a prompt file must be a regular "
                      f"JSONL(.gz) file")


def _exists(path: Path) -> bool:
    """Path.exists() that says no (instead of raising) for a name too long for the filesystem."""
    try:
        return path.exists()
    except OSError:
        return False
