"""What the drill-down views read: the recent failed attempts by kind, dataset and provider, and each
provider's answers, errors and latency.

With 2,000 requests in flight a 429 storm produces hundreds of errors a second, so the cost per
error is three deque appends of one shared record, and the snapshot's tuple is rebuilt only when
something was added. Each ring is bounded (`per_key` records for each kind, each dataset and each
provider), so a storm of one kind never pushes a rare kind out of view, and memory stays flat.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, deque
from collections.abc import Callable
from operator import itemgetter

from draftgen.core.live.snapshot import ErrorRecord, ProviderStat
from draftgen.core.safe_text import visible

ERROR_MESSAGE_MAX = 300
LATENCY_SAMPLES = 256   # per provider: the recent answers its percentile is taken over


class RecentErrors:
    def __init__(self, per_key: int = 8, clock: Callable[[], float] = time.time,
                 providers: ProviderStats | None = None) -> None:
        self.per_key = per_key
        self.providers = providers
        self._clock = clock
        self._rings: dict[tuple[str, str], deque[ErrorRecord]] = {}
        self._version = 0
        self._built: tuple[int, tuple[ErrorRecord, ...]] = (0, ())

    def add(self, *, kind: str, dataset: str, prompt_id: str, attempt: int, message: str,
            status: int | None = None, provider: str = "", final: bool = False) -> None:
        if len(message) > ERROR_MESSAGE_MAX:
            message = message[:ERROR_MESSAGE_MAX - 1] + "…"
        # The message and provider come redacted (core/secrets.py: safe for a terminal); the prompt id is
        # the prompt file's, kept exact in the records, shown with its control characters escaped.
        record = ErrorRecord(ts=round(self._clock(), 3), kind=kind, dataset=dataset,
                             prompt_id=visible(str(prompt_id)), attempt=attempt, message=message, status=status,
                             provider=provider or "", final=final)
        for key in (("kind", kind), ("dataset", dataset), ("provider", provider or "")):
            ring = self._rings.get(key)
            if ring is None:
                ring = self._rings[key] = deque(maxlen=self.per_key)
            ring.append(record)
        if provider and self.providers is not None:
            self.providers.error(provider, kind)
        self._version += 1

    def mark_final(self, dataset: str, prompt_id: str) -> None:
        """The prompt failed for good with its last recorded attempt."""
        ring = self._rings.get(("dataset", dataset), ())
        last = next((r for r in reversed(ring) if r.prompt_id == prompt_id), None)
        if last is None:
            return
        marked = dataclasses.replace(last, final=True)
        for ring in self._rings.values():  # the same record sits in its kind's, dataset's and provider's rings
            for i, r in enumerate(ring):
                if r is last:
                    ring[i] = marked
        self._version += 1

    def records(self) -> tuple[ErrorRecord, ...]:
        """Every record still in some ring, oldest first (rebuilt only after an add)."""
        version, built = self._built
        if version != self._version:
            seen: dict[int, ErrorRecord] = {}
            for ring in self._rings.values():
                for r in ring:
                    seen[id(r)] = r
            built = tuple(sorted(seen.values(), key=lambda r: r.ts))
            self._built = (self._version, built)
        return built


class _Provider:
    """One provider's tallies (one object per provider: an answer updates it with one lookup)."""

    __slots__ = ("answers", "errors", "tokens", "latency_sum", "latency", "outcomes", "failing", "bad")

    def __init__(self) -> None:
        self.answers = 0
        self.errors = 0
        self.tokens = 0
        self.latency_sum = 0.0
        self.latency: deque[float] = deque(maxlen=LATENCY_SAMPLES)  # the recent latencies (p90)
        self.outcomes: deque[str] = deque(maxlen=HEALTH_WINDOW)  # its last attempts: "" answered, else the error
        self.failing = 0   # of them, errors
        self.bad = False   # said gone bad, not said back yet


# A provider goes bad when at least half of its last HEALTH_WINDOW attempts (HEALTH_WINDOW // 2 at least)
# failed, and is back once fewer than a fifth of them do: one line each way, not one per error.
HEALTH_WINDOW = 20
BAD_SHARE = 0.5
BACK_SHARE = 0.2


class ProviderStats:
    """Answers, attributed errors, completion tokens and latency per provider; `on_health(bad, message)`
    hears a provider going bad (with the errors that made it so) and coming back."""

    def __init__(self, on_health: Callable[[bool, str], None] | None = None) -> None:
        self._on_health = on_health
        self._by: dict[str, _Provider] = {}
        self._answered: list[str] = []  # providers in the order of their first answer (answer_counts' ties)
        self._version = 0
        self._built: tuple[int, tuple[ProviderStat, ...]] = (0, ())
        # A fleet's servers, (name, why it is out or "") each in the order listed (api/fleet.py); None: no fleet.
        self.servers: Callable[[], tuple[tuple[str, str], ...]] | None = None
        # A fleet's servers' adaptive limits: name -> (now, configured) (api/fleet.py); None: no fleet.
        self.server_limits: Callable[[], dict[str, tuple[int, int]]] | None = None

    def _of(self, provider: str) -> _Provider:
        p = self._by[provider] = _Provider()
        return p

    def answer(self, provider: str, latency_s: float, completion_tokens: int) -> None:
        p = self._by.get(provider) or self._of(provider)
        if not p.answers:
            self._answered.append(provider)
        p.answers += 1
        p.tokens += completion_tokens
        p.latency_sum += latency_s
        p.latency.append(latency_s)
        self._version += 1
        if self._on_health is not None:
            if p.failing or p.bad:
                self._health(provider, p, "")
            else:  # _health's work when none of its last attempts failed (nearly always): one more answered
                p.outcomes.append("")

    def answer_counts(self) -> tuple[tuple[str, int], ...]:
        """Answers per provider, most first (ties in the order first answered): RunSnapshot.providers."""
        by = self._by
        return tuple(sorted(((name, by[name].answers) for name in self._answered), key=itemgetter(1), reverse=True))

    def error(self, provider: str, kind: str = "error") -> None:
        p = self._by.get(provider) or self._of(provider)
        p.errors += 1
        self._version += 1
        if self._on_health is not None:
            self._health(provider, p, kind)

    def _health(self, name: str, p: _Provider, outcome: str) -> None:
        """One more attempt of provider `name` (`outcome`: "" answered, else its error's kind)."""
        out = p.outcomes
        if len(out) == out.maxlen and out[0]:
            p.failing -= 1
        out.append(outcome)
        if outcome:
            p.failing += 1
        n = len(out)
        assert self._on_health is not None
        if not p.bad and n >= HEALTH_WINDOW // 2 and p.failing >= BAD_SHARE * n:
            p.bad = True
            kinds = Counter(k for k in out if k)
            why = ", ".join(f"{c} {k}" for k, c in kinds.most_common())
            self._on_health(True, f"provider {name} gone bad: {p.failing} of its last {n} attempts failed ({why})")
        elif p.bad and n == HEALTH_WINDOW and p.failing < BACK_SHARE * n:
            p.bad = False
            self._on_health(False, f"provider {name} back: {n - p.failing} of its last {n} attempts answered")

    def stats(self) -> tuple[ProviderStat, ...]:
        """Per provider, most answers first; a fleet's servers marked, each listed (answered or not) with
        whether it is out now and its adaptive limit."""
        built = self._stats()
        if self.servers is None:
            return built
        fleet = dict(self.servers())
        limits = self.server_limits() if self.server_limits is not None else {}
        named = {p.name for p in built}

        def server(p: ProviderStat) -> ProviderStat:
            now, configured = limits.get(p.name, (0, 0))
            return dataclasses.replace(p, server=True, out=fleet[p.name], limit=now, limit_configured=configured)
        return tuple(server(p) if p.name in fleet else p for p in built) + tuple(
            server(ProviderStat(name=name)) for name in fleet if name not in named)

    def _stats(self) -> tuple[ProviderStat, ...]:
        version, built = self._built
        if version == self._version:
            return built
        out = []
        for name, p in sorted(self._by.items(), key=lambda item: (-item[1].answers, item[0])):
            answers = p.answers
            recent = sorted(p.latency)
            p90 = recent[min(len(recent) - 1, int(len(recent) * 0.9))] if recent else 0.0
            out.append(ProviderStat(name=name, answers=answers, errors=p.errors,
                                    latency_mean_s=round(p.latency_sum / answers, 3) if answers else 0.0,
                                    latency_p90_s=round(p90, 3), completion_tokens=p.tokens))
        built = tuple(out)
        self._built = (self._version, built)
        return built
