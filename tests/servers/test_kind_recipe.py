"""docs/contributing.md "Add a server kind", followed: a kind is one class and one registry entry
(core/server_kinds.py `KINDS`); nothing else in the code branches on which kind it is.

The kind here is a test's own: a strict OpenAI-API server ("bare-openai") that has no account, bills
nothing, takes no OpenRouter key, reads a sampling cycle's effort as the top-level `reasoning_effort`,
and takes an earlier answer back without its reasoning. Registered for the test alone, it runs a whole
generate run against a small server of the test's own on 127.0.0.1.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, ClassVar

import orjson
import pytest
from aiohttp import web

from draftgen.core import server_kinds
from draftgen.core.config import Config
from draftgen.core.generate.loop.conversations import history_message
from draftgen.core.generate.loop.engine import Engine
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.live import snapshot as snap
from draftgen.core.request_keys import OPENROUTER_ONLY_KEYS
from draftgen.core.rundir import RunDir
from draftgen.core.server_kinds import ServerKind
from tests.helpers import TEST_KEY, make_config, serve_local


class BareOpenAI(ServerKind):
    """The recipe's kind: every capability said once, by what it means."""
    name: ClassVar[str] = "bare-openai"
    label: ClassVar[str] = "the bare OpenAI-API server"
    has_account = bills_answers = lists_prices = streams_by_default = smoke_decides_stream = False
    full_at_503 = odd_finish_fails = specials_as_tokens = one_tokenizer = stream_usage_asked = True
    returns_ids = False
    dropped_keys = OPENROUTER_ONLY_KEYS

    def put_effort(self, body: dict[str, Any], effort: str) -> None:
        body["reasoning_effort"] = effort

    def history_reasoning(self, msg: dict[str, Any], reasoning: str | None, details: list[Any] | None) -> None:
        pass  # the API takes no reasoning back


@pytest.fixture
def bare_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry entry: `[api] kind = "bare-openai"` names the class (for this test only)."""
    monkeypatch.setattr(server_kinds, "KINDS", MappingProxyType({**server_kinds.KINDS, BareOpenAI.name: BareOpenAI}))


class BareServer:
    """POST /v1/chat/completions answers each prompt with plain text and token counts (no cost, no
    provider, no generation id); every other path is a 404, and each request's path is kept."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.bodies: list[dict[str, Any]] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def __aenter__(self) -> BareServer:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner, self.port = await serve_local(app)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def handle(self, request: web.Request) -> web.Response:
        self.paths.append(f"{request.method} {request.path}")
        if request.method != "POST" or request.path != "/v1/chat/completions":
            return web.json_response({"detail": "Not Found"}, status=404)
        body = await request.json()
        self.bodies.append(body)
        n = len(self.bodies)
        return web.json_response({
            "id": f"chatcmpl-{n}", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": f"Answer number {n}."}}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}})


def _config(tmp_path: Any, base_url: str) -> Config:
    cfg = make_config(tmp_path, base_url, [{"name": "a", "n": 4, "concurrency": 2, "max_tokens": 64,
                                            "reasoning_efforts": ["low", "high"]}],
                      tables={"api": {"kind": "openai-compatible", "prompt_price_per_mtok": 1.0,
                                      "completion_price_per_mtok": 2.0},
                              "engine": {"reconstruct": False}},
                      request={"temperature": 0.6, "include_reasoning": True})
    # `[api] kind = "bare-openai"`: its name in server_kinds.KindName is the TOML's check (not made here)
    return dataclasses.replace(cfg, api=dataclasses.replace(cfg.api, kind="bare-openai"))  # type: ignore[arg-type]


async def test_a_kind_added_as_one_class_and_one_registry_entry_runs_a_whole_run(tmp_path, bare_kind) -> None:
    async with BareServer() as server:
        cfg = _config(tmp_path, server.base_url)
        assert isinstance(cfg.api.server.kind, BareOpenAI)
        engine = Engine(cfg, TEST_KEY, seed=1)
        assert await engine.run() == snap.RunState.DONE
    # Asked only for answers: no account behind it (GET /key, /credits), no prices listing, no records.
    assert sorted(set(server.paths)) == ["POST /v1/chat/completions"] and len(server.bodies) == 4
    # Its body: no OpenRouter key, the effort where it reads it, and the one warning that says so.
    for body in server.bodies:
        assert "include_reasoning" not in body and "reasoning" not in body and "stream" not in body
        assert body["reasoning_effort"] in ("low", "high") and body["temperature"] == 0.6
    assert "include_reasoning is OpenRouter-only, not sent to the bare OpenAI-API server" in cfg.kind_warning()
    # Who pays: each answer on the ledger at its tokens at [api] prices, nothing left pending.
    rd = RunDir(cfg.run_dir)
    spend = SpendLedger.read(rd.spend)
    assert not spend.pending and spend.spent_usd == pytest.approx(4 * (12 * 1.0 + 5 * 2.0) / 1e6)
    records = [orjson.loads(x) for x in rd.responses("a").read_bytes().splitlines()]
    assert sorted(r["content"] for r in records) == [f"Answer number {n}." for n in range(1, 5)]
    # A later turn's history, as the kind takes it: the answer without its reasoning.
    assert history_message("a", "r", [{"type": "x"}], server=cfg.api.server) == {"role": "assistant", "content": "a"}
