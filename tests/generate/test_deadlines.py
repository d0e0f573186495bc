"""api.request_timeout_s: one sweep bounds every request in flight (core/generate/api/deadlines.py). A
request past its deadline fails as a timeout at the await it was in, the others go on; a stop that
cancels a request is a cancel, even when its deadline has passed too; no timer is left once nothing is
in flight."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp import web

from draftgen.core.generate.api.client import ChatClient, RequestFailed
from draftgen.core.generate.api.deadlines import Deadlines
from draftgen.core.records import ErrorKind
from tests.helpers import serve_local

ANSWER = {"id": "gen-1", "provider": "P", "model": "m", "choices": [{"index": 0, "finish_reason": "stop",
          "message": {"role": "assistant", "content": "an answer"}}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 2, "cost": 0.00001}}


class HoldingServer:
    """A chat completions endpoint on 127.0.0.1 that answers at once, except a prompt "hold", which it
    keeps until the test ends."""

    def __init__(self) -> None:
        self.released = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def __aenter__(self) -> HoldingServer:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner, self.port = await serve_local(app)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.released.set()
        assert self.runner is not None
        await self.runner.cleanup()

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body["messages"][-1]["content"] == "hold":
            await self.released.wait()
        return web.json_response(ANSWER, headers={"X-Generation-Id": "gen-1"})


def _body(text: str) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": text}]}


async def test_a_request_past_its_deadline_fails_as_a_timeout_while_the_others_are_answered():
    async with HoldingServer() as server, ChatClient(f"http://127.0.0.1:{server.port}/v1", "sk-test-key-0000",
                                                     concurrency=8, request_timeout_s=0.4) as client:
        start = time.monotonic()
        results = await asyncio.gather(client.chat(_body("hold")), *(client.chat(_body(f"q{i}")) for i in range(6)),
                                       client.chat(_body("hold")), return_exceptions=True)
        took = time.monotonic() - start
        held, answered = [results[0], results[-1]], results[1:-1]
        assert all(isinstance(e, RequestFailed) and e.kind is ErrorKind.TIMEOUT and "within 0.4 s" in e.message
                   for e in held), held
        assert all(not isinstance(a, BaseException) and a.content == "an answer" for a in answered), answered
        assert took >= 0.4  # not before its deadline (and at most a sweep, 0.1 s here, after it)
        # The deadline's cancel was taken back: the gathering task is not left cancelling.
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        # Once nothing is in flight, the next sweep schedules none.
        await asyncio.sleep(0.25)
        assert not client._deadlines.armed


async def _held(deadlines: Deadlines, entered: asyncio.Event) -> None:
    with deadlines:
        entered.set()
        await asyncio.sleep(30)


async def test_a_sweep_turns_its_own_cancel_into_a_timeout():
    deadlines, entered = Deadlines(0.01, every_s=60), asyncio.Event()  # swept by the test, not by the timer
    task = asyncio.create_task(_held(deadlines, entered))
    await entered.wait()
    await asyncio.sleep(0.05)
    assert deadlines.sweep() == 1 and deadlines.sweep() == 0  # cancelled once
    with pytest.raises(TimeoutError):
        await task
    assert task.cancelling() == 0


async def test_a_stop_that_cancels_a_request_past_its_deadline_is_a_cancel_not_a_timeout():
    deadlines, entered = Deadlines(0.01, every_s=60), asyncio.Event()
    task = asyncio.create_task(_held(deadlines, entered))
    await entered.wait()
    await asyncio.sleep(0.05)
    task.cancel()  # stop now, in the same tick as the sweep
    assert deadlines.sweep() == 1
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_a_request_within_its_deadline_is_not_cancelled_by_a_sweep():
    deadlines, entered = Deadlines(30, every_s=60), asyncio.Event()
    task = asyncio.create_task(_held(deadlines, entered))
    await entered.wait()
    assert deadlines.sweep() == 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
