"""A real third-party OpenAI-compatible server: Hugging Face's `transformers serve` on loopback,
serving a tiny Llama built here (tests/selfhosted_model.py), driven through the workflow of docs/self-hosted-servers.md.

It has no GET /key (404), no usage.cost, no provider, no generation records, and it refuses keys it
does not know with a 422: the server kind ("openai-compatible") must make all of that work, and a
server killed mid-run must leave no phantom worst-case spend on the ledger.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest

from draftgen.core.config_load import load_config
from draftgen.core.config_values import toml_value
from draftgen.core.generate.api.classify import classify_status
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.records import ErrorKind
from draftgen.core.rundir import RunDir
from tests.helpers import TEST_KEY, cli_env, read_ids, until, write_prompts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`transformers serve` in a subprocess; it loads the model a request names (a local folder)."""

    def __init__(self, port: int, log: Path) -> None:
        self.port = port
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "transformers.cli.transformers", "serve",
                                          "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu"],
                                         env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"transformers serve did not answer: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("fastapi", "uvicorn", "openai"):  # what `transformers serve` imports first
        pytest.importorskip(module, reason="`transformers serve` needs transformers' serving extra: "
                                           "pip install -e '.[selfhosted]'")
    from tests.selfhosted_model import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model: Path):
    srv = Server(_free_port(), tmp_path_factory.mktemp("serve") / "serve.log")
    srv.start()
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def offset_model(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Path:
    """The same tiny Llama with a chat template whose generation prompt drops ChatML's newline."""
    from tests.selfhosted_model import CHATML_NO_NEWLINE, build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-offset"), CHATML_NO_NEWLINE)


@pytest.fixture(scope="module")
def reasoning_model(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Path:
    """A tiny Qwen2: transformers serve parses its `<think>` (serving/utils.py's qwen2 response template)."""
    from tests.selfhosted_model import build_tiny_reasoning_model
    return build_tiny_reasoning_model(tmp_path_factory.mktemp("tiny-qwen2"))


def _config(tmp_path: Path, server: Server, model: Path, n: int, concurrency: int, **api: Any) -> Path:
    """The documented self-hosted config: no kind (detected), an OpenRouter-only key that must be left
    out, prices for max_usd, the tokenizer's own chat template."""
    write_prompts(tmp_path / "prompts" / "a.jsonl", n, prefix="a-")
    tables = {
        "api": {"base_url": server.base_url, "api_key_env": "DG_TEST_KEY", "model": str(model),
                "request_timeout_s": 60, "connect_timeout_s": 5, "prompt_price_per_mtok": 1.0,
                "completion_price_per_mtok": 2.5, **api},
        "request": {"temperature": 0.6, "include_reasoning": True},
        "budget": {"max_usd": 1.0},
        "tokenizer": {"path": str(model), "template": "auto"},
        "output": {"dir": "run"},
        "engine": {"backoff_base_s": 0.05, "backoff_max_s": 0.5, "workers": 1},
    }
    lines = []
    for table, values in tables.items():
        lines += [f"[{table}]"] + [f"{k} = {toml_value(v)}" for k, v in values.items()] + [""]
    lines += ["[[datasets]]", 'name = "a"', 'prompts = "prompts/a.jsonl"', f"concurrency = {concurrency}",
              "max_tokens = 16"]
    path = tmp_path / "selfhosted.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _draftgen(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "draftgen.cli.main", *args], env=cli_env(), text=True,
                          capture_output=True, timeout=timeout)


@pytest.mark.slow
def test_readme_workflow_against_transformers_serve(tmp_path: Path, server: Server, model: Path) -> None:
    path = _config(tmp_path, server, model, n=24, concurrency=4)
    smoke = _draftgen("smoke", str(path))
    assert smoke.returncode == 0, smoke.stdout[-4000:] + smoke.stderr[-2000:]
    report = orjson.loads((tmp_path / "run" / "smoke.json").read_bytes())
    rows = {r["check"]: r for r in report["rows"]}
    for check in ("key", "balance", "a: provider"):
        assert "n/a (self-hosted" in rows[check]["detail"], rows[check]
    assert "include_reasoning" in rows["request keys"]["detail"] and rows["request keys"]["warning"]
    for check in ("a: request", "a: content", "a: finish", "a: tokens", "a: prompt tokens", "a: usage"):
        assert rows[check]["passed"], rows[check]

    run = _draftgen("run", str(path), "--headless", "--interval", "0.5")  # no --skip-smoke
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    rd = RunDir(tmp_path / "run")
    assert sorted(read_ids(rd.responses("a"))) == sorted(f"a-{i}" for i in range(24))
    # The cost columns read what the ledger booked: tokens at the configured prices.
    spend = SpendLedger.read(rd.spend)
    costs = [orjson.loads(line)["usage"]["cost"] for line in rd.responses("a").read_bytes().splitlines()]
    assert all(c > 0 for c in costs)
    assert sum(costs) == pytest.approx(spend.by_dataset["a"], rel=1e-6)
    assert not spend.pending

    tokens = _draftgen("tokens", str(path))
    assert tokens.returncode == 0, tokens.stdout[-3000:] + tokens.stderr[-2000:]
    checked = orjson.loads((rd.root / "a" / "tokens" / "report.json").read_bytes())
    assert (checked["checked"], checked["valid"]) == (24, 24), checked
    merge = _draftgen("merge", str(path))
    assert merge.returncode == 0, merge.stdout[-3000:] + merge.stderr[-2000:]
    assert len((rd.root / "merged" / "train.jsonl").read_bytes().splitlines()) == 24
    assert TEST_KEY not in (rd.root / "events.log").read_text()


@pytest.mark.slow
def test_a_one_token_template_offset_is_flagged(tmp_path: Path, server: Server, offset_model: Path) -> None:
    """Every answer one token longer than the server generated (the generation prompt drops a newline
    the answer turn renders): within count_tolerance, so each sample alone is "valid"; the smoke test's
    tokens row, the tokens report and merge catch it on one server with no other to compare with."""
    path = _config(tmp_path, server, offset_model, n=24, concurrency=4)
    smoke = _draftgen("smoke", str(path))
    assert smoke.returncode != 0 and (tmp_path / "run" / "smoke.json").exists(), (
        smoke.stdout[-3000:] + smoke.stderr[-3000:])
    rows = {r["check"]: r for r in orjson.loads((tmp_path / "run" / "smoke.json").read_bytes())["rows"]}
    assert not rows["a: tokens"]["passed"] and "(diff 1)" in rows["a: tokens"]["detail"], rows["a: tokens"]
    assert "chat template" in rows["a: tokens"]["detail"], rows["a: tokens"]
    run = _draftgen("run", str(path), "--headless", "--skip-smoke", "--interval", "0.5")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    tokens = _draftgen("tokens", str(path))
    assert tokens.returncode == 0, tokens.stdout[-3000:] + tokens.stderr[-2000:]
    assert "FLAGGED" in tokens.stdout and "constant offset" in " ".join(tokens.stdout.split()), tokens.stdout[-3000:]
    report = orjson.loads((tmp_path / "run" / "a" / "tokens" / "report.json").read_bytes())
    assert report["valid"] == 24 and report["token_count_diff"]["histogram"] == {"1": 24}, report
    [flag] = report["provider_flags"]
    assert flag["absolute"] and "+1 token off" in flag["reason"] and "template" in flag["fix"], flag
    merge = _draftgen("merge", str(path))
    assert merge.returncode == 0, merge.stdout[-3000:] + merge.stderr[-2000:]
    assert "constant offset" in " ".join(merge.stdout.split()), merge.stdout[-3000:]
    stats = orjson.loads((tmp_path / "run" / "merged" / "stats.json").read_bytes())
    assert stats["dropped"]["source_flagged"] == 24 and stats["samples"] == 0, stats
    assert stats["datasets"][0]["flagged_sources"][0]["dropped"] is True


@pytest.mark.slow
def test_a_parser_rewriting_non_streamed_text_makes_the_run_stream(tmp_path: Path, server: Server,
                                                                    reasoning_model: Path) -> None:
    """transformers serve's Qwen reasoning parser strips the leading space of reasoning and content in
    a non-streamed answer (streamed, it keeps it): with `[api] stream = false` the smoke test fails with
    the fix, naming the parser; with `stream` unset the smoke test picks streaming, records it, and the
    run streams: every merged sample has the ids the model generated."""
    from transformers import AutoTokenizer
    path = _config(tmp_path, server, reasoning_model, n=24, concurrency=4, stream=False)
    smoke = _draftgen("smoke", str(path))
    rows = {r["check"]: r for r in orjson.loads((tmp_path / "run" / "smoke.json").read_bytes())["rows"]}
    assert smoke.returncode != 0 and not rows["stream"]["passed"], smoke.stdout[-3000:]
    assert "'is'" in rows["stream"]["detail"] and "' is'" in rows["stream"]["detail"], rows["stream"]
    assert "set [api] stream = true" in rows["stream"]["detail"], rows["stream"]
    assert "reasoning parser strips leading whitespace of the reasoning and the content in non-streamed" \
        in rows["stream"]["detail"], rows["stream"]

    path = _config(tmp_path, server, reasoning_model, n=24, concurrency=4)  # `stream` left unset
    smoke = _draftgen("smoke", str(path))
    report = orjson.loads((tmp_path / "run" / "smoke.json").read_bytes())
    rows = {r["check"]: r for r in report["rows"]}
    # transformers serves a qwen2 folder with its Qwen2Tokenizer (digits split), not tokenizer.json's
    # pre-tokenizer: draftgen encodes as transformers loads the folder, so the prompts count as served.
    assert smoke.returncode == 0 and all(r["passed"] for r in rows.values()), rows
    assert "greedy request" in rows["stream"]["detail"] and "this run streams" in rows["stream"]["detail"]
    assert report["stream"] is True
    run = _draftgen("run", str(path), "--headless", "--interval", "0.5")  # no --skip-smoke
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "requests stream" in (tmp_path / "run" / "events.log").read_text()
    assert _draftgen("tokens", str(path)).returncode == 0
    report = orjson.loads((tmp_path / "run" / "a" / "tokens" / "report.json").read_bytes())
    assert report["valid"] == 24 and report["token_count_diff"]["histogram"] == {"0": 24}, report
    assert report["provider_flags"] == [], report["provider_flags"]
    assert _draftgen("merge", str(path)).returncode == 0
    tok = AutoTokenizer.from_pretrained(reasoning_model)
    generated = tok.convert_tokens_to_ids(["<think>", "Ġis", "</think>", "Ġ", "4", "<|im_end|>"])
    merged = tmp_path / "run" / "merged" / "tokens"
    from draftgen.core.tokens.store import TokenReader
    samples = list(TokenReader(merged))
    assert len(samples) == 24
    for _entry, ids, mask in samples:  # the trained span (mask 1) is exactly what the model generated
        assert [int(i) for i, m in zip(ids, mask) if m] == generated


@pytest.fixture(scope="module")
def sampling_model(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Path:
    """A tiny Qwen2 whose greedy answer is empty and whose sampled ones begin with a space."""
    from tests.selfhosted_model import build_tiny_sampling_reasoning_model
    return build_tiny_sampling_reasoning_model(tmp_path_factory.mktemp("tiny-qwen2-sampling"))


@pytest.mark.slow
def test_the_readme_config_keeps_the_text_as_generated(tmp_path: Path, server: Server, sampling_model: Path) -> None:
    """README's self-hosted config, `stream` unset, against a reasoning model whose greedy answer is empty
    on both sides: the smoke test compares a sampled, seeded answer instead, sees the parser strip the
    non-streamed text, and the run it lets start (no --skip-smoke) streams: the stored reasoning and
    content keep their leading space, as the model generated them."""
    from tests.selfhosted_model import WORDS
    n = 24
    path = _config(tmp_path, server, sampling_model, n=n, concurrency=4)
    smoke = _draftgen("smoke", str(path))
    report = orjson.loads((tmp_path / "run" / "smoke.json").read_bytes())
    rows = {r["check"]: r for r in report["rows"]}
    assert smoke.returncode == 0 and all(r["passed"] for r in rows.values()), rows
    stream = rows["stream"]
    assert "sampled request" in stream["detail"] and "greedy one came back empty" in stream["detail"], stream
    assert "reasoning parser strips leading whitespace" in stream["detail"], stream
    assert "this run streams" in stream["detail"] and not stream["warning"], stream
    assert report["stream"] is True

    run = _draftgen("run", str(path), "--headless", "--interval", "0.5")  # no --skip-smoke
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    answers = [orjson.loads(x) for x in RunDir(tmp_path / "run").responses("a").read_bytes().splitlines()]
    assert sorted(a["id"] for a in answers) == sorted(f"a-{i}" for i in range(n))
    # What the model generates: one word with its space in the reasoning, another in the content.
    said = {" " + w for w in WORDS}
    kept = [a for a in answers if a["reasoning"] in said and a["content"] in said]
    assert len(kept) >= 0.9 * n, [(a["reasoning"], a["content"]) for a in answers]
    assert _draftgen("tokens", str(path)).returncode == 0
    checked = orjson.loads((tmp_path / "run" / "a" / "tokens" / "report.json").read_bytes())
    assert checked["token_count_diff"]["histogram"].get("0", 0) >= 0.9 * n, checked


@pytest.mark.slow
async def test_server_killed_mid_run_leaves_no_phantom_spend(tmp_path: Path, server: Server, model: Path) -> None:
    n = 60
    path = _config(tmp_path, server, model, n=n, concurrency=8)
    rd = RunDir(tmp_path / "run")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "draftgen.cli.main", "run", str(path), "--headless", "--interval", "0.5",
        env=cli_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        await until(lambda: len(read_ids(rd.responses("a"))) >= 8, "answers before the kill", timeout=90)
        server.kill()  # SIGKILL with requests in flight: their connections drop, no answer, no id
        await asyncio.to_thread(server.start)
        out, _ = await asyncio.wait_for(proc.communicate(), 150)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = out.decode()
    assert proc.returncode == 0, text[-4000:]
    assert sorted(read_ids(rd.responses("a"))) == sorted(f"a-{i}" for i in range(n))
    spend = SpendLedger.read(rd.spend)
    lines = [orjson.loads(line) for line in rd.spend.read_bytes().splitlines()]
    lost = [x for x in lines if x.get("e") == "settle" and x.get("s") == "self-hosted"]
    assert lost, "no attempt was in flight when the server died: the test did not test the crash"
    assert all(x["c"] == 0 for x in lost)
    # Nothing left at its worst case: what max_usd holds is the answers' token estimates, no more.
    assert not spend.pending and spend.pending_usd == 0
    answered = sum(x["c"] for x in lines if x.get("e") == "end" and x.get("o") == "answered")
    assert spend.committed_usd == pytest.approx(answered, rel=1e-6)
    assert spend.committed_usd < 0.01


@pytest.mark.slow
def test_a_server_refusing_a_key_stops_the_dataset_naming_it(tmp_path: Path, server: Server, model: Path) -> None:
    """Told it is OpenRouter, draftgen sends include_reasoning; transformers serve answers 422: the
    dataset stops, no prompt fails, and the message says which key to drop and where."""
    path = _config(tmp_path, server, model, n=4, concurrency=2, kind="openrouter")
    run = _draftgen("run", str(path), "--headless", "--skip-smoke", "--interval", "0.5")
    assert run.returncode == 3, run.stdout[-4000:] + run.stderr[-2000:]
    out = " ".join(run.stdout.split())
    assert "does not accept the request field(s) include_reasoning" in out, out[-3000:]
    assert "remove [request] include_reasoning" in out and 'kind = "openai-compatible"' in out, out[-3000:]
    assert read_ids(RunDir(tmp_path / "run").failures("a")) == []


def test_a_refused_field_names_the_config_key() -> None:
    """transformers serve's 422 for keys it does not take: the dataset's, naming what to change."""
    e = classify_status(422, b'{"detail":"Unexpected fields in the request: {\'return_token_ids\', \'top_k\'}"}', {})
    assert e.kind is ErrorKind.UNEXPECTED_FIELD and e.whose.value == "dataset"
    assert "set [api] return_token_ids = false" in e.message and "remove [request] top_k" in e.message


def test_kind_shapes_the_request(tmp_path: Path) -> None:
    """An openai-compatible server gets no OpenRouter-only keys, and usage asked for in a stream."""
    write_prompts(tmp_path / "p.jsonl", 1)
    path = tmp_path / "c.toml"
    path.write_text('[api]\nbase_url = "http://127.0.0.1:9/v1"\nkind = "openai-compatible"\nstream = true\n'
                    '[request]\ntemperature = 0.6\ninclude_reasoning = true\n[request.provider]\nsort = "price"\n'
                    '[[datasets]]\nname = "a"\nprompts = "p.jsonl"\n')
    cfg = load_config(path)
    body = cfg.request_body(cfg.datasets[0], [])
    assert "include_reasoning" not in body and "provider" not in body and body["temperature"] == 0.6
    assert body["stream_options"] == {"include_usage": True}
    assert "include_reasoning, provider" in cfg.kind_warning()
    path.write_text(path.read_text().replace('kind = "openai-compatible"', 'kind = "openrouter"'))
    cfg = load_config(path)
    body = cfg.request_body(cfg.datasets[0], [])
    assert body["include_reasoning"] is True and "stream_options" not in body and not cfg.kind_warning()


def test_a_killed_runs_open_attempts_settle_at_zero_on_a_self_hosted_server(tmp_path: Path) -> None:
    """`kill -9` of draftgen mid-request leaves `sent` lines without an end (no generation id): on an
    openai-compatible server the next run settles them at $0 instead of their worst case for good."""
    from draftgen.core.generate.api.client import ChatClient
    from draftgen.core.generate.money.settle import Settler
    path = tmp_path / "spend.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"e": "sent", "a": f"x-{i}", "ds": "a", "p": f"a-{i}", "w": 0.0256,
                                            "t": 1.0}) + b"\n" for i in range(3)))
    spend = SpendLedger(path)
    spend.open()
    assert spend.pending_usd == pytest.approx(3 * 0.0256)
    try:
        Settler(spend, ChatClient("http://127.0.0.1:9/v1", TEST_KEY, concurrency=1), 1.0, bills_answers=False).start()
    finally:
        spend.close()
    again = SpendLedger.read(path)
    assert not again.pending and again.committed_usd == 0
    assert [x["s"] for x in map(orjson.loads, path.read_bytes().splitlines()) if x["e"] == "settle"] == \
        ["self-hosted"] * 3
