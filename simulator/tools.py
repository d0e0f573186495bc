"""The simulator's tool calls: a request that sends `tools` may be answered with calls, as an agent model
answers (Kimi-K2.5 emits its reasoning, then the calls; `finish_reason` "tool_calls", `content` "").

Deterministic and independent of the seed: what a request is answered with depends only on its task
(the text of its first user message), the names of the tools it sends and its step (how many
assistant messages its `messages` already hold). `plan(task, names)` gives every round of calls the
simulator makes for a task; round r is the answer at step r + 1, and the step after the last round is a
plain answer. A task holding "tool rounds: N" makes N rounds; any other makes 0 to 2 (from a hash of the
task). A round calls one tool, or two at once (parallel calls) about one round in four; each call names
one of the tools sent and carries arguments of its own (`{"query": ..., "round": r + 1}`).

So a test (or the demo) builds an agent dataset whose recorded calls match what the simulator will call
by writing `plan(task, names)` as its assistant messages' `tool_calls`, or one that diverges by changing
one of them; `planned_calls(messages, tools)` says what one request is answered with.

A call's id has Kimi's own shape, `functions.NAME:IDX`, IDX counting the calls of the conversation from 0
(the calls of the earlier assistant messages sent, then this answer's).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import orjson

from draftgen.simulator.answers import AnswerTokenizer

_ROUNDS = re.compile(r"tool rounds: (\d+)")
MAX_ROUNDS = 8  # a task's "tool rounds: N" at most


def tool_names(tools: Any) -> list[str]:
    """The function names of a request's `tools` (those of the OpenAI shape), in order."""
    if not isinstance(tools, list):
        return []
    return [t["function"]["name"] for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) and t["function"]["name"]]


def plan(task: str, names: list[str]) -> list[list[tuple[str, dict[str, Any]]]]:
    """Every round of calls the simulator makes for `task` with tools named `names` ([] with no tools)."""
    if not names:
        return []
    digest = hashlib.blake2b(orjson.dumps([task, names]), digest_size=32).digest()
    said = _ROUNDS.search(task)
    rounds = min(int(said.group(1)), MAX_ROUNDS) if said else digest[0] % 3
    out = []
    for r in range(rounds):
        parallel = digest[1 + r] % 4 == 0
        calls = []
        for i in range(2 if parallel else 1):
            name = names[digest[10 + 2 * r + i] % len(names)]
            calls.append((name, {"query": f"{task[:40]} #{digest[20 + r] % 97}.{i}", "round": r + 1}))
        out.append(calls)
    return out


def _task(messages: list[Any]) -> str:
    first = next((m for m in messages if isinstance(m, dict) and m.get("role") == "user"), None)
    content = first.get("content") if first is not None else None
    return content if isinstance(content, str) else ""


def planned_calls(messages: Any, tools: Any) -> list[tuple[str, dict[str, Any]]]:
    """The calls (name, arguments) a request with these `messages` and `tools` is answered with ([]: a plain
    answer)."""
    if not isinstance(messages, list):
        return []
    step = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
    rounds = plan(_task(messages), tool_names(tools))
    return rounds[step] if step < len(rounds) else []


def tool_calls(messages: Any, tools: Any) -> list[dict[str, Any]]:
    """The answer's `tool_calls` as the API returns them (ids `functions.NAME:IDX`), [] for a plain answer."""
    calls = planned_calls(messages, tools)
    if not calls:
        return []
    before = sum(len(m.get("tool_calls") or ()) for m in messages
                 if isinstance(m, dict) and m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list))
    return [{"id": f"functions.{name}:{before + i}", "type": "function",
             "function": {"name": name, "arguments": orjson.dumps(args).decode()}}
            for i, (name, args) in enumerate(calls)]


def calls_ids(tok: AnswerTokenizer, calls: list[dict[str, Any]]) -> list[int]:
    """The token ids of the calls as Kimi-K2.5 generates them (after its `</think>`): the tool-calls section's
    begin and end, and for each call its begin, id, argument begin, arguments and end (as simulator/prompt.py
    counts a call in a history)."""
    sid = tok.special_id
    ids = [sid("<|tool_calls_section_begin|>")]
    for c in calls:
        ids += [sid("<|tool_call_begin|>"), *tok.encode_text(c["id"]), sid("<|tool_call_argument_begin|>"),
                *tok.encode_text(c["function"]["arguments"]), sid("<|tool_call_end|>")]
    ids.append(sid("<|tool_calls_section_end|>"))
    return ids
