"""Hostile and broken input across the product: configs, prompt files, answers, tokenizer folders.

Each bad input gets a clear message naming the file (and the key or line where there is one),
through the real `draftgen` command: exit code 2, `draftgen: error: ...` on stderr, no traceback;
and nothing already written in the run directory is touched. Over 400 lines: one table of bad
inputs per file kind, all checked through the same command runner.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import hashlib
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftgen.core.config import ApiConfig, Config
from draftgen.core.config_load import load_config
from draftgen.core.config_tables import (
    BudgetConfig,
    DatasetConfig,
    EngineConfig,
    ExtractConfig,
    MergeConfig,
    OutputConfig,
    SmokeConfig,
    TokenizerConfig,
)
from draftgen.core.config_values import key_fields
from draftgen.core.errors import ConfigError, NoPromptError, PromptFileError
from draftgen.core.generate.loop.engine import Engine
from draftgen.core.generate.loop.prompt_files import read_prompts
from draftgen.core.generate.loop.prompts import Prompt, Rejection
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.store import TokenReader
from draftgen.core.tokens.tokenizer import bundled_kimi, bundled_kimi_path
from draftgen.core.tokens.workers import reconstruct_dataset
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import TEST_KEY, cli_env, make_config, serve_local

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                derandomize=True)


def cli(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    # Wide: rich folds table cells at the default 80 columns of a pipe.
    return subprocess.run([sys.executable, "-m", "draftgen.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=cli_env(COLUMNS="250"))


def assert_clean_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert proc.stderr.startswith("draftgen: error: "), proc.stderr[-2000:]
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


def assert_no_traceback(proc: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in proc.stderr + proc.stdout, (proc.stdout + proc.stderr)[-3000:]


def digests(root: Path, skip: tuple[str, ...] = ("run.json", "events.log", "run.lock")) -> dict[str, str]:
    """What is already written in a run directory (run.json is rewritten at each start, events.log grows,
    run.lock names the process that last held it)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name not in skip}


# ---------------------------------------------------------------------------------------------
# Config files

_TABLE_CLASSES = {"api": ApiConfig, "budget": BudgetConfig, "tokenizer": TokenizerConfig, "output": OutputConfig,
                  "engine": EngineConfig, "merge": MergeConfig, "extract": ExtractConfig, "smoke": SmokeConfig,
                  "datasets": DatasetConfig}
KEYS = sorted({f.name for cls in _TABLE_CLASSES.values() for f in key_fields(cls)}
              | {"unknown_key", "messages", "model", "provider", "datasets", "api"})
HEADERS = [f"[{t}]" for t in (*_TABLE_CLASSES, "request", "request.provider", "bogus")] + \
          ["[[datasets]]", "[[api]]", "[[datasets.request]]", ""]


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return {float("inf"): "inf", float("-inf"): "-inf"}.get(v, "nan" if v != v else repr(v))
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return orjson.dumps(v).decode()
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"


_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
_scalar = st.one_of(st.integers(-2**63, 2**63 - 1), st.floats(), st.booleans(), _text,
                    st.sampled_from(["http://127.0.0.1:1/v1", "eagle3", "hf", "kimi-k2.5", "auto", ".", "a/b", "x",
                                     "n" * 300]))
_value = st.recursive(_scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.sampled_from(KEYS), inner, max_size=3)),
                      max_leaves=6)
_TYPED = {float: st.floats(), int: st.integers(-2**63, 2**63 - 1), bool: st.booleans(), str: _text, Path: _text}


def _fields(table: str, typed_only: bool) -> st.SearchStrategy[dict[str, Any]]:
    """Some of a table's own keys, each with a value of its own type (nan, inf, NUL, huge included),
    or (unless typed_only) anything at all."""
    cls = _TABLE_CLASSES[table]
    hints = typing.get_type_hints(cls)

    def value_for(name: str) -> st.SearchStrategy[Any]:
        hint = hints[name]
        if typing.get_origin(hint) is typing.Literal:
            return st.sampled_from(typing.get_args(hint)) if typed_only else st.one_of(
                st.sampled_from(typing.get_args(hint)), _value)
        kinds = [t for t in _TYPED if t is hint or t in typing.get_args(hint)]
        typed = [_TYPED[t] for t in kinds]
        return st.one_of(*typed) if typed and typed_only else st.one_of(*typed, _value)
    return st.fixed_dictionaries({}, optional={f.name: value_for(f.name) for f in key_fields(cls)})


_random_section = st.tuples(st.sampled_from(HEADERS),
                            st.lists(st.tuples(st.sampled_from(KEYS), _value), max_size=5))
# Well-formed TOML with the real tables and keys, a few of them set to values of their own type
# (nan, inf, NUL, extremes): what is left to catch is a bad value that gets through.
_TABLE_FIELDS = [(t, f.name) for t, cls in _TABLE_CLASSES.items() for f in key_fields(cls)]


def _one_value(table_field: tuple[str, str]) -> st.SearchStrategy[tuple[str, str, Any]]:
    table, name = table_field
    return _fields(table, typed_only=True).map(lambda kv: kv.get(name, ...)).filter(
        lambda v: v is not ...).map(lambda v: (table, name, v))


def _shape(settings: list[tuple[str, str, Any]]) -> tuple[list[tuple[str, list[tuple[str, Any]]]], bool, list[str]]:
    tables: dict[str, dict[str, Any]] = {"datasets": {"name": "a", "prompts": "p.jsonl"}}
    for table, name, value in settings:
        tables.setdefault(table, {})[name] = value
    sections = [(f"[{t}]", list(kv.items())) for t, kv in tables.items() if t != "datasets"]
    return sections + [("[[datasets]]", list(tables["datasets"].items()))], False, []


_shaped = st.lists(st.sampled_from(_TABLE_FIELDS).flatmap(_one_value), min_size=1, max_size=2).map(_shape)
_document = st.one_of(
    st.tuples(st.lists(st.one_of(_random_section, st.sampled_from(sorted(_TABLE_CLASSES)).flatmap(
        lambda t: st.tuples(st.just("[[datasets]]" if t == "datasets" else f"[{t}]"),
                            _fields(t, typed_only=False).map(lambda kv: list(kv.items()))))), max_size=6),
              st.booleans(), st.lists(_text, max_size=2)),
    _shaped)


def render(doc: tuple[list[tuple[str, list[tuple[str, Any]]]], bool, list[str]]) -> str:
    sections, with_dataset, garbage = doc
    lines = []
    for header, pairs in sections:
        lines.append(header)
        lines += [f"{k} = {toml_value(v)}" for k, v in pairs]
    if with_dataset:
        lines += ["[[datasets]]", 'name = "a"', 'prompts = "p.jsonl"']
    return "\n".join(lines + garbage) + "\n"


def assert_loaded_config_is_sane(cfg: Config) -> None:
    """What load_config accepts is usable: finite numbers, no NUL in names or paths."""
    def walk(value: Any, where: str) -> None:
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), f"{where}.{f.name}")
        elif isinstance(value, float):
            assert np.isfinite(value), where
        elif isinstance(value, (str, Path)):
            assert "\x00" not in str(value), where
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{where}[{i}]")
    for name in ("api", "budget", "tokenizer", "output", "engine", "merge", "extract", "smoke", "datasets"):
        walk(getattr(cfg, name), name)


@pytest.mark.slow
@FUZZ
@given(doc=_document)
def test_any_toml_ish_config_loads_or_raises_config_error_naming_the_file(tmp_path_factory, doc):
    path = tmp_path_factory.mktemp("cfg") / "fuzz.toml"
    path.write_text(render(doc), encoding="utf-8")
    try:
        cfg = load_config(path)
    except ConfigError as e:
        assert str(path) in str(e)
        return
    assert_loaded_config_is_sane(cfg)


@FUZZ
@given(data=st.binary(max_size=300))
def test_any_bytes_as_a_config_give_config_error(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("cfg") / "bytes.toml"
    path.write_bytes(b"[[datasets]]\nname = 'a'\nprompts = 'p'\n" + data)
    try:
        load_config(path)
    except ConfigError as e:
        assert str(path) in str(e)


GOOD_CONFIG = """[api]
base_url = "http://127.0.0.1:9/api/v1"
api_key_env = "DG_TEST_KEY"
[budget]
max_usd = 10.0
[engine]
workers = 1
[[datasets]]
name = "a"
prompts = "prompts.jsonl"
concurrency = 4
"""


@pytest.mark.parametrize("edit, needles", [
    (("concurrency = 4", 'concurrency = "lots"'), ["datasets[0].concurrency must be an integer", "'lots'"]),
    (("workers = 1", "workers = 1\nparalel = true"), ["unknown key engine.paralel"]),
    (("[budget]", "[budgets]"), ["unknown table or key 'budgets'"]),
    (("[[datasets]]", "[datasets]"), ["datasets must be an array of tables"]),
    (('[api]\nbase_url = "http://127.0.0.1:9/api/v1"\n', "api = 3\n[engine.x]\n"), ["[api] must be a table, not 3"]),
    (("max_usd = 10.0", "max_usd = nan"), ["budget.max_usd must be a finite number, not nan"]),
    (("max_usd = 10.0", "max_usd = inf"), ["budget.max_usd must be a finite number, not inf"]),
    (('name = "a"', 'name = "a\\u0000b"'), ["datasets[0].name must not contain a NUL character"]),
    (('prompts = "prompts.jsonl"', 'prompts = "p\\u0000.jsonl"'), ["datasets[0].prompts must not contain a NUL"]),
    (("workers = 1", "workers = 100000000"), ["engine.workers must be at most 1024"]),
    (("[api]", "[api]\nrequest_timeout_s = -inf"), ["api.request_timeout_s must be a finite number"]),
    (('name = "a"', "name = 'a'\nname = 'b'"), ["not valid TOML", "line 10"]),
    ((None, "\xff\xfe\x00"), ["not UTF-8 text"]),
], ids=["wrong-type", "unknown-key", "unknown-table", "datasets-not-array", "table-not-table", "nan", "inf",
        "nul-name", "nul-path", "workers", "neg-inf", "duplicate-key", "garbage-bytes"])
def test_bad_config_through_the_cli(tmp_path, edit, needles):
    path = tmp_path / "bad.toml"
    old, new = edit
    if old is None:  # bytes that are not UTF-8 in front of a good config
        path.write_bytes(new.encode("latin-1") + GOOD_CONFIG.encode())
    else:
        assert old in GOOD_CONFIG
        path.write_text(GOOD_CONFIG.replace(old, new, 1), encoding="utf-8")
    assert_clean_error(cli("run", str(path), "--headless", "--skip-smoke"), str(path), *needles)


def test_config_that_is_not_a_file(tmp_path):
    assert_clean_error(cli("smoke", str(tmp_path)), str(tmp_path), "cannot read")
    assert_clean_error(cli("merge", str(tmp_path / "missing.toml")), "config file not found")


# ---------------------------------------------------------------------------------------------
# Prompt files

HUGE = 10 * 1024 * 1024


def hostile_prompt_lines() -> list[tuple[bytes, str | None]]:
    """(line, expected rejection reason fragment or None for an accepted prompt)."""
    deep = b"[" * 200_000 + b"]" * 200_000
    return [
        (orjson.dumps({"id": "ok-1", "prompt": "fine"}), None),
        (b"\xc3\x28" + b'{"id": "x"}', "not valid UTF-8"),                          # bad continuation byte
        (b'{"id": "ov", "prompt": "\xc0\xaf"}', "not valid UTF-8"),                 # overlong encoding
        (b'{"id": "sur", "prompt": "\xed\xa0\x80"}', "not valid UTF-8"),            # an encoded surrogate
        (b'{"id": "cut", "prompt": "\xe4\xbd"}', "not valid UTF-8"),                # cut mid-character
        (b'{"id": "lone", "prompt": "\\ud800"}', "not valid JSON"),                 # a lone surrogate escape
        (deep, "not valid JSON"),                                                   # nested past any limit
        (b'{"id": "nest", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "not valid JSON"),
        (orjson.dumps({"id": "nested-ok", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                    {"type": "text", "text": "b"}]}]}),
         None),
        (orjson.dumps({"id": "parts", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
         "content must be a string"),
        (orjson.dumps({"id": {"a": [1]}, "prompt": "x"}), "bad id"),
        (orjson.dumps({"id": 1.5, "prompt": "x"}), "bad id"),
        (orjson.dumps({"id": True, "prompt": "x"}), "bad id"),
        (orjson.dumps({"id": "nul\x00id", "prompt": "with a NUL \x00 inside"}), None),
        (orjson.dumps({"id": "deep-msg", "messages": [[[{"role": "user"}]]]}), "must be an object"),
        (orjson.dumps({"id": "role", "conversations": [{"from": {"x": 1}, "value": "v"}]}), "unknown role"),
        (orjson.dumps({"id": 7, "prompt": "seven"}), None),
        (orjson.dumps({"id": "7", "prompt": "seven again"}), "duplicate id '7'"),
        (orjson.dumps({"id": "ok-1", "prompt": "again"}), "duplicate id 'ok-1'"),
        (orjson.dumps({"id": "nop"}), "no `prompt`"),
        (orjson.dumps({"id": "nop", "prompt": "now with a prompt"}), None),  # a rejected line's id is free
        (b"   \t  ", "blank"),
        (b"\x00\x00\x00", "not valid JSON"),
        (b'{"id": "big-garbage", "prompt": "' + b"x" * HUGE, "not valid JSON"),  # 10 MB, never closed
        (orjson.dumps({"id": "big", "prompt": "y" * HUGE}), None),                 # a valid 10 MB prompt
        (orjson.dumps({"id": "after-big", "prompt": "still read, with the right line number"}), None),
        (b"\r", "blank"),
        (orjson.dumps({"id": "crlf", "prompt": "windows line end"}) + b"\r", None),
    ]


def test_hostile_prompt_lines_are_rejected_with_line_and_reason(tmp_path):
    cases = hostile_prompt_lines()
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(line for line, _ in cases) + b"\n")
    items = {item.line: item for item in read_prompts(path)}
    for line_no, (_, expect) in enumerate(cases, 1):
        item = items.get(line_no)
        if expect == "blank":
            assert item is None, (line_no, item)
        elif expect is None:
            assert isinstance(item, Prompt), (line_no, item)
        else:
            assert isinstance(item, Rejection) and expect in item.reason, (line_no, expect, item)
    assert items[1].id == "ok-1", "a UTF-8 byte-order mark does not cost the first prompt"
    assert len(items[len(cases) - 3].messages[0]["content"]) == HUGE
    assert all(item.id is None or len(item.id) <= 200 for item in items.values() if isinstance(item, Rejection))


@pytest.mark.slow
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(st.one_of(
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")),
    st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-10, 10), st.text(max_size=5)),
                 lambda inner: st.one_of(st.lists(inner, max_size=3),
                                         st.dictionaries(st.sampled_from(["id", "prompt", "messages", "conversations",
                                                                          "role", "content", "from", "value"]),
                                                         inner, max_size=4)),
                 max_leaves=8).map(orjson.dumps)), max_size=20), gz=st.booleans())
def test_any_prompt_file_reads_to_prompts_and_rejections(tmp_path_factory, lines, gz):
    path = tmp_path_factory.mktemp("p") / ("p.jsonl.gz" if gz else "p.jsonl")
    data = b"".join(line + b"\n" for line in lines)
    path.write_bytes(gzip.compress(data) if gz else data)
    if not gz and data.startswith(b"\x1f\x8b"):  # looks like gzip and is not: a clear error is right too
        with pytest.raises(PromptFileError, match="cannot read the file"):
            list(read_prompts(path))
        return
    items: list = []
    try:
        items.extend(read_prompts(path))
    except NoPromptError:  # no usable line at all: an error at the end, the lines read as before
        assert not any(isinstance(i, Prompt) for i in items)
    numbers = [i.line for i in items]
    assert numbers == sorted(set(numbers))
    unbommed = [line[3:] if i == 0 and line.startswith(b"\xef\xbb\xbf") else line for i, line in enumerate(lines)]
    assert len(items) == sum(1 for line in unbommed if line.strip())
    ids = [i.id for i in items if isinstance(i, Prompt)]
    assert len(ids) == len(set(ids))


def test_empty_and_blank_prompt_files(tmp_path):
    for name, data in (("empty.jsonl", b""), ("blank.jsonl", b"\n\n  \n\t\n"), ("empty.jsonl.gz", gzip.compress(b""))):
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(NoPromptError, match="no prompt in it"):  # an error, not an empty "complete" run
            list(read_prompts(path))


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "header-only", "folder"])
def test_broken_gzip_or_path_names_the_file(tmp_path, damage):
    data = varied_prompt_lines(3000)
    path = tmp_path / "p.jsonl.gz"
    packed = gzip.compress(data)
    if damage == "truncated":
        path.write_bytes(packed[: len(packed) // 2])
    elif damage == "corrupt":
        broken = bytearray(packed)
        for i in range(200, 260):
            broken[i] ^= 0x55
        path.write_bytes(bytes(broken))
    elif damage == "header-only":
        path.write_bytes(packed[:10])
    else:
        path.mkdir()
    with pytest.raises(PromptFileError) as e:
        list(read_prompts(path))
    assert str(path) in str(e.value)
    assert ("line " in str(e.value)) if damage != "folder" else ("is a folder" in str(e.value))


async def finished_run(tmp_path: Path, n: int = 12) -> Config:
    """A run that answered every prompt and reconstructed its tokens, as a user has before editing things.
    Its tokenizer folder `tok` is a link to the bundled one until a case breaks a copy of it."""
    (tmp_path / "tok").symlink_to(bundled_kimi_path(), target_is_directory=True)
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=60), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": n, "concurrency": 4}],
                          tables={"tokenizer": {"path": str(tmp_path / "tok")}, "engine": {"workers": 1}})
        assert await Engine(cfg, TEST_KEY, seed=1).run() == "DONE"
    reconstruct_dataset(cfg, "a", workers=1)
    RunDir(cfg.run_dir).rejected("a").write_bytes(b'{"line": 99, "id": null, "reason": "kept from before"}\n')
    return cfg


def break_prompts(cfg: Config, how: str) -> None:
    path = cfg.datasets[0].prompts
    good = path.with_suffix(".good")
    if not good.exists():
        path.rename(good)
    elif path.is_dir():
        path.rmdir()
    else:
        path.unlink()
    if how == "folder":
        path.mkdir()
        return
    packed = gzip.compress(good.read_bytes() + varied_prompt_lines(2000))
    if how == "truncated-gz":
        path.write_bytes(packed[: len(packed) // 2])
    else:  # a valid header, then a deflate stream that goes wrong (zlib.error, not a CRC mismatch)
        broken = bytearray(packed)
        for i in range(200, 260):
            broken[i] ^= 0x55
        path.write_bytes(bytes(broken))


def varied_prompt_lines(n: int) -> bytes:
    """Prompt lines that do not compress to almost nothing (so damage hits the deflate stream itself)."""
    rng = np.random.default_rng(3)
    words = np.array(["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"])
    return b"".join(orjson.dumps({"id": f"z{i}", "prompt": " ".join(f"{w}{k}" for w, k in zip(
        rng.choice(words, 30), rng.integers(0, 999, 30)))}) + b"\n" for i in range(n))


def break_tokenizer(cfg: Config, how: str) -> None:
    folder = Path(cfg.tokenizer.path)
    if folder.is_symlink():
        folder.unlink()
    elif folder.exists():
        shutil.rmtree(folder)
    if how == "missing":
        return
    folder.mkdir()
    if how in ("empty", "bad-tokenizer-json"):
        if how == "bad-tokenizer-json":
            (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {')
        return
    for name in ("tiktoken.model", "special_tokens.json"):
        (folder / name).write_bytes((bundled_kimi_path() / name).read_bytes())
    model = folder / "tiktoken.model"
    if how == "garbage-model":
        model.write_bytes(os.urandom(4096))
    elif how == "cut-model":  # an interrupted copy: whole lines, too few of them
        model.write_bytes(b"\n".join(model.read_bytes().splitlines()[:120_000]) + b"\n")
    elif how == "cut-mid-line":
        model.write_bytes(model.read_bytes()[:1_000_003])
    elif how == "bad-table":
        (folder / "special_tokens.json").write_text('{"named": {"<|im_end|>": "x"')


BROKEN = [  # (what, how, command, words the message must hold)
    ("prompts", "truncated-gz", "run", ["prompts/a.jsonl", ": line ", "cannot read the file"]),
    ("prompts", "corrupt-gz", "run", ["prompts/a.jsonl", ": line ", "cannot read the file"]),
    ("tokenizer", "missing", "run", ["tok", "tokenizer folder not found"]),
    ("tokenizer", "empty", "tokens", ["tok", "no tokenizer here"]),
    ("tokenizer", "garbage-model", "tokens", ["tok/tiktoken.model", "is not a tiktoken BPE entry"]),
    ("tokenizer", "cut-model", "tokens", ["tok/tiktoken.model", "holds 120,000 tokens", "cut short"]),
    ("tokenizer", "cut-mid-line", "run", ["tok/tiktoken.model", "is not a tiktoken BPE entry"]),
    ("tokenizer", "bad-table", "tokens", ["tok/special_tokens.json", "not valid JSON"]),
    ("tokenizer", "bad-tokenizer-json", "tokens", ["tok/tokenizer.json", "not a valid tokenizer.json"]),
    # Last: a folder is refused when the config loads, before the tokenizer cases above could be reached.
    ("prompts", "folder", "run", ["prompts/a.jsonl", "is a folder"]),
]


@pytest.mark.slow
async def test_broken_inputs_fail_clearly_and_damage_nothing(tmp_path):
    cfg = await finished_run(tmp_path)
    root = RunDir(cfg.run_dir).root
    before = digests(root)
    for what, how, command, needles in BROKEN:
        (break_prompts if what == "prompts" else break_tokenizer)(cfg, how)
        args = ["run", str(cfg.path), "--headless", "--skip-smoke"] if command == "run" else [command, str(cfg.path)]
        proc = await asyncio.to_thread(cli, *args)
        try:
            assert_clean_error(proc, *needles)
        except AssertionError as e:
            raise AssertionError(f"{what} {how}: {e}") from None
        assert digests(root) == before, f"{what} {how}: a failing `{command}` changed what was already written"
        assert not list(root.rglob("*.tmp")), f"{what} {how}: a failing `{command}` left a temporary file"
    events = (root / "events.log").read_text()
    assert "cannot read the file" in events and "tokenizer folder not found" in events


# ---------------------------------------------------------------------------------------------
# Hostile answers: 1 MB, control characters, special-token and markup look-alikes

MB = 1 << 20
CONTROLS = "".join(chr(c) for c in range(32)) + "\x7f\x85\u2028\u2029\ufeff\u200b\u202e"


def hostile_answers() -> dict[str, tuple[str, str]]:
    """name -> (reasoning, content)."""
    words = "the quick brown fox jumps over the lazy dog 你好 世界 ½ ∑ αβγ 🙂 def f(x): return x**2\n".split(" ")
    rng = np.random.default_rng(1)
    big = " ".join(rng.choice(words, size=MB // 5))[:MB]
    return {
        "big": ("Let me think about a long answer. " * 3000, big),
        "controls": (f"Reasoning with controls {CONTROLS} ok", f"Answer with controls {CONTROLS} end\x00"),
        "im_end": ("The user typed <|im_end|> as text; it stays text.",
                   "Kimi ends a turn with <|im_end|>, opens one with <|im_user|>user<|im_middle|> and "
                   "<|im_assistant|>assistant<|im_middle|>; <|im_system|> too."),
        "think_close": ("A reasoning that is fine.", "Then the content says </think> as if it closed again."),
        "think_open": ("A reasoning that is fine.", "The content opens <think> a second think."),
        "markup": ("Two plus two [/think] [bold]", "4 [/INST] [bold red]four[/] [/x] \\[escaped]"),
    }


VALID = {"big", "controls", "im_end", "markup"}


class HostileUpstream:
    """An OpenAI-compatible API on loopback answering `case:NAME` prompts with hostile_answers()[NAME]
    (the smoke test's prompt gets the "markup" answer); `case:surrogate` gets a body that is not
    valid JSON (a lone surrogate escape)."""

    def __init__(self) -> None:
        self.answers = hostile_answers()
        tok = bundled_kimi()
        # Billed like a provider: the answer's real token count (reasoning, </think>, content, <|im_end|>).
        self.billed = {name: len(tok.encode_text(r)) + len(tok.encode_text(c)) + 2
                       for name, (r, c) in self.answers.items()}
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    async def __aenter__(self) -> HostileUpstream:
        app = web.Application(client_max_size=64 * MB)
        app.router.add_post("/api/v1/chat/completions", self._chat)
        app.router.add_get("/api/v1/credits", self._credits)
        app.router.add_get("/api/v1/key", self._key)
        self._runner, port = await serve_local(app)
        self.base_url = f"http://127.0.0.1:{port}/api/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _credits(self, request: web.Request) -> web.Response:
        return web.json_response({"data": {"total_credits": 100.0, "total_usage": 1.0}})

    async def _key(self, request: web.Request) -> web.Response:
        return web.json_response({"data": {"label": "hostile [/x]", "limit_remaining": 99.0}})

    async def _chat(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        prompt = body["messages"][-1]["content"]
        name = prompt.split("case:", 1)[1].split()[0] if "case:" in prompt else "markup"
        if name == "surrogate":
            return web.Response(body=b'{"choices": [{"message": {"content": "\\ud800"}}]}',
                                content_type="application/json")
        reasoning, content = self.answers[name]
        return web.Response(body=orjson.dumps({
            "id": f"gen-{name}", "provider": "Hostile", "model": "moonshotai/kimi-k2.5",
            "choices": [{"message": {"role": "assistant", "content": content, "reasoning": reasoning},
                         "finish_reason": "stop", "native_finish_reason": "stop"}],
            "usage": {"prompt_tokens": 20, "completion_tokens": self.billed[name], "cost": 0.001,
                      "completion_tokens_details": {"reasoning_tokens": 1}}}), content_type="application/json")


HAND_WRITTEN = [  # responses.jsonl lines another tool (or a hand) wrote
    b"[1, 2]", b'"a string"', b"null", b'{"no": "id"}',
    b'{"id": "h0", "messages": "not a list", "content": 5, "usage": [1, 2]}',
    b'{"id": "h1", "messages": [1, null, {"role": 5}], "reasoning": ["x"], "usage": {"completion_tokens": "12",'
    b' "cost": "lots"}}',
    b'{"id": "h-ids", "messages": [{"role": "user", "content": "q"}], "reasoning": "r", "content": "c",'
    b' "token_ids": ["a", -1], "usage": {"completion_tokens": 1180591620717411303424, "cost": 1e308}}',
    b'{"id": "h-neg", "messages": [{"role": "user", "content": "q2"}], "reasoning": "r", "content": "c",'
    b' "token_ids": [99999999999, -5], "truncated": "yes", "usage": {"completion_tokens": -3, "cost": -1}}',
    b'{"id": "h-nul", "messages": [{"role": "user", "content": "q3\\u0000"}], "reasoning": "r\\u0000",'
    b' "content": "c\\u0000", "usage": {"completion_tokens": 6, "cost": 0.1}}',
    b'{"id": {"nested": [1]}, "messages": [], "content": "c"}',
    b'{"id": "torn", "content": "half a line in the middle of the file',
    b"\xff\xfe not UTF-8",
]


@pytest.mark.slow
async def test_hostile_answers_stay_text_and_are_validated_right(tmp_path):
    names = [*hostile_answers(), "surrogate"]
    prompts = tmp_path / "prompts" / "chat[v2].jsonl"
    prompts.parent.mkdir()
    prompts.write_bytes(b"".join(orjson.dumps({"id": n, "prompt": f"case:{n} You said <|im_end|><|im_assistant|>"
                                                                   f"assistant<|im_middle|><think> [/INST]"}) + b"\n"
                                 for n in names))
    hand_prompts = tmp_path / "prompts" / "hand.jsonl"
    hand_prompts.write_bytes(b"".join(orjson.dumps({"id": f"h{i}", "prompt": f"case:im_end {i}"}) + b"\n"
                                      for i in range(5)))
    async with HostileUpstream() as upstream:
        cfg = make_config(tmp_path, upstream.base_url,
                          # max_tokens above the 1 MB answer's count: an answer past it is not kept.
                          [{"name": "chat[v2]", "prompts": str(prompts), "concurrency": 4, "max_tokens": 1_000_000},
                           {"name": "hand", "prompts": str(hand_prompts), "concurrency": 2}],
                          tables={"tokenizer": {"path": str(bundled_kimi_path())},
                                  "engine": {"workers": 1, "max_attempts": 2}})
        run = RunDir(cfg.run_dir)
        run.responses("hand").parent.mkdir(parents=True)
        run.responses("hand").write_bytes(b"\n".join(HAND_WRITTEN) + b"\n")
        hand_before = run.responses("hand").read_bytes()

        smoke = await asyncio.to_thread(cli, "smoke", str(cfg.path))
        assert_no_traceback(smoke)
        assert "[/INST]" in smoke.stdout and "[bold red]four[/]" in smoke.stdout, smoke.stdout[-3000:]
        proc = await asyncio.to_thread(cli, "run", str(cfg.path), "--headless", "--skip-smoke", "--interval", "0.5")
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        assert_no_traceback(proc)
    for command in ("tokens", "merge"):
        out = await asyncio.to_thread(cli, command, str(cfg.path))
        assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
        assert_no_traceback(out)
        assert "chat[v2]" in out.stdout, "a dataset name is text, not rich markup"

    # Every answer is on disk exactly as sent; the one whose body was not JSON failed with a reason.
    records = {r["id"]: r for r in map(orjson.loads, run.responses("chat[v2]").read_bytes().splitlines())}
    for name, (reasoning, content) in hostile_answers().items():
        assert records[name]["content"] == content and records[name]["reasoning"] == reasoning, name
    failed = [orjson.loads(x) for x in run.failures("chat[v2]").read_bytes().splitlines()]
    assert [(f["id"], f["error_kind"]) for f in failed] == [("surrogate", "bad_body")]

    # Look-alikes typed in prompts and answers stay text: the only special tokens are the template's.
    tok = bundled_kimi()
    special = {n: tok.special_id(n) for n in ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
                                              "<think>", "</think>")}
    reader = TokenReader(run.tokens("chat[v2]"))
    for name, (reasoning, content) in hostile_answers().items():
        entry = reader.entry(name)
        ids, _ = reader.arrays(entry)
        counts = {n: int(np.count_nonzero(ids == i)) for n, i in special.items()}
        assert counts == {"<|im_end|>": 2, "<|im_user|>": 1, "<|im_assistant|>": 1, "<|im_middle|>": 2,
                          "<think>": 1, "</think>": 1}, (name, counts)
        span = ids[entry.meta["answer_start"]:entry.meta["answer_end"]].tolist()
        assert tok.decode(span) == reasoning + "</think>" + content + "<|im_end|>", name
        assert entry.meta["valid"] == (name in VALID), (name, entry.meta["failed_checks"])
        assert entry.meta["count_diff"] == 0, (name, entry.meta["count_diff"])
    assert reader.entry("think_close").meta["failed_checks"] == ["one_think_close"]
    assert reader.entry("think_open").meta["failed_checks"] == ["no_think_open"]

    # The hand-written file was resumed over, not rewritten; odd lines are counted, not fatal.
    hand = run.responses("hand").read_bytes()
    assert hand.startswith(hand_before.rsplit(b"\n", 2)[0]), "lines already written were changed"
    hand_ids = [r.get("id") for r in map(orjson.loads, hand[len(hand_before):].splitlines())]
    assert sorted(hand_ids) == ["h2", "h3", "h4"], "h0 and h1 were on disk already (odd as they are)"
    hand_report = orjson.loads((run.tokens("hand") / "report.json").read_bytes())
    assert hand_report["checked"] >= 8 and hand_report["failures"]["renders"] >= 2

    # Merge keeps the valid answers byte for byte and drops the ones whose reasoning split is wrong.
    train = [orjson.loads(x) for x in (run.merged / "train.jsonl").read_bytes().splitlines()]
    kept = {row["id"]: row["conversations"][-1] for row in train if row["id"].startswith("chat[v2]/")}
    assert set(kept) == {f"chat[v2]/{n}" for n in VALID}
    for name in VALID:
        reasoning, content = hostile_answers()[name]
        assert kept[f"chat[v2]/{name}"]["content"] == content
        assert kept[f"chat[v2]/{name}"]["reasoning_content"] == reasoning
    stats = orjson.loads((run.merged / "stats.json").read_bytes())
    chat = next(d for d in stats["datasets"] if d["name"] == "chat[v2]")
    assert chat["dropped"]["invalid"] == 2 and chat["dropped"]["failed"] == 1


@pytest.mark.slow
async def test_tokens_and_merge_before_every_dataset_has_answers(tmp_path):
    """A second dataset not run yet (no responses.jsonl): tokens and merge do the first and skip it."""
    cfg = await finished_run(tmp_path, n=6)
    text = cfg.path.read_text() + '\n[[datasets]]\nname = "later"\nprompts = "prompts/a.jsonl"\n'
    cfg.path.write_text(text)
    for command in ("tokens", "merge"):
        proc = await asyncio.to_thread(cli, command, str(cfg.path))
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert not RunDir(cfg.run_dir).responses("later").exists()


def test_names_too_long_for_the_filesystem(tmp_path):
    long = "n" * 300
    (tmp_path / "prompts.jsonl").write_bytes(b'{"id": 1, "prompt": "p"}\n')
    path = tmp_path / "long.toml"
    path.write_text(GOOD_CONFIG.replace("[engine]", f'[tokenizer]\npath = "{long}"\n[engine]'))
    assert load_config(path).tokenizer.path == long  # an HF-id-like name, not a crash
    assert_clean_error(cli("tokens", str(path)), long, "File name too long")
    path.write_text(GOOD_CONFIG.replace("[engine]", f'[output]\ndir = "{long}"\n[engine]'))
    assert_clean_error(cli("run", str(path), "--headless", "--skip-smoke"), str(tmp_path / long), "File name too long")
