"""A self-hosted server that returns its own token ids (`[api] return_token_ids = true`): the prompt's
and the answer's, in the shapes vLLM and SGLang releases use, served by a canned aiohttp handler on
loopback (no model). The run asks each release the way it takes the request, stores the ids; `draftgen
tokens` trains on them, says where they differ from the reconstruction, and never drops a sample
whose ids the server gave because its text was rewritten.

The shapes, from the servers' released sources (tests/servers/test_server_contract.py reads the wheels):
  vLLM >= 0.10.2: ChatCompletionResponseChoice and ChatCompletionResponseStreamChoice `token_ids` (a
    stream chunk's are its delta tokens); ChatCompletionResponse and ChatCompletionStreamResponse
    `prompt_token_ids` at the top level ("In streaming mode, prompt_token_ids is included only in the
    first chunk"); GET /version {"version": ...}.
  SGLang: ChatCompletionResponseChoice `prompt_token_ids` and `token_ids` (0.5.17) or
    `response_token_ids` (0.5.18+), non-streamed only (`return_token_ids` on a stream is a 400); from
    0.5.20 `return_{input,output}_ids_in_sglext` put `sglext.input_ids` / `sglext.output_ids` in the
    stream's last chunk; 0.5.16 and earlier ignore `return_token_ids`. GET /server_info {"version": ...}.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import orjson
import pytest
from aiohttp import web

from draftgen.core.config import Config
from draftgen.core.generate.loop.engine import Engine
from draftgen.core.live import snapshot as snap
from draftgen.core.live.events import EventKind
from draftgen.core.rundir import RunDir
from draftgen.core.server_kinds import OpenAICompatible, OpenRouter
from draftgen.core.servers import ServerProfile
from draftgen.core.tokens.command import tokens_command
from draftgen.core.tokens.reconstruct import reconstruct
from draftgen.core.tokens.store import TokenReader
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.core.tokens.workers import WorkerSpec, reconstruct_dataset
from tests.helpers import TEST_KEY, make_config, serve_local

N = 6
BAD_ANSWER = "a-1"   # its token_ids differ from what the reconstruction gives (one id changed)
BAD_PROMPT = "a-2"   # its prompt_token_ids differ from the rendered prompt (one id changed)


class CannedServer:
    """POST /v1/chat/completions answers every prompt with a fixed reasoning and answer, and the ids the
    run's own tokenizer and template give for them, shaped as release `version` of `shape` ("vllm" or
    "sglang") does. `rewrite`: the server's parser strips the reasoning's trailing whitespace from the
    text it sends (vLLM's kimi_k2), the ids staying the generated ones. `abort`: prompt ids answered
    once with SGLang's `finish_reason: "abort"` first."""

    def __init__(self, shape: str, version: str = "", *, rewrite: bool = False,
                 abort: frozenset[str] = frozenset()) -> None:
        self.shape = shape
        self.version = version or ("0.13.0" if shape == "vllm" else "0.5.17")
        self.rewrite = rewrite
        self.abort = set(abort)
        self.spec: WorkerSpec | None = None
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.sent: dict[str, tuple[list[int], list[int]]] = {}  # prompt id -> (prompt ids, answer ids) served
        self.bodies: list[dict[str, Any]] = []  # every request body, as received

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def release(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.version.split("."))

    async def __aenter__(self) -> CannedServer:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        async def info(_: web.Request) -> web.Response:
            return web.json_response({"version": self.version})
        app.router.add_get("/version" if self.shape == "vllm" else "/server_info", info)
        self.runner, self.port = await serve_local(app)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    def ids(self, messages: list[dict[str, Any]], reasoning: str, content: str) -> tuple[list[int], list[int]]:
        assert self.spec is not None
        tok, template = self.spec.load()
        r = reconstruct(tok, template, messages, reasoning, content)
        ids = [int(i) for i in r.input_ids]
        return ids[:r.answer_start], ids[r.answer_start:r.answer_end]

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        stream = bool(body.get("stream"))
        sglang = self.shape == "sglang"
        if sglang and stream and body.get("return_token_ids") and self.release >= (0, 5, 17):
            return web.json_response({"object": "error", "message": "return_token_ids is not supported with "
                                      "streaming on /v1/chat/completions.", "code": 400}, status=400)
        messages = body["messages"]
        pid = messages[-1]["content"].split(":")[0].removeprefix("Question ")
        reasoning, content = f"The user asks about {pid}. Think.\n\n", f"Here is {pid}: an answer."
        prompt_ids, answer_ids = self.ids(messages, reasoning, content)
        if self.rewrite:
            reasoning = reasoning.rstrip()
        if pid == BAD_ANSWER:
            answer_ids = [answer_ids[0] + 1, *answer_ids[1:]]  # another valid id: not what the text encodes
        if pid == BAD_PROMPT:
            prompt_ids = [prompt_ids[0], prompt_ids[1] + 1, *prompt_ids[2:]]
        finish = "stop"
        if pid in self.abort:
            self.abort.discard(pid)
            finish = "abort"
        else:
            self.sent[pid] = (prompt_ids, answer_ids)
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(answer_ids),
                 "total_tokens": len(prompt_ids) + len(answer_ids)}
        head = {"id": f"chatcmpl-{pid}", "created": int(time.time()), "model": body["model"]}
        if not stream:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish,
                                      "message": {"role": "assistant", "content": content, "reasoning": reasoning}}
            out: dict[str, Any] = {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
            if not body.get("return_token_ids") or (sglang and self.release < (0, 5, 17)):
                pass  # not asked, or a release that ignores the key
            elif sglang:
                choice["prompt_token_ids"] = prompt_ids
                choice["token_ids" if self.release < (0, 5, 18) else "response_token_ids"] = answer_ids
            else:
                choice["token_ids"] = answer_ids
                out["prompt_token_ids"] = prompt_ids
            return web.json_response(out, dumps=lambda o: orjson.dumps(o).decode())
        # vLLM's stream: the role first with the prompt ids, then deltas, each with its own token ids;
        # SGLang's: no ids on the choices, both lists in an `sglext` chunk at the end when asked.
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {**head, "object": "chat.completion.chunk"}
        n_think = len(self.ids(messages, reasoning, "")[1]) - 2  # up to </think>, before ""<|im_end|>
        vllm_ids = not sglang and body.get("return_token_ids")

        def choice_of(delta: dict[str, Any], ids: list[int], finish: str | None = None) -> dict[str, Any]:
            c: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            if vllm_ids:
                c["token_ids"] = ids
            return c
        first: dict[str, Any] = {**chunk, "choices": [choice_of({"role": "assistant", "content": ""}, [])]}
        if vllm_ids:
            first["prompt_token_ids"] = prompt_ids
        events = [
            first,
            {**chunk, "choices": [choice_of({"reasoning_content" if sglang else "reasoning": reasoning},
                                            answer_ids[:n_think])]},
            {**chunk, "choices": [choice_of({"content": content}, answer_ids[n_think:-1])]},
            {**chunk, "choices": [choice_of({}, answer_ids[-1:], finish)]},
        ]
        if sglang and body.get("return_output_ids_in_sglext") and self.release >= (0, 5, 20):
            ext = {"output_ids": [answer_ids]}
            if body.get("return_input_ids_in_sglext"):
                ext["input_ids"] = prompt_ids
            events.append({**chunk, "choices": [], "sglext": ext})
        events.append({**chunk, "choices": [], "usage": usage})
        for e in events:
            await resp.write(b"data: " + orjson.dumps(e) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def server_config(tmp_path, base_url: str, stream: bool) -> Config:
    return make_config(tmp_path, base_url, [{"name": "a", "n": N, "concurrency": 4, "max_tokens": 512}],
                       tables={"api": {"kind": "openai-compatible", "return_token_ids": True, "stream": stream},
                               "tokenizer": {"path": str(bundled_kimi_path())}},
                       request={"temperature": 0.6})


@pytest.mark.parametrize("shape,version,stream", [("vllm", "0.13.0", False), ("vllm", "0.13.0", True),
                                                  ("sglang", "0.5.17", False), ("sglang", "0.5.18", False),
                                                  ("sglang", "0.5.23", True)])
async def test_the_servers_ids_are_stored_used_and_compared(tmp_path, capsys, shape, version, stream):
    async with CannedServer(shape, version) as server:
        cfg = server_config(tmp_path, server.base_url, stream)
        server.spec = WorkerSpec.from_config(cfg)
        engine = Engine(cfg, TEST_KEY, seed=1)
        assert await engine.run() == snap.RunState.DONE
    assert len(server.sent) == N and engine.errors["no_ids"] == 0
    # Each release asked its own way; a stream never carries a key the release refuses on streams.
    asked = {k for k in ("return_token_ids", "return_output_ids_in_sglext", "return_input_ids_in_sglext")
             if server.bodies[0].get(k)}
    assert asked == ({"return_output_ids_in_sglext", "return_input_ids_in_sglext"} if shape == "sglang" and stream
                     else {"return_token_ids"})

    # The run stored the server's ids, prompt and answer, as they came.
    lines = [orjson.loads(x) for x in RunDir(cfg.run_dir).responses("a").read_bytes().splitlines()]
    assert len(lines) == N
    for line in lines:
        prompt_ids, answer_ids = server.sent[line["id"]]
        assert line["prompt_token_ids"] == prompt_ids and line["token_ids"] == answer_ids

    # `draftgen tokens`: the samples hold the server's ids; the two deliberate differences are flagged.
    assert tokens_command(dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, workers=1))) == 0
    out = capsys.readouterr().out
    assert f"a: prompt ids from the server: {N}, agreeing {N - 1}" in out
    tokens = TokenReader(RunDir(cfg.run_dir).tokens("a"))
    for line in lines:
        prompt_ids, answer_ids = server.sent[line["id"]]
        entry = tokens.entry(line["id"])
        input_ids, mask = tokens.arrays(entry)
        start, end = entry.meta["answer_start"], entry.meta["answer_end"]
        assert input_ids[:start].tolist() == prompt_ids and input_ids[start:end].tolist() == answer_ids
        assert entry.meta["source"] == "backend" and entry.meta["prompt_source"] == "backend"
        assert mask[start:end].all() and not mask[:start - 1].any()  # the answer span (and `<think>`) only
        failed = set(entry.meta["failed_checks"])
        assert ("matches_backend" in failed) == (line["id"] == BAD_ANSWER)
        assert ("matches_backend_prompt" in failed) == (line["id"] == BAD_PROMPT)
    report = reconstruct_dataset(cfg, "a", workers=1)  # nothing left to do: the folder's report
    assert report.checked == N and report.from_backend == N
    assert report.prompt_from_backend == N and report.prompt_backend_match == N - 1
    assert report.failures["matches_backend"] == 1 and report.failures["matches_backend_prompt"] == 1
    assert f"prompt ids from the server: {N}, agreeing {N - 1}" in report.format()
    assert sum(p.backend_match for p in report.providers.values()) == N - 1
    # The changed answer id decodes to another text than the answer's: the server's ids are the sample,
    # kept and noted as a rewritten text; the other prompt, the one the model saw, is kept and noted.
    assert report.failures["round_trip"] == 0 and report.failures["text_matches_ids"] == 1
    assert report.dropped == {} and report.kept == N
    assert report.noted == {"backend_prompt_mismatch": 1, "backend_mismatch": 1, "text_rewritten": 1}


def test_a_server_prompt_with_another_generation_prompt_or_foreign_ids(tmp_path):
    """The prompt's masked tail (`<think>`) stays masked only where the server's prompt ends with it;
    ids the tokenizer does not have are never trained on: the rendered prompt stays, the check fails."""
    cfg = server_config(tmp_path, "http://127.0.0.1:9/v1", stream=False)
    tok, template = WorkerSpec.from_config(cfg).load()
    messages = [{"role": "user", "content": "Question x: why?"}]
    plain = reconstruct(tok, template, messages, "Because.", "So.")
    prompt = plain.input_ids[:plain.answer_start].tolist()
    assert plain.loss_mask[plain.answer_start - 1] == 1  # the generation prompt's `<think>`

    other_tail = [*prompt[:-1], prompt[-2]]
    r = reconstruct(tok, template, messages, "Because.", "So.", backend_prompt_ids=other_tail)
    assert r.prompt_source == "backend" and r.failed_checks == ("matches_backend_prompt",)
    assert r.input_ids[:r.answer_start].tolist() == other_tail
    assert not r.loss_mask[:r.answer_start].any() and r.loss_mask[r.answer_start:r.answer_end].all()

    foreign = [*prompt[:-1], tok.vocab_size + 5, prompt[-1]]
    r = reconstruct(tok, template, messages, "Because.", "So.", backend_prompt_ids=foreign)
    assert r.prompt_source == "rendered" and "matches_backend_prompt" in r.failed_checks
    assert r.input_ids.tolist() == plain.input_ids.tolist() and r.loss_mask.tolist() == plain.loss_mask.tolist()


async def test_true_server_ids_are_kept_when_its_parser_rewrote_the_text(tmp_path, capsys):
    """vLLM's kimi_k2 parser strips the reasoning's trailing whitespace from the text it sends, in both
    modes; its ids are what the model generated. Every sample is kept with the server's ids, and the
    rewrite is counted and named with the fix."""
    async with CannedServer("vllm", "0.33.0", rewrite=True) as server:
        cfg = server_config(tmp_path, server.base_url, False)
        server.spec = WorkerSpec.from_config(cfg)
        assert await Engine(cfg, TEST_KEY, seed=1).run() == snap.RunState.DONE
    lines = [orjson.loads(x) for x in RunDir(cfg.run_dir).responses("a").read_bytes().splitlines()]
    assert all(not line["reasoning"].endswith("\n") for line in lines)  # the text as the server sent it
    report = reconstruct_dataset(cfg, "a", workers=1)
    assert report.from_backend == N and report.dropped == {} and report.kept == N
    assert report.failures["text_matches_ids"] == N and report.failures["round_trip"] == 0
    assert report.noted["text_rewritten"] == N
    text = report.format()
    assert f"the server's parser rewrote the text of {N} answer(s)" in text and "stream = true" in text
    assert f"the server's parser rewrote the text of {N} answer(s)" in report.summary_line()  # the run's event
    tokens = TokenReader(RunDir(cfg.run_dir).tokens("a"))
    for line in lines:
        entry = tokens.entry(line["id"])
        input_ids, _ = tokens.arrays(entry)
        assert input_ids[entry.meta["answer_start"]:entry.meta["answer_end"]].tolist() == server.sent[line["id"]][1]


@pytest.mark.parametrize("shape,version,stream", [("sglang", "0.5.14", False), ("sglang", "0.5.17", True),
                                                  ("vllm", "0.12.0", True)])
async def test_ids_a_release_cannot_give_are_said_and_counted(tmp_path, shape, version, stream):
    """SGLang 0.5.14 ignores `return_token_ids`; 0.5.17 refuses it on a stream and has no streamed ids;
    vLLM 0.12's streamed ids miss the parser's steps: the run says so at start and counts every answer
    without ids; it never sends a key the stream refuses."""
    events: list[tuple[Any, ...]] = []
    async with CannedServer(shape, version) as server:
        cfg = server_config(tmp_path, server.base_url, stream)
        server.spec = WorkerSpec.from_config(cfg)
        engine = Engine(cfg, TEST_KEY, seed=1, on_event=lambda p: events.append((p.level, p.kind, p.text())))
        assert await engine.run() == snap.RunState.DONE
    assert len(server.sent) == N and engine.errors["no_ids"] == N
    said = [e[2] for e in events if e[1] == EventKind.SERVER_IDS]
    assert said and version in said[0] and ("stream = false" in said[0]) == stream
    if stream:
        assert not any(b.get("return_token_ids") for b in server.bodies)
    lines = [orjson.loads(x) for x in RunDir(cfg.run_dir).responses("a").read_bytes().splitlines()]
    assert len(lines) == N and all("token_ids" not in line for line in lines)


async def test_ids_asked_of_a_server_that_ignores_the_key_are_counted_never_silently_missing(tmp_path):
    """The simulator playing a server that names no release and ignores `return_token_ids`: every
    answer is kept, counted as no_ids, and the event says why and what to change."""
    from draftgen.simulator import SimConfig, SimServer
    events: list[tuple[Any, ...]] = []
    async with SimServer(SimConfig(seed=3, latency_scale=0.0, mean_completion_tokens=60, ignore_token_ids=True,
                                   reasoning_field="reasoning_content"), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": N, "concurrency": 3, "max_tokens": 512}],
                          tables={"api": {"kind": "openai-compatible", "return_token_ids": True, "stream": False}})
        engine = Engine(cfg, TEST_KEY, seed=1, on_event=lambda p: events.append((p.level, p.kind, p.text())))
        assert await engine.run() == snap.RunState.DONE
    assert engine.errors["no_ids"] == N
    assert ("no_ids", N) in engine.snapshot().errors
    said = [e[2] for e in events if e[1] == EventKind.SERVER_IDS]
    assert any("without the token ids asked for" in m and "return_token_ids = false" in m for m in said)
    assert len(RunDir(cfg.run_dir).responses("a").read_bytes().splitlines()) == N


async def test_an_aborted_request_is_retried_never_stored(tmp_path):
    """SGLang returns an aborted request as a normal body with `finish_reason: "abort"`: a failed
    attempt, retried; the stored answer is the one that finished."""
    async with CannedServer("sglang", "0.5.18", abort=frozenset({"a-0", "a-3"})) as server:
        cfg = server_config(tmp_path, server.base_url, False)
        server.spec = WorkerSpec.from_config(cfg)
        engine = Engine(cfg, TEST_KEY, seed=1)
        assert await engine.run() == snap.RunState.DONE
    assert len(server.bodies) == N + 2 and not server.abort
    lines = [orjson.loads(x) for x in RunDir(cfg.run_dir).responses("a").read_bytes().splitlines()]
    assert len(lines) == N and {line["finish_reason"] for line in lines} == {"stop"}
    assert engine.errors["finish_error"] == 2
    assert not RunDir(cfg.run_dir).failures("a").exists() or not RunDir(cfg.run_dir).failures("a").read_bytes()


def test_a_key_refused_on_streams_names_the_config_keys() -> None:
    """SGLang 0.5.17+ answers `return_token_ids` on a stream with a 400 (a server whose release was not
    found at start is asked the vLLM way): the dataset stops naming the key, not as a prompt's fault."""
    from draftgen.core.generate.api.classify import Whose, classify_status
    from draftgen.core.records import ErrorKind
    body = orjson.dumps({"object": "error", "message": "return_token_ids is not supported with streaming on "
                         "/v1/chat/completions. Please set stream=false when using return_token_ids=true.",
                         "type": "BadRequestError", "param": None, "code": 400})
    e = classify_status(400, body, {})
    assert e.kind is ErrorKind.UNEXPECTED_FIELD and e.whose is Whose.DATASET
    assert e.metadata["unexpected_fields"] == ["return_token_ids"] and "return_token_ids = false" in e.message


@pytest.mark.parametrize("reason", ["end_turn", "repetition"])
def test_an_unusual_finish_reason_is_a_failed_attempt_only_from_a_self_hosted_server(reason: str) -> None:
    """OpenRouter passes a provider's own finish reason through on an answer it billed ("end_turn"): kept,
    never bought again; a self-hosted server's reason other than stop, length, tool_calls or
    content_filter (vLLM's "repetition") ends no answer: a failed attempt. "abort" is one from either."""
    from draftgen.core.generate.api.answer import parse_completion
    from draftgen.core.generate.api.client import RequestFailed
    from draftgen.core.records import ErrorKind

    def body(finish: str) -> dict:
        return {"id": "gen-1", "provider": "Moonshot AI", "model": "moonshotai/kimi-k2.5",
                "choices": [{"message": {"role": "assistant", "content": "4", "reasoning": "2+2"},
                             "finish_reason": finish}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 500, "cost": 0.01}}

    kept = parse_completion(body(reason), 0.0, ServerProfile(OpenRouter()))
    assert kept.content == "4" and kept.finish_reason == reason
    assert parse_completion(body(reason), 0.0).content == "4"  # a caller that does not know the kind: kept
    for kind in (OpenAICompatible(), OpenRouter()):
        with pytest.raises(RequestFailed) as abort:
            parse_completion(body("abort"), 0.0, ServerProfile(kind))
        assert abort.value.kind is ErrorKind.FINISH_ERROR
    with pytest.raises(RequestFailed) as failed:
        parse_completion(body(reason), 0.0, ServerProfile(OpenAICompatible()))
    assert failed.value.kind is ErrorKind.FINISH_ERROR and reason in failed.value.message


class RestartedServer(CannedServer):
    """One address whose server is replaced between runs (`shape`, `version` changed): GET /version
    answers while it plays vLLM, GET /server_info while it plays SGLang, the other path 404."""

    async def __aenter__(self) -> RestartedServer:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)

        def info(shape: str) -> Any:
            async def answer(_: web.Request) -> web.Response:
                if self.shape != shape:
                    raise web.HTTPNotFound()
                return web.json_response({"version": self.version})
            return answer
        app.router.add_get("/version", info("vllm"))
        app.router.add_get("/server_info", info("sglang"))
        self.runner, self.port = await serve_local(app)
        return self


async def test_two_runs_in_one_process_each_find_their_own_server(tmp_path):
    """What a run finds of its server (its kind, its release, the mode its smoke test decided) is the run's
    own (`ApiConfig.server`), not the process's. The first run's start-up check finds its kind and release
    (kind "auto": GET /key's 404); a second run at the same address, now SGLang 0.5.14, set to
    openai-compatible and run without the check (as a notebook would), asks its server which release it is
    (a process-wide note kept the first run's vLLM: it asked SGLang for ids it ignores and said they were
    asked); a config loaded after them has found nothing yet (a process-wide note gave it the kind)."""
    from draftgen.core.generate.api.preflight import check_api
    from draftgen.core.servers import Server

    def config(name: str, kind: str) -> Config:
        return make_config(tmp_path / name, server.base_url, [{"name": "a", "n": N, "concurrency": 4,
                                                               "max_tokens": 512}],
                           tables={"api": {"kind": kind, "return_token_ids": True, "stream": False},
                                   "tokenizer": {"path": str(bundled_kimi_path())}})
    said: list[list[tuple[Any, ...]]] = [[], []]
    async with RestartedServer("vllm", "0.13.0") as server:
        cfgs = [config("one", "auto"), config("two", "openai-compatible")]
        server.spec = WorkerSpec.from_config(cfgs[0])
        await check_api(cfgs[0], TEST_KEY)  # the first run's start-up check: its kind, then its release
        for k, (shape, version) in enumerate((("vllm", "0.13.0"), ("sglang", "0.5.14"))):
            server.shape, server.version = shape, version
            engine = Engine(cfgs[k], TEST_KEY, seed=1,
                            on_event=lambda p, k=k: said[k].append((p.level, p.kind, p.text())))
            assert await engine.run() == snap.RunState.DONE
            assert engine.errors["no_ids"] == (0 if shape == "vllm" else N)
        later = config("three", "auto")
    first, second = ([e[2] for e in events if e[1] == EventKind.SERVER_IDS] for events in said)
    assert "vLLM 0.13.0" in first[0] and "token ids asked with return_token_ids" in first[0]
    assert "SGLang 0.5.14 has no `return_token_ids`" in second[0]
    assert [c.api.server.kind.name for c in cfgs] == ["openai-compatible"] * 2
    # Not asked yet: treated as OpenRouter until its server answers.
    assert later.api.server.kind.name == "openrouter" and later.api.server.found is None
    assert not later.api.server.asked and later.api.server.release is None
    assert cfgs[0].api.server.release == Server("vllm", (0, 13, 0), "0.13.0")
    assert cfgs[1].api.server.release == Server("sglang", (0, 5, 14), "0.5.14")
