"""What the last smoke test left in smoke.json that a run reads before its first request: its
answer's figures (for the projection), which datasets' request shapes got a priced answer, and the
mode (streamed or not) that keeps a self-hosted server's text as generated. Read by the run's
opening; written by the smoke test (commands/smoke.py)."""

from __future__ import annotations

from typing import Any

import orjson

from draftgen.core.config import Config
from draftgen.core.generate.money.forecast import SmokeFigures
from draftgen.core.rundir import RunDir


def last_smoke(rd: RunDir, fingerprint: str, key: str) -> Any:
    """`key` of smoke.json when its last smoke test was of these request shapes (else None)."""
    try:
        data = orjson.loads(rd.smoke_json.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return data.get(key) if isinstance(data, dict) and data.get("fingerprint") == fingerprint else None


def load_smoke_answer(rd: RunDir, fingerprint: str) -> SmokeFigures | None:
    """The smoke answer of the last passing smoke test of these request shapes, for the projection."""
    raw = last_smoke(rd, fingerprint, "smoke_answer")
    try:
        return None if not isinstance(raw, dict) else SmokeFigures(
            int(raw["completion_tokens"]), float(raw["cost_usd"]), float(raw["latency_s"]))
    except (KeyError, TypeError, ValueError):
        return None


def load_smoke_answered(rd: RunDir, fingerprint: str) -> frozenset[str]:
    """The datasets whose request shape the last smoke test of these shapes got a priced answer for."""
    answered = last_smoke(rd, fingerprint, "cost_per_request")
    return frozenset(str(name) for name in answered) if isinstance(answered, dict) else frozenset()


def load_smoke_stream(rd: RunDir, fingerprint: str) -> bool | None:
    """The streaming mode the last smoke test of these shapes decided for a self-hosted server whose
    `[api] stream` is unset (None: it decided nothing, e.g. the comparison could not be made)."""
    decided = last_smoke(rd, fingerprint, "stream")
    return decided if isinstance(decided, bool) else None


def apply_smoke_stream(config: Config, rd: RunDir) -> bool | None:
    """Note the mode smoke.json records for this config's shapes, so the run's bodies use it (an explicit
    `[api] stream` wins: `ApiConfig.streams`); returns it."""
    decided = load_smoke_stream(rd, config.run_fingerprint())
    if decided is not None:
        config.api.server.note_stream(decided)
    return decided
