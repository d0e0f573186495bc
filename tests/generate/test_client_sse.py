"""The client's SSE reader on the simulator's real streams, cut at every kind of boundary."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import socket
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.base_protocol import BaseProtocol

from draftgen.core.generate.api.answer import parse_completion
from draftgen.core.generate.api.client import ChatClient, RequestFailed
from draftgen.core.records import ErrorKind
from draftgen.simulator import SimConfig, SimServer

BODY = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": "Say something long."}],
        "max_tokens": 10240, "include_reasoning": True, "return_token_ids": True}


async def _raw(stream: bool) -> bytes:
    cfg = SimConfig(seed=3, latency_scale=0.0, mean_completion_tokens=300, pool_size=8, stream_chunk_tokens=2)
    async with SimServer(cfg, port=0) as sim, aiohttp.ClientSession() as s:
        async with s.post(f"{sim.base_url}/chat/completions", data=orjson.dumps({**BODY, "stream": stream}),
                          headers={"Authorization": "Bearer sk-test"}) as r:
            assert r.status == 200
            return await r.read()


@pytest.fixture(scope="module")
def answers() -> tuple[bytes, bytes]:
    return asyncio.run(_raw(False)), asyncio.run(_raw(True))


@dataclasses.dataclass
class _Response:
    content: aiohttp.StreamReader


async def _read(raw: bytes, piece: int) -> Any:
    """What ChatClient makes of `raw` arriving `piece` bytes at a time, each piece its own read."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()  # a connected transport under the reader, as aiohttp has
    transport, protocol = await loop.connect_accepted_socket(lambda: BaseProtocol(loop), ours)
    reader = aiohttp.StreamReader(protocol, 1 << 16, loop=loop)

    async def arrive() -> None:
        for i in range(0, len(raw), piece):
            reader.feed_data(raw[i:i + piece])
            await asyncio.sleep(0)  # the reader takes this piece before the next one lands
        reader.feed_eof()
    feeding = asyncio.create_task(arrive())
    try:
        return parse_completion(await ChatClient("http://unused", "k", concurrency=1)._read_sse(_Response(reader)), 0.0)
    finally:
        await feeding
        transport.close()
        theirs.close()


def _gen_id(answer: Any) -> str:
    """The generation id without the second it was made in: the two answers come from two simulator
    servers started one after the other, so a second may tick between them."""
    return re.sub(r"^gen-\d+-", "gen-", answer.generation_id)


def _same(a: Any, b: Any) -> None:
    assert (a.content, a.reasoning, a.token_ids, a.usage, a.finish_reason, _gen_id(a), a.provider) == \
           (b.content, b.reasoning, b.token_ids, b.usage, b.finish_reason, _gen_id(b), b.provider)


@pytest.mark.parametrize("piece", [1, 2, 7, 61, 400, 4096, 1 << 30])
async def test_a_stream_cut_anywhere_gives_the_plain_answer(answers, piece):
    plain_raw, stream_raw = answers
    assert stream_raw.count(b"\ndata: ") > 40 and b": OPENROUTER PROCESSING" in stream_raw
    plain = parse_completion(orjson.loads(plain_raw), 0.0)
    assert plain.reasoning and plain.content and plain.token_ids
    _same(await _read(stream_raw, piece), plain)


async def test_crlf_lines_and_a_last_line_without_newline(answers):
    plain_raw, stream_raw = answers
    plain = parse_completion(orjson.loads(plain_raw), 0.0)
    crlf = stream_raw.replace(b"\n", b"\r\n")
    _same(await _read(crlf, 5), plain)
    # No `[DONE]`, and the final chunk (finish_reason, usage) not closed by a newline.
    cut = stream_raw[:stream_raw.rindex(b"data: [DONE]")].rstrip(b"\n")
    _same(await _read(cut, 33), plain)


async def test_a_bad_event_or_an_unfinished_stream_fails_the_request(answers):
    _, stream_raw = answers
    events = stream_raw.split(b"\n\n")
    broken = b"\n\n".join([*events[:5], b"data: {not json", *events[5:]])
    with pytest.raises(RequestFailed) as err:
        await _read(broken, 100)
    assert err.value.kind == ErrorKind.BAD_BODY and "not JSON" in err.value.message
    unfinished = b"\n\n".join(events[:len(events) // 2]) + b"\n\n"
    with pytest.raises(RequestFailed) as err:
        await _read(unfinished, 100)
    assert err.value.kind == ErrorKind.BAD_BODY and "ended before" in err.value.message
