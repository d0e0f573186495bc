"""Merge: clean samples of every dataset → merged/train.jsonl + merged/tokens/ + merged/stats.json.

Over 400 lines: the output format, the crash safety and the lock share one run-directory builder.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from draftgen.core.config import Config
from draftgen.core.config_load import config_from_dict
from draftgen.core.errors import DraftgenError
from draftgen.core.live.snapshot import StageProgress
from draftgen.core.merge import merge as merge_mod
from draftgen.core.merge.command import merge_command
from draftgen.core.merge.merge import merge
from draftgen.core.merge.stats import DROP_REASONS
from draftgen.core.merge.swap import recover
from draftgen.core.tokens.store import TokenReader, TokenWriter
from tests.multiturn import multi_turn_run


@dataclass
class Sample:
    id: str
    messages: list[dict[str, Any]]
    content: str = "The answer."
    reasoning: str | None = "Let me think."
    truncated: bool = False
    tokens: bool = True                     # a token store entry exists
    valid: bool = True
    failed_checks: list[str] = field(default_factory=list)
    cost: float = 0.001
    extra: dict[str, Any] = field(default_factory=dict)  # more keys of the line (a conversation turn's `turn`)


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def write_dataset(run: Path, name: str, samples: list[Sample], *, failures: int = 0, torn_tail: bool = False,
                  seed: int = 0, vocab: int = 163_000) -> None:
    folder = run / name
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lines = [orjson.dumps({
        "id": s.id, "messages": s.messages, "reasoning": s.reasoning, "content": s.content,
        "tool_calls": None, "finish_reason": "length" if s.truncated else "stop",
        "usage": {"prompt_tokens": 10, "completion_tokens": 20, "reasoning_tokens": 5, "cost": s.cost},
        "truncated": s.truncated, "empty_content": not s.content, "ts": 1.0, **s.extra,
    }) + b"\n" for s in samples]
    if torn_tail:
        lines.append(b'{"id": "torn", "messages": [{"role": "user", "content": "half')
    (folder / "responses.jsonl").write_bytes(b"".join(lines))
    (folder / "failures.jsonl").write_bytes(b"".join(
        orjson.dumps({"id": f"f{i}", "messages": user(f"failed {i}"), "error_kind": "400"}) + b"\n"
        for i in range(failures)))
    with TokenWriter(folder / "tokens") as writer:
        for s in samples:
            if not s.tokens:
                continue
            n = int(rng.integers(5, 40))
            ids = rng.integers(0, vocab, n, dtype=np.uint32)
            mask = (np.arange(n) >= n // 2).astype(np.uint8)
            writer.append(s.id, ids, mask, {"answer_start": n // 2, "answer_end": n, "valid": s.valid,
                                            "failed_checks": s.failed_checks, "truncated": s.truncated})


SYSTEM_PROMPT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
MULTI_TURN = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
              {"role": "user", "content": "And 2+2?"}]


@pytest.fixture
def run_config(tmp_path: Path) -> Config:
    run = tmp_path / "run"
    write_dataset(run, "A", [
        Sample("a1", user("shared prompt")),
        Sample("a2", SYSTEM_PROMPT, reasoning=None),
        Sample("a3", MULTI_TURN),
        Sample("a4", user("cut short"), truncated=True),
        Sample("a5", user("no answer"), content=""),
        Sample("a6", user("bad tokens"), valid=False, failed_checks=["decode_roundtrip", "count"]),
        Sample("a7", user("not yet reconstructed"), tokens=False),
        Sample("a8", user("shared prompt")),  # same prompt as a1: duplicate within the dataset
    ], failures=2, seed=1)
    write_dataset(run, "B", [
        Sample("b1", SYSTEM_PROMPT),                 # duplicate of A/a2 across datasets
        Sample("b2", user("only in B")),
        Sample("b3", user("cut short")),             # A/a4 was dropped, so this one is kept
        Sample("b4", user("bad eot"), valid=False, failed_checks=["ends_with_eot"]),
        Sample("7", [{"role": "user", "content": [{"type": "text", "text": "parts "},
                                                  {"type": "text", "text": "joined"}]}]),
    ], torn_tail=True, seed=2)
    write_dataset(run, "C", [Sample(f"c{i}", user(f"prompt {i}"), cost=0.002) for i in range(30)], failures=1, seed=3)
    return make_config(tmp_path, seed=42)


def raw_config(seed: int) -> dict[str, Any]:
    return {"output": {"dir": "run"}, "merge": {"seed": seed},
            "datasets": [{"name": n, "prompts": f"{n}.jsonl"} for n in ("A", "B", "C")]}


def make_config(tmp_path: Path, seed: int) -> Config:
    return config_from_dict(raw_config(seed), tmp_path / "draftgen.toml")


def train_lines(run: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in (run / "merged" / "train.jsonl").read_bytes().splitlines()]


def snapshot_outputs(run: Path) -> dict[str, bytes]:
    merged = run / "merged"
    return {str(p.relative_to(merged)): p.read_bytes() for p in sorted(merged.rglob("*")) if p.is_file()}


def stats_without_times(raw: bytes) -> dict[str, Any]:
    stats = orjson.loads(raw)
    stats.pop("created_at")
    stats.pop("elapsed_s", None)  # fingerprint.json has created_at only
    return stats


EXPECTED_KEPT = {"A/a1", "A/a2", "A/a3", "B/b2", "B/b3", "B/7", *(f"C/c{i}" for i in range(30))}


def test_keeps_clean_first_seen_samples_and_counts_each_drop_reason(run_config: Config) -> None:
    stats = merge(run_config)
    run = run_config.run_dir
    assert {r["id"] for r in train_lines(run)} == EXPECTED_KEPT
    by_name = {d.name: d for d in stats.datasets}
    assert by_name["A"].dropped == dict.fromkeys(DROP_REASONS, 0) | {
        "failed": 2, "truncated": 1, "empty": 1, "not_reconstructed": 1, "invalid": 1, "duplicate": 1}
    assert by_name["A"].invalid_checks == {"decode_roundtrip": 1, "count": 1}
    assert by_name["B"].dropped == dict.fromkeys(DROP_REASONS, 0) | {"duplicate": 1, "invalid": 1}
    assert by_name["B"].invalid_checks == {"ends_with_eot": 1}
    assert by_name["B"].read == 5  # the torn last line is not read
    assert all(d.read == d.kept + d.dropped_total for d in stats.datasets)
    assert by_name["C"].dropped["failed"] == 1 and by_name["C"].kept == 30
    assert stats.samples == len(EXPECTED_KEPT) == sum(d.kept for d in stats.datasets)
    assert by_name["C"].cost_usd == pytest.approx(0.06)
    assert by_name["A"].cost_usd == pytest.approx(0.003) and by_name["A"].cost_all_usd == pytest.approx(0.008)

    on_disk = orjson.loads((run / "merged" / "stats.json").read_bytes())
    assert on_disk["seed"] == 42 and on_disk["samples"] == stats.samples
    assert on_disk["dropped"]["duplicate"] == 2 and on_disk["dropped"]["failed"] == 3
    assert on_disk["tokens"] == stats.tokens == sum(d["tokens"] for d in on_disk["datasets"])
    assert 0 < on_disk["masked_tokens"] < on_disk["tokens"]
    fingerprinted = {f["path"] for f in on_disk["inputs"]}
    assert {"A/responses.jsonl", "A/failures.jsonl", "A/tokens/index.jsonl", "C/tokens/input_ids.bin"} <= fingerprinted
    b_responses = next(f for f in on_disk["inputs"] if f["path"] == "B/responses.jsonl")
    assert b_responses["size"] == (run / "B" / "responses.jsonl").stat().st_size


def test_odd_costs_count_as_nothing_as_on_resume(tmp_path: Path) -> None:
    """Merge reads usage.cost by the same rule as the engine's resume (core/records.py cost_of): a
    boolean, a negative number or a string is no cost, never $1 or a refund."""
    run = tmp_path / "run"
    write_dataset(run, "A", [Sample("yes", user("p1"), cost=True), Sample("neg", user("p2"), cost=-0.5),
                             Sample("text", user("p3"), cost="0.5"), Sample("real", user("p4"), cost=0.25)])  # type: ignore[arg-type]
    for name in ("B", "C"):
        write_dataset(run, name, [])
    stats = merge(make_config(tmp_path, seed=1))
    a = next(d for d in stats.datasets if d.name == "A")
    assert a.kept == 4 and a.cost_all_usd == a.cost_usd == 0.25


def test_same_inputs_and_seed_give_byte_identical_outputs(run_config: Config, tmp_path: Path) -> None:
    merge(run_config)
    first = snapshot_outputs(run_config.run_dir)
    merge(run_config)
    second = snapshot_outputs(run_config.run_dir)
    assert first.keys() == second.keys() == {"train.jsonl", "train-tokens.jsonl", "stats.json", "fingerprint.json",
                                             "provenance.json", "tokens/input_ids.bin", "tokens/loss_mask.bin",
                                             "tokens/index.jsonl"}
    for name in first:
        if name in ("stats.json", "fingerprint.json"):
            assert stats_without_times(first[name]) == stats_without_times(second[name])
        elif name == "provenance.json":  # what made it, and when: the same but for the times
            records = [orjson.loads(x[name])["records"]["merge"] for x in (first, second)]
            for rec in records:
                del rec["started_at"], rec["ended_at"]
            assert records[0] == records[1]
        else:
            assert first[name] == second[name], name

    merge(make_config(tmp_path, seed=7))
    reseeded = [r["id"] for r in train_lines(run_config.run_dir)]
    original = [orjson.loads(line)["id"] for line in first["train.jsonl"].splitlines()]
    assert sorted(reseeded) == sorted(original) and reseeded != original


def test_train_jsonl_lines_align_with_merged_tokens(run_config: Config) -> None:
    merge(run_config)
    run = run_config.run_dir
    merged = TokenReader(run / "merged" / "tokens")
    sources = {name: TokenReader(run / name / "tokens") for name in ("A", "B", "C")}
    lines = train_lines(run)
    # The pre-tokenized copy online trainers read: line k is entry k, its id, ids and 0/1 mask as plain lists.
    pretokenized = [orjson.loads(x) for x in (run / "merged" / "train-tokens.jsonl").read_bytes().splitlines()]
    assert len(lines) == len(merged) == len(pretokenized)
    for line, entry, tokenized in zip(lines, merged.entries, pretokenized, strict=True):
        assert line["id"] == entry.id
        dataset, source_id = entry.id.split("/", 1)
        assert entry.meta["dataset"] == dataset
        got_ids, got_mask = merged.raw(entry)
        want_ids, want_mask = sources[dataset].raw(sources[dataset].entry(source_id))
        assert got_ids.dtype == np.dtype("<u4") and got_mask.dtype == np.uint8
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_array_equal(got_mask, want_mask)
        assert list(tokenized) == ["id", "input_ids", "loss_mask"] and tokenized["id"] == entry.id
        assert tokenized["input_ids"] == got_ids.tolist() and tokenized["loss_mask"] == got_mask.tolist()
        assert set(tokenized["loss_mask"]) <= {0, 1} and all(type(x) is int for x in tokenized["input_ids"])
    stats = orjson.loads((run / "merged" / "stats.json").read_bytes())
    assert stats["outputs"]["train_tokens_jsonl"] == {
        "lines": len(merged), "bytes": (run / "merged" / "train-tokens.jsonl").stat().st_size}


def test_records_follow_specforge_conversation_schema(run_config: Config) -> None:
    merge(run_config)
    records = {r["id"]: r for r in train_lines(run_config.run_dir)}
    for record in records.values():
        assert list(record) == ["id", "conversations"] and isinstance(record["id"], str)
        turns = record["conversations"]
        assert all(isinstance(t["content"], str) for t in turns)
        roles = [t["role"] for t in turns]
        body = roles[1:] if roles[0] == "system" else roles
        # SpecForge's GeneralParser: starts with user, an assistant turn follows a user (or tool) turn.
        assert body[0] == "user" and body[-1] == "assistant"
        assert all(prev != "assistant" for prev, cur in itertools.pairwise(body) if cur == "assistant")
        assert isinstance(turns[-1]["reasoning_content"], str)
        assert all("reasoning_content" not in t for t in turns[:-1])

    assert records["A/a1"]["conversations"] == [
        {"role": "user", "content": "shared prompt"},
        {"role": "assistant", "content": "The answer.", "reasoning_content": "Let me think."}]
    assert records["A/a2"]["conversations"] == [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "The answer.", "reasoning_content": ""}]
    assert [t["role"] for t in records["A/a3"]["conversations"]] == ["user", "assistant", "user", "assistant"]
    assert records["A/a3"]["conversations"][1] == {"role": "assistant", "content": "Hello!"}
    assert records["B/7"]["conversations"][0] == {"role": "user", "content": "parts joined"}


def test_crash_mid_write_leaves_old_merged_intact(run_config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    run = run_config.run_dir
    merge(run_config)
    before = snapshot_outputs(run)

    calls = {"n": 0}
    real_append = TokenWriter.append

    def failing_append(self: TokenWriter, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] > len(EXPECTED_KEPT) // 2:
            raise RuntimeError("simulated crash")
        return real_append(self, *args, **kwargs)

    # A new answer lands, so the failed merge would have produced a different merged/.
    with open(run / "C" / "responses.jsonl", "ab") as f:
        f.write(orjson.dumps({"id": "late", "messages": user("late"), "content": "x", "reasoning": "y",
                              "truncated": False, "empty_content": False, "usage": {"cost": 0.0}}) + b"\n")
    monkeypatch.setattr(merge_mod.TokenWriter, "append", failing_append)
    progress: list[StageProgress] = []
    with pytest.raises(RuntimeError, match="simulated crash"):
        merge(run_config, progress.append)
    assert progress[-1].state == "failed"
    assert snapshot_outputs(run) == before
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("merged")) == ["merged", "merged.lock"]

    monkeypatch.setattr(merge_mod.TokenWriter, "append", real_append)
    stats = merge(run_config)
    assert stats.samples == len(EXPECTED_KEPT)  # "late" has no tokens yet: not_reconstructed
    assert stats.datasets[2].dropped["not_reconstructed"] == 1


def test_error_between_renames_puts_the_old_merged_back(run_config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    run = run_config.run_dir
    merge(run_config)
    before = snapshot_outputs(run)
    real_rename = os.rename
    calls = {"n": 0}

    def rename_then_fail(src: Any, dst: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # merged → merged.old-* done, tmp → merged not yet
            raise OSError("simulated failure")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename_then_fail)
    with pytest.raises(OSError, match="simulated failure"):
        merge(run_config)
    monkeypatch.setattr(os, "rename", real_rename)
    assert snapshot_outputs(run) == before
    assert not list(run.glob("merged.old-*")) and not list(run.glob("merged.tmp-*"))


# A merge killed outright (os._exit: no except, no finally) at a chosen point, in a child process.
HARD_CRASH = """
import os, sys
from pathlib import Path
import orjson
from draftgen.core.merge import merge as m
from draftgen.core.config_load import config_from_dict

where, calls = sys.argv[3], [0]
real_append, real_rename = m.TokenWriter.append, os.rename
def append(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] > 10:
        os._exit(9)
    return real_append(self, *args, **kwargs)
def rename(src, dst):
    calls[0] += 1
    if calls[0] == 2:
        os._exit(9)
    real_rename(src, dst)
if where == "write":
    m.TokenWriter.append = append
else:
    os.rename = rename
m.merge(config_from_dict(orjson.loads(sys.argv[1]), Path(sys.argv[2])))
"""


@pytest.mark.parametrize("where", ["write", "rename"])
def test_killed_merge_leaves_old_or_new_merged_never_half(run_config: Config, tmp_path: Path, where: str) -> None:
    run = run_config.run_dir
    merge(run_config)
    before = snapshot_outputs(run)
    child = subprocess.run([sys.executable, "-c", HARD_CRASH, orjson.dumps(raw_config(42)).decode(),
                            str(tmp_path / "draftgen.toml"), where], capture_output=True, text=True, check=False)
    assert child.returncode == 9, child.stderr
    if where == "write":
        assert snapshot_outputs(run) == before and list(run.glob("merged.tmp-*"))
    else:  # killed between the renames: merged/ is aside as merged.old-*, the new one still in tmp
        assert not (run / "merged").exists() and list(run.glob("merged.old-*"))
        recover(run)
        assert snapshot_outputs(run) == before
    merge(run_config)
    assert not list(run.glob("merged.tmp-*")) and not list(run.glob("merged.old-*"))
    after = snapshot_outputs(run)
    assert (after["train.jsonl"] == before["train.jsonl"]
            and after["tokens/input_ids.bin"] == before["tokens/input_ids.bin"])


def test_stale_temp_folders_are_cleaned(run_config: Config) -> None:
    run = run_config.run_dir
    stale = run / "merged.tmp-999999"
    (stale / "tokens").mkdir(parents=True)
    (stale / "train.jsonl").write_text("half\n")
    merge(run_config)
    assert not stale.exists()


def test_reads_only_what_was_on_disk_at_the_start(run_config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    run = run_config.run_dir
    real_read_index = merge_mod.DatasetInput.read_token_index

    def read_index_while_generation_appends(self: Any) -> Any:
        # Generation goes on while merge runs: a clean answer (with tokens) lands after the sizes were taken.
        if self.name == "B":
            late = Sample("late", user("arrived during the merge"))
            with open(run / "B" / "responses.jsonl", "ab") as f:
                f.write(b"\n" + orjson.dumps({"id": late.id, "messages": late.messages, "content": "x",
                                              "reasoning": "y", "truncated": False}) + b"\n")
            with TokenWriter(run / "B" / "tokens") as writer:
                writer.append(late.id, [1, 2, 3], [0, 1, 1], {"valid": True, "failed_checks": []})
        return real_read_index(self)

    monkeypatch.setattr(merge_mod.DatasetInput, "read_token_index", read_index_while_generation_appends)
    stats = merge(run_config)
    assert "B/late" not in {r["id"] for r in train_lines(run)}
    assert stats.datasets[1].read == 5


def test_a_second_merge_at_the_same_time_is_refused(run_config: Config) -> None:
    run = run_config.run_dir
    fd = os.open(run / "merged.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(DraftgenError, match="another merge or an extraction is running"):
            merge(run_config)
    finally:
        os.close(fd)


def test_missing_run_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DraftgenError, match="run directory not found"):
        merge(make_config(tmp_path, seed=1))


def test_progress_reports_counts_and_ends_done(run_config: Config) -> None:
    seen: list[StageProgress] = []
    stats = merge(run_config, seen.append)
    assert all(p.name == "merge" for p in seen)
    final = seen[-1]
    assert final.state == "done" and final.done == final.total == stats.samples
    detail = dict(final.detail)
    assert list(detail) == ["read", "kept", "dropped", "written"]
    assert int(detail["kept"]) == int(detail["written"]) == stats.samples
    assert int(detail["read"]) == stats.read == stats.samples + sum(stats.dropped.values())
    assert int(detail["dropped"]) == sum(stats.dropped.values())


def test_merge_command_prints_a_summary(run_config: Config, capsys: pytest.CaptureFixture[str]) -> None:
    assert merge_command(run_config) == 0
    out = capsys.readouterr().out
    assert "merge done" in out and "total" in out and "duplicate" in out
    assert f"{len(EXPECTED_KEPT)} samples written" in out


def test_tool_call_prompts_give_every_row_the_same_keys(run_config: Config, tmp_path: Path) -> None:
    # datasets < 5 (what SpecForge loads with) fails when a key is in some Arrow batches and not others.
    tool_prompt = [{"role": "user", "content": "list files"},
                   {"role": "assistant", "content": "", "tool_calls": [
                       {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
                   {"role": "tool", "content": "a.py"}, {"role": "user", "content": "now read it"}]
    write_dataset(run_config.run_dir, "D", [Sample("d1", tool_prompt)], seed=4)
    # An answer that calls a tool (reconstruction renders its calls into the tokens).
    responses = run_config.run_dir / "D" / "responses.jsonl"
    record = orjson.loads(responses.read_bytes())
    record["tool_calls"] = [{"id": "c2", "type": "function", "function": {"name": "cat", "arguments": "{}"}}]
    responses.write_bytes(orjson.dumps(record) + b"\n")
    raw = {"output": {"dir": "run"}, "datasets": [{"name": n, "prompts": f"{n}.jsonl"} for n in "ABCD"]}
    merge(config_from_dict(raw, tmp_path / "draftgen.toml"))
    records = {r["id"]: r for r in train_lines(run_config.run_dir)}
    assert records["D/d1"]["conversations"][1]["tool_calls"][0]["function"]["name"] == "ls"
    assert [t["role"] for t in records["D/d1"]["conversations"]] == ["user", "assistant", "tool", "user", "assistant"]
    assert records["D/d1"]["conversations"][-1]["tool_calls"][0]["function"]["name"] == "cat"
    assert all(r["conversations"][-1]["tool_calls"] == [] for i, r in records.items() if i != "D/d1")


def test_a_prompt_differing_only_in_case_spacing_or_unicode_form_is_a_duplicate(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_dataset(run, "A", [Sample("a1", user("Shared prompt"))], seed=1)
    write_dataset(run, "B", [Sample("b1", user("  shared\nPROMPT ")), Sample("b2", user("Ｓhared prompt")),
                             Sample("b3", user("Shared prompts"))], seed=2)
    write_dataset(run, "C", [], seed=3)
    stats = merge(make_config(tmp_path, seed=1))
    assert {r["id"] for r in train_lines(run)} == {"A/a1", "B/b3"}
    assert {d.name: d.dropped["duplicate"] for d in stats.datasets} == {"A": 0, "B": 2, "C": 0}


# -- turns of multi-turn conversations ([merge] multi_turn) ------------------------------------------------


def _stored(config: Config) -> dict[str, tuple[list[int], list[int], dict[str, Any]]]:
    reader = TokenReader(config.run_dir / "M" / "tokens")
    return {e.id: (ids.tolist(), mask.tolist(), e.meta) for e, (_, ids, mask) in zip(reader.entries, reader)}


def test_per_turn_merge_keeps_each_generation_event_and_nothing_after_an_invalid_turn(tmp_path: Path) -> None:
    config, convs = multi_turn_run(tmp_path)
    stats = merge(config)
    merged = TokenReader(config.run_dir / "merged" / "tokens")
    rows = {r["id"]: r for r in train_lines(config.run_dir)}
    # c2's turn 2 broke (its own line after its turn 3 on disk): turn 3 went with it; c4 failed at turn 2.
    assert set(rows) == {"M/c1#t1", "M/c1#t2", "M/c1#t3", "M/c2#t1", "M/c3#t1", "M/c3#t2", "M/c3#t3", "M/c4#t1"}
    ds = stats.datasets[0]
    assert ds.read == ds.kept + ds.dropped_total == 11
    assert {r: n for r, n in ds.dropped.items() if n} == {"invalid": 1, "after_invalid_turn": 1, "failed": 1}
    assert stats.by_turn == {"1": {"read": 4, "kept": 4, "dropped": {}},
                             "2": {"read": 4, "kept": 2, "dropped": {"invalid": 1, "failed": 1}},
                             "3": {"read": 3, "kept": 2, "dropped": {"after_invalid_turn": 1}}}
    on_disk = orjson.loads((config.run_dir / "merged" / "stats.json").read_bytes())
    assert on_disk["by_turn"] == stats.by_turn and on_disk["multi_turn"] == "per_turn"
    assert on_disk["datasets"][0]["by_turn"] == stats.by_turn
    # One sample per generation event: the turn's own ids and mask, byte for byte (loss on its answer only).
    stored = _stored(config)
    for entry, (_, ids, mask) in zip(merged.entries, merged):
        own_ids, own_mask, _ = stored[entry.id.removeprefix("M/")]
        assert ids.tolist() == own_ids and mask.tolist() == own_mask
    # The row: the turn's history (the target's own earlier answers, content only) and its answer.
    c1 = convs["c1"]
    assert rows["M/c1#t3"]["conversations"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": c1[0]["messages"][1]["content"]},
        {"role": "assistant", "content": c1[0]["content"]},
        {"role": "user", "content": c1[1]["messages"][-1]["content"]},
        {"role": "assistant", "content": c1[1]["content"]},
        {"role": "user", "content": c1[2]["messages"][-1]["content"]},
        {"role": "assistant", "content": c1[2]["content"], "reasoning_content": c1[2]["reasoning"]}]


def test_per_conversation_merge_writes_one_sample_with_every_assistant_turn_in_the_loss_mask(tmp_path: Path) -> None:
    from draftgen.core.tokens.tokenizer import bundled_kimi
    tok = bundled_kimi()
    config, convs = multi_turn_run(tmp_path, merge={"multi_turn": "per_conversation"})
    stats = merge(config)
    rows = {r["id"]: r for r in train_lines(config.run_dir)}
    reader = TokenReader(config.run_dir / "merged" / "tokens")
    merged = {e.id: (ids, mask) for e, (_, ids, mask) in zip(reader.entries, reader)}
    assert set(rows) == set(merged) == {"M/c1", "M/c2", "M/c3", "M/c4"}
    ds = stats.datasets[0]
    assert ds.read == ds.kept + ds.dropped_total == 11 and ds.kept == 4
    assert {r: n for r, n in ds.dropped.items() if n} == {"in_conversation": 4, "invalid": 1,
                                                          "after_invalid_turn": 1, "failed": 1}
    assert stats.by_turn == {"1": {"read": 4, "kept": 2, "dropped": {"in_conversation": 2}},
                             "2": {"read": 4, "kept": 0, "dropped": {"invalid": 1, "failed": 1, "in_conversation": 2}},
                             "3": {"read": 3, "kept": 2, "dropped": {"after_invalid_turn": 1}}}
    stored = _stored(config)
    c1 = convs["c1"]
    ids, mask = merged["M/c1"]
    last_ids, last_mask, meta = stored["c1#t3"]
    # The last good turn's ids (earlier answers without their reasoning, as served), every answer masked.
    assert ids.tolist() == last_ids and len(meta["history_spans"]) == 2
    runs = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    pieces = [tok.decode(ids[s:e].tolist()) for s, e in zip(runs[::2], runs[1::2])]
    assert pieces == [f"<think></think>{c1[0]['content']}<|im_end|>", f"<think></think>{c1[1]['content']}<|im_end|>",
                      f"<think>{c1[2]['reasoning']}</think>{c1[2]['content']}<|im_end|>"]
    assert int(mask.sum()) > sum(last_mask)
    assert stats.masked_tokens == sum(int(m.sum()) for _, m in merged.values())
    # c2 ends at its turn 1 (turn 2 broke); c4 at its turn 1 (turn 2 failed): that turn's sample as stored.
    assert merged["M/c2"][0].tolist() == stored["c2#t1"][0] and merged["M/c2"][1].tolist() == stored["c2#t1"][1]
    assert [t["role"] for t in rows["M/c1"]["conversations"]] == [
        "system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert all("reasoning_content" not in t for t in rows["M/c1"]["conversations"][:-1])
    # The kept cost is every turn in a sample.
    assert ds.cost_usd == pytest.approx(sum(r["usage"]["cost"] for c in ("c1", "c3") for r in convs[c])
                                        + convs["c2"][0]["usage"]["cost"] + convs["c4"][0]["usage"]["cost"])


def test_per_conversation_needs_the_template_that_knows_the_turns(tmp_path: Path) -> None:
    raw = {"output": {"dir": "run"}, "tokenizer": {"template": "auto"}, "merge": {"multi_turn": "per_conversation"},
           "datasets": [{"name": "M", "prompts": "M.jsonl"}]}
    with pytest.raises(DraftgenError, match='merge.multi_turn = "per_conversation" needs tokenizer.template'):
        merge(config_from_dict(raw, tmp_path / "draftgen.toml"))
    with pytest.raises(DraftgenError, match="multi_turn"):
        config_from_dict({**raw, "merge": {"multi_turn": "per_sample"}}, tmp_path / "draftgen.toml")


def test_merge_command_prints_the_turns_by_turn_number(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = multi_turn_run(tmp_path)
    assert merge_command(config) == 0
    out = capsys.readouterr().out
    assert 'turns of conversations ([merge] multi_turn = "per_turn")' in out
    assert "after_invalid_turn" in out


def test_a_conversation_whose_sample_is_a_duplicate_drops_all_its_turns(tmp_path: Path) -> None:
    from draftgen.core.tokens.workers import reconstruct_dataset
    from tests.multiturn import write_records
    config, convs = multi_turn_run(tmp_path, merge={"multi_turn": "per_conversation"})
    # The same conversation again under another name (the same turns and answers): its sample repeats c1's.
    copy = [{**r, "id": r["id"].replace("c1", "c9"), "conversation": "c9"} for r in convs["c1"]]
    write_records(config.run_dir / "M" / "responses.jsonl", copy)
    reconstruct_dataset(config, "M", workers=1)
    stats = merge(config)
    ds = stats.datasets[0]
    assert {r["id"] for r in train_lines(config.run_dir)} == {"M/c1", "M/c2", "M/c3", "M/c4"}
    assert ds.dropped["duplicate"] == 3 and ds.dropped["in_conversation"] == 4
    assert ds.cost_usd == pytest.approx(sum(r["usage"]["cost"] for c in ("c1", "c3") for r in convs[c])
                                        + convs["c2"][0]["usage"]["cost"] + convs["c4"][0]["usage"]["cost"])


def _turn(conversation: str, k: int, messages: list[dict[str, Any]]) -> Sample:
    return Sample(f"{conversation}#t{k}", messages, extra={"conversation": conversation, "turn": k, "turns": 2})


def test_a_conversation_turn_is_deduplicated_on_its_prompt_side_never_on_earlier_answers(tmp_path: Path) -> None:
    """The same conversation regenerated in two datasets: its turns differ only in the target's earlier answers
    (which differ per run), so they are duplicates; a single-turn prompt carrying the dataset's own answer as
    history is another prompt (that answer is part of what it sends)."""
    run = tmp_path / "run"
    u1, u2 = {"role": "user", "content": "Hi"}, {"role": "user", "content": "And 2+2?"}
    write_dataset(run, "A", [_turn("c", 1, [u1]), _turn("c", 2, [u1, {"role": "assistant", "content": "Hey."}, u2])],
                  seed=1)
    write_dataset(run, "B", [_turn("d", 1, [u1]), _turn("d", 2, [u1, {"role": "assistant", "content": "Hello!"}, u2]),
                             _turn("e", 2, [u1, {"role": "assistant", "content": "Yo"},
                                            {**u2, "content": "And 3+3?"}])],
                  seed=2)
    write_dataset(run, "C", [Sample("c1", MULTI_TURN)], seed=3)
    stats = merge(make_config(tmp_path, seed=1))
    assert {r["id"] for r in train_lines(run)} == {"A/c#t1", "A/c#t2", "B/e#t2", "C/c1"}
    assert {d.name: d.dropped["duplicate"] for d in stats.datasets} == {"A": 0, "B": 2, "C": 0}
