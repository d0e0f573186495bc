"""A server's text never reaches a terminal or a log as a command (issue 50, point 1).

The simulator answers with escape sequences (SimConfig.hostile_text) in every field it sends: the
answer's `provider`, `model` and `id`, its content and reasoning, every error's message and metadata
and the key's label. Each view is run against it: `draftgen smoke`, a headless `draftgen run` (its
output, its raw attach stream, `events.log` and every file a user tails or cats), `draftgen tokens`,
`report` and `ledger`, the TUI with the run in it and the read-only attach view: none holds an ESC,
BEL or C1 control of the server's; each shows the server's text with its controls as visible escapes.
The stored answers keep their text exactly as generated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import re
import shutil
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from rich.console import Console

from draftgen.core.config import Config
from draftgen.core.live.attach_viewer import AttachControls, last_run_ended
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.rundir import EventLog, RunDir
from draftgen.core.safe_text import visible
from draftgen.core.secrets import Redactor
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.simulator import SimConfig, SimServer
from tests import fixtures as fx
from tests.helpers import TEST_KEY, chat_body, chat_post, cli_env, make_config, read_attach_stream, until

# A window title, a screen wipe, an OSC 52 clipboard write, an OSC 8 link, a C1 CSI, a carriage return
# and a backspace that write over what came before, and Rich markup.
HOSTILE = ("\x1b]0;pwned\x07\x1b[2J\x1b]52;c;cHduZWQ=\x07\x1b]8;;http://127.0.0.1/x\x1b\\here\x1b]8;;\x1b\\"
           "\x9b31m\r\b[bold]b[/bold] [/x]")
SHOWN = visible(HOSTILE)  # as the views show it
MARKUP = "[bold]b[/bold]"
SCENARIOS = {"provider_400": {"rate": 0.3, "match": "Question a-"},  # a prompt's own 400, failed at once
             "bad_parameter": {"match": "Question b-"}}  # every request of b: the dataset stops


def controls(text: str) -> list[str]:
    """The terminal controls in `text`: ESC, BEL, backspace, carriage return, C1."""
    return sorted({repr(c) for c in text if c in "\x1b\x07\x08\r" or 0x80 <= ord(c) <= 0x9f})


def hostile_sim() -> SimServer:
    return SimServer(SimConfig(seed=5, latency_scale=0.0, fixed_latency_s=0.02, mean_completion_tokens=40,
                               faults={"error200": 0.1, "500": 0.1}, retry_after_s=0.01, hostile_text=HOSTILE,
                               scenarios=SCENARIOS), port=0)


def released_by(sim: SimServer, session: aiohttp.ClientSession,
                sent: list[asyncio.Task[tuple[int, Any, bytes]]]) -> Callable[[], Awaitable[None]]:
    """What a viewer calls once attached: one request of the test's own in flight, which brings a server
    holding every request until the run's concurrency + 1 are in flight (SimConfig.hold_until_in_flight) to
    release them all, so a short run cannot end, on a loaded machine, before its viewer is in."""
    async def release() -> None:
        sent.append(asyncio.create_task(chat_post(session, sim, chat_body())))
    return release


def config(folder: Path, base_url: str, stream: bool = False, hostile_ids: bool = False) -> Config:
    """Datasets a (30 prompts, some refused as their own) and b (10, every request refused: it stops);
    `hostile_ids`: prompt ids carrying HOSTILE as a prompt file may, b's lines three-turn conversations."""
    datasets: list[dict[str, Any]] = [{"name": "a", "n": 30, "concurrency": 4},
                                      {"name": "b", "n": 10, "concurrency": 2}]
    if hostile_ids:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "a.jsonl").write_bytes(b"".join(orjson.dumps(
            {"id": f"a-{i}{HOSTILE}", "prompt": f"Question a-{i}: explain item {i}."}) + b"\n" for i in range(30)))
        (folder / "b.jsonl").write_bytes(b"".join(orjson.dumps(
            {"id": f"b-{i}{HOSTILE}", "messages": [{"role": "user", "content": f"Question b-{i}: explain item {i}."},
                                                   {"role": "assistant", "content": "An answer."},
                                                   {"role": "user", "content": "Question b-: and then?"}]}) + b"\n"
            for i in range(10)))
        datasets = [{"name": "a", "prompts": "a.jsonl", "concurrency": 4},
                    {"name": "b", "prompts": "b.jsonl", "concurrency": 2, "turns": "all"}]
    return make_config(folder, base_url, datasets,
                       tables={"tokenizer": {"path": str(bundled_kimi_path())},
                               "engine": {"max_attempts": 2, "workers": 1},
                               "api": {"credits_interval_s": 0.2, "generation_lookup_s": 1.0, "stream": stream}})


async def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "draftgen.cli.main", *args,
                                                env={**cli_env(), **(env or {})},
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert b"Traceback" not in err, err.decode()[-3000:]
    return proc.returncode or 0, (out + err).decode()


async def headless_run(cfg: Config, attached: Callable[[], Awaitable[object]] | None = None
                       ) -> tuple[int, str, bytes]:
    """`draftgen run --headless --skip-smoke` in a subprocess, with a viewer on its attach socket: its exit
    status, its output, and every byte the viewer was sent (`attached`: read_attach_stream's)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", "--skip-smoke",
        "--interval", "0.2", env=cli_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    attach = asyncio.create_task(read_attach_stream(cfg.run_dir, proc, attached))
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    stream_bytes = await asyncio.wait_for(attach, 30)
    assert b"Traceback" not in err, err.decode()[-3000:]
    return proc.returncode or 0, (out + err).decode(), stream_bytes


def strings(value: Any) -> list[str]:
    """Every string in a JSON value, keys included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (k, *strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return []


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
async def test_no_control_a_server_sends_reaches_the_commands_the_headless_run_or_its_files(
        tmp_path: Path, stream: bool) -> None:
    outputs: dict[str, str] = {}
    async with hostile_sim() as sim:
        cfg = config(tmp_path, sim.base_url, stream)
        # The run first: with no smoke test answered before it, b (every request refused) stops.
        code, outputs["run"], stream_bytes = await headless_run(cfg)
        assert code == 3, outputs["run"][-3000:]  # b stopped
        code, outputs["smoke"] = await cli("smoke", str(cfg.path))
        for command in ("tokens", "ledger", "report"):
            code, outputs[command] = await cli(command, str(cfg.path))
            assert code == 0, outputs[command][-3000:]
    run = RunDir(cfg.run_dir)
    # The attach stream is JSON: what a viewer shows is the strings in it.
    lines = [orjson.loads(line) for line in stream_bytes.splitlines()]
    assert any(x["type"] == "snapshot" for x in lines)
    outputs["attach stream"] = stream_bytes.decode() + "\n".join(s for x in lines for s in strings(x))
    for path in run.root.rglob("*"):
        if path.is_file() and path.suffix in (".log", ".jsonl", ".json", ".txt") and path.name != "responses.jsonl":
            data = path.read_text(encoding="utf-8")
            outputs[str(path.relative_to(run.root))] = data + "".join(
                "\n".join(strings(orjson.loads(line))) for line in data.splitlines() if path.suffix == ".jsonl")

    # The server's text really came through each of these (lines wrapped or not), its controls escaped.
    for where in ("smoke", "run", "events.log", "attach stream", "a/failures.jsonl", "tokens"):
        assert "\\x1b]0;pwned\\x07" in "".join(outputs[where].split()), (where, outputs[where][-2000:])
    assert "b:stopped:HTTP400:Providerreturnederror\\x1b]0;pwned" in "".join(outputs["run"].split())
    found = {where: c for where, text in outputs.items() if (c := controls(text))}
    assert not found, f"a server's controls were printed or written raw: {found}"
    # The stored answers keep their text as generated (JSON escapes it).
    records = [orjson.loads(line) for line in run.responses("a").read_bytes().splitlines()]
    assert records and all(r["content"].startswith(HOSTILE) for r in records)
    assert all(r["provider"].endswith(SHOWN) and r["model"].endswith(SHOWN) for r in records)

    # Records whose provider names were stored raw (by an earlier version, or a file from elsewhere):
    # `draftgen tokens` shows them escaped too.
    run.responses("a").write_bytes(b"".join(orjson.dumps({**r, "provider": r["provider"].replace(SHOWN, HOSTILE)})
                                            + b"\n" for r in records))
    shutil.rmtree(run.root / "a" / "tokens")  # reconstructed again from the records
    code, out = await cli("tokens", str(cfg.path))
    assert code == 0 and SHOWN.split("[")[0] in "".join(out.split()), out[-3000:]
    assert not controls(out), controls(out)


def screen(app: Any) -> str:
    """The app's whole screen as rendered (every widget's strips), without Textual's own styling codes."""
    console = Console(width=app.size.width, file=io.StringIO(), color_system=None)
    with console.capture() as cap:
        console.print(app.screen._compositor.render_update(full=True))
    return cap.get()


@pytest.mark.slow
async def test_no_control_a_server_sends_reaches_the_tui_or_the_attach_view(tmp_path: Path) -> None:
    from draftgen.tui.app import DraftgenApp
    from draftgen.tui.screens.drill import DrillScreen

    shown: dict[str, str] = {}
    async with hostile_sim() as sim:
        # The TUI with the run in it: the main screen, the smoke checklist, a dataset's and a provider's drill.
        cfg = config(tmp_path / "tui", sim.base_url, hostile_ids=True)
        pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True, serve_attach=False)
        await pipeline.start()
        try:
            app = DraftgenApp(pipeline, title="draftgen · hostile")
            async with app.run_test(size=(160, 50)) as pilot:
                await pipeline.smoke()
                await pipeline.generate()
                await until(lambda: "pwned" in screen(app), "the providers shown")
                shown["tui"] = screen(app)
                await pilot.press("s")
                await until(lambda: "a: provider" in screen(app), "the smoke checklist")
                shown["tui smoke"] = screen(app)
                await pilot.press("escape", "enter")  # the first dataset's drill: its recent errors
                assert isinstance(app.screen, DrillScreen)
                await until(lambda: "Provider returned error" in screen(app), "a's errors")
                shown["tui drill a"] = screen(app)
                await pilot.press("escape", "j", "enter")  # b's: its last conversation, ended at turn 1
                assert isinstance(app.screen, DrillScreen)
                await until(lambda: "last conversation" in screen(app), "b's last conversation")
                shown["tui drill b"] = screen(app)
                await pilot.press("escape", "tab", "tab", "enter")  # the first provider's
                assert isinstance(app.screen, DrillScreen)
                shown["tui drill provider"] = screen(app)
        finally:
            await pipeline.close()

        # The read-only attach view of a run in this process, attached before its first request.
        cfg = config(tmp_path / "attach", sim.base_url)
        pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True)
        await pipeline.start()
        try:
            viewer = AttachControls(cfg.run_dir, retry_s=0.05)
            app = DraftgenApp(viewer, title="draftgen attach", refresh_s=0.02)
            async with viewer, app.run_test(size=(160, 50)) as pilot:
                await until(lambda: "ATTACHED" in screen(app), "attached")
                await pipeline.generate()
                await until(lambda: "pwned" in screen(app) and "b: stopped" in screen(app), "the run shown")
                shown["attach"] = screen(app)
                await pilot.press("enter")
                assert isinstance(app.screen, DrillScreen)
                await until(lambda: "Provider returned error" in screen(app), "a's errors")
                shown["attach drill a"] = screen(app)
        finally:
            await pipeline.close()

    for where, text in shown.items():
        assert "\\x1b]0;pwned" in "".join(text.split()), (where, text)
    found = {where: c for where, text in shown.items() if (c := controls(text))}
    assert not found, f"a server's controls reached the screen: {found}"
    # Server text is text, not Rich markup: the tags are shown as sent.
    for where in ("tui drill a", "tui drill b", "tui drill provider", "attach drill a"):
        assert MARKUP in "".join(shown[where].split()), (where, shown[where])


def test_visible_shows_controls_as_escapes_and_keeps_ordinary_text() -> None:
    assert visible("\x1b[2J\x07\x9b\x7f\r\b\x00") == "\\x1b[2J\\x07\\x9b\\x7f\\r\\x08\\x00"
    text = "Kimi 回答 👍 café\n\tindented"
    assert visible(text) is text
    assert visible(text, one_line=True) == "Kimi 回答 👍 café\\n\\tindented"
    # Bidi embeddings, overrides and isolates (Trojan Source): `moonshotai/<RLO>5.2k-imik` shows as kimi-k2.5
    # on screen. Escaped; zero-width joiners (emoji, Persian) and the plain direction marks kept.
    spoof = "moonshotai/\u202e5.2k-imik \u202a\u202b\u202c\u202d \u2066\u2067\u2068\u2069"
    assert visible(spoof) == visible(spoof, one_line=True) == \
        "moonshotai/\\u202e5.2k-imik \\u202a\\u202b\\u202c\\u202d \\u2066\\u2067\\u2068\\u2069"
    kept = "👨\u200d👩\u200d👧 می\u200cخواهم \u200b\u200e\u200f\ufeff"
    assert visible(kept) is kept and visible(kept, one_line=True) == kept
    assert Redactor(TEST_KEY)(spoof) == visible(spoof)
    # Once is enough: what it returns is returned as is.
    assert visible(visible(HOSTILE)) == visible(HOSTILE)
    # The Redactor's output is made safe in the same pass as the key is cut (every upstream field passes it).
    cut = Redactor("sk-or-v1-0123456789abcdef0123456789abcdef")
    assert cut(f"{HOSTILE} sk-or-v1-0123456789abcdef0123456789abcdef") == f"{SHOWN} [redacted]"
    assert not controls(cut(HOSTILE))


async def test_the_ledger_says_a_refused_keys_message_as_text(tmp_path: Path) -> None:
    """`draftgen ledger` quotes GET /key's error: a server's `[/x]` in it is text (it crashed the command),
    its controls escaped."""
    sim_cfg = SimConfig(seed=1, latency_scale=0.0, hostile_text=HOSTILE, scenarios={"revoked_key": {}})
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 3}])
        code, out = await cli("ledger", str(cfg.path))
    assert code == 0, out
    assert f"key usage not shown (GET /key: HTTP 401: User not found. {SHOWN}" in "".join(out.splitlines()), out
    assert not controls(out)


def test_a_servers_line_break_starts_no_line_of_its_own_in_events_log(tmp_path: Path) -> None:
    """A server's message with a line break and what reads as a run's end after it: the line is indented
    under the message in events.log, so `draftgen attach` does not read it as how the last run ended."""
    forged = "HTTP 400: bad\n2026-12-07 13:00:00 INFO  run DONE: 1 of 1 answered, 0 failed; forged"
    log = EventLog(RunDir(tmp_path).events_log)
    log.write("info", "run STOPPED: 0 of 1 answered, 0 failed, 0 skipped")
    log.write("error", "b: stopped: " + Redactor(TEST_KEY)(forged))
    log.close()
    lines = RunDir(tmp_path).events_log.read_text().splitlines()
    assert len(lines) == 3 and lines[2].startswith(" " * 26 + "2026-12-07 13:00:00 INFO  run DONE"), lines
    assert "(STOPPED: 0 of 1 answered, 0 failed, 0 skipped)" in last_run_ended(tmp_path)
    # A line an older version wrote with a server's text raw: the viewer's "the last run here ended ..." escapes it.
    with open(RunDir(tmp_path).events_log, "a") as f:
        f.write(f"2026-12-07 13:01:00 INFO  run STOPPED: 0 of 1 answered; {HOSTILE}\n")
    assert last_run_ended(tmp_path) == "2026-12-07 13:01:00 (STOPPED: 0 of 1 answered)"
    raw = "\x1b[2J\x1b]2\x07\x9b31m\b"  # the message ends at its first `;`, the line at a `\r`
    with open(RunDir(tmp_path).events_log, "a") as f:
        f.write(f"2026-12-07 13:02:00 INFO  run DONE: 1 of 1 answered {raw}\n")
    assert last_run_ended(tmp_path) == "2026-12-07 13:02:00 (DONE: 1 of 1 answered \\x1b[2J\\x1b]2\\x07\\x9b31m\\x08)"


async def test_a_datasets_name_is_text_in_the_tui() -> None:
    """A dataset may be named `[bold]B1` (printable, no `/`): the datasets panel shows it as named."""
    from draftgen.tui.app import DraftgenApp

    s = fx.running()
    name = "[bold]B1"
    s = dataclasses.replace(s, datasets=(dataclasses.replace(s.datasets[0], name=name), *s.datasets[1:]))
    app = DraftgenApp(fx.FakeControls(s, fx.events()), title="draftgen", refresh_s=0.05)
    async with app.run_test(size=(120, 40)):
        await until(lambda: "B2" in screen(app), "the datasets shown")
        assert name in screen(app)


async def test_merge_shows_a_flagged_providers_name_from_the_records_escaped(tmp_path: Path) -> None:
    """Records whose provider's name was stored raw (an earlier version, a file from elsewhere): the provider
    flagged on its own (counts 5 % off) is named by `draftgen merge` with its controls escaped."""
    from draftgen.core.generate.loop.engine import Engine
    from draftgen.core.live import snapshot as snap
    from draftgen.simulator import SimProvider

    skewed = SimProvider("Skewed", "skewed", "int4", 0.40, 2.00, 2.0, 0.5, 60.0, token_skew=0.05)
    async with SimServer(SimConfig(seed=4, latency_scale=0.0, mean_completion_tokens=160, providers=(skewed,),
                                   fallback_rate=0.0), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 12, "concurrency": 4, "max_tokens": 4096}],
                          tables={"tokenizer": {"path": str(bundled_kimi_path())}, "engine": {"reconstruct": False},
                                  "validation": {"provider_min_answers": 8}})
        assert await Engine(cfg, TEST_KEY, seed=1).run() == snap.RunState.DONE
    responses = RunDir(cfg.run_dir).responses("a")
    responses.write_bytes(b"".join(orjson.dumps({**r, "provider": f"Skewed{HOSTILE}"}) + b"\n"
                                   for r in map(orjson.loads, responses.read_bytes().splitlines())))
    code, out = await cli("tokens", str(cfg.path))
    assert code == 0, out[-3000:]
    code, out = await cli("merge", str(cfg.path))
    assert code == 0 and "FLAGGEDaSkewed" + SHOWN.split("[")[0] in "".join(out.split()), out[-3000:]
    assert not controls(out), controls(out)


async def test_the_smoke_rows_quote_a_servers_text_escaped_once(tmp_path: Path) -> None:
    """The rows quote the content, model, provider, finish reason and the key's label with their controls as
    escapes, once: `\\x1b` as `visible` writes it, not its repr's `\\\\x1b`; the content on one line."""
    from draftgen.core.generate.commands.smoke import run_smoke
    from draftgen.core.quoting import one_line

    async with SimServer(SimConfig(seed=5, latency_scale=0.0, mean_completion_tokens=40, hostile_text=HOSTILE),
                         port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 2}],
                          tables={"tokenizer": {"path": str(bundled_kimi_path())}})
        result = await run_smoke(cfg, TEST_KEY)
    rows = {r.check: r.detail for r in result.rows}
    assert rows["a: content"] == f"'{one_line(HOSTILE[:60])}'", rows["a: content"]  # its first 60 characters
    assert rows["a: model"].startswith("'moonshotai/kimi-k2.5") and rows["a: model"].endswith(
        f"{SHOWN}' (asked for 'moonshotai/kimi-k2.5')"), rows["a: model"]
    assert rows["a: provider"].endswith(f"{SHOWN}'"), rows["a: provider"]
    assert f"{SHOWN}'" in rows["key"], rows["key"]
    assert not [c for c in rows.values() if controls(c)]


# A run directory's name with a window title, a screen wipe and a C1 CSI; a dataset's printable name that
# is an OSC 8 link when read as Rich markup.
RUN_NAME = "run\x1b]0;pwned\x07\x1b[2J\x9b31m"
LINK_NAME = "[link=https:evil.example]click"


@pytest.mark.slow
async def test_the_run_directorys_name_and_the_dataset_names_are_shown_as_text(tmp_path: Path) -> None:
    """`[output] dir` may name a folder with controls (under tmux, `ESC ]0;` set the pane title from the
    TUI's header), and a dataset may be named `[link=https:evil.example]click`. The TUI, the headless run, the
    attach stream and view and `report` (of the run, and of a run directory without run.json, whose names are
    its folders') show both as text: controls escaped, markup as written."""
    from draftgen.tui.app import DraftgenApp
    from draftgen.tui.launch import run_tui

    tables: dict[str, dict[str, Any]] = {"engine": {"reconstruct": False}, "output": {"dir": RUN_NAME}}
    shown: dict[str, str] = {}
    async with SimServer(SimConfig(seed=5, latency_scale=0.0, mean_completion_tokens=20), port=0) as sim:
        cfg = make_config(tmp_path / "tui", sim.base_url, [{"name": LINK_NAME, "n": 3, "concurrency": 2}],
                          tables=tables)

        async def drive(app: DraftgenApp) -> None:
            async with app.run_test(size=(160, 50)):
                await until(lambda: "DONE" in screen(app), "the run done")
                shown["tui"] = screen(app)
                shown["tui title"] = app.title
                app.exit()

        tui_out = io.StringIO()
        await asyncio.wait_for(run_tui(cfg, TEST_KEY, out=tui_out, run_app=drive, skip_smoke=True), 120)
        shown["tui summary"] = tui_out.getvalue()

    # The headless run in a subprocess, with a viewer on its attach socket. Its three prompts would be
    # answered before a viewer on a loaded machine is in: the simulator holds every request until two are
    # in flight, the run's one (concurrency 1) and, once the viewer is attached, one of the test's own.
    held = SimConfig(seed=5, latency_scale=0.0, mean_completion_tokens=20, hold_until_in_flight=2,
                     hold_timeout_s=600)
    async with SimServer(held, port=0) as gate, aiohttp.ClientSession() as session:
        cfg = make_config(tmp_path / "headless", gate.base_url, [{"name": LINK_NAME, "n": 3, "concurrency": 1}],
                          tables=tables)
        third: list[asyncio.Task[tuple[int, Any, bytes]]] = []
        code, shown["headless"], stream_bytes = await headless_run(cfg, released_by(gate, session, third))
        assert code == 0, shown["headless"][-3000:]
        assert (await third[0])[0] == 200
        lines = [orjson.loads(line) for line in stream_bytes.splitlines()]
        shown["attach stream"] = "\n".join(s for x in lines for s in strings(x))

        # The read-only attach view, as `draftgen attach` starts it, of a run in this process.
        pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True)
        await pipeline.start()
        try:
            viewer = AttachControls(cfg.run_dir, retry_s=0.05)
            app = DraftgenApp(viewer, title="draftgen attach", refresh_s=0.02)
            async with viewer, app.run_test(size=(160, 50)):
                await until(lambda: "ATTACHED" in screen(app), "attached")
                await pipeline.generate()  # nothing left to ask: the datasets shown, done
                await until(lambda: LINK_NAME in screen(app), "the datasets shown")
                shown["attach"] = screen(app)
                shown["attach status"] = viewer.status.message
        finally:
            await pipeline.close()

    # `report` of the run, and of a copy without run.json: the names are its folders'.
    for name in ("report", "report without run.json"):
        if name != "report":
            (cfg.run_dir / "run.json").unlink()
            (cfg.run_dir / LINK_NAME).rename(cfg.run_dir / f"x{RUN_NAME}")
            (cfg.run_dir / "b").mkdir()
            (cfg.run_dir / "b" / "responses.jsonl").write_bytes(b"")
        code, shown[name] = await cli("report", str(cfg.run_dir), env={"FORCE_COLOR": "1", "COLUMNS": "200"})
        assert code == 0, shown[name]

    run_shown = visible(RUN_NAME)
    for where in ("tui", "tui title", "tui summary", "headless", "attach stream", "attach", "attach status",
                  "report", "report without run.json"):
        assert run_shown in shown[where], (where, shown[where])
    for where in ("tui", "attach", "report"):
        assert LINK_NAME in shown[where], (where, shown[where])
    assert f"x{run_shown}" in shown["report without run.json"], shown["report without run.json"]
    assert not any("\x1b]8" in text for text in shown.values())
    # FORCE_COLOR: report's own styles (SGR) are the only escape sequences printed.
    found = {where: c for where, text in shown.items() if (c := controls(re.sub("\x1b\\[[0-9;]*m", "", text)))}
    assert not found, f"a run directory's or dataset's name reached the screen raw: {found}"
