"""Builders shared by the tests: prompt files and configs pointing at a simulator on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from rich.console import Console

from draftgen.core.config import Config
from draftgen.core.config_load import load_config
from draftgen.core.config_values import toml_value
from draftgen.core.rundir import RunDir

if TYPE_CHECKING:
    import aiohttp
    from aiohttp import web

    from draftgen.core.generate.loop.engine import Engine
    from draftgen.core.live.snapshot import DatasetSnapshot
    from draftgen.simulator import SimServer
    from draftgen.tui.app import DraftgenApp

TEST_KEY = "sk-or-v1-draftgen-test-key-0123456789abcdef"
SIM_AUTH = {"Authorization": "Bearer sk-test"}


def write_prompts(path: Path, n: int, prefix: str = "q", start: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.writelines(orjson.dumps({"id": f"{prefix}{i}", "prompt": f"Question {prefix}{i}: explain item {i}."}) + b"\n"
                     for i in range(start, start + n))
    return path


def make_config(tmp_path: Path, base_url: str, datasets: list[dict[str, Any]], *,
                tables: dict[str, dict[str, Any]] | None = None, request: dict[str, Any] | None = None,
                key_env: str = "DG_TEST_KEY") -> Config:
    """A config file in tmp_path; each dataset dict needs name and n (prompt count) or prompts."""
    api = {"base_url": base_url, "api_key_env": key_env, "model": "moonshotai/kimi-k2.5",
           "request_timeout_s": 20, "connect_timeout_s": 5, **(tables or {}).get("api", {})}
    engine = {"backoff_base_s": 0.01, "backoff_max_s": 0.2, "snapshot_hz": 10, **(tables or {}).get("engine", {})}
    lines = ["[api]"] + [f"{k} = {toml_value(v)}" for k, v in api.items()]
    lines += ["", "[request]"]
    for k, v in (request if request is not None else {"temperature": 0.6, "include_reasoning": True}).items():
        lines.append(f"{k} = {toml_value(v)}")
    lines += ["", "[engine]"] + [f"{k} = {toml_value(v)}" for k, v in engine.items()]
    for table, values in (tables or {}).items():
        if table in ("api", "engine"):
            continue
        lines += ["", f"[{table}]"] + [f"{k} = {toml_value(v)}" for k, v in values.items()]
    if "output" not in (tables or {}):
        lines += ["", "[output]", "dir = \"run\""]
    for ds in datasets:
        ds = dict(ds)
        n = ds.pop("n", None)
        if n is not None and "prompts" not in ds:
            ds["prompts"] = f"prompts/{ds['name']}.jsonl"
            write_prompts(tmp_path / ds["prompts"], n, prefix=f"{ds['name']}-")
        lines += ["", "[[datasets]]"] + [f"{k} = {toml_value(v)}" for k, v in ds.items()]
    path = tmp_path / "draftgen.toml"
    path.write_text("\n".join(lines) + "\n")
    return load_config(path)


def dataset_row(engine: Engine, name: str) -> DatasetSnapshot:
    """Dataset `name` as the views see it: its entry of the engine's snapshot, not the engine's own state."""
    return next(d for d in engine.snapshot().datasets if d.name == name)


def read_ids(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [orjson.loads(line)["id"] for line in path.read_bytes().splitlines() if line.strip()]


# -- raw chat requests to the simulator ----------------------------------------------------------


def chat_body(prompt: str = "What is 2+2? Answer in one word.", **kw: Any) -> dict[str, Any]:
    """A chat-completions request body as the engine sends it, with `kw` on top."""
    out: dict[str, Any] = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": prompt}],
                           "max_tokens": 10240, "include_reasoning": True}
    out.update(kw)
    return out


async def chat_post(s: aiohttp.ClientSession, sim: SimServer, payload: dict[str, Any],
                    headers: dict[str, str] = SIM_AUTH, **kw: Any) -> tuple[int, Any, bytes]:
    """(status, headers, raw body) of one POST /chat/completions."""
    async with s.post(f"{sim.base_url}/chat/completions", data=orjson.dumps(payload),
                      headers={**headers, "Content-Type": "application/json"}, **kw) as r:
        return r.status, r.headers, await r.read()


def parse_sse(raw: bytes) -> tuple[list[dict[str, Any]], int, bool]:
    """(data chunks, comment lines, saw [DONE]) of an SSE body."""
    chunks, comments, done = [], 0, False
    for line in raw.decode().split("\n"):
        if line.startswith(":"):
            comments += 1
        elif line.startswith("data: "):
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
            else:
                chunks.append(json.loads(data))
    return chunks, comments, done


def cli_env(key: str = TEST_KEY, **extra: str) -> dict[str, str]:
    """The environment for a `draftgen` subprocess: this one's, plus the API key where configs look."""
    return {**os.environ, "DG_TEST_KEY": key, **extra}


async def serve_local(app: web.Application) -> tuple[web.AppRunner, int]:
    """A test's own aiohttp app served on 127.0.0.1 (a free port): its runner (cleanup() at the end) and port."""
    from aiohttp import web
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


@contextlib.asynccontextmanager
async def served(app: web.Application) -> AsyncIterator[str]:
    """`app` served on 127.0.0.1 (serve_local) for the block: its address, http://127.0.0.1:PORT."""
    runner, port = await serve_local(app)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def until(cond: Callable[[], bool], what: str, timeout: float = 30.0, every: float = 0.01) -> None:
    """Wait for `cond`: a guard against a hang, not a timing check (the timeout is generous)."""
    async def poll() -> None:
        while not cond():
            await asyncio.sleep(every)
    try:
        await asyncio.wait_for(poll(), timeout)
    except TimeoutError:
        raise AssertionError(f"never happened within {timeout:.0f} s: {what}") from None


async def read_until(proc: asyncio.subprocess.Process, lines: list[str], needle: str, timeout: float = 60.0) -> None:
    """Read `proc`'s output into `lines` until its last 8 lines, joined, hold `needle`: a guard against a
    hang (the timeout), not a timing check; the output so far is in the failure."""
    async def read() -> None:
        assert proc.stdout is not None
        while needle not in " ".join(x.strip() for x in lines[-8:]):
            line = (await proc.stdout.readline()).decode()
            assert line, f"ended before {needle!r}: " + "".join(lines)[-3000:]
            lines.append(line)
    try:
        await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise AssertionError(f"never printed {needle!r}: " + "".join(lines)[-3000:]) from None


def tui_run_in_pty(config_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """`draftgen run CONFIG --skip-smoke` (the TUI) in a 120x40 pseudo-terminal it has as its controlling
    terminal (so a hang-up reaches it as SIGHUP); returns the process and the pty's master end."""
    import fcntl
    import struct
    import termios
    master, slave = os.openpty()
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))

    def controlling_tty() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen([sys.executable, "-m", "draftgen.cli.main", "run", str(config_path), "--skip-smoke"],
                            stdin=slave, stdout=slave, stderr=slave, env=cli_env(TERM="xterm-256color"),
                            preexec_fn=controlling_tty)
    os.close(slave)
    return proc, master


def drain_pty(master: int, stop: threading.Event) -> None:
    """Read what the TUI draws so its writes never block on a full pty buffer."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not stop.is_set():
        ready, _, _ = select.select([master], [], [], 0.05)
        if ready:
            try:
                if not os.read(master, 65536):
                    return
            except OSError:
                return


async def read_attach_stream(run_dir: Path, proc: asyncio.subprocess.Process,
                             attached: Callable[[], Awaitable[object]] | None = None) -> bytes:
    """Every byte the run's attach socket sends to a viewer, from as early as it can connect to the bye;
    `attached` is awaited once the viewer is connected (a test that holds the run's requests until then
    releases them there, so a short run cannot end before the viewer is in)."""
    sock = RunDir(run_dir).socket
    for _ in range(3000):  # a hang guard: the run serves the socket before its first request
        try:
            # Through its folder's descriptor, as `draftgen attach` does (attach.py short_path): a run
            # directory under a deep tmp_path (pytest-xdist's popen-gwN) names a socket past sockaddr_un's
            # ~108 bytes.
            folder = os.open(sock.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                reader, writer = await asyncio.open_unix_connection(f"/proc/self/fd/{folder}/{sock.name}",
                                                                    limit=1 << 24)
            finally:
                os.close(folder)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            assert proc.returncode is None, "the run ended before a viewer could attach"
            await asyncio.sleep(0.01)
    else:
        raise AssertionError(f"nothing served {sock}")
    if attached is not None:
        await attached()
    chunks = []
    try:
        while chunk := await asyncio.wait_for(reader.read(1 << 16), 60):
            chunks.append(chunk)
    finally:
        writer.close()
    return b"".join(chunks)


def text(app: DraftgenApp, selector: str) -> str:
    """What a Static panel shows, as plain text at its current width."""
    widget = app.screen.query_one(selector)
    console = Console(width=max(widget.content_region.width, 40), file=io.StringIO(), color_system=None)
    with console.capture() as cap:
        console.print(widget.content)  # type: ignore[attr-defined]
    return cap.get()
