"""A dataset's prompt source (core/generate/loop/source.py): what admission pulls, and what each
booked outcome does to what comes next."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from draftgen.core.generate.loop.prompts import Prompt
from draftgen.core.generate.loop.source import HANDED_BACK, Booked, FileSource


def prompt(i: int) -> Prompt:
    return Prompt(f"a-{i}", [{"role": "user", "content": str(i)}], i + 1)


async def stream(n: int) -> AsyncIterator[list[Prompt]]:
    """n prompts in chunks of two, as a dataset's file is read a chunk at a time."""
    for i in range(0, n, 2):
        yield [prompt(k) for k in range(i, min(n, i + 2))]


async def test_prompts_handed_back_come_before_the_files_next_in_the_order_they_came_back() -> None:
    source = FileSource(stream(4))
    p0, p1, p2 = [await source.next() for _ in range(3)]
    assert p0 is not None and p1 is not None and p2 is not None
    source.booked(p2, HANDED_BACK)
    source.booked(p0, HANDED_BACK)
    source.booked(p1, Booked.skipped("max_usd"))
    got = [await source.next() for _ in range(3)]
    assert [p.id for p in got if p is not None] == ["a-2", "a-0", "a-3"]
    assert source.out == 3 and source.handed_back == 0


async def test_at_the_files_end_next_waits_for_what_is_out_and_ends_once_all_is_booked() -> None:
    source = FileSource(stream(2))
    a, b = await source.next(), await source.next()
    assert a is not None and b is not None
    waiting = asyncio.create_task(source.next())
    await asyncio.sleep(0.01)
    assert not waiting.done(), "a prompt out may still come back: the source is not finished"
    source.booked(a, Booked.failed("bad_request"))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    source.booked(b, HANDED_BACK)  # an account condition: it is asked again
    assert await waiting is b
    source.booked(b, Booked.skipped("token budget"))
    assert await source.next() is None
