"""Turns of multi-turn conversations in a merge (`[merge] multi_turn`).

A turns = "all" dataset writes one responses.jsonl line per turn (`conversation`, `turn`: core/records.py);
turn k's messages hold the target's own answers to turns 1..k-1. Those lines are judged like any
answer (core/merge/select.py `_drop_reason`), then held here until the dataset is read, and resolved
per conversation, whatever order the lines came in:

- a turn dropped for a broken answer (`BREAKING`: truncated, empty, invalid, or another model's)
  drops every later turn of its conversation (`after_invalid_turn`): they were conditioned on that
  answer, which is not the target's. Other drops
  (a count or prompt difference, an excluded provider, a duplicate) are the turn's own;
- "per_turn" (the default): every other turn is a sample of its own, one per generation event: its
  history and its answer, loss on that answer (the token store's ids and mask as they are);
- "per_conversation": one sample per conversation: the longest run of good turns from turn 1 ends
  at turn m, and turn m's ids (its history renders the earlier answers without their reasoning, as
  at serving time) get every earlier assistant turn (`TokenRef.history`, from `<think>` through
  `<|im_end|>`) added to the loss mask. Turns 1..m-1 are counted `in_conversation` (their answers
  are in that sample), good turns after a dropped one `after_dropped_turn`. A turn whose history
  positions are unknown (the server's prompt ids differed from the rendering) cannot end a run
  (counted `prompt_mismatch`). A sample that is a duplicate (core/dedupe.py `prompt_key` of its last
  turn's messages, as for any sample) takes its conversation's turns with it (`duplicate`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from draftgen.core.merge.inputs import TokenRef

MODES = ("per_turn", "per_conversation")
BREAKING = frozenset({"truncated", "empty", "invalid", "other_model"})
TURN_REASONS = ("after_invalid_turn", "after_dropped_turn", "in_conversation")


@dataclass(slots=True)
class PendingTurn:
    """One turn line, judged, waiting for its conversation to be resolved."""
    offset: int
    length: int
    conversation: str
    turn: int
    reason: str | None          # its own drop reason (None: good)
    ref: TokenRef | None
    notes: tuple[str, ...]
    sample_id: str
    key: bytes                  # core/dedupe.py prompt_key of its messages (b"" when dropped)
    cost: float
    tools: bool
    history: tuple[tuple[int, int], ...] | None = None  # set on the turn that ends a per_conversation sample
    diverged: bool = False      # an agent step whose answer was not the dataset's next move (its record's flag)
    replayed: bool = False      # an agent step sent with a replayed tool result (`tool_results` "replayed")


def turn_of(record: Mapping[str, Any]) -> tuple[str, int] | None:
    """(conversation, turn) of a multi-turn record; None for a single-turn one."""
    conversation, turn = record.get("conversation"), record.get("turn")
    if isinstance(conversation, str) and isinstance(turn, int) and not isinstance(turn, bool) and turn >= 1:
        return conversation, turn
    return None


def _by_conversation(pending: list[PendingTurn]) -> dict[str, list[PendingTurn]]:
    out: dict[str, list[PendingTurn]] = {}
    for p in pending:
        out.setdefault(p.conversation, []).append(p)
    for turns in out.values():
        turns.sort(key=lambda p: p.turn)
    return out


def resolve(pending: list[PendingTurn], mode: str) -> None:
    """Set each turn's final reason (and, per conversation, the sample's history spans) in place."""
    for turns in _by_conversation(pending).values():
        broken = min((p.turn for p in turns if p.reason in BREAKING), default=None)
        for p in turns:
            if broken is not None and p.turn > broken:
                p.reason = "after_invalid_turn"
        if mode == "per_conversation":
            _one_sample(turns)


def _one_sample(turns: list[PendingTurn]) -> None:
    """The conversation's sample: the last turn of the longest run of good turns from turn 1."""
    end: PendingTurn | None = None
    expected = 1
    for p in turns:
        if p.turn != expected or p.reason is not None:
            break
        if p.ref is None or len(p.ref.history) != p.turn - 1:  # where its history sits is not known
            p.reason = "prompt_mismatch"
            break
        end, expected = p, expected + 1
    for p in turns:
        if end is not None and p.turn < end.turn:
            p.reason = "in_conversation"
        elif p.reason is None and p is not end:
            p.reason = "after_dropped_turn"
    if end is not None:
        end.history = end.ref.history if end.ref is not None else ()


# Agent steps' figures a turn row carries when any of its lines has them: read lines whose answer diverged
# from the dataset (the conversation ended there), and lines sent with a replayed tool result.
AGENT_FLAGS = ("diverged", "replayed")


def count_turn(by_turn: dict[str, dict[str, Any]], turn: int, reason: str | None, *, diverged: bool = False,
               replayed: bool = False) -> None:
    """Count one turn line under its turn number: read, and kept or dropped by `reason`; an agent step's
    `diverged` and `replayed` lines too (the keys only in rows that have them)."""
    row = by_turn.setdefault(str(turn), {"read": 0, "kept": 0, "dropped": {}})
    row["read"] += 1
    if reason is None:
        row["kept"] += 1
    else:
        row["dropped"][reason] = row["dropped"].get(reason, 0) + 1
    for flag, on in zip(AGENT_FLAGS, (diverged, replayed), strict=True):
        if on:
            row[flag] = row.get(flag, 0) + 1


def add_turns(total: dict[str, dict[str, Any]], by_turn: Mapping[str, Mapping[str, Any]]) -> None:
    for k, row in by_turn.items():
        mine = total.setdefault(k, {"read": 0, "kept": 0, "dropped": {}})
        mine["read"] += row["read"]
        mine["kept"] += row["kept"]
        for reason, n in row["dropped"].items():
            mine["dropped"][reason] = mine["dropped"].get(reason, 0) + n
        for flag in AGENT_FLAGS:
            if row.get(flag):
                mine[flag] = mine.get(flag, 0) + row[flag]


def sorted_turns(by_turn: Mapping[str, Any]) -> dict[str, Any]:
    return {k: by_turn[k] for k in sorted(by_turn, key=int)}
