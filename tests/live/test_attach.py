"""The attach socket: owner-only, one-way, bounded per client; a viewer in another process follows
the run, survives its restart, and nothing it sends changes the run."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from draftgen.core.live import snapshot as snap
from draftgen.core.live.attach import AttachError, AttachServer
from draftgen.core.live.attach_viewer import ENDED, LIVE, WAITING, AttachClient, AttachControls, AttachState
from draftgen.core.live.events import Event, EventKind, Level, Other, Payload
from draftgen.core.live.hub import Hub
from draftgen.core.live.payloads import PAYLOADS
from draftgen.core.live.snapshot import event_from_dict, snapshot_from_dict
from draftgen.core.rundir import RunDir
from tests import fixtures as fx
from tests.helpers import until

# The viewer of the two-process test: prints what it receives, one JSON line each, and from a
# second connection throws commands and junk at the engine.
VIEWER = r"""
import asyncio, sys, orjson
from pathlib import Path
from draftgen.core.live.attach_viewer import AttachClient, AttachState
from draftgen.core.live.snapshot import RunSnapshot

def say(**kw):
    sys.stdout.write(orjson.dumps(kw).decode() + "\n"); sys.stdout.flush()

async def garbage(path):
    reader, writer = await asyncio.open_unix_connection(path)
    for junk in (b'{"type":"pause"}\n', b'{"type":"quit","drain":false}\n', b"p\nq\nx\nm\n",
                 bytes(range(256)) * 256, b"{" * (1 << 20) + b"\n", b'{"type":"resume"}\n'):
        writer.write(junk)
        await writer.drain()
    writer.close()
    say(kind="garbage_sent")

async def main(run_dir):
    sent = False
    async for item in AttachClient(Path(run_dir), retry_s=0.05):
        if isinstance(item, AttachState):
            say(kind="state", state=item.state)
            if item.state == "live" and not sent:
                sent = True
                await garbage(str(Path(run_dir) / "attach.sock"))
        elif isinstance(item, RunSnapshot):
            say(kind="snapshot", seq=item.seq, state=item.state, run=item.run_name)
        else:
            say(kind="event", message=item.message)

asyncio.run(main(sys.argv[1]))
"""


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    return d


async def test_socket_is_owner_only_and_removed_on_close(run_dir: Path) -> None:
    path = RunDir(run_dir).socket
    async with AttachServer(Hub(), path):
        mode = path.lstat().st_mode
        assert stat.S_ISSOCK(mode)
        assert stat.S_IMODE(mode) == 0o600
        assert path.lstat().st_uid == os.getuid()
    assert not path.exists()


async def test_socket_is_owner_only_whatever_the_umask(run_dir: Path) -> None:
    old = os.umask(0)
    try:
        async with AttachServer(Hub(), RunDir(run_dir).socket) as server:
            assert stat.S_IMODE(server.path.lstat().st_mode) == 0o600
    finally:
        os.umask(old)


async def test_stale_socket_from_a_crashed_run_is_replaced(run_dir: Path) -> None:
    path = RunDir(run_dir).socket
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # the file stays, nothing listens: what kill -9 leaves behind
    assert path.exists()
    async with AttachServer(Hub(), path):
        reader, writer = await asyncio.open_unix_connection(str(path))
        assert orjson.loads(await reader.readline())["type"] == "hello"
        writer.close()


async def test_a_live_run_or_a_foreign_file_is_never_replaced(run_dir: Path) -> None:
    path = RunDir(run_dir).socket
    async with AttachServer(Hub(), path):
        with pytest.raises(AttachError, match="already live"):
            await AttachServer(Hub(), path).start()
    path.write_text("not a socket")
    with pytest.raises(AttachError, match="not a socket"):
        await AttachServer(Hub(), path).start()
    assert path.read_text() == "not a socket"


async def test_deep_run_directory(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)  # beyond the ~108 bytes a socket address holds
    deep.mkdir(parents=True)
    hub = Hub()
    hub.publish_snapshot(fx.running())
    async with AttachServer(hub, RunDir(deep).socket):
        items = AttachClient(deep, retry_s=0.05).__aiter__()
        first, second = await anext(items), await anext(items)
        assert isinstance(first, AttachState) and first.state == LIVE
        assert isinstance(second, snap.RunSnapshot) and second.seq == 100
        await items.aclose()


async def test_viewer_in_another_process_follows_the_run_and_cannot_change_it(run_dir: Path) -> None:
    controls = fx.FakeControls(fx.running(), fx.events()[:2])  # the engine side: records any command
    path = RunDir(run_dir).socket
    server = AttachServer(controls.hub, path)
    await server.start()
    viewer = await asyncio.create_subprocess_exec(sys.executable, "-c", VIEWER, str(run_dir),
                                                  stdout=asyncio.subprocess.PIPE)
    assert viewer.stdout is not None
    seen: list[dict] = []

    async def expect(pred: Callable[[dict], bool], what: str) -> dict:
        for msg in seen:
            if pred(msg):
                return msg
        while True:
            line = await asyncio.wait_for(viewer.stdout.readline(), 30)  # hang guard
            assert line, f"viewer exited before {what}; saw {seen}"
            msg = orjson.loads(line)
            seen.append(msg)
            if pred(msg):
                return msg

    try:
        await expect(lambda m: m.get("state") == LIVE, "live")
        await expect(lambda m: m.get("seq") == 100 and m["state"] == snap.RunState.RUNNING, "first snapshot")
        await expect(lambda m: m["kind"] == "event", "replayed events")
        controls.publish(fx.paused())
        await expect(lambda m: m.get("seq") == 101 and m["state"] == snap.RunState.PAUSED, "paused snapshot")
        await expect(lambda m: m["kind"] == "garbage_sent", "garbage sent")
        latest = controls.hub.latest
        controls.publish(dataclasses.replace(fx.running(), seq=102))
        await expect(lambda m: m.get("seq") == 102, "snapshot after the garbage")
        # Commands, keys and junk from a client changed nothing: no control was called.
        assert controls.calls == []
        assert latest is not None and latest.seq == 101

        await server.close()
        await expect(lambda m: m.get("state") == ENDED, "run ended")
        assert not path.exists()

        # The run restarts (a new engine, a new socket): the viewer picks it up by itself.
        restarted = fx.FakeControls(dataclasses.replace(fx.running(), seq=1, elapsed_s=1.0))
        server = AttachServer(restarted.hub, path)
        await server.start()
        await expect(lambda m: m.get("seq") == 1, "snapshot of the restarted run")
        assert restarted.calls == []
        states = [m["state"] for m in seen if m["kind"] == "state"]
        assert states[:2] == [LIVE, ENDED] and states[-1] == LIVE
    finally:
        await server.close()
        viewer.kill()
        await viewer.wait()


async def test_a_client_that_never_reads_is_dropped_and_costs_the_engine_nothing(run_dir: Path) -> None:
    hub = Hub()
    hub.publish_snapshot(fx.running())
    server = AttachServer(hub, RunDir(run_dir).socket, client_queue=4, stall_timeout_s=0.2)
    await server.start()
    try:
        stuck = socket.socket(socket.AF_UNIX)
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect(str(server.path))  # connects, never reads
        await until(lambda: server.clients == 1, "stuck client served")
        big = dataclasses.replace(fx.running(), alert="x" * 200_000)
        for i in range(200):
            hub.publish_snapshot(dataclasses.replace(big, seq=1000 + i))  # returns at once: never waits
            # The stuck client's queue stays bounded however far behind it falls.
            assert all(len(sub._items) <= 4 for sub in hub._subs)
            await asyncio.sleep(0)
        await until(lambda: server.dropped_clients == 1 and server.clients == 0, "stuck client dropped")
        # A viewer that reads still gets the newest snapshot.
        items = AttachClient(run_dir, retry_s=0.05).__aiter__()
        got = [await anext(items) for _ in range(2)]
        assert got[0].state == LIVE and got[1].seq == 1199
        await items.aclose()
        stuck.close()
    finally:
        await server.close()


async def test_client_skips_lines_it_cannot_read(run_dir: Path) -> None:
    good = orjson.dumps({"type": "snapshot", "data": fx.running()})

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'{"type":"hello","protocol":1}\nnot json\n{"type":"snapshot"}\n{"type":"new"}\n[1,2]\n'
                     + good + b'\n{"type":"bye","reason":"run ended"}\n')
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(engine, str(RunDir(run_dir).socket))
    try:
        items = AttachClient(run_dir, retry_s=0.05).__aiter__()
        got = [await anext(items) for _ in range(3)]
        assert [type(x).__name__ for x in got] == ["AttachState", "RunSnapshot", "AttachState"]
        assert got[1] == fx.running() and got[2].state == ENDED
        await items.aclose()
    finally:
        server.close()


async def test_attach_controls_render_in_the_app_read_only(run_dir: Path) -> None:
    from draftgen.tui.app import DraftgenApp

    engine = fx.FakeControls(fx.running(), fx.events())
    server = AttachServer(engine.hub, RunDir(run_dir).socket)
    viewer = AttachControls(run_dir, retry_s=0.05)
    assert viewer.read_only and viewer.unavailable("pause") == "attached read-only: this viewer cannot change the run"
    app = DraftgenApp(viewer, title="draftgen attach", refresh_s=0.02)

    def header() -> str:
        return _plain(app, "#header")

    async with viewer, app.run_test() as pilot:
        await until(lambda: "waiting for run" in _plain(app, "#alert"), "waiting for run")
        await server.start()
        await until(lambda: "RUNNING" in header() and "ATTACHED" in header(), "attached and running")
        assert not app.query_one("#alert").display
        engine.publish(fx.paused())
        await until(lambda: "PAUSED" in header(), "viewer follows the pause")
        await pilot.press("p", "r", "s", "m", "x")
        assert engine.calls == []
        await server.close()
        await until(lambda: "run ended" in _plain(app, "#alert"), "run ended shown")
        assert "PAUSED" in header()  # its last state stays on screen


async def test_attached_after_the_run_ended_the_wait_says_how_the_last_run_ended(tmp_path: Path) -> None:
    """`draftgen attach` on a directory whose run has ended: "waiting for run" alone reads as a run about to
    start; the first state names when and how the last run ended, from the run's own events.log."""
    from draftgen.core.run.pipeline import Pipeline
    from draftgen.simulator import SimConfig, SimServer
    from tests.helpers import TEST_KEY, make_config
    async with SimServer(SimConfig(seed=1, latency_scale=0.0), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 3}], tables={"engine": {"reconstruct": False}})
        pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True, serve_attach=False, seed=1)
        await pipeline.start()
        try:
            assert await pipeline.generate() == snap.RunState.DONE
        finally:
            await pipeline.close()
    first = await anext(aiter(AttachClient(cfg.run_dir, retry_s=0.05)))
    assert isinstance(first, AttachState) and first.state == WAITING
    assert " yet; the last run here ended 20" in first.message, first.message
    assert "(DONE: 3 of 3 answered, 0 failed, 0 skipped, 0 not asked yet); retrying every 0.05 s" in first.message
    # A directory no run has ended in: the wait alone.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    first = await anext(aiter(AttachClient(fresh, retry_s=0.05)))
    assert isinstance(first, AttachState) and "ended" not in first.message, first.message


def test_attach_to_a_missing_directory_says_so(tmp_path: Path) -> None:
    with pytest.raises(AttachError, match="not a run directory"):
        AttachControls(tmp_path / "nope")


def _plain(app: object, selector: str) -> str:
    import io

    from rich.console import Console

    widget = app.query_one(selector)  # type: ignore[attr-defined]
    console = Console(width=200, file=io.StringIO(), color_system=None)
    with console.capture() as cap:
        console.print(widget.content)
    return cap.get()


@pytest.mark.parametrize("make", [fx.running, fx.paused, fx.smoke, fx.merging, fx.extracting, fx.out_of_credits])
def test_a_snapshot_comes_back_from_json_equal_and_typed(make) -> None:
    """What the viewer rebuilds from the wire is the snapshot the owner sent: nested dataclasses,
    tuples and the state enums come back from the type hints, for every field."""
    sent = make()
    back = snapshot_from_dict(orjson.loads(sent.to_json()))
    assert back == sent
    assert isinstance(back.state, snap.RunState) and all(isinstance(d.status, snap.DatasetStatus)
                                                         for d in back.datasets)
    assert all(isinstance(st.state, snap.StageState) for st in back.stages)
    for event in fx.events():
        assert event_from_dict(orjson.loads(event.to_json())) == event


def _example(cls: type[Payload]) -> Payload:
    """A payload of `cls` with a value in each field, of the field's type (text, counts, dollars)."""
    values = {"str": "a text with 'quotes', a \u00e9 and a $", "int": 7, "float": 0.0125, "bool": True}
    fields = {f.name: values[str(f.type)] for f in dataclasses.fields(cls) if str(f.type) in values}
    return cls(**(fields | {"dataset": "a", "at": Level.ERROR}))


def test_every_event_kind_has_one_payload_type_and_each_comes_back_from_json_as_itself() -> None:
    """Each EventKind has exactly one payload class, which declares it; an event of each crosses the
    attach stream as the same payload class with the same fields, level and message. A kind this side
    does not know (a newer engine's) comes as `Other`, shown by its message, never refused; so does a
    known kind whose fields this side cannot take (an engine from before they were typed)."""
    assert set(PAYLOADS) == set(EventKind) and len(set(PAYLOADS.values())) == len(EventKind)
    assert all(cls.kind is kind for kind, cls in PAYLOADS.items())
    for kind, cls in PAYLOADS.items():
        event = Event.of(_example(cls), ts=1.5)
        back = event_from_dict(orjson.loads(event.to_json()))
        assert back == event and type(back.payload) is cls, kind
        assert (back.kind, back.level, back.dataset, back.message) == (kind, Level.ERROR, "a", event.payload.text())
    newer = {"ts": 4.0, "level": "warn", "kind": "a_kind_from_a_newer_engine", "message": "m", "data": {"x": 1}}
    back = event_from_dict(newer)
    assert isinstance(back.payload, Other) and back.payload.name == "a_kind_from_a_newer_engine"
    assert (back.kind, back.level, back.message) == (EventKind.OTHER, Level.WARN, "m")
    older = {"ts": 5.0, "level": "info", "kind": "dataset_done", "message": "a: done", "dataset": "a", "data": None}
    back = event_from_dict(older)
    assert isinstance(back.payload, Other) and (back.message, back.dataset) == ("a: done", "a")


def test_no_kind_is_a_line_made_at_the_call_site() -> None:
    """Every kind carries what its message is made of as fields of their own (counts, dollars, paths,
    the cause's text named for what it is); none is one `line` written where it was sent. Only
    `Other` (a kind this side does not know) keeps the message as it came."""
    def said(cls: type[Payload]) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)} - {"dataset", "at"}
    assert not [cls.__name__ for cls in PAYLOADS.values() if cls is not Other and "line" in said(cls)]
    fixed = {EventKind.HELD_WRITTEN, EventKind.QUIT_DIALOG, EventKind.RESUMED}  # one sentence, no figure
    assert not [kind for kind, cls in PAYLOADS.items() if kind not in fixed and not said(cls)]
