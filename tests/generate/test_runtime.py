"""The event loop the commands run on (core/runtime.py): uvloop's where installed, asyncio's own when
DRAFTGEN_EVENT_LOOP=asyncio, and the suite runs on the same one."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from draftgen.core import runtime

uvloop = pytest.importorskip("uvloop")


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_run_uses_uvloop_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(runtime.LOOP_ENV, raising=False)
    assert runtime.run(_loop_module()).startswith("uvloop")
    assert runtime.loop_name() == "uvloop"


def test_asyncio_loop_when_asked() -> None:
    """In a fresh process (this one has conftest's policy, which asyncio's default would follow)."""
    code = ("import asyncio; from draftgen.core import runtime\n"
            "async def m(): return type(asyncio.get_running_loop()).__module__\n"
            "print(runtime.run(m()), runtime.loop_name())")
    for env, want in (({runtime.LOOP_ENV: "asyncio"}, ("asyncio.unix_events", "asyncio")),
                      ({runtime.LOOP_ENV: ""}, ("uvloop", "uvloop"))):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, **env})
        assert tuple(out.stdout.split()) == want, out.stdout


def test_the_tests_run_on_the_commands_loop() -> None:
    """conftest sets the policy, so what the suite checks is what `draftgen run` runs on."""
    assert asyncio.run(_loop_module()).startswith("uvloop")


async def test_an_async_test_runs_on_uvloop() -> None:
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)

