"""A hostile or broken server cannot make draftgen read, hold or store more than max_tokens allows, nor
send the prompts elsewhere; a quit is honoured while a prompt file is read; nan is no temperature.

Each scenario runs against a loopback server of the test's own (aiohttp on 127.0.0.1), the runs through
the real `draftgen` command in a subprocess whose peak memory (VmHWM, read by the child as it exits) is
measured: a gzip bomb of 256 MiB (a ~256 KB body) at concurrency 2, non-streamed and streamed, is cut at
the body bound (core/generate/api/client.py `answer_body_limit`) as an answer past max_tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from draftgen.core.config import Config
from draftgen.core.errors import ConfigError
from draftgen.core.generate.api import client as client_module
from draftgen.core.generate.api.client import ChatClient, RequestFailed
from draftgen.core.records import ErrorKind
from tests.helpers import TEST_KEY, chat_body, cli_env, make_config, served

MB = 1 << 20
BOMB = 256 * MB  # what each answer inflates to
MAX_TOKENS = 1024  # the body bound: answer_body_limit(1024) = 9 MiB
PEAK_RSS_MB = 800

# The child reports its own peak RSS as it exits: VmHWM is the high-water mark of its own memory
# (ru_maxrss is not: Linux carries the parent's over fork and exec).
MEASURED = """
import atexit, runpy, sys
def report(out=sys.argv[1]):
    with open("/proc/self/status") as f:
        peak = next(line for line in f if line.startswith("VmHWM:"))
    with open(out, "w") as f:
        f.write(peak.split()[1])
atexit.register(report)
sys.argv = ["draftgen", *sys.argv[2:]]
runpy.run_module("draftgen.cli.main", run_name="__main__")
"""


def gzip_of(piece: bytes, total: int, head: bytes = b"", tail: bytes = b"") -> bytes:
    """gzip of `head`, `piece` repeated to `total` bytes, and `tail`, compressed a piece at a time."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    out = [z.compress(head)]
    block = piece * max(1, MB // len(piece))
    for _ in range(total // len(block)):
        out.append(z.compress(block))
    out.append(z.compress(tail))
    out.append(z.flush())
    return b"".join(out)


def json_bomb() -> bytes:
    """A non-streamed answer whose content is BOMB bytes of "a", billed as 10 tokens."""
    return gzip_of(b"a", BOMB, b'{"id": "gen-bomb", "provider": "Bomb", "model": "moonshotai/kimi-k2.5", "choices": '
                               b'[{"index": 0, "message": {"role": "assistant", "content": "',
                   b'"}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 5, "completion_tokens": 10, '
                   b'"cost": 0.0001}}')


def sse_bomb() -> bytes:
    """A stream of BOMB bytes of events carrying no text, only token ids (a self-hosted server's), then a
    clean end: nothing the text or usage checks see."""
    ids = b"0," * 4095 + b"0"
    event = b'data: {"id": "gen-bomb", "choices": [{"index": 0, "delta": {}, "token_ids": [' + ids + b"]}]}\n\n"
    end = (b'data: {"id": "gen-bomb", "provider": "Bomb", "choices": [{"index": 0, "delta": {"content": "ok"}, '
           b'"finish_reason": "stop"}], "usage": {"prompt_tokens": 5, "completion_tokens": 10, "cost": 0.0001}}\n\n'
           b"data: [DONE]\n\n")
    return gzip_of(event, BOMB, tail=end)


class Upstream:
    """An OpenAI-compatible API: every chat request gets `body` (with its status, content type and extra
    headers); /key and /credits answer as a key without a cap does."""

    def __init__(self, body: bytes = b"", content_type: str = "application/json",
                 headers: dict[str, str] | None = None, status: int = 200) -> None:
        self.body, self.content_type, self.headers, self.status = body, content_type, headers or {}, status
        self.chats = 0
        self.base_url = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/api/v1/chat/completions", self._chat)
        app.router.add_get("/api/v1/key", self._key)
        app.router.add_get("/api/v1/credits", self._key)
        return app

    async def _key(self, request: web.Request) -> web.Response:
        return web.json_response({"data": {"label": "test", "limit": None, "limit_remaining": None, "usage": 0}})

    async def _chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.chats += 1
        return web.Response(body=self.body, status=self.status, content_type=self.content_type,
                            headers=self.headers)


@contextlib.asynccontextmanager
async def upstream(*args: Any, **kw: Any) -> AsyncIterator[Upstream]:
    """An Upstream(*args, **kw) served on 127.0.0.1 for the block (its base_url set)."""
    up = Upstream(*args, **kw)
    async with served(up.app()) as root:
        up.base_url = f"{root}/api/v1"
        yield up


def bomb_config(tmp_path: Path, base_url: str, *, stream: bool) -> Config:
    return make_config(tmp_path, base_url, [{"name": "bomb", "n": 4, "concurrency": 2, "max_tokens": MAX_TOKENS}],
                       tables={"api": {"stream": stream}, "engine": {"max_attempts": 2, "reconstruct": False}})


def run_measured(tmp_path: Path, cfg: Config, guard_s: float = 600) -> tuple[int, str, float]:
    """`draftgen run CONFIG --headless --skip-smoke` in a subprocess: (exit code, its output, peak RSS in MB).
    `guard_s` only guards against a hang: the run must end by itself."""
    report = tmp_path / "peak_kb"
    proc = subprocess.run([sys.executable, "-c", MEASURED, str(report), "run", str(cfg.path), "--headless",
                           "--skip-smoke", "--interval", "1"], capture_output=True, text=True, timeout=guard_s,
                          env=cli_env())
    return proc.returncode, proc.stdout + proc.stderr, int(report.read_text()) / 1024


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_gzip_bomb_is_cut_at_the_body_bound_as_past_max_tokens(tmp_path, stream):
    body = sse_bomb() if stream else json_bomb()
    assert len(body) < MB  # what crosses the wire: the bomb is in what it inflates to
    async with upstream(body, "text/event-stream" if stream else "application/json",
                        {"Content-Encoding": "gzip"}) as up:
        cfg = bomb_config(tmp_path, up.base_url, stream=stream)
        code, out, peak_mb = await asyncio.to_thread(run_measured, tmp_path, cfg)
    assert "Traceback" not in out, out[-3000:]
    assert peak_mb <= PEAK_RSS_MB, f"peak RSS {peak_mb:.0f} MB"
    big = {str(p): p.stat().st_size for p in cfg.run_dir.rglob("*") if p.is_file() and p.stat().st_size > MB}
    assert not big, big
    # Every attempt cut as past max_tokens, so every prompt failed after its two attempts: the run ended by
    # itself, every prompt with its outcome (exit 0: complete, its failures said).
    assert up.chats == 8, (up.chats, out[-3000:])
    assert code == 0 and "4 failed" in out, out[-3000:]
    failures = [orjson.loads(line) for line in (cfg.run_dir / "bomb" / "failures.jsonl").read_bytes().splitlines()]
    assert sorted(f["id"] for f in failures) == [f"bomb-{i}" for i in range(4)]
    assert {f["error_kind"] for f in failures} == {"past_cap"}, failures[0]
    assert f"ran past {client_module.answer_body_limit(MAX_TOKENS):,} bytes" in failures[0]["message"], failures[0]
    assert not (cfg.run_dir / "bomb" / "responses.jsonl").exists() or \
        not (cfg.run_dir / "bomb" / "responses.jsonl").read_bytes().strip()
    print(f"bounded reads ({'sse' if stream else 'json'}): peak RSS {peak_mb:.0f} MB")


def blank_lines_gz(path: Path, gib: int = 1) -> Path:
    """A gzipped prompt file of `gib` GiB of blank lines (~1 MB): one 64 MiB member, repeated (gzip reads
    concatenated members as one stream)."""
    member = gzip_of(b"\n", 64 * MB)
    with open(path, "wb") as f:
        for _ in range(gib * 16):
            f.write(member)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_quit_is_honoured_while_a_prompt_file_of_blank_lines_is_read(tmp_path, sig):
    prompts = blank_lines_gz(tmp_path / "blank.jsonl.gz")
    cfg = make_config(tmp_path, "http://127.0.0.1:9/api/v1", [{"name": "blank", "prompts": str(prompts)}],
                      tables={"engine": {"reconstruct": False}})
    proc = subprocess.Popen([sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless",
                             "--skip-smoke", "--interval", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=cli_env())
    assert proc.stdout is not None
    try:
        out = b""
        while b"IDLE" not in out:  # its first status line: the prompt file is being read (for minutes)
            line = proc.stdout.readline()
            assert line, out.decode()
            out += line
        os.kill(proc.pid, sig)
        # Read through, the file takes minutes: a quit that waits for it does not end in this guard.
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = (out + rest).decode()
    assert proc.returncode == 130, text[-3000:]
    assert "quit before the run started" in text and "Traceback" not in text, text[-3000:]


async def test_a_cancelled_smoke_count_stops_reading_its_prompt_file(tmp_path):
    from draftgen.core.generate.commands.smoke_local import scan_prompts
    from draftgen.core.generate.loop.prompt_files import read_stoppable
    prompts = blank_lines_gz(tmp_path / "blank.jsonl.gz")
    cfg = make_config(tmp_path, "http://127.0.0.1:9/api/v1", [{"name": "blank", "prompts": str(prompts)}])
    started, ended = threading.Event(), threading.Event()

    def count(stop: threading.Event) -> object:
        started.set()
        try:
            return scan_prompts(cfg.datasets[0], (), stop)
        finally:
            ended.set()
    task = asyncio.ensure_future(read_stoppable(count))
    await asyncio.to_thread(started.wait)
    task.cancel()
    # Read through, the file takes minutes: a cancel that waited for that does not end in this guard.
    done, _ = await asyncio.wait({task}, timeout=60)
    assert done and task.cancelled()
    assert ended.is_set(), "the cancelled count's thread is still reading"


async def test_a_redirect_to_another_origin_is_an_error_naming_both_and_nothing_is_stored(tmp_path):
    async with upstream(orjson.dumps({"id": "gen-elsewhere", "provider": "Elsewhere", "model": "moonshotai/kimi-k2.5",
                                      "choices": [{"message": {"role": "assistant", "content": "planted"},
                                                   "finish_reason": "stop"}],
                                      "usage": {"prompt_tokens": 5, "completion_tokens": 1, "cost": 0.0}})) as there:
        async with upstream(b"", headers={"Location": f"{there.base_url}/chat/completions"}, status=307) as here:
            here_origin, there_origin = (u.base_url.removesuffix("/api/v1")
                                         for u in (here, there))
            # The client: POST and GET refused, naming both origins (port written).
            async with ChatClient(here.base_url, TEST_KEY, concurrency=1) as client:
                with pytest.raises(RequestFailed) as e:
                    await client.chat(chat_body(max_tokens=64))
                assert e.value.kind is ErrorKind.REDIRECT and e.value.status == 307
                assert here_origin in e.value.message and there_origin in e.value.message, e.value.message
            assert there.chats == 0
            # A run: the dataset stops with that message; nothing asked elsewhere, nothing stored.
            cfg = make_config(tmp_path, here.base_url, [{"name": "a", "n": 3, "concurrency": 2}],
                              tables={"engine": {"reconstruct": False}})
            proc = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless",
                                 "--skip-smoke", "--interval", "1"], capture_output=True, text=True, timeout=120,
                env=cli_env())
    out = " ".join((proc.stdout + proc.stderr).split())  # the headless lines wrap
    assert proc.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert f"redirect from {here_origin} to another origin, {there_origin}" in out, out[-3000:]
    assert there.chats == 0
    responses = cfg.run_dir / "a" / "responses.jsonl"
    assert not responses.exists() or not responses.read_bytes().strip()


async def test_a_get_redirect_to_another_origin_is_refused(tmp_path):
    async with upstream() as there:
        app = web.Application()

        async def moved(request: web.Request) -> web.Response:
            raise web.HTTPTemporaryRedirect(f"{there.base_url}/key")
        app.router.add_get("/api/v1/key", moved)
        async with served(app) as here, ChatClient(f"{here}/api/v1", TEST_KEY, concurrency=1) as client:
            with pytest.raises(RequestFailed) as e:
                await client.get_json("/key")
    assert e.value.kind is ErrorKind.REDIRECT
    assert f"redirect from {here} to another origin, {there.base_url.removesuffix('/api/v1')}" in e.value.message, \
        e.value.message


async def test_a_same_origin_redirect_is_refused_too_and_a_get_body_is_bounded(tmp_path):
    app = web.Application()

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPPermanentRedirect("/api/v2/chat/completions")

    async def key_bomb(request: web.Request) -> web.Response:  # 64 MiB of JSON-ish text in a ~64 KB body
        return web.Response(body=gzip_of(b'{"a": 0}', 64 * MB, b"["), content_type="application/json",
                            headers={"Content-Encoding": "gzip"})
    app.router.add_post("/api/v1/chat/completions", moved)
    app.router.add_get("/api/v1/key", key_bomb)
    async with served(app) as here, ChatClient(f"{here}/api/v1", TEST_KEY, concurrency=1) as client:
        with pytest.raises(RequestFailed) as e:
            await client.chat(chat_body(max_tokens=64))
        assert e.value.kind is ErrorKind.REDIRECT and e.value.status == 308
        assert f"redirect to /api/v2/chat/completions on the same origin ({here})" in e.value.message, e.value.message
        with pytest.raises(RequestFailed) as e:
            await client.get_json("/key")
        assert e.value.kind is ErrorKind.BAD_BODY
        assert e.value.message == f"GET /key: body over {client_module.GET_BODY_LIMIT >> 20} MB: not read"


@pytest.mark.parametrize("request_table, needle", [
    ({"temperature": float("nan")}, "request.temperature = nan ([request]) must be a finite number"),
    ({"top_p": float("inf")}, "request.top_p = inf ([request]) must be a finite number"),
    ({"provider": {"order": ["a"], "max_price": {"prompt": float("-inf")}}},
     "request.provider.max_price.prompt = -inf ([request]) must be a finite number"),
], ids=["nan-temperature", "inf-top_p", "nested"])
def test_a_non_finite_sampling_value_is_a_config_error_naming_the_key(tmp_path, request_table, needle):
    with pytest.raises(ConfigError) as e:
        make_config(tmp_path, "http://127.0.0.1:9/api/v1", [{"name": "a", "n": 1}], request=request_table)
    assert needle in str(e.value) and str(tmp_path / "draftgen.toml") in str(e.value), str(e.value)


def test_a_non_finite_value_in_a_datasets_request_table_is_named(tmp_path):
    with pytest.raises(ConfigError) as e:
        make_config(tmp_path, "http://127.0.0.1:9/api/v1",
                    [{"name": "a", "n": 1, "request": {"temperature": float("nan")}}])
    assert "datasets[0].request.temperature = nan (dataset a) must be a finite number" in str(e.value), str(e.value)


def line_bomb() -> bytes:
    """A stream whose one `data:` line never ends: 24 MiB of text (the line bound, 16 MiB, cuts it; the
    body bound at 65,536 tokens, 72 MiB, would not)."""
    return gzip_of(b"a", 24 * MB, b'data: {"id": "gen-line", "choices": [{"index": 0, "delta": {"content": "')


@pytest.mark.slow
async def test_an_sse_line_past_its_bound_is_an_answer_past_max_tokens_and_fails_its_prompt(tmp_path):
    # A line bound cut was a bad body, which spends no attempt while every prompt fares the same: the
    # two prompts were asked (and paid) without end. Past max_tokens, each fails after max_attempts.
    async with upstream(line_bomb(), "text/event-stream", {"Content-Encoding": "gzip"}) as up:
        cfg = make_config(tmp_path, up.base_url, [{"name": "line", "n": 2, "concurrency": 2, "max_tokens": 65536}],
                          tables={"api": {"stream": True}, "engine": {"max_attempts": 2, "reconstruct": False}})
        code, out, _ = await asyncio.to_thread(run_measured, tmp_path, cfg, 300)
        assert up.chats == 4, (up.chats, out[-3000:])
    assert code == 0 and "2 failed" in out, out[-3000:]
    failures = [orjson.loads(line) for line in (cfg.run_dir / "line" / "failures.jsonl").read_bytes().splitlines()]
    assert {f["error_kind"] for f in failures} == {"past_cap"}, failures
    assert f"ran past {client_module.MAX_SSE_LINE:,} bytes" in failures[0]["message"], failures[0]


@pytest.mark.slow
async def test_a_dataset_whose_every_answer_is_unreadable_stops_and_says_why(tmp_path):
    # Every answer a stream that ends before it finishes: no prompt's own fault (they all fare the same),
    # so none fails; the dataset stops once more than a wave of them came in a row, its prompts eligible.
    cut = b'data: {"id": "gen-cut", "choices": [{"index": 0, "delta": {"content": "half an ans"}}]}\n\n'
    async with upstream(cut, "text/event-stream") as up:
        cfg = make_config(tmp_path, up.base_url, [{"name": "cut", "n": 3, "concurrency": 2, "max_tokens": 64}],
                          tables={"api": {"stream": True},
                                  "engine": {"max_attempts": 2, "reconstruct": False, "backoff_base_s": 0.01,
                                             "backoff_max_s": 0.02}})
        code, out, _ = await asyncio.to_thread(run_measured, tmp_path, cfg, 300)
        chats = up.chats
    assert code == 3, out[-3000:]  # incomplete: the dataset stopped, its prompts not failed
    assert "cut: stopped: more than 22 answers in a row could not be read" in "".join(out.split("\n")), out[-3000:]
    assert "the stream ended before the answer finished" in out and "[api] stream = false" in out, out[-3000:]
    assert 22 < chats <= 22 + 2, chats  # the wave past the limit, no more
    assert not (cfg.run_dir / "cut" / "failures.jsonl").exists() or not \
        (cfg.run_dir / "cut" / "failures.jsonl").read_bytes().strip()


async def test_a_get_whose_connection_is_dropped_is_a_connection_error_not_an_internal_one():
    async def drop(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.close()  # connected, then closed before any answer
        return web.Response()

    app = web.Application()
    app.router.add_get("/api/v1/key", drop)
    async with served(app) as root:
        async with ChatClient(f"{root}/api/v1", TEST_KEY, concurrency=1) as client:
            with pytest.raises(RequestFailed) as caught:
                await client.get_json("/key")
    assert caught.value.kind is ErrorKind.CONNECTION and caught.value.message.startswith("GET /key: "), \
        caught.value.message
