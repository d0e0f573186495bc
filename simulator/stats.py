"""Counters of what the simulator served, for tests and the soak check.

Per-prompt counts are keyed by `prompt_key(messages)`: the sha1 of the request's `messages`
serialised by orjson (compact, keys in the order sent), so a test can compute the key of a
prompt it sent and look up how often it was asked, answered and billed.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

import orjson


def prompt_key(messages: Any) -> str:
    """The identity of a prompt: sha1 hex of its `messages` as compact JSON."""
    return hashlib.sha1(orjson.dumps(messages)).hexdigest()


@dataclass(frozen=True)
class Sent:
    """One chat request as the simulator received it (kept with `SimConfig.sent_log_size`)."""
    seq: int              # the chat request's number, from 1
    messages: Any         # the body's `messages`, as sent
    prompt_tokens: int    # usage.prompt_tokens it counted (0: refused before the prompt was counted)
    tools: Any = None     # the body's `tools`, as sent (None when it sent none)

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "messages": self.messages, "prompt_tokens": self.prompt_tokens, "tools": self.tools}


@dataclass
class SimStats:
    """What the simulator served. `in_flight` counts chat requests whose handler is running: at
    latency 0 each finishes within one turn of the event loop, so measure concurrency with a
    latency (e.g. `fixed_latency_s=2.0`)."""

    requests_total: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    # HTTP status sent per request, as a string; "drop" and "hang" where none was sent.
    by_status: dict[str, int] = field(default_factory=dict)
    # Injected, by kind (config.FAULT_KINDS), plus "max_in_flight": 429s of the concurrency limit.
    faults: dict[str, int] = field(default_factory=dict)
    answers_total: int = 0  # HTTP 200 with an answer (finish_reason stop or length)
    answers_by_provider: dict[str, int] = field(default_factory=dict)
    finish_reasons: dict[str, int] = field(default_factory=dict)
    completion_tokens_total: int = 0  # billed completion tokens
    billed_usd: float = 0.0  # every charge, read or not (see generations.py)
    generations_billed: int = 0  # answers, requests the client gave up on, cancelled streams
    generations_running: int = 0  # started and not yet billed (billed later even if nobody listens)
    cancelled_total: int = 0  # streams aborted mid-generation, billed up to the cancel
    # Responses sent by a scenario, by name (see scenarios.py).
    scenarios: dict[str, int] = field(default_factory=dict)
    prompt_requests: dict[str, int] = field(default_factory=dict)
    prompt_answers: dict[str, int] = field(default_factory=dict)  # generations billed, per prompt
    prompt_cost: dict[str, float] = field(default_factory=dict)

    def copy(self) -> SimStats:
        out = copy.copy(self)
        for f in dataclasses.fields(self):
            if isinstance(v := getattr(self, f.name), dict):
                setattr(out, f.name, dict(v))
        return out

    def to_json(self, *, prompts: bool = True) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if not prompts:
            for name in ("prompt_requests", "prompt_answers", "prompt_cost"):
                out.pop(name)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SimStats:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
