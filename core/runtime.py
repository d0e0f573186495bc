"""The event loop every command runs on: uvloop's where it is installed (a dependency on Linux and
macOS), asyncio's own elsewhere or with DRAFTGEN_EVENT_LOOP=asyncio. At 2,000 requests in flight
the loop's own work (select, callbacks, socket reads) is a third of the engine's CPU, and uvloop's
does it in C (BENCHMARKS.md, "engine vs references"). Nothing in draftgen depends on which loop runs;
the tests run on the same one (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

LOOP_ENV = "DRAFTGEN_EVENT_LOOP"  # "asyncio": the standard library's loop even where uvloop is installed


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's new_event_loop, or None for asyncio's default (not installed, or asked for)."""
    if os.environ.get(LOOP_ENV, "").strip().lower() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:  # Windows, or installed without it
        return None
    return uvloop.new_event_loop


def loop_name() -> str:
    """Which loop `run` uses, for the benchmarks and `--debug`."""
    return "asyncio" if loop_factory() is None else "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on the chosen loop: the same shutdown (tasks cancelled, async generators and the
    default executor closed) and the same Ctrl-C handling."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
