"""What the last smoke test left in smoke.json that a run reads before its first request: its
answer's figures (for the projection) and which datasets' request shapes got a priced answer. Read
by the run's opening; written by the smoke test (commands/smoke.py)."""

from __future__ import annotations

from typing import Any

import orjson

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
