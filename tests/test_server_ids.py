"""A self-hosted server that returns its own token ids (`[api] return_token_ids = true`): the prompt's
and the answer's, in the shapes vLLM and SGLang document, served by a canned aiohttp handler on
loopback (no model). The run stores them; `draftgen tokens` trains on them and says where they
differ from the reconstruction.

The shapes, from the servers' sources:
  vLLM >= 0.10.2, vllm/entrypoints/openai/chat_completion/protocol.py: ChatCompletionResponseChoice
    and ChatCompletionResponseStreamChoice `token_ids` (a stream chunk's are its delta tokens);
    ChatCompletionResponse and ChatCompletionStreamResponse `prompt_token_ids` at the top level (the
    `return_token_ids` doc: "In streaming mode, prompt_token_ids is included only in the first chunk").
  SGLang, python/sglang/srt/entrypoints/openai/protocol.py: ChatCompletionResponseChoice
    `prompt_token_ids` and `token_ids`, both on the (non-streamed) choice.
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
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.command import tokens_command
from draftgen.core.tokens.reconstruct import reconstruct
from draftgen.core.tokens.store import TokenReader
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.core.tokens.workers import WorkerSpec, reconstruct_dataset

from .helpers import TEST_KEY, make_config

N = 6
BAD_ANSWER = "a-1"   # its token_ids differ from what the reconstruction gives (one id changed)
BAD_PROMPT = "a-2"   # its prompt_token_ids differ from the rendered prompt (one id changed)


class CannedServer:
    """POST /v1/chat/completions answers every prompt with a fixed reasoning and answer, and the ids the
    run's own tokenizer and template give for them, shaped as `shape` says ("vllm" or "sglang")."""

    def __init__(self, shape: str) -> None:
        self.shape = shape
        self.spec: WorkerSpec | None = None
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.sent: dict[str, tuple[list[int], list[int]]] = {}  # prompt id -> (prompt ids, answer ids) served

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def __aenter__(self) -> CannedServer:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
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
        messages = body["messages"]
        pid = messages[-1]["content"].split(":")[0].removeprefix("Question ")
        reasoning, content = f"The user asks about {pid}. Think.", f"Here is {pid}: an answer."
        prompt_ids, answer_ids = self.ids(messages, reasoning, content)
        if pid == BAD_ANSWER:
            answer_ids = [answer_ids[0] + 1, *answer_ids[1:]]  # another valid id: not what the text encodes
        if pid == BAD_PROMPT:
            prompt_ids = [prompt_ids[0], prompt_ids[1] + 1, *prompt_ids[2:]]
        self.sent[pid] = (prompt_ids, answer_ids)
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(answer_ids),
                 "total_tokens": len(prompt_ids) + len(answer_ids)}
        head = {"id": f"chatcmpl-{pid}", "created": int(time.time()), "model": body["model"]}
        if not body.get("stream"):
            choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "token_ids": answer_ids,
                                      "message": {"role": "assistant", "content": content, "reasoning": reasoning}}
            out: dict[str, Any] = {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
            if self.shape == "sglang":
                choice["prompt_token_ids"] = prompt_ids
            else:
                out["prompt_token_ids"] = prompt_ids
            return web.json_response(out, dumps=lambda o: orjson.dumps(o).decode())
        # vLLM's stream: the role first with the prompt ids, then deltas, each with its own token ids.
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {**head, "object": "chat.completion.chunk"}
        n_think = len(self.ids(messages, reasoning, "")[1]) - 2  # up to </think>, before ""<|im_end|>
        events = [
            {**chunk, "prompt_token_ids": prompt_ids,
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}]},
            {**chunk, "choices": [{"index": 0, "delta": {"reasoning": reasoning}, "token_ids": answer_ids[:n_think]}]},
            {**chunk, "choices": [{"index": 0, "delta": {"content": content}, "token_ids": answer_ids[n_think:-1]}]},
            {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "token_ids": answer_ids[-1:]}]},
            {**chunk, "choices": [], "usage": usage},
        ]
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


@pytest.mark.parametrize("shape,stream", [("vllm", False), ("vllm", True), ("sglang", False)])
async def test_the_servers_ids_are_stored_used_and_compared(tmp_path, capsys, shape, stream):
    async with CannedServer(shape) as server:
        cfg = server_config(tmp_path, server.base_url, stream)
        server.spec = WorkerSpec.from_config(cfg)
        assert await Engine(cfg, TEST_KEY, seed=1).run() == snap.RunState.DONE
    assert len(server.sent) == N

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
    # The changed answer id decodes to another text than the answer's (round_trip): that sample is
    # dropped; the other prompt, the one the model saw, is kept and noted.
    assert report.failures["round_trip"] == 1 and report.dropped == {"invalid": 1}
    assert report.kept == N - 1 and report.noted == {"backend_prompt_mismatch": 1}


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
