"""The lines draftgen writes, byte for byte: a responses.jsonl line (every optional key), a failures.jsonl
line and each kind of spend-ledger line, written through the real writers (`ResponseRecord.line`,
`FailureRecord`, `SpendLedger`, `JsonlAppender`) at a fixed clock and compared with the golden lines
checked in under tests/golden/. The typed shapes (records.py, ledger_lines.py) must not change a byte
of what is on disk: a run's files are read back by older and newer versions alike."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import orjson
import pytest

from draftgen.core.generate.money import spend as spend_module
from draftgen.core.generate.money import spend_sums
from draftgen.core.generate.money.spend import CostSource, SpendLedger
from draftgen.core.records import ErrorKind, FailureRecord, ResponseRecord, TurnFields, Usage
from draftgen.core.rundir import JsonlAppender

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
NOW = 1_765_000_000.125


@pytest.fixture
def fixed_clock(monkeypatch):
    monkeypatch.setattr(time, "time", lambda: NOW)
    monkeypatch.setattr(spend_sums.os, "getpid", lambda: 0x1234)


def test_records_lines_are_the_golden_ones(tmp_path, fixed_clock):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo \u2028 \"q\""}]
    calls = [{"id": "c1", "type": "function", "function": {"name": "find", "arguments": "{\"q\": 1}"}}]
    agent = TurnFields("conv-1", 2, 3, "0123456789abcdef", agent=True, tools=[{"type": "function"}],
                       tool_results="matched")
    plain = ResponseRecord.line(
        "p1", messages, None, "hi", None, "stop", "stop", "Together", "moonshotai/kimi-k2.5", "gen-1",
        Usage(12, 3, 0, 0.000125), 0.25, 1, False, False, NOW, None, None, None, None)
    full = ResponseRecord.line(
        "conv-1#t2", messages, "thinking", "", calls, "tool_calls", None, None, "moonshotai/kimi-k2.5-0127", None,
        Usage(7, 9, 4, 1e-07), 1.5, 3, False, True, NOW, [1, 2, 3], [9, 8], agent, [{"type": "reasoning.text"}])
    full["sampling"] = {"temperature": 0.6, "reasoning_effort": None}
    full["server"] = "http://127.0.0.1:8000/v1"
    full["diverged"] = True
    turn = TurnFields("conv-2", 1, 2, "fedcba9876543210")
    out = JsonlAppender(tmp_path / "responses.jsonl")
    for line in (plain, full, ResponseRecord.from_dict(full).to_dict() | {"sampling": full["sampling"],
                                                                          "server": full["server"],
                                                                          "diverged": True}):
        out.append(line)
    out.close()
    failures = JsonlAppender(tmp_path / "failures.jsonl")
    failures.append(FailureRecord("p2", messages, ErrorKind.CONTEXT_LENGTH, 400, "too long", 2, NOW).to_dict())
    failures.append(FailureRecord("conv-2#t1", messages, ErrorKind.TIMEOUT, None, "timed out", 5, NOW,
                                  turn=turn).to_dict())
    failures.close()
    assert (tmp_path / "responses.jsonl").read_bytes() == (GOLDEN / "responses.jsonl").read_bytes()
    assert (tmp_path / "failures.jsonl").read_bytes() == (GOLDEN / "failures.jsonl").read_bytes()


async def test_ledger_lines_are_the_golden_ones(tmp_path, fixed_clock):
    path = tmp_path / "spend.jsonl"
    ledger = SpendLedger(path)
    ledger.open()
    ledger.set_key_baseline(12.5)
    ledger.carry("a", 0.25, 3)
    ledger.carry("b", 0.5)
    ledger.found("a", 2, 0.125)
    ledger.prices_checked("a", "fp01", 6e-07, 2.5e-06, 0.0)
    answered, unpriced, refused, abandoned, lost, run_past = (ledger.reserve("a", f"p{i}", 0.01) for i in range(6))
    for t in (answered, unpriced, refused, abandoned, lost, run_past):
        ledger.send(t)
    ledger.generation(answered, "gen-a")            # with its end line (the same tick)
    ledger.answered(answered, 0.002)
    ledger.generation(unpriced, "gen-u")
    p_unpriced = ledger.answered_unpriced(unpriced, 0.004)
    ledger.refused(refused)
    ledger.generation(abandoned, "gen-x")
    await asyncio.sleep(0)                          # the tick's write: a gen line of its own
    p_abandoned = ledger.abandoned(abandoned, status=502)
    p_lost = ledger.abandoned(lost)                 # no generation id: "t", priced from the key's usage
    p_past = ledger.abandoned(run_past, at_least=0.05)
    assert p_unpriced and p_abandoned and p_lost and p_past
    ledger.settle(p_unpriced, 0.003)
    ledger.settle(p_abandoned, 0.0, CostSource.NO_RECORD)
    ledger.settle(p_lost, 0.001, CostSource.KEY_USAGE)
    ledger.settle(p_past, 0.04, CostSource.ESTIMATE)
    t = ledger.reserve("b", "q1", 0.02)             # inside the event loop: the tick's lines in one write
    await ledger.send_grouped(t)
    ledger.generation(t, "gen-b")
    ledger.answered(t, 0.001, CostSource.ESTIMATE)
    ledger.close()
    assert path.read_bytes() == (GOLDEN / "spend.jsonl").read_bytes()
    again = SpendLedger.read(path, answer_costs=True)  # and read back as before
    assert (round(again.settled_usd, 9), again.pending_usd, again.key_baseline) == (0.922, 0.0, 12.5)
    assert again.answer_costs == {"a": {"p0": 0.002, "p1": 0.003}, "b": {"q1": 0.001}}


def test_spend_module_documents_every_kind_written():
    golden = (GOLDEN / "spend.jsonl").read_bytes().splitlines()
    written = {line.split(b'"e":"')[1].split(b'"')[0].decode() for line in golden}
    assert written == {"key", "carry", "found", "prices", "sent", "gen", "end", "settle"}
    assert all(f'{{"e":"{kind}"' in (spend_module.__doc__ or "") for kind in written)


def test_an_end_or_settle_line_that_will_not_convert_leaves_its_attempt_at_worst_case(tmp_path):
    """A hand-edited end or settle line whose cost is not a number counts as nothing (ledger_lines.py `checked`):
    its attempt stays open, pending at its reservation, rather than dropped from the sums (it counted $0)."""
    path = tmp_path / "spend.jsonl"
    sent = [{"e": "sent", "a": a, "ds": "a", "p": a, "w": 0.5, "t": NOW} for a in ("x", "y")]
    odd = [{"e": "end", "a": "x", "o": "answered", "c": "n/a", "s": "usage.cost"},
           {"e": "end", "a": "y", "o": "abandoned", "c": None, "s": "pending"},
           {"e": "settle", "a": "y", "c": [1], "s": "generation"}]
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in sent + odd))
    ledger = SpendLedger.read(path)
    assert sorted(ledger.pending) == ["x", "y"] and ledger.pending_usd == 1.0 and ledger.settled_usd == 0.0


def test_a_sent_line_with_an_odd_time_still_counts_its_attempt(tmp_path):
    """A hand-edited `sent` line whose `t` is not a number: its attempt, left open, is pending at its reservation
    (its `t` read as 0.0, as when absent), not dropped from the sums with the line."""
    path = tmp_path / "spend.jsonl"
    path.write_bytes(orjson.dumps({"e": "sent", "a": "x", "ds": "a", "p": "x", "w": 0.5, "t": "soon"}) + b"\n")
    ledger = SpendLedger.read(path)
    assert list(ledger.pending) == ["x"] and ledger.pending_usd == 0.5


@pytest.mark.parametrize("w", ["nan", -5, "1e400"])
def test_a_sent_line_with_a_reservation_no_attempt_has_counts_at_the_most_one_can(tmp_path, w):
    """A hand-edited `sent` reservation that is NaN, negative or infinite counts as `MAX_ATTEMPT_USD`: a NaN
    pending sum made every `max_usd` check pass, a negative one gave its dollars back."""
    path = tmp_path / "spend.jsonl"
    path.write_bytes(orjson.dumps({"e": "sent", "a": "x", "ds": "a", "p": "x", "w": w, "t": NOW}) + b"\n")
    ledger = SpendLedger.read(path)
    assert ledger.pending_usd == spend_module.MAX_ATTEMPT_USD
