"""The API key never leaves the process: not in a file, a log line, stdout/stderr, the attach stream
or a screenshot — even when the upstream quotes it back in its error bodies.

One recognisable fake key goes through smoke, run (headless subprocess with a viewer on the attach
socket, and the in-process pipeline inside the real TUI), tokens and merge, against a simulator
that echoes the key in every error (SimConfig.echo_key) and one that rejects it with a 401 that
quotes it. Then everything written and printed is searched for the key and its first 12 characters.
"""

from __future__ import annotations

import asyncio
import base64
import html
import os
import re
import sys
from pathlib import Path

import aiohttp
import orjson
import pytest

from draftgen.core.config_load import load_config
from draftgen.core.errors import EXIT_KEY_REFUSED
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.rundir import RunDir
from draftgen.core.secrets import MARK, PREFIX, Redactor
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import cli_env, make_config, read_attach_stream

CANARY = "sk-or-v1-LEAKCANARY-7f3a9c1e5b2d4f6a8c0e1b3d5f7a9c2e4b6d8f0a1c3e5b7d9f2a4c6e8b0d1f3a"
NEEDLES = (CANARY.encode(), CANARY[:PREFIX].encode())
FAULTS = {"429": 0.1, "500": 0.1, "524": 0.1, "error200": 0.1, "truncated": 0.05}
REQUEST = {"temperature": 0.6, "include_reasoning": True, "provider": {"ignore": ["fireworks", "baseten"]}}
# The 500s and 524s leave attempts whose generation record never comes: each is still looked up, its 404s
# retried and written down (where the key could leak), but a run ends after 2 s of them, not 10
# (min(10, generation_lookup_s) at the end of a run).
LOOKUP_S = 2.0


def leaks(data: bytes) -> list[bytes]:
    return [n for n in NEEDLES if n in data]


def svg_text(svg: str) -> bytes:
    """The visible text of an SVG screenshot (tags dropped, entities decoded), as well as the raw file."""
    return (svg + html.unescape(re.sub(r"<[^>]+>", "", svg))).encode()


def scan_tree(root: Path) -> tuple[int, dict[str, list[bytes]]]:
    """(files read, {path: needles found}) over every regular file under root (names included)."""
    found: dict[str, list[bytes]] = {}
    count = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*filenames, *dirnames]:
            path = Path(dirpath) / name
            hits = leaks(os.fsencode(str(path)))
            if path.is_file() and not path.is_symlink():
                count += 1
                hits += leaks(path.read_bytes())
            if hits:
                found[str(path)] = hits
    return count, found


async def cli(*args: str, env_key: str = CANARY, timeout: float = 90) -> tuple[int, bytes, bytes]:
    env = cli_env(env_key)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "draftgen.cli.main", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode, out, err


@pytest.mark.slow
async def test_the_key_appears_nowhere(tmp_path: Path) -> None:
    outputs: dict[str, bytes] = {}
    sim_cfg = SimConfig(seed=11, latency_scale=0.0, fixed_latency_s=0.02, mean_completion_tokens=60,
                        faults=FAULTS, retry_after_s=0.01, echo_key=True)
    async with SimServer(sim_cfg, port=0) as sim, \
            SimServer(SimConfig(seed=12, latency_scale=0.0, api_key="the-real-key", echo_key=True), port=0) as deny:
        # The simulator really does quote the key back: otherwise this test would prove nothing.
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {CANARY}"}) as http:
            async with http.get(f"{deny.base_url}/credits") as resp:
                assert resp.status == 401 and CANARY in await resp.text()

        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 120, "concurrency": 8},
                                                   {"name": "b", "n": 40, "concurrency": 4, "max_tokens": 2048}],
                          tables={"tokenizer": {"path": str(bundled_kimi_path())},
                                  "engine": {"max_attempts": 2, "workers": 1},
                                  "api": {"credits_interval_s": 0.2, "generation_lookup_s": LOOKUP_S}},
                          request=REQUEST)
        denied_dir = tmp_path / "denied"
        denied_dir.mkdir()
        denied = make_config(denied_dir, deny.base_url, [{"name": "d", "n": 6, "concurrency": 3}],
                             tables={"tokenizer": {"path": str(bundled_kimi_path())},
                                     "engine": {"reconstruct": False}})

        # smoke: one against the echoing fault storm, one whose key is refused with a 401 that quotes it.
        for label, config in (("smoke", cfg), ("smoke-401", denied)):
            code, out, err = await cli("smoke", str(config.path))
            outputs[f"{label} stdout"], outputs[f"{label} stderr"] = out, err
            assert b"Traceback" not in err, err.decode()[-2000:]
        assert code == 1 and b"key" in outputs["smoke-401 stdout"]

        # run, headless in a subprocess, with a viewer reading the raw attach stream throughout.
        env = cli_env(CANARY)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", "--skip-smoke",
            "--interval", "0.2", env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stream_task = asyncio.create_task(read_attach_stream(cfg.run_dir, proc))
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        outputs["attach stream"] = await asyncio.wait_for(stream_task, 30)
        outputs["run stdout"], outputs["run stderr"] = out, err
        assert proc.returncode == 0, (out + err).decode()[-3000:]

        # run with the refused key: the start-up check stops it with the 401 body, which quotes the key.
        code, out, err = await cli("run", str(denied.path), "--headless", "--skip-smoke", "--interval", "0.2")
        outputs["run-401 stdout"], outputs["run-401 stderr"] = out, err
        assert code == EXIT_KEY_REFUSED and b"was refused" in err, (out + err).decode()[-3000:]

        # The in-process pipeline inside the real TUI, then its screenshot.
        shots = await pipeline_in_tui(tmp_path / "tui", sim.base_url)
        stats = sim.stats

    for command in ("tokens", "merge"):
        code, out, err = await cli(command, str(cfg.path))
        outputs[f"{command} stdout"], outputs[f"{command} stderr"] = out, err
        assert code == 0, (out + err).decode()[-3000:]

    # The storm really happened and errors really were recorded (with the key cut out of them).
    assert sum(stats.faults.values()) > 20
    # A refused key fails no prompt (the account's problem): its 401 body, which quotes the key, is
    # said at the shell with the key cut out.
    assert not RunDir(denied.run_dir).failures("d").exists() or not RunDir(denied.run_dir).failures("d").read_bytes()
    assert b"[redacted]" in outputs["run-401 stderr"] and b"401" in outputs["run-401 stderr"]
    assert b"[redacted]" in outputs["smoke-401 stdout"] or b"[redacted]" in outputs["smoke stdout"]
    stream_lines = [orjson.loads(line) for line in outputs["attach stream"].splitlines()]
    assert stream_lines[0]["type"] == "hello" and any(x["type"] == "snapshot" for x in stream_lines)
    assert (Path(cfg.run_dir) / "merged" / "train.jsonl").exists()

    files, found = scan_tree(tmp_path)
    assert files > 20
    for name, svg in shots.items():
        outputs[name] = svg_text(svg)
    repo_shots = sorted((Path(__file__).resolve().parents[2] / "screenshots").glob("*.svg"))
    for path in repo_shots:
        outputs[str(path)] = svg_text(path.read_text(encoding="utf-8"))
    printed = {name: hits for name, data in outputs.items() if (hits := leaks(data))}
    print(f"searched {files} files and {len(outputs)} outputs ({sum(map(len, outputs.values())):,} bytes)")
    assert not found, f"the key was written to {found}"
    assert not printed, f"the key was printed in {printed}"


async def pipeline_in_tui(folder: Path, base_url: str) -> dict[str, str]:
    """Smoke, then a run, in the Pipeline embedded in the real app; SVG screenshots of both."""
    from draftgen.tui.app import DraftgenApp

    folder.mkdir()
    make_config(folder, base_url, [{"name": "t", "n": 40, "concurrency": 6}],
                tables={"tokenizer": {"path": str(bundled_kimi_path())},
                        "engine": {"max_attempts": 2, "workers": 1}, "api": {"credits_interval_s": 0.2}},
                request=REQUEST)
    config = load_config(folder / "draftgen.toml")
    pipeline = Pipeline(config, CANARY, skip_smoke=True)
    await pipeline.start()
    shots = {}
    try:
        app = DraftgenApp(pipeline, title="draftgen · secrets")
        async with app.run_test(size=(120, 40)) as pilot:
            await pipeline.smoke()
            await pilot.pause(0.3)
            shots["tui smoke screenshot"] = app.export_screenshot()
            await pipeline.generate()
            await pilot.pause(0.3)
            shots["tui run screenshot"] = app.export_screenshot()
    finally:
        await pipeline.close()
    return shots


def key_forms(key: str) -> dict[str, bytes]:
    """Needles for every form an upstream may quote `key` in: plain (as is, re-cased), JSON-\\u-escaped
    (lower and upper hex), percent-encoded (both cases) and base64 (behind "user:", a Basic credential),
    each for 12-character windows at the key's start, middle and end; and each as it reads inside a
    JSON string (its backslashes escaped), as records, ledgers and the attach stream hold them."""
    mid = len(key) // 2 - 6
    forms: dict[str, bytes] = {}
    for at in (0, mid, len(key) - PREFIX):
        w = key[at:at + PREFIX]
        for name, text in (("plain", w), ("upper", w.upper()), ("lower", w.lower()),
                           ("json", "".join(f"\\u{ord(c):04x}" for c in w)),
                           ("JSON", "".join(f"\\u{ord(c):04X}" for c in w)),
                           ("url", "".join(f"%{ord(c):02x}" for c in w)),
                           ("URL", "".join(f"%{ord(c):02X}" for c in w))):
            forms[f"{name}@{at}"] = text.encode()
            forms[f"{name}@{at} in JSON"] = text.replace("\\", "\\\\").encode()
    basic = base64.b64encode(f"user:{key}".encode()).decode()
    for at in (8, len(basic) // 2, len(basic) - 24):
        forms[f"base64@{at}"] = basic[at:at + 16].encode()
    return forms


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
async def test_no_form_of_the_key_an_upstream_echoes_in_any_field_reaches_a_file_or_the_attach_stream(
        tmp_path: Path, stream: bool) -> None:
    """The upstream echoes the key in X-Generation-Id, `id`, `provider`, `model`, error messages and
    error metadata, plain, JSON-escaped, percent-encoded and in base64 (SimConfig.echo_key_fields). A
    headless run (the real client, streamed or not) with a viewer on the attach socket: no form of the
    key is in any file of the run directory, the attach stream (its snapshots: the providers panel) or
    the output."""
    forms = key_forms(CANARY)
    faults = {"error200": 0.25, "500": 0.1, "429": 0.05, "524": 0.05}
    # A prompt's own 400 (provider_400, with the provider's metadata) fails it at once, echoed key and all:
    # failures are recorded whatever the answer faults' evidence rule decides for the other faults.
    sim_cfg = SimConfig(seed=21, latency_scale=0.0, fixed_latency_s=0.02, mean_completion_tokens=60,
                        faults=faults, retry_after_s=0.01, echo_key=True, echo_key_fields=True,
                        scenarios={"provider_400": {"rate": 0.1}})
    async with SimServer(sim_cfg, port=0) as sim:
        # The simulator really quotes every form: otherwise this test would prove nothing.
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {CANARY}"}) as http:
            seen = b""
            for i in range(40):
                async with http.post(f"{sim.base_url}/chat/completions", json={
                        "model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": f"q{i}"}]}) as resp:
                    seen += (await resp.read()) + resp.headers.get("X-Generation-Id", "").encode()
        missing = [name for name, needle in forms.items()
                   if (" in JSON" in name or name.startswith("base64")) and needle not in seen]
        assert not missing, f"the simulator did not echo {missing}"

        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 60, "concurrency": 6}],
                          tables={"tokenizer": {"path": str(bundled_kimi_path())},
                                  "engine": {"max_attempts": 1, "workers": 1},
                                  "api": {"credits_interval_s": 0.2, "stream": stream,
                                          "generation_lookup_s": LOOKUP_S}},
                          request=REQUEST)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", "--skip-smoke",
            "--interval", "0.2", env=cli_env(CANARY), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stream_task = asyncio.create_task(read_attach_stream(cfg.run_dir, proc))
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        stream = await asyncio.wait_for(stream_task, 30)
        assert proc.returncode in (0, 3), (out + err).decode()[-3000:]
    run = RunDir(cfg.run_dir)
    # The fields really came through, redacted: answers and failures recorded, providers named.
    assert run.failures("a").exists() and b"[redacted]" in run.failures("a").read_bytes()
    records = [orjson.loads(line) for line in run.responses("a").read_bytes().splitlines()]
    assert records and all(MARK in r["provider"] and MARK in r["generation_id"] and MARK in r["model"]
                           for r in records)
    assert b"providers" in stream or b"provider_stats" in stream
    outputs = {"stdout": out, "stderr": err, "attach stream": stream}
    for dirpath, _, filenames in os.walk(tmp_path):
        for name in filenames:
            path = Path(dirpath) / name
            if path.is_file() and not path.is_symlink():
                outputs[str(path)] = path.read_bytes()
    assert len(outputs) > 10
    found = {where: [f for f, needle in forms.items() if needle in data]
             for where, data in outputs.items()}
    found = {where: names for where, names in found.items() if names}
    assert not found, f"a form of the key was written: {found}"


def test_the_redactor_cuts_the_key_json_escaped_percent_encoded_and_in_base64() -> None:
    cut = Redactor(CANARY, "sk-or-v1-management-0123456789abcdef0123")
    for name, needle in key_forms(CANARY).items():
        text = f"upstream said: {needle.decode()} (and more)"
        assert PREFIX <= len(needle) and not [n for n, x in key_forms(CANARY).items() if x in cut(text).encode()], name
        assert cut(text).startswith("upstream said: ") and cut(text).endswith(" (and more)"), (name, cut(text))
    whole = base64.b64encode(f"user:{CANARY}".encode()).decode()
    assert MARK in cut(f"Authorization: Basic {whole}")
    # Escapes and encodings of other text are left alone.
    for text in ("%20 100% \\u00e9 gen-1733-abcdef012345", "dXNlcjpwYXNzd29yZA== a Basic credential of another"):
        assert cut(text) == text


def test_the_redactor_finds_the_key_beside_characters_whose_case_folding_changes_length() -> None:
    # The prefilter folds a text with str.lower(), which turns "İ" into two characters and the Kelvin
    # sign into "k": the key's windows around them are still found, and text without them is left alone.
    cut = Redactor(CANARY)
    for around in ("İ", "\u212a", "ß", "ǅ"):
        for piece in (CANARY, CANARY[9:9 + PREFIX], CANARY[20:40].upper()):
            text = f"{around * 3}{piece}{around}x"
            out = cut(text)
            assert MARK in out and out.startswith(around * 3) and out.endswith(f"{around}x"), (around, piece, out)
        plain = f"{around} gen-1733-{around}abcdef012345 K\u212aK"
        assert cut(plain) == plain
