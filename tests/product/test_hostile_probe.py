"""What a hostile probe of the product found, each kept fixed: the key in every form it can be quoted
in, keys with whitespace, world-readable run files, the simulator's key in argv, a flood of attach
connections, prompt paths that are not files, output.dir naming a file, control characters in
dataset names, and a clock stepped back and forth under the history.

Real things throughout: the `draftgen` command in a subprocess against the simulator's HTTP server,
real FIFOs and devices, real Unix sockets and a real file-descriptor limit.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import socket
import stat
import subprocess
import sys
from pathlib import Path

import aiohttp
import orjson
import pytest

from draftgen.core.config_load import load_config
from draftgen.core.errors import ConfigError
from draftgen.core.generate.loop import prompt_files
from draftgen.core.generate.loop.prompt_files import read_prompts
from draftgen.core.generate.loop.prompts import Prompt, Rejection
from draftgen.core.live import attach as attach_mod
from draftgen.core.live.attach import AttachServer
from draftgen.core.live.hub import Hub
from draftgen.core.live.timeline import TimelineRecorder, Totals, read_history
from draftgen.core.rundir import RunDir
from draftgen.core.secrets import Redactor
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import cli_env, make_config, read_attach_stream, until, write_prompts

KEY = "sk-or-v1-PROBE7f3a9c1e5b2d4f6a8c0e1b3d5f7a9c2e4b6d8f0a1c3e5b7d9f2a4c6e8b0d1f3a"
BODY = KEY.removeprefix("sk-or-v1-")


def forms(key: str = KEY) -> dict[str, str]:
    """Every form of the key a careless upstream has been seen quoting."""
    mid = len(key) // 2
    return {"whole": key, "upper": key.upper(), "lower": key.lower(), "body": BODY, "body-upper": BODY.upper(),
            "window": key[mid:mid + 12], "window-upper": key[mid:mid + 12].upper(), "head": key[:12],
            "tail": key[-12:]}


def windows_left(data: str) -> list[str]:
    """The key's 12-character windows (any case) still in `data`."""
    low, key = data.lower(), KEY.lower()
    return sorted({key[i:i + 12] for i in range(len(key) - 11) if key[i:i + 12] in low})


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    def limit_memory() -> None:  # a prompt path like /dev/zero must fail, never eat the machine's memory
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    return subprocess.run([sys.executable, "-m", "draftgen.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or cli_env(), preexec_fn=limit_memory)


def assert_config_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("draftgen: error: "), proc.stderr[-2000:]
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


def offline_config(tmp_path: Path, **dataset: object) -> Path:
    """A config whose server is never reached (every case here fails before a request)."""
    write_prompts(tmp_path / "prompts.jsonl", 3)
    return make_config(tmp_path, "http://127.0.0.1:9/api/v1", [{"name": "a", "prompts": "prompts.jsonl",
                                                                **dataset}]).path


# -- the key in every form ---------------------------------------------------------------------


@pytest.mark.parametrize("form", list(forms()))
def test_redactor_cuts_every_form_of_the_key(form):
    quoted = forms()[form]
    for secret in (KEY, KEY + " ", "\t" + KEY + "\n"):  # a key read with whitespace around it still matches
        text = f'{{"error": {{"message": "invalid key {quoted}; see docs", "raw": "{quoted}"}}}}'
        out = Redactor(secret)(text)
        assert not windows_left(out), (form, out)
        assert out.count("[redacted]") == 2 and "invalid key " in out and "; see docs" in out


def test_the_management_key_is_cut_too(monkeypatch, tmp_path):
    # GET /credits takes the management key: an error that quotes it is cut like the run's key.
    mgmt = "sk-or-v1-" + "9f8e7d6c5b4a" * 5
    monkeypatch.setenv("DG_MGMT_KEY", mgmt)
    from draftgen.core.config_load import load_config
    cfg = load_config(offline_config(tmp_path))
    import dataclasses
    api = dataclasses.replace(cfg.api, management_key_env="DG_MGMT_KEY")
    redact = Redactor(KEY, api.management_key())
    out = redact(f"403 for {mgmt} and {mgmt[9:].upper()} and {KEY}")
    assert mgmt[9:21].lower() not in out.lower() and KEY[9:21] not in out and out.count("[redacted]") == 3


def test_redactor_leaves_other_text_alone():
    redact = Redactor(KEY)
    text = "429 rate limited by provider novita; retry after 1 s; id gen-0123456789abcdefabcdef; sk-or-v1-"
    assert redact(text) == text
    assert redact("") == ""
    assert Redactor("short")("a short key is no needle") == "a short key is no needle"


@pytest.fixture(scope="module")
def echoed_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One real headless run (then merge) against a simulator that quotes the key, in every form, in
    each of its error bodies; with a viewer on the attach socket throughout."""
    tmp_path = tmp_path_factory.mktemp("echoed")

    async def go() -> dict[str, object]:
        sim_cfg = SimConfig(seed=5, latency_scale=0.0, fixed_latency_s=0.02, mean_completion_tokens=60,
                            faults={"500": 0.2, "429": 0.1}, retry_after_s=0.01, echo_key=True,
                            scenarios={"invalid_prompt": {"rate": 0.2}})
        async with SimServer(sim_cfg, port=0) as sim:
            cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 60, "concurrency": 6}],
                              tables={"tokenizer": {"path": str(bundled_kimi_path())},
                                      "engine": {"max_attempts": 2, "workers": 1}})
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", "--skip-smoke",
                "--interval", "0.2", env=cli_env(KEY), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            stream = asyncio.create_task(read_attach_stream(cfg.run_dir, proc))
            out, err = await asyncio.wait_for(proc.communicate(), 120)
            attach = await asyncio.wait_for(stream, 30)
        merged = await asyncio.to_thread(cli, "merge", str(cfg.path), env=cli_env(KEY))
        assert merged.returncode == 0, merged.stderr[-2000:]
        return {"cfg": cfg, "code": proc.returncode, "out": out + err, "attach": attach}

    return asyncio.run(go())


@pytest.mark.slow
def test_no_form_of_an_echoed_key_reaches_failures_the_log_or_the_attach_stream(echoed_run):
    cfg = echoed_run["cfg"]
    rd = RunDir(cfg.run_dir)
    failures = rd.failures("a").read_text()
    # The storm really failed prompts for good, with the upstream's message (key forms cut out).
    assert failures.count("\n") >= 5 and "[redacted]" in failures, failures[:2000]
    attach = echoed_run["attach"].decode()
    assert '"type":"hello"' in attach and "[redacted]" in attach
    for name, data in {"failures.jsonl": failures, "events.log": rd.events_log.read_text(), "attach stream": attach,
                       "run output": echoed_run["out"].decode()}.items():
        assert not windows_left(data), (name, windows_left(data))
    for path in Path(cfg.run_dir).rglob("*"):
        if path.is_file():
            assert not windows_left(path.read_bytes().decode("utf-8", "replace")), path


@pytest.mark.slow
def test_everything_in_a_run_directory_is_owner_only(echoed_run):
    root = Path(echoed_run["cfg"].run_dir)
    seen = {"files": 0, "folders": 1}
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for path in root.rglob("*"):
        mode = stat.S_IMODE(path.lstat().st_mode)
        if path.is_dir():
            seen["folders"] += 1
            assert mode == 0o700, (path, oct(mode))
        else:
            seen["files"] += 1
            assert mode == 0o600, (path, oct(mode))
    names = {p.name for p in root.rglob("*")}
    # The run wrote its whole tree: records, spend, events, history, tokens and the merge.
    assert {"responses.jsonl", "failures.jsonl", "events.log", "spend.jsonl", "run.json", "tokens",
            "merged", "train.jsonl"} <= names, names
    assert seen["files"] > 10 and seen["folders"] >= 4


@pytest.mark.parametrize("value, says", [
    (KEY + "\n", "ends with a line break"),
    (KEY + " ", "ends with whitespace"),
    (" " + KEY, "starts with whitespace"),
    (KEY[:20] + "\n" + KEY[20:], "contains at character 21 a line break"),
    (KEY[:20] + "\x07" + KEY[20:], "control or non-ASCII character at character 21"),
], ids=["newline", "trailing-space", "leading-space", "inner-newline", "bell"])
def test_a_key_with_whitespace_or_control_characters_is_refused_naming_the_variable(tmp_path, value, says):
    path = offline_config(tmp_path)
    for command in ("smoke", "run"):
        proc = cli(command, str(path), *(["--headless", "--skip-smoke"] if command == "run" else []),
                   env=cli_env(value))
        assert_config_error(proc, "$DG_TEST_KEY", "api.api_key_env", says, str(path))
        assert not windows_left(proc.stdout + proc.stderr)
        assert "internal error" not in proc.stderr


# -- the simulator's key -----------------------------------------------------------------------


def test_the_simulator_reads_its_key_from_the_environment(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DRAFTGEN_SIM_KEY": "sk-sim-from-env"}
    proc = subprocess.Popen([sys.executable, "-m", "draftgen.cli.main", "simulate", "--port", "0",
                             "--latency-scale", "0", "--status-every", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = proc.stdout.readline()
        assert "http://127.0.0.1:" in first, first + proc.stderr.read()
        base_url = first.split(" at ")[1].strip()

        async def ask(key: str) -> int:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
                async with s.get(f"{base_url}/key") as r:
                    return r.status

        assert asyncio.run(ask("sk-some-other-key")) == 401
        assert asyncio.run(ask("sk-sim-from-env")) == 200
        proc.terminate()
        out, err = proc.communicate(timeout=20)
        assert "sk-sim-from-env" not in first + out + err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # A key in argv (visible in `ps`) is refused, saying where the key goes instead.
    old = cli("simulate", "--port", "0", "--key", "sk-in-argv", timeout=30)
    assert old.returncode == 2 and "DRAFTGEN_SIM_KEY" in old.stderr and "sk-in-argv" not in old.stderr


# -- attach floods -----------------------------------------------------------------------------


async def test_attach_serves_at_most_its_limit_and_says_so_once(tmp_path, monkeypatch):
    monkeypatch.setattr(attach_mod, "MAX_CLIENTS", 4)
    said: list[str] = []
    async with AttachServer(Hub(), tmp_path / "attach.sock", on_warning=said.append) as server:
        conns = [await asyncio.open_unix_connection(str(tmp_path / "attach.sock")) for _ in range(204)]
        await until(lambda: server.clients + server.refused_clients == 204, "every connection accepted or refused")
        assert server.clients == 4 and server.refused_clients == 200
        # The refused are closed at once: they read EOF without a hello.
        assert await asyncio.wait_for(conns[-1][0].read(), 10) == b""
        for _, w in conns:
            w.close()
    assert len(said) == 1 and "refused" in said[0] and "4 already attached" in said[0], said


ATTACH_UNDER_FD_LIMIT = """
import asyncio, resource, sys
from pathlib import Path
from draftgen.core.live.attach import AttachServer
from draftgen.core.live.hub import Hub

async def main():
    async with AttachServer(Hub(), Path(sys.argv[1]), on_warning=lambda m: print("WARN", m, flush=True)) as server:
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        print("ready", flush=True)
        await asyncio.sleep(float(sys.argv[2]))
        print("served", server.clients, "failures", server.accept_failures, flush=True)

asyncio.run(main())
"""


@pytest.mark.slow
def test_running_out_of_descriptors_never_floods_the_output(tmp_path):
    """200 viewers against a run with few descriptors left: the accept failure is said once, not in a
    tight loop (asyncio's own server logged it 658,523 times in 25 s)."""
    sock_path = tmp_path / "attach.sock"
    proc = subprocess.Popen([sys.executable, "-c", ATTACH_UNDER_FD_LIMIT, str(sock_path), "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    clients = []
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-2000:]
        for _ in range(200):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(str(sock_path))  # queued by the kernel even when the server cannot accept
            clients.append(c)
        out, err = proc.communicate(timeout=60)
    finally:
        for c in clients:
            c.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    served = re.search(r"served (\d+) failures (\d+)", out)
    assert served and 0 < int(served[1]) < 200 and int(served[2]) >= 1, out[-2000:]
    warnings = [line for line in out.splitlines() if line.startswith("WARN")]
    assert len(warnings) == 1 and "cannot accept a viewer" in warnings[0], warnings
    assert len(out) + len(err) < 4000, (len(out), len(err), err[:2000])


# -- prompt paths that are not files -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "dev-urandom", "folder"])
def test_a_prompt_path_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    target = {"dev-zero": "/dev/zero", "dev-urandom": "/dev/urandom"}.get(kind, str(tmp_path / "prompts.pipe"))
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "folder":
        os.mkdir(target)
    path = offline_config(tmp_path)
    path.write_text(path.read_text().replace('prompts = "prompts.jsonl"', f'prompts = "{target}"'))
    says = {"fifo": "a FIFO", "dev-zero": "a device", "dev-urandom": "a device", "folder": "a folder"}[kind]
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "datasets[0].prompts" in str(e.value) and target in str(e.value) and says in str(e.value)
    for args in (["run", str(path), "--headless", "--skip-smoke"], ["smoke", str(path)]):
        proc = cli(*args, timeout=30)
        assert_config_error(proc, str(path), "datasets[0].prompts", target, says)
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name], list(tmp_path.rglob("*"))


def test_reading_a_prompt_path_that_became_a_fifo_fails_at_once(tmp_path):
    fifo = tmp_path / "p.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(prompt_files.PromptFileError, match="not a regular file"):
        list(read_prompts(fifo))  # opened without waiting for a writer


def test_a_line_far_too_long_is_rejected_by_length(tmp_path, monkeypatch):
    monkeypatch.setattr(prompt_files, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "p.jsonl"
    lines = [orjson.dumps({"id": "ok1", "prompt": "short"}),
             orjson.dumps({"id": "huge", "prompt": "x" * 5_000_000}),
             orjson.dumps({"id": "edge", "prompt": "y" * (1000 - 30)}),
             orjson.dumps({"id": "ok2", "prompt": "after"})]
    path.write_bytes(b"\n".join(lines) + b"\n")
    items = list(read_prompts(path))
    assert [type(i).__name__ for i in items] == ["Prompt", "Rejection", "Prompt", "Prompt"], items[1]
    assert isinstance(items[1], Rejection) and items[1].line == 2 and "longer than 1,000 bytes" in items[1].reason
    assert [i.id for i in items if isinstance(i, Prompt)] == ["ok1", "edge", "ok2"]
    assert [i.line for i in items] == [1, 2, 3, 4]


# -- config: output.dir and dataset names ------------------------------------------------------


def test_output_dir_naming_a_file_is_a_config_error(tmp_path):
    path = offline_config(tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    path.write_text(path.read_text().replace('dir = "run"', 'dir = "a-file"'))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "output.dir" in str(e.value) and str(tmp_path / "a-file") in str(e.value) and str(path) in str(e.value)
    assert_config_error(cli("run", str(path), "--headless", "--skip-smoke"), str(path), "output.dir",
                        str(tmp_path / "a-file"), "is a file")


@pytest.mark.parametrize("name", ["a\u0007b", "a\tb", "line\nbreak", "esc\x1b[31mred", "del\x7f"])
def test_a_dataset_name_with_control_characters_is_refused_naming_the_key(tmp_path, name):
    path = offline_config(tmp_path)
    path.write_text(path.read_text().replace('name = "a"', f"name = {json.dumps(name)}"))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "datasets[0].name" in str(e.value) and "printable" in str(e.value) and str(path) in str(e.value)
    assert name not in str(e.value)  # said escaped (repr), never printed raw


# -- history under a stepped clock -------------------------------------------------------------


class SteppedClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_history_intervals_come_from_the_monotonic_clock(tmp_path):
    path = tmp_path / "history.jsonl"
    wall, mono = SteppedClock(1_767_261_600.0), SteppedClock(1000.0)
    rec = TimelineRecorder(path, interval_s=5.0, clock=wall, monotonic=mono)
    rec.start(Totals(0, 0, 0.0, 0, 0))
    steps = [0, -3600, 0, +86_400, -86_400 + 20, 0, 0, +7, -7, 0]  # the wall clock stepped back and forth
    for i, step in enumerate(steps, 1):
        wall.t += 5.0 + step
        mono.t += 5.0
        rec.observe(Totals(answers=10 * i, tokens=100 * i, usd=0.01 * i, errors=0, in_flight=3))
    rec.close()
    intervals = list(read_history(path))
    assert len(intervals) == len(steps)
    assert [iv.dt for iv in intervals] == [5.0] * len(steps)
    ts = [iv.ts for iv in intervals]
    assert ts == sorted(ts) and ts[0] == 1_767_261_600.0 and ts[-1] - ts[0] == 5.0 * (len(steps) - 1)
    assert all(iv.answers == 10 for iv in intervals)
    assert rec.timeline().series("req_s")[-1] == pytest.approx(2.0)
