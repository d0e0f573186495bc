"""The settler's close ends its tasks whatever turn of the event loop the close comes in.

Python 3.11's `asyncio.wait_for` swallows a cancel that arrives as its inner wait completes. The settler's
pricing loop waits on its wake with `wait_for`, and a drain both wakes it (an attempt abandoned: one more
to price from the key's usage) and closes it (`Engine.run`'s `finally`): when the two met in one turn, the
cancel was lost, the loop went on waiting, and close()'s gather held the drained run's exit for ever (the
crash-and-resume soak's SIGHUP drain sat at DRAINING with nothing in flight, 1 run in 4 under load)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from draftgen.core.generate.money.settle import Settler
from draftgen.core.generate.money.spend import SpendLedger


@pytest.mark.parametrize("turns", [0, 1, 2, 3])
async def test_a_close_in_the_turn_the_pricing_loop_wakes_ends_it(tmp_path: Path, turns: int) -> None:
    spend = SpendLedger(tmp_path / "spend.jsonl")
    spend.open()
    spend.set_key_baseline(0.0)
    ticket = spend.reserve("a", "p1", 0.01)
    await spend.send_grouped(ticket)
    spend.abandoned(ticket)  # no generation id: priced from the key's usage once it cannot still run

    async def no_usage() -> float | None:
        return None

    settler = Settler(spend, None, 1.0, key_usage=no_usage, request_timeout_s=30.0)  # type: ignore[arg-type]
    settler.start_unknown()
    for _ in range(3):  # the loop waits for the attempt to be due (wait_for on its wake, 30 s)
        await asyncio.sleep(0)
    assert settler.unknown_waiting == 1
    settler._unknown_wake.set()  # what an attempt abandoned by a drain does
    for _ in range(turns):
        await asyncio.sleep(0)
    await asyncio.wait_for(settler.close(), 5)  # before the fix: turns 0 and 1 never returned
    assert settler.unknown_waiting == 0
    spend.close()
