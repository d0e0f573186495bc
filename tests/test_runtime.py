"""The event loop the commands run on (core/runtime.py): uvloop's where installed, asyncio's own when
DRAFTGEN_EVENT_LOOP=asyncio, and the suite runs on the same one."""

from __future__ import annotations

import asyncio

import pytest

from draftgen.core import runtime

uvloop = pytest.importorskip("uvloop")


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_run_uses_uvloop_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(runtime.LOOP_ENV, raising=False)
    assert runtime.run(_loop_module()).startswith("uvloop")
    assert runtime.loop_name() == "uvloop"


def test_asyncio_loop_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(runtime.LOOP_ENV, "asyncio")
    assert runtime.run(_loop_module()).startswith("asyncio")
    assert runtime.loop_name() == "asyncio"


def test_the_tests_run_on_the_commands_loop() -> None:
    """conftest sets the policy, so what the suite checks is what `draftgen run` runs on."""
    assert asyncio.run(_loop_module()).startswith("uvloop")


async def test_an_async_test_runs_on_uvloop() -> None:
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)

