"""`run` never sends a prompt another dataset of the run directory answered (or is answering): the real
engine and aiohttp client against the simulator on 127.0.0.1, checked with the simulator's own
per-prompt request counters."""

from __future__ import annotations

from pathlib import Path

import orjson

from draftgen.core.live import snapshot as snap
from draftgen.simulator import SimConfig, SimServer, prompt_key
from tests.generate.test_engine import FAST, accounted, run_engine
from tests.helpers import dataset_row, make_config, read_ids


def write(path: Path, prompts: list[tuple[str, str]]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps({"id": i, "prompt": text}) + b"\n" for i, text in prompts))
    return str(path.name)


def sent(stats, text: str) -> int:
    return stats.prompt_requests.get(prompt_key([{"role": "user", "content": text}]), 0)


SHARED = "Explain how a hash map handles collisions."
TWIN = "  explain how a HASH MAP handles collisions. "   # the same prompt once normalised


async def test_a_prompt_answered_in_an_earlier_dataset_is_skipped_and_never_sent(tmp_path: Path) -> None:
    write(tmp_path / "prompts/a.jsonl", [("a1", SHARED), ("a2", "What is a B-tree?")])
    write(tmp_path / "prompts/b.jsonl", [("b1", TWIN), ("b2", "What is a trie?"), ("b3", "What is a heap?")])
    async with SimServer(SimConfig(seed=2, **FAST), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "prompts": "prompts/a.jsonl"},
                                                   {"name": "b", "prompts": "prompts/b.jsonl"}])
        engine, state, events = await run_engine(cfg)
        stats = sim.stats.copy()
    assert state == snap.RunState.DONE
    assert sent(stats, SHARED) == 1 and sent(stats, TWIN) == 0
    assert stats.requests_total == 4
    assert read_ids(cfg.run_dir / "b" / "responses.jsonl") == ["b2", "b3"]
    assert dataset_row(engine, "b").skipped == 1 and dataset_row(engine, "a").skipped == 0
    accounted(cfg, engine)
    warn = [m for lvl, kind, m in events if kind == "duplicate"]
    assert len(warn) == 1 and "'b1'" in warn[0] and "already answered in a" in warn[0]
    assert any("b: done: 2/3 answered, 0 failed, 1 skipped (1 already answered in another dataset)" in m
               for _, _, m in events)

    # The next run reads it from disk: still skipped, still not sent.
    async with SimServer(SimConfig(seed=2, **FAST), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "prompts": "prompts/a.jsonl"},
                                                   {"name": "b", "prompts": "prompts/b.jsonl"}])
        engine, state, _ = await run_engine(cfg)
        assert sim.stats.requests_total == 0
    assert dataset_row(engine, "b").skipped == 1


async def test_answers_of_a_dataset_no_longer_in_the_config_count(tmp_path: Path) -> None:
    old = tmp_path / "run" / "retired" / "responses.jsonl"
    old.parent.mkdir(parents=True)
    old.write_bytes(orjson.dumps({"id": "r1", "messages": [{"role": "user", "content": SHARED}],
                                  "content": "x", "usage": {"cost": 0.001}}) + b"\n")
    write(tmp_path / "prompts/b.jsonl", [("b1", TWIN), ("b2", "What is a trie?")])
    async with SimServer(SimConfig(seed=2, **FAST), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "b", "prompts": "prompts/b.jsonl"}])
        engine, state, _ = await run_engine(cfg)
        stats = sim.stats.copy()
    assert sent(stats, TWIN) == 0 and stats.requests_total == 1
    assert dataset_row(engine, "b").skipped == 1


async def test_parallel_datasets_never_both_send_a_shared_prompt(tmp_path: Path) -> None:
    texts = [f"Shared question number {i}?" for i in range(40)]
    write(tmp_path / "prompts/a.jsonl", [(f"a{i}", t) for i, t in enumerate(texts)])
    write(tmp_path / "prompts/b.jsonl", [(f"b{i}", t.upper()) for i, t in enumerate(texts)] + [("b-own", "Mine?")])
    async with SimServer(SimConfig(seed=4, fixed_latency_s=0.05, mean_completion_tokens=40), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "prompts": "prompts/a.jsonl", "concurrency": 8},
                                                   {"name": "b", "prompts": "prompts/b.jsonl", "concurrency": 8}],
                          tables={"engine": {"parallel": True}})
        engine, state, _ = await run_engine(cfg)
        stats = sim.stats.copy()
    assert state == snap.RunState.DONE
    for t in texts:
        assert sent(stats, t) + sent(stats, t.upper()) == 1, t
    assert sent(stats, "Mine?") == 1
    a, b = dataset_row(engine, "a"), dataset_row(engine, "b")
    assert a.done + b.done == 41 and a.skipped + b.skipped == 40
    accounted(cfg, engine)


async def test_the_switch_turns_it_off(tmp_path: Path) -> None:
    write(tmp_path / "prompts/a.jsonl", [("a1", SHARED)])
    write(tmp_path / "prompts/b.jsonl", [("b1", TWIN)])
    async with SimServer(SimConfig(seed=2, **FAST), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "prompts": "prompts/a.jsonl"},
                                                   {"name": "b", "prompts": "prompts/b.jsonl"}],
                          tables={"engine": {"skip_cross_dataset_duplicates": False}})
        engine, _, _ = await run_engine(cfg)
        stats = sim.stats.copy()
    assert sent(stats, SHARED) == 1 and sent(stats, TWIN) == 1
    assert dataset_row(engine, "b").skipped == 0


def test_a_conversation_turn_is_claimed_on_its_prompt_side_not_on_the_targets_earlier_answers(tmp_path: Path) -> None:
    """Turn 2 of a conversation answered in dataset a (its history holds a's own answer to turn 1) takes the
    same turn of the same conversation in b, whose history holds another answer; a single-turn prompt whose
    history is the file's own assistant turn stays another prompt."""
    from draftgen.core.generate.loop.duplicates import CrossDatasetDuplicates
    u1, u2 = {"role": "user", "content": "Hi"}, {"role": "user", "content": "And 2+2?"}
    (tmp_path / "a").mkdir()
    (tmp_path / "a/responses.jsonl").write_bytes(orjson.dumps({
        "id": "c#t2", "conversation": "c", "turn": 2, "turns": 2,
        "messages": [u1, {"role": "assistant", "content": "Hey."}, u2]}) + b"\n")
    dup = CrossDatasetDuplicates()
    dup.load(tmp_path, ["a", "b"])
    assert dup.claim("b", "d#t2", [u1, {"role": "assistant", "content": "Hello!"}, u2], turn=True) == "a"
    assert dup.claim("b", "x", [u1, {"role": "assistant", "content": "Hello!"}, u2]) is None
    assert dup.claim("b", "d#t1", [u1], turn=True) is None  # turn 1 (user turn 1 alone) was not answered in a
