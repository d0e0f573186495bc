"""Dataset reconstruction on disk (`draftgen tokens`) and live during a run, on the real Kimi vocabulary."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from draftgen.core.config import Config
from draftgen.core.config_load import config_from_dict
from draftgen.core.errors import ConfigError, TokenizerError
from draftgen.core.live.snapshot import StageProgress
from draftgen.core.rundir import RunDir, repair_torn_tail
from draftgen.core.tokens.command import tokens_command
from draftgen.core.tokens.during_run import RunReconstructor
from draftgen.core.tokens.reconstruct import answer_fields, reconstruct_record
from draftgen.core.tokens.store import INDEX_FILE, TokenReader
from draftgen.core.tokens.template import load_template
from draftgen.core.tokens.tokenizer import bundled_kimi, bundled_kimi_path
from draftgen.core.tokens.workers import INLINE_MAX, REPORT_FILE, reconstruct_dataset

META_KEYS = {"answer_start", "answer_end", "valid", "failed_checks", "span_tokens", "billed_tokens", "count_diff",
             "truncated", "source", "prompt_tokens", "billed_prompt_tokens", "prompt_diff", "provider",
             "prompt_source"}


def make_config(tmp_path: Path, *, tokenizer: str | None = None, datasets: tuple[str, ...] = ("A",)) -> Config:
    raw: dict[str, Any] = {
        "tokenizer": {"path": tokenizer or str(bundled_kimi_path()), "template": "kimi-k2.5"},
        "output": {"dir": "run"},
        "engine": {"workers": 2},
        "datasets": [{"name": n, "prompts": f"{n}.jsonl"} for n in datasets],
    }
    return config_from_dict(raw, tmp_path / "draftgen.toml")


def response(i: int, **over: Any) -> dict[str, Any]:
    """A response line; its billed count is what the Kimi tokenizer gives, so it validates."""
    rec = {"id": f"p{i}", "messages": [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}],
           "reasoning": f"Add {i} and {i}: " + "carefully " * (i % 7), "content": f"It is {2 * i}. 答案 🚀",
           "tool_calls": None, "finish_reason": "stop", "native_finish_reason": "stop", "provider": "Test",
           "model": "moonshotai/kimi-k2.5", "generation_id": f"gen-{i}", "latency_s": 0.1, "attempts": 1,
           "truncated": False, "empty_content": False, "ts": 1.0}
    rec.update(over)
    probe = reconstruct_record(bundled_kimi(), load_template("kimi-k2.5", bundled_kimi()), rec)
    rec.setdefault("usage", {"prompt_tokens": 20, "completion_tokens": probe.span_tokens, "reasoning_tokens": 5,
                             "cost": 0.0001})
    return rec


def write_responses(config: Config, name: str, records: list[dict[str, Any]]) -> Path:
    path = RunDir(config.run_dir).responses(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        for rec in records:
            f.write(orjson.dumps(rec) + b"\n")
    return path


def index_lines(config: Config, name: str) -> list[dict[str, Any]]:
    path = RunDir(config.run_dir).tokens(name) / INDEX_FILE
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_reconstruct_dataset_incremental_and_resumable(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    tok, template = bundled_kimi(), load_template("kimi-k2.5", bundled_kimi())
    records = [response(i) for i in range(INLINE_MAX + 8)]  # enough to use the worker processes
    records[3] = response(3, finish_reason="length", truncated=True, content="It is cu")
    records[5] = response(5, content="Type <|im_end|> to end a turn.")
    records[7] = response(7, usage={"completion_tokens": 500})
    backend = reconstruct_record(tok, template, records[9])
    records[9]["token_ids"] = backend.input_ids[backend.answer_start:backend.answer_end].tolist()
    records[11] = {**records[11], "messages": "not a list", "reasoning": 5}  # malformed: flagged, not fatal
    write_responses(config, "A", records)
    with open(RunDir(config.run_dir).responses("A"), "ab") as f:
        f.write(b'{"id": "torn", "messages": [{"role": "user", "con')  # a crash mid-line: ignored

    seen: list[StageProgress] = []
    report = reconstruct_dataset(config, "A", seen.append)
    assert report.checked == len(records) and report.valid == len(records) - 3
    assert report.failures["ends_with_eot"] == 1 and report.failures["token_count"] == 1
    assert report.failures["renders"] == 1
    assert report.from_backend == 1 and report.truncated == 1
    assert seen[-1].name == "tokens" and seen[-1].state == "done" and seen[-1].done == len(records)

    lines = index_lines(config, "A")
    assert [e["id"] for e in lines] == [r["id"] for r in records]  # committed in response order
    assert all(set(e) == {"id", "offset", "length"} | META_KEYS for e in lines)
    reader = TokenReader(RunDir(config.run_dir).tokens("A"))
    for rec in records:
        expected = reconstruct_record(tok, template, rec)
        ids, mask = reader.arrays(reader.entry(rec["id"]))
        assert ids.tolist() == expected.input_ids.tolist() and mask.tolist() == expected.loss_mask.tolist()
        assert reader.entry(rec["id"]).meta == expected.index_meta()
    assert reader.entry("p9").meta["source"] == "backend"
    assert reader.entry("p11").length == 0 and reader.entry("p11").meta["failed_checks"] == ["renders"]
    saved = orjson.loads((RunDir(config.run_dir).tokens("A") / REPORT_FILE).read_bytes())
    assert saved == report.to_dict()

    # Again: nothing new, nothing written twice.
    folder = RunDir(config.run_dir).tokens("A")
    sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
    again = reconstruct_dataset(config, "A")
    assert again.to_dict() == report.to_dict()
    assert {p.name: p.stat().st_size for p in folder.iterdir()} == sizes

    # A crash mid-commit: a torn index line and stray token bytes. Repaired, then only what is missing.
    with open(folder / INDEX_FILE, "rb+") as f:
        data = f.read()
        cut = data.rstrip(b"\n").rfind(b"\n") + 1
        f.seek(cut)
        f.truncate()
        f.write(data[cut:cut + 25])
    with open(folder / "input_ids.bin", "ab") as f:
        f.write(b"\x01\x02\x03\x04" * 3)
    repair_torn_tail(RunDir(config.run_dir).responses("A"))  # as the engine's appender does on reopening
    write_responses(config, "A", [response(i) for i in range(100, 103)])  # answers that landed since
    third = reconstruct_dataset(config, "A")
    lines = index_lines(config, "A")
    ids = [e["id"] for e in lines]
    assert len(ids) == len(set(ids)) == len(records) + 3
    assert third.checked == len(records) + 3
    assert ids[-4:] == [records[-1]["id"], "p100", "p101", "p102"]
    final = TokenReader(folder)
    for rec in (records[-1], response(101)):
        got, _ = final.arrays(final.entry(rec["id"]))
        assert got.tolist() == reconstruct_record(tok, template, rec).input_ids.tolist()


def test_tokens_command_prints_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")
    config = make_config(tmp_path, datasets=("A", "B"))
    write_responses(config, "A", [response(i) for i in range(3)])
    write_responses(config, "B", [response(i, content="cut", truncated=True, finish_reason="length")
                                  for i in range(2)])
    assert tokens_command(config) == 0
    out = capsys.readouterr().out
    assert "ends_with_eot 2" in out and "all" in out and "100.0%" in out
    assert (RunDir(config.run_dir).tokens("B") / REPORT_FILE).exists()


def test_errors_name_what_is_wrong(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    with pytest.raises(ConfigError, match="no dataset named 'Z'"):
        reconstruct_dataset(config, "Z")
    write_responses(config, "A", [response(0)])
    broken = make_config(tmp_path, tokenizer=str(tmp_path / "missing-tokenizer"))
    with pytest.raises(TokenizerError, match="missing-tokenizer: tokenizer folder not found"):
        reconstruct_dataset(broken, "A")


async def test_live_reconstructor(tmp_path: Path) -> None:
    config = make_config(tmp_path, datasets=("A", "B"))
    # Answers a crashed run left on disk without tokens.
    write_responses(config, "A", [response(i) for i in range(5)])
    live = RunReconstructor(config, workers=1)
    await live.start()
    assert await live.catch_up("A") == 5
    assert await live.catch_up("B") == 0

    new = [response(i) for i in range(5, 45)]
    write_responses(config, "A", new)
    for rec in new:
        live.submit("A", rec)
    live.submit("A", new[0])  # a duplicate: ignored
    live.submit("B", response(900, content="cut", truncated=True, finish_reason="length"))
    # submit only queued the work: nothing can have been written by the worker yet.
    assert live.progress().done < 46 and live.progress().name == "tokens"

    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    t = asyncio.create_task(ticker())
    await live.wait_idle()
    t.cancel()
    assert ticks > 1  # the loop kept running while workers tokenized
    await live.close()

    ids_a = [e["id"] for e in index_lines(config, "A")]
    assert sorted(ids_a) == sorted(f"p{i}" for i in range(45)) and len(ids_a) == 45
    assert [e["id"] for e in index_lines(config, "B")] == ["p900"]
    assert live.report("A").checked == 45 and live.report("A").valid == 45
    assert live.report(None).checked == 46 and live.report("B").failures["ends_with_eot"] == 1
    done = live.progress()
    assert done.state == "done" and done.done == 46 and done.total == 46
    assert orjson.loads((RunDir(config.run_dir).tokens("A") / REPORT_FILE).read_bytes())["checked"] == 45

    # A restart: what is on disk is known, nothing is redone.
    again = RunReconstructor(config, workers=1)
    await again.start()
    assert await again.catch_up("A") == 0
    assert again.report("A").checked == 45
    await again.close()
    assert len(index_lines(config, "A")) == 45


async def test_the_prompt_check_is_counted_per_turn_number(tmp_path: Path) -> None:
    from draftgen.core.tokens.report import ValidationReport
    from tests.multiturn import conversation_records, three_turns
    config = make_config(tmp_path, datasets=("M",))
    tok = bundled_kimi()
    records = []
    for c in range(8):
        conv = conversation_records(f"c{c}", three_turns(f" {c}"))
        if c >= 4:  # a server that renders the earlier answers WITH their reasoning: its later turns count more
            for rec in conv:
                kept = sum(len(tok.encode_text(m["reasoning_details"][0]["text"]))
                           for m in rec["messages"] if m["role"] == "assistant")
                rec["usage"] = {**rec["usage"], "prompt_tokens": rec["usage"]["prompt_tokens"] + kept}
                rec["provider"] = "KeepsReasoning"
        records += conv
    write_responses(config, "M", records)
    live = RunReconstructor(config, workers=1)
    await live.start()
    assert await live.catch_up("M") == 24
    await live.close()
    report = live.report("M")
    by_turn = {t.turn: t for t in report.prompt_by_turn}
    assert sorted(by_turn) == [1, 2, 3] and all(t.n == 8 for t in by_turn.values())
    assert by_turn[1].share_exact == 1.0 and by_turn[1].mean_diff == 0
    assert by_turn[2].share_exact == by_turn[3].share_exact == 0.5
    assert by_turn[2].mean_diff < 0 and by_turn[3].mean_diff < by_turn[2].mean_diff  # the history grows
    # Per provider, for the providers panel: the honest one agrees at every turn, the other from turn 2 on not.
    rows = {f.name: f for f in live.fidelity()}
    assert [(t.turn, t.answers, t.exact) for t in rows["Together"].prompt_by_turn] == [(1, 4, 1.0), (2, 4, 1.0),
                                                                                         (3, 4, 1.0)]
    assert [(t.turn, t.exact) for t in rows["KeepsReasoning"].prompt_by_turn] == [(1, 1.0), (2, 0.0), (3, 0.0)]
    # report.json keeps them, and reads them back; the text report says them.
    saved = orjson.loads((RunDir(config.run_dir).tokens("M") / REPORT_FILE).read_bytes())
    assert saved["prompt_token_count_by_turn"]["2"]["share_exact"] == 0.5
    assert ValidationReport.from_dict(saved).prompt_turns == report.prompt_turns
    assert "prompt tokens by turn 1: exact 100.0% (mean diff +0.00) of 8; turn 2: exact 50.0%" in report.format()
    assert report.providers["KeepsReasoning"].to_dict()["prompt_by_turn"]["3"]["share_exact"] == 0.0
    # A single-turn dataset's report has none.
    assert make_report_single(tmp_path).prompt_by_turn == ()


def make_report_single(tmp_path: Path) -> Any:
    config = make_config(tmp_path / "single")
    write_responses(config, "A", [response(i) for i in range(3)])
    return reconstruct_dataset(config, "A", workers=1)


def test_a_batch_comes_back_with_its_report_and_its_index_lines_encoded(tmp_path: Path) -> None:
    """A worker's batch (reconstruct_batch) carries its answers' report, judged by the config's sample
    policy, and their index metadata already JSON: the main process merges one report a batch and writes
    the lines without decoding them. The report is the one the index lines give, answer by answer, and the
    files are byte for byte those of the same answers appended one by one."""
    from draftgen.core.tokens.report import ValidationReport
    from draftgen.core.tokens.store import TokenWriter
    from draftgen.core.tokens.workers import _init_worker, each_sample, reconstruct_batch, worker_spec
    raw: dict[str, Any] = {"tokenizer": {"path": str(bundled_kimi_path()), "template": "kimi-k2.5"},
                           "output": {"dir": "run"}, "merge": {"exclude_providers": ["Other"]},
                           "datasets": [{"name": "A", "prompts": "A.jsonl"}]}
    config = config_from_dict(raw, tmp_path / "draftgen.toml")
    records = [response(i) for i in range(6)]
    records[1]["provider"] = "Other"                                     # dropped by the policy
    records[2]["usage"] = {**records[2]["usage"], "completion_tokens": 3}  # a count that differs
    records[3]["messages"] = "not a list"                                # nothing to render
    records[4]["turn"] = 2
    _init_worker(worker_spec(config))
    results = reconstruct_batch([answer_fields(r) for r in records])
    ids, masks, samples, report = results
    assert [rid for rid, _, _ in samples] == [f"p{i}" for i in range(6)]
    by_lines = ValidationReport("", policy=report.policy)
    with TokenWriter(tmp_path / "batch") as batch, TokenWriter(tmp_path / "one_by_one") as one:
        batch.append_encoded(ids, masks, samples)
        for rid, sample_ids, mask, meta in each_sample(results):
            one.append(rid, sample_ids, mask, meta)
            by_lines.add_meta(meta)
    for name in ("input_ids.bin", "loss_mask.bin", "index.jsonl"):
        assert (tmp_path / "batch" / name).read_bytes() == (tmp_path / "one_by_one" / name).read_bytes(), name
    assert report.to_dict() == by_lines.to_dict()
    assert report.checked == 6 and report.dropped.get("provider_excluded") == 1 and report.valid < 6
