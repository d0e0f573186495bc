"""`draftgen demo --headless` end to end: simulator, smoke, run, reconstruction, merge, extraction."""

from __future__ import annotations

import io

import orjson
import pytest

from draftgen.core.extract import load_sample
from draftgen.core.tokens.store import TokenReader
from draftgen.tui.demo import DEMO_KEY, run_demo
from tests.test_specforge_release import check_run_with_specforge


@pytest.mark.slow
async def test_demo_headless_end_to_end(tmp_path, specforge_tree):
    out = io.StringIO()
    code = await run_demo(tmp_path, headless=True, out=out, latency_scale=0.02)
    text = out.getvalue()
    assert code == 0, text[-3000:]
    run = tmp_path / "run"
    # The chat dataset runs out of its token budget; its two bad lines are rejected, not fatal.
    assert "chat: token budget reached" in text
    assert len((run / "chat" / "rejected.jsonl").read_bytes().splitlines()) == 2
    train = (run / "merged" / "train.jsonl").read_bytes().splitlines()
    tokens = TokenReader(run / "merged" / "tokens")
    assert len(train) == len(tokens) > 200
    stats = orjson.loads((run / "merged" / "stats.json").read_bytes())
    assert stats["dropped"]["duplicate"] >= 1
    files = sorted((run / "hidden_states").rglob("data_*.ckpt"))
    assert len(files) == len(train)
    sample = load_sample(files[0])
    assert set(sample) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
    assert DEMO_KEY not in (run / "events.log").read_text()
    # SpecForge's released reader, loader and EAGLE-3 normaliser accept every file and row the demo wrote.
    check_run_with_specforge(run, specforge_tree)


@pytest.mark.parametrize("enabled", [False, True], ids=["off", "on"])
def test_the_multi_turn_demo_dataset_is_bundled_and_its_entry_loads_when_switched_on(tmp_path, monkeypatch, enabled):
    """dialogue.jsonl: 6 conversations of 3 user turns; the demo's config lists it (turns = "all") only with
    MULTI_TURN_DEMO on, and carries it commented out otherwise, so the demo runs either way."""
    from draftgen.tui import demo
    monkeypatch.setattr(demo, "MULTI_TURN_DEMO", enabled)
    monkeypatch.setattr(demo, "build_tiny_model", lambda folder: None)  # not needed to read the config
    cfg = demo.prepare(tmp_path, "http://127.0.0.1:9/api/v1")
    names = {d.name: d for d in cfg.datasets}
    assert ("dialogue" in names) is enabled
    assert "# multi-turn demo" in (tmp_path / "draftgen.toml").read_text() or enabled
    lines = [orjson.loads(x) for x in (tmp_path / "prompts" / "dialogue.jsonl").read_bytes().splitlines()]
    users = [sum(t["from"] == "human" for t in line["conversations"]) for line in lines]
    assert users == [3] * 6
    if enabled:
        assert (names["dialogue"].turns, names["dialogue"].prompts) == ("all", tmp_path / "prompts/dialogue.jsonl")
