"""Only the model asked, and nothing from another user (issue 50, points 4 and 5).

- A router or server that answers as another model (the simulator's `answer_model`): the answers are
  paid for and kept, counted (by dataset, by provider, in the errors tally and the summary), the run
  is held once most of them are, and the merge keeps none, also of records an earlier run wrote.
- A spool file another uid planted in a world-writable TMPDIR (you are root: files are chowned to
  nobody, 65534) is refused unread and named; the run asks every prompt itself.
- A run directory other users can write is refused, naming it, unless `[output] shared = true`.
- `attach` without permission says "permission denied" and exits non-zero: the viewer runs with every
  capability dropped (setpriv), so the socket's owner-only mode refuses it the way it refuses another user.
"""

from __future__ import annotations

import asyncio
import grp
import io
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from draftgen.core.config import Config
from draftgen.core.errors import DraftgenError
from draftgen.core.generate.loop.spool import SpoolRecord, find_spools, run_key, write_spool
from draftgen.core.live import snapshot as snap
from draftgen.core.live.attach import AttachServer
from draftgen.core.live.attach_viewer import ENDED, AttachControls
from draftgen.core.live.events import Event
from draftgen.core.live.hub import Hub
from draftgen.core.live.summary import summary_lines
from draftgen.core.merge.merge import merge
from draftgen.core.private_dir import check_private
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.simulator import SimConfig, SimServer
from draftgen.tui.report import report
from tests.generate.test_held_answers import events_of
from tests.helpers import TEST_KEY, cli_env, dataset_row, make_config, until
from tests.multiturn import multi_turn_run

NOBODY = 65534
OTHER_MODEL = "openai/gpt-3.5-turbo"
ASKED = "moonshotai/kimi-k2.5"


async def _run_to_the_end(cfg: Config) -> tuple[snap.RunSnapshot, list[Event]]:
    """A run of `cfg` that must end DONE by itself: its last snapshot and its events."""
    pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True, serve_attach=False)
    sub = pipeline.hub.subscribe(maxsize=10_000)
    await pipeline.start()
    try:
        assert await asyncio.wait_for(pipeline.generate(), 120) == snap.RunState.DONE
        return pipeline.snapshot(), events_of(sub)
    finally:
        await pipeline.close()


def _tables(**more: dict) -> dict[str, dict]:
    return {"engine": {"reconstruct": True, "workers": 1},
            "tokenizer": {"path": str(bundled_kimi_path()), "template": "kimi-k2.5"}, **more}


# ---------------------------------------------------------------------------------------------
# Only the model asked


async def test_answers_from_another_model_hold_the_run_and_merge_keeps_none(tmp_path: Path) -> None:
    """20 prompts, every answer from openai/gpt-3.5-turbo: once 10 are in the run is held, saying why;
    resumed by the user it finishes (the hold is said once), and the merge keeps none of the 20."""
    sim_cfg = SimConfig(seed=3, fixed_latency_s=0.02, mean_completion_tokens=40, answer_model=OTHER_MODEL)
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 20, "concurrency": 2}], tables=_tables())
        pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True, serve_attach=False)
        sub = pipeline.hub.subscribe(maxsize=10_000)
        await pipeline.start()
        task = asyncio.create_task(pipeline.generate())
        try:
            await until(lambda: pipeline.engine.state == snap.RunState.PAUSED, "the run to be held")
            await until(lambda: pipeline.engine.in_flight == 0, "the requests in flight to finish")
            held = pipeline.snapshot()
            assert f"came from another model than '{ASKED}'" in held.alert and OTHER_MODEL in held.alert, held.alert
            assert sim.stats.requests_total < 20 and dataset_row(pipeline.engine, "a").done < 20, "it paid on"
            pipeline.resume()
            state = await asyncio.wait_for(task, 120)
            final = pipeline.snapshot()
        finally:
            if not task.done():
                pipeline.quit(drain=False)
            await pipeline.close()
    assert state == snap.RunState.DONE
    events = events_of(sub)
    assert [e.level for e in events if e.kind == "alert" and "another model" in e.message] == ["error"]
    row = next(d for d in final.datasets if d.name == "a")
    assert row.done == 20 and row.other_model == 20
    assert dict(final.errors).get("other_model") == 20
    # Counted by provider: each answer's provider carries it as an error.
    assert sum(p.errors for p in final.provider_stats) == 20
    assert {r.kind for r in final.recent_errors} == {"other_model"}
    summary = " ".join(line.strip() for line in summary_lines(final, pipeline.exit_code))
    assert "merge leaves out those from another model" in summary and f"20 from another model than {ASKED}" \
        in summary, summary
    # Paid for and kept on disk, with the model that answered.
    lines = [orjson.loads(x) for x in RunDir(cfg.run_dir).responses("a").read_bytes().splitlines()]
    assert len(lines) == 20 and {x["model"] for x in lines} == {OTHER_MODEL}
    stats = merge(cfg)
    assert stats.samples == 0 and stats.dropped["other_model"] == 20, stats.dropped


async def test_headless_says_why_the_run_is_held_and_a_drain_ends_it(tmp_path: Path) -> None:
    """`run --headless` against a server answering as another model: the hold's alert in its lines and in
    events.log, naming both models; Ctrl-C drains (exit 3) and the summary counts them."""
    sim_cfg = SimConfig(seed=8, fixed_latency_s=0.02, mean_completion_tokens=40, answer_model=OTHER_MODEL)
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 20, "concurrency": 2}],
                          tables={"engine": {"reconstruct": False}})
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", "--skip-smoke",
            "--interval", "0.2", env=cli_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)
        events_log = RunDir(cfg.run_dir).events_log
        try:
            await until(lambda: events_log.exists() and "came from another model" in events_log.read_text(),
                        "the hold in events.log", 60)
            os.kill(proc.pid, signal.SIGINT)  # headless: Ctrl-C drains
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
    text = " ".join(line.strip() for line in out.decode().splitlines())
    assert proc.returncode == 3, text[-3000:]
    assert f"came from another model than '{ASKED}' (the last: '{OTHER_MODEL}'" in text, text[-3000:]
    assert f"from another model than {ASKED}" in text[text.rindex("draftgen: run "):], text[-3000:]
    assert f"'{OTHER_MODEL}'" in events_log.read_text()


async def test_merge_leaves_out_another_models_answers_an_earlier_run_wrote(tmp_path: Path) -> None:
    """Records written before the check (or by hand): the merge reads each line's `model`. A date suffix of
    the model asked is the same model; another model, or another release of the slug, is not."""
    async with SimServer(SimConfig(seed=4, latency_scale=0.0, mean_completion_tokens=40), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 8, "concurrency": 4}], tables=_tables())
        await _run_to_the_end(cfg)
    path = RunDir(cfg.run_dir).responses("a")
    lines = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    assert merge(cfg).samples == 8, "the model asked: every answer kept"
    models = ["MoonshotAI/Kimi-K2.5", "moonshotai/kimi-k2.5-0127", "moonshotai/kimi-k2.5:nitro", OTHER_MODEL,
              "moonshotai/kimi-k2", "moonshotai/kimi-k2.5", "someone/kimi-k2.5", 7]
    for line, model in zip(lines, models):
        line["model"] = model
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    stats = merge(cfg)
    assert stats.samples == 4 and stats.dropped["other_model"] == 4, stats.dropped
    # `draftgen report` counts them as the run's summary does.
    out = io.StringIO()
    report(cfg.run_dir, out=out, width=200)
    assert f"4 answers from another model than {ASKED} (a 4): kept, but never a sample (merge leaves them out)" \
        in out.getvalue(), out.getvalue()


def test_a_later_turn_conditioned_on_another_models_answer_is_left_out_with_it(tmp_path: Path) -> None:
    """Turn 1 of a conversation answered by another model: turns 2 and 3 carry that answer in their history
    (not the target's), so they go with it, as after a broken turn."""
    config, _ = multi_turn_run(tmp_path)
    path = config.run_dir / "M" / "responses.jsonl"
    lines = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    for line in lines:
        line["model"] = OTHER_MODEL if line["id"] == "c1#t1" else ASKED
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    stats = merge(config)
    kept = {r["id"] for r in map(orjson.loads, (config.run_dir / "merged" / "train.jsonl").read_bytes().splitlines())}
    assert not {"M/c1#t1", "M/c1#t2", "M/c1#t3"} & kept and {"M/c3#t1", "M/c3#t2", "M/c3#t3"} <= kept, kept
    assert stats.datasets[0].dropped["other_model"] == 1 and stats.datasets[0].dropped["after_invalid_turn"] == 3


# ---------------------------------------------------------------------------------------------
# Nothing from another user: the spool


def _plant(folder: Path, cfg_run_dir: Path, *, uid: int, ids: list[str]) -> Path:
    """A spool file for `cfg_run_dir` in `folder`, owned by `uid`: a header as draftgen writes it, then
    "answers" for dataset a."""
    path = folder / f"{run_key(cfg_run_dir)}-20260101-000000-1.jsonl"
    header = {"draftgen_spool": 1, "run_dir": str(Path(cfg_run_dir).resolve()), "ts": 1.0}
    records = [{"dataset": "a", "file": "responses", "record": {
        "id": i, "messages": [{"role": "user", "content": "x"}], "content": "PLANTED", "reasoning": None,
        "finish_reason": "stop", "model": ASKED, "usage": {"prompt_tokens": 1, "completion_tokens": 1, "cost": 0.0},
        "truncated": False, "empty_content": False, "ts": 1.0}} for i in ids]
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in [header, *records]))
    os.chown(path, uid, uid)
    return path


@pytest.fixture
def world_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A world-writable TMPDIR (as /tmp is) for this test, and a home of its own (~/.draftgen-spool)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setattr("tempfile.tempdir", str(tmp))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("DRAFTGEN_SPOOL_DIR", raising=False)
    return tmp


@pytest.mark.parametrize("how", ["their folder", "a folder all can write", "their file", "a link"])
async def test_a_spool_another_user_planted_is_refused_and_named(tmp_path: Path, world_tmp: Path, how: str) -> None:
    """Another uid plants 5 "answers" for this run directory: none is imported, the run asks all 5
    prompts itself, the file is named with why, and it stays where it is."""
    spool = world_tmp / "draftgen-spool"
    spool.mkdir()
    async with SimServer(SimConfig(seed=5, latency_scale=0.0, mean_completion_tokens=40), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 5, "concurrency": 2}],
                          tables={"engine": {"reconstruct": False}})
        ids = [f"a-{i}" for i in range(5)]
        if how == "their folder":  # the folder and the file are nobody's, the folder open to all
            os.chown(spool, NOBODY, NOBODY)
            spool.chmod(0o777)
            planted = _plant(spool, cfg.run_dir, uid=NOBODY, ids=ids)
            why = f"owned by uid {NOBODY}, not by you"
        elif how == "a folder all can write":  # ours, but anyone could have put the file there
            spool.chmod(0o777)
            planted = _plant(spool, cfg.run_dir, uid=os.geteuid(), ids=ids)
            why = "other users can write to it (mode 0777)"
        elif how == "their file":  # our private folder, a file of nobody's
            spool.chmod(0o700)
            planted = _plant(spool, cfg.run_dir, uid=NOBODY, ids=ids)
            why = f"it is owned by uid {NOBODY}, not by you"
        else:  # our folder and our name, but a link to a file elsewhere
            spool.chmod(0o700)
            target = _plant(tmp_path, cfg.run_dir, uid=os.geteuid(), ids=ids)
            planted = spool / target.name
            planted.symlink_to(target)
            why = "it is a symbolic link"
        final, events = await _run_to_the_end(cfg)
        asked = sim.stats.requests_total
    assert asked == 5, "the planted answers stood in for requests"
    answers = [orjson.loads(x) for x in RunDir(cfg.run_dir).responses("a").read_bytes().splitlines()]
    assert sorted(a["id"] for a in answers) == ids and not any(a["content"] == "PLANTED" for a in answers)
    assert "imported" not in final.held, final.held
    said = [e for e in events if e.kind == "spool"]
    assert len(said) == 1 and said[0].level == "error", said
    assert str(planted) in said[0].message and "refused, nothing in it imported" in said[0].message \
        and why in said[0].message, said[0].message
    assert planted.is_symlink() or planted.exists(), "a refused file is left where it is"


def test_a_spool_goes_elsewhere_when_the_temp_folder_spool_is_not_ours(tmp_path: Path, world_tmp: Path) -> None:
    """Another uid made $TMPDIR/draftgen-spool first: nothing is written there (they could read or remove
    it); the spool goes to ~/.draftgen-spool, made 0700, and the refusal names the folder."""
    theirs = world_tmp / "draftgen-spool"
    theirs.mkdir(mode=0o777)
    theirs.chmod(0o777)
    os.chown(theirs, NOBODY, NOBODY)
    path, refused = write_spool(tmp_path / "run", [SpoolRecord("a", "responses", {"id": "a-1"})])
    home = Path(os.environ["HOME"]) / ".draftgen-spool"
    assert path is not None and path.parent == home and not list(theirs.iterdir())
    assert (home.stat().st_mode & 0o777) == 0o700
    assert refused == [f"{theirs}: it is owned by uid {NOBODY}, not by you (uid {os.geteuid()})"]
    assert [s.path for s in find_spools(tmp_path / "run")] == [path], "and read back from there"


def test_a_spool_folder_draftgen_makes_is_owner_only(tmp_path: Path, world_tmp: Path) -> None:
    os.umask(old := os.umask(0))  # the most open umask there is: the folder is still 0700
    try:
        path, _ = write_spool(tmp_path / "run", [SpoolRecord("a", "responses", {"id": "a-1"})])
    finally:
        os.umask(old)
    assert path is not None and path.parent == world_tmp / "draftgen-spool"
    assert (path.parent.stat().st_mode & 0o777) == 0o700


# ---------------------------------------------------------------------------------------------
# Nothing from another user: the run directory


@pytest.mark.parametrize("where", ["itself", "the folder above"])
async def test_a_run_directory_others_can_write_is_refused_unless_shared(tmp_path: Path, where: str) -> None:
    shared = tmp_path / "shared"
    run = shared / "run"
    run.mkdir(parents=True)
    (run if where == "itself" else shared).chmod(0o777)
    named = run if where == "itself" else shared
    async with SimServer(SimConfig(seed=6, latency_scale=0.0, mean_completion_tokens=40), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 2, "concurrency": 2}],
                          tables={"engine": {"reconstruct": False}, "output": {"dir": "shared/run"}})
        pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True, serve_attach=False)
        with pytest.raises(DraftgenError) as refused:
            await pipeline.start()
        message = str(refused.value)
        assert message.startswith(f"{named}") and "can be written by every user" in message and "(mode 0777)" in \
            message and f"[output] shared = true in {cfg.path}" in message, message
        assert sim.stats.requests_total == 0 and not (run / "events.log").exists()

        # Shared on purpose: the setting lets it through.
        await _run_to_the_end(make_config(tmp_path, sim.base_url, [{"name": "a", "n": 2, "concurrency": 2}], tables={
            "engine": {"reconstruct": False}, "output": {"dir": "shared/run", "shared": True}}))

        # A folder above with the sticky bit, as /tmp: others can write it, but not move what is not theirs.
        shared.chmod(0o1777)
        run.chmod(0o700)
        await _run_to_the_end(make_config(tmp_path, sim.base_url, [{"name": "a", "n": 2, "concurrency": 2}],
                                          tables={"engine": {"reconstruct": False}, "output": {"dir": "shared/run"}}))


def test_a_run_directory_another_group_can_write_or_another_user_owns_is_refused(tmp_path: Path) -> None:
    """Group write counts when the group is not the user's own (here nogroup, 65534); and a directory another
    user owns is theirs to empty, whatever its mode."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    os.chown(run, -1, NOBODY)
    run.chmod(0o770)
    group = grp.getgrgid(NOBODY).gr_name
    with pytest.raises(DraftgenError, match=f"can be written by the users of group {group} \\(mode 0770\\)"):
        check_private(run, "c.toml", shared=False)
    run.chmod(0o700)
    check_private(run, "c.toml", shared=False)
    os.chown(run, NOBODY, -1)
    with pytest.raises(DraftgenError, match=f"owned by uid {NOBODY}, not by you"):
        check_private(run, "c.toml", shared=False)
    check_private(run, "c.toml", shared=True)


def test_a_folder_or_link_on_the_way_that_another_user_owns_is_refused(tmp_path: Path) -> None:
    """A folder above the run directory owned by another user (even 0755) lets them rename the directory
    away and put their own in its place; a symbolic link they own on the way, they can point elsewhere. Both
    are refused naming the folder or link and its owner, also when the link's target is reached through
    another link; root's and the user's own are fine, and `[output] shared = true` lets them through."""
    tmp_path.chmod(0o755)
    theirs = tmp_path / "theirs"
    run = theirs / "mine" / "run"
    run.mkdir(parents=True, mode=0o700)
    theirs.chmod(0o755)
    (theirs / "mine").chmod(0o700)
    check_private(run, "c.toml", shared=False)  # root's (or the user's own): fine
    os.chown(theirs, NOBODY, -1)
    owner = f"uid {NOBODY} ({pwd.getpwuid(NOBODY).pw_name})"
    with pytest.raises(DraftgenError, match=f"^{theirs}, a folder on the way to the run directory {run}, is owned "
                                            f"by {re.escape(owner)}, not by you or root \\(mode 0755\\)"):
        check_private(run, "c.toml", shared=False)
    check_private(run, "c.toml", shared=True)
    # Not made yet: the folders above it are checked all the same.
    with pytest.raises(DraftgenError, match=f"^{theirs}, a folder on the way"):
        check_private(run / "later", "c.toml", shared=False)

    mine = tmp_path / "target"
    mine.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(mine)
    check_private(link / "run", "c.toml", shared=False)  # the user's own link
    os.chown(link, NOBODY, -1, follow_symlinks=False)
    for via in (link / "run", link, tmp_path / "link2"):
        if via.name == "link2":
            (tmp_path / "link2").symlink_to("link/run")  # the user's own link, through theirs
        with pytest.raises(DraftgenError, match=f"^{link}, a symbolic link on the way to the run directory "
                                                f"{mine}.*, is owned by {re.escape(owner)}, not by you or root"):
            check_private(via, "c.toml", shared=False)
    check_private(link / "run", "c.toml", shared=True)
    # The user's own link in a folder another user owns leads to the user's own folder: the owner of that folder
    # can replace the link, so it is on the way too (it is not above the directory the link leads to).
    (theirs / "ln").symlink_to(mine)
    os.chown(theirs / "ln", 0, -1, follow_symlinks=False)
    with pytest.raises(DraftgenError, match=f"^{theirs}, a folder on the way to the run directory {mine}/run,"):
        check_private(theirs / "ln" / "run", "c.toml", shared=False)


async def test_every_command_that_writes_into_a_run_directory_others_can_write_refuses_it(tmp_path: Path) -> None:
    """Not only `run`: smoke (spend.jsonl, smoke.json), retry-failed, ledger, tokens, merge, extract and
    train-command write there too. Each is refused before it writes or sends anything, naming the folder;
    `report` and `attach` only read, and go on."""
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o777)
    async with SimServer(SimConfig(seed=6, latency_scale=0.0, mean_completion_tokens=40), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 2, "concurrency": 2}],
                          tables={"engine": {"reconstruct": False}})
        for command in ("smoke", "run --headless --skip-smoke", "retry-failed", "ledger", "tokens", "merge",
                        "extract", "train-command"):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "draftgen.cli.main", *command.split(), str(cfg.path), env=cli_env(),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 120)
            said = (out + err).decode()
            assert proc.returncode == 2 and f"{run}: the run directory can be written by every user (mode 0777)" \
                in said, (command, said[-2000:])
        assert sim.stats.requests_total == 0 and sorted(p.name for p in run.iterdir()) == []
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "draftgen.cli.main", "report", str(cfg.path), env=cli_env(),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert b"can be written by" not in out + err, (out + err).decode()[-2000:]


# ---------------------------------------------------------------------------------------------
# attach without permission


def _attach_without_rights(where: Path) -> subprocess.CompletedProcess[str]:
    """`draftgen attach WHERE` run as root with every capability dropped: file modes bind it as they bind
    any other user (it may not enter or connect to what another uid owns, owner-only)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv(1) to drop the capabilities that bypass file modes")
    return subprocess.run([setpriv, "--bounding-set=-all", "--inh-caps=-all", "--", sys.executable, "-m",
                           "draftgen.cli.main", "attach", str(where)], env=cli_env(), capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("what", ["socket", "directory"])
async def test_attach_without_permission_says_so_and_exits_non_zero(tmp_path: Path, what: str) -> None:
    """A live run served by another uid: its socket (or its directory) is owner-only, so the viewer may not
    connect: it says "permission denied" and exits 2, instead of "connecting…" for ever."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    async with AttachServer(Hub(), RunDir(run).socket) as server:
        os.chown(server.path, NOBODY, NOBODY)  # the run's, as if another user had started it
        if what == "directory":
            os.chown(run, NOBODY, NOBODY)
        done = await asyncio.to_thread(_attach_without_rights, run)
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert "permission denied" in done.stderr and "connecting" not in done.stdout + done.stderr, done.stderr


async def test_a_viewer_refused_mid_way_shows_why_instead_of_waiting(tmp_path: Path) -> None:
    """The viewer's own loop (a run restarted by another user after it attached): the refusal is its state
    and the alert every panel shows, and kept for the command's exit code, not a task that died unseen
    behind "connecting…". The loop runs with this process's effective uid set to nobody's, so the
    kernel refuses the connection (EACCES) as it would another user's."""
    if os.geteuid() != 0:
        pytest.skip("needs root to take nobody's effective uid and back")
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    async with AttachServer(Hub(), RunDir(run).socket):
        controls = AttachControls(run, retry_s=0.05)
        sub = controls.hub.subscribe(maxsize=100)
        os.seteuid(NOBODY)
        try:
            await asyncio.wait_for(controls.run(), 30)
        finally:
            os.seteuid(0)
    assert controls.error is not None and "permission denied" in str(controls.error)
    assert controls.status.state == ENDED and "permission denied" in controls.status.message
    items = []
    while (item := sub.get_nowait()) is not None:
        items.append(item)
    assert any(kind == "snapshot" and "permission denied" in shot.alert for kind, shot in items), items
    assert any(kind == "event" and "permission denied" in e.message and e.level == "error" for kind, e in items)

