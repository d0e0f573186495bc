"""What every part of a run's loop reads: its config and gate, its event sink, clock and redactor,
and the tallies the views show. Built once by the engine (engine.py) and passed whole, so a part's
constructor takes the context plus the few objects it works with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from draftgen.core.config import Config
from draftgen.core.generate.loop.run_state import RunControl
from draftgen.core.generate.loop.stats import Tally
from draftgen.core.live.events import EventSink
from draftgen.core.live.recent import ProviderStats, RecentErrors
from draftgen.core.secrets import Redactor


@dataclass(frozen=True)
class RunContext:
    config: Config
    control: RunControl         # the run's state and gate (run_state.py): changed only through it
    event: EventSink            # every event of the run (redacted by the engine's sink)
    clock: Callable[[], float]  # monotonic seconds
    redact: Redactor            # the API key out of every text that leaves
    errors: Tally               # error kinds seen, for the views
    recent: RecentErrors        # the drill-down's rings of recent errors
    provider_stats: ProviderStats  # answers, latency and tokens per provider
