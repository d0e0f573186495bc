"""Turn records as a turns = "all" dataset's responses.jsonl holds them (core/records.py), made from a
list of turns, for the tests of reconstruction, merge and SpecForge's reader.

Each turn k of conversation C is one record: `id` "C#tk", `conversation`, `turn`, `turns`,
`prompt_hash` (blake2b-16 of the system and user texts 1..k), `messages` = the system turn, the user
turns 1..k and the target's OWN earlier answers between them, sent back as each API documents:
"openrouter" (`reasoning_details` passed back as returned), "openrouter_text" (`reasoning`) or
"self_hosted" (`reasoning_content`). `usage.prompt_tokens` is the simulator's count of the rendered
prompt (simulator/prompt.py, a rendering written apart from draftgen's), `completion_tokens` the
answer's tokens, so a record reconstructs clean unless a test spoils it.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from draftgen.simulator.answers import answer_tokenizer
from draftgen.simulator.prompt import prompt_token_count

HISTORY_STYLES = ("openrouter", "openrouter_text", "self_hosted")


@dataclass(frozen=True)
class Turn:
    user: str
    reasoning: str = "Thinking it over."
    content: str = "An answer."
    finish_reason: str = "stop"
    provider: str | None = "Together"


def fingerprint(system: list[dict[str, Any]], users: list[str]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for m in system:
        h.update(orjson.dumps(["system", m.get("content")]))
    for u in users:
        h.update(orjson.dumps(["user", u]))
    return h.hexdigest()


def history_message(turn: Turn, style: str) -> dict[str, Any]:
    """The target's own answer to `turn` as the next request carries it back."""
    m: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if style == "openrouter":
        m["reasoning_details"] = [{"type": "reasoning.text", "text": turn.reasoning, "format": "unknown", "index": 0}]
    elif style == "openrouter_text":
        m["reasoning"] = turn.reasoning
    elif style == "self_hosted":
        m["reasoning_content"] = turn.reasoning
    else:
        raise ValueError(f"history style {style!r} (known: {HISTORY_STYLES})")
    return m


def answer_tokens(turn: Turn) -> int:
    """The answer span's tokens: reasoning, `</think>`, content, `<|im_end|>`."""
    tok = answer_tokenizer()
    return len(tok.encode_text(turn.reasoning)) + 1 + len(tok.encode_text(turn.content)) + 1


def conversation_records(cid: str, turns: list[Turn], *, system: str | None = None, style: str = "openrouter",
                         max_turns: int | None = None) -> list[dict[str, Any]]:
    """One record per turn of `turns` (all answered), in the order they are asked."""
    sys_msgs = [{"role": "system", "content": system}] if system is not None else []
    total = len(turns) if max_turns is None else min(max_turns, len(turns))
    records = []
    messages: list[dict[str, Any]] = list(sys_msgs)
    for k, t in enumerate(turns[:total], 1):
        messages = [*messages, {"role": "user", "content": t.user}]
        usage = {"prompt_tokens": prompt_token_count(answer_tokenizer(), messages),
                 "completion_tokens": answer_tokens(t), "reasoning_tokens": 0, "cost": 0.001 * k}
        records.append({
            "id": f"{cid}#t{k}", "conversation": cid, "turn": k, "turns": total,
            "prompt_hash": fingerprint(sys_msgs, [x.user for x in turns[:k]]),
            "messages": messages, "reasoning": t.reasoning, "content": t.content, "tool_calls": None,
            "reasoning_details": [{"type": "reasoning.text", "text": t.reasoning, "format": "unknown", "index": 0}],
            "finish_reason": t.finish_reason, "native_finish_reason": t.finish_reason, "provider": t.provider,
            "model": "moonshotai/kimi-k2.5", "generation_id": f"gen-{cid}-{k}", "usage": usage, "latency_s": 0.1,
            "attempts": 1, "truncated": t.finish_reason == "length", "empty_content": not t.content,
            "sampling": {"temperature": None, "reasoning_effort": None}, "ts": time.time()})
        messages = [*messages, history_message(t, style)]
    return records


def three_turns(tag: str = "") -> list[Turn]:
    """A 3-turn conversation with distinct texts (and a look-alike of no special token)."""
    return [Turn(f"Name a prime{tag}.", "Two is the smallest prime.", f"2{tag}"),
            Turn(f"And the next one{tag}?", "After 2 comes 3.", f"3, then 5{tag}."),
            Turn(f"Sum them{tag}.", "2 + 3 = 5; with 5 it is 10.", f"10{tag}")]


def write_records(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        for r in records:
            f.write(orjson.dumps(r) + b"\n")
    return path


def failure_record(cid: str, turn: int, turns: int, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A failures.jsonl line of a turn that failed for good."""
    return {"id": f"{cid}#t{turn}", "conversation": cid, "turn": turn, "turns": turns, "messages": messages,
            "error_kind": "400", "status": 400, "message": "bad request", "attempts": 1, "ts": time.time()}


def leaked(turns: list[Turn], k: int) -> list[Turn]:
    """`turns` with turn k's answer holding a `<think>` typed as text: reconstruction marks it invalid."""
    t = turns[k - 1]
    return [*turns[:k - 1], Turn(t.user, t.reasoning, "<think>oops " + t.content, t.finish_reason, t.provider),
            *turns[k:]]


def multi_turn_run(tmp_path: Path, *, merge: dict[str, Any] | None = None, style: str = "openrouter",
                   system: str | None = "Be brief.", tables: dict[str, Any] | None = None
                   ) -> tuple[Any, dict[str, list[dict[str, Any]]]]:
    """A run directory with dataset "M" of four 3-turn conversations, reconstructed with the real Kimi
    tokenizer: c1 all good; c2's turn 2 invalid (a leaked `<think>`), its turn 3 written BEFORE turn 2
    (order on disk must not matter); c3 all good; c4's turn 2 failed for good (no turn 3).
    `tables`: more config tables (e.g. [extract]). Returns the config and each conversation's records."""
    from draftgen.core.config_load import config_from_dict
    from draftgen.core.tokens.tokenizer import bundled_kimi_path
    from draftgen.core.tokens.workers import reconstruct_dataset
    raw = {"output": {"dir": "run"}, "tokenizer": {"path": str(bundled_kimi_path())},
           "datasets": [{"name": "M", "prompts": "M.jsonl"}], **({"merge": merge} if merge else {}), **(tables or {})}
    config = config_from_dict(raw, tmp_path / "draftgen.toml")
    convs = {"c1": conversation_records("c1", three_turns(" one"), system=system, style=style),
             "c2": conversation_records("c2", leaked(three_turns(" two"), 2), system=system, style=style),
             "c3": conversation_records("c3", three_turns(" three"), system=system, style=style),
             "c4": conversation_records("c4", three_turns(" four"), system=system, style=style)[:1]}
    folder = config.run_dir / "M"
    c2 = convs["c2"]
    write_records(folder / "responses.jsonl",
                  [*convs["c1"], c2[0], convs["c3"][0], c2[2], convs["c4"][0], c2[1], *convs["c3"][1:]])
    four = three_turns(" four")
    turn2 = [*convs["c4"][0]["messages"], history_message(four[0], style), {"role": "user", "content": four[1].user}]
    write_records(folder / "failures.jsonl", [failure_record("c4", 2, 3, turn2)])
    report = reconstruct_dataset(config, "M", workers=1)
    assert report.checked == 10
    return config, convs
