"""Prompts set aside by a 4xx that names no known cause, until it is known whose the refusal is.

A provider's own 400 passed on with no code OpenRouter documents (`UNRECOGNIZED_4XX`) may be the
prompt's content, or a request parameter every prompt of the dataset carries. Failing the prompt at
once would fail a whole dataset one prompt at a time when it is the parameters; so the prompt is set
aside, unrecorded, and:

- an answer to a request sent after the refusal came shows the parameters work: the refusal was the
  prompt's own, and it fails (`confirmed`). Any provider's answer counts: a parameter only one of the
  routing's providers refuses then fails the prompts it refused (their messages name it; `draftgen
  retry-failed` makes them eligible again once the routing leaves it out). Counting only the same
  provider's answers would stop busy datasets whose few bad prompts met a rarely used provider;
- at `DOUBT_LIMIT` set aside with no such answer (`held`), the dataset sends one request at a time (a
  probe: requests already in flight were sent before the refusals, so their answers prove nothing):
  a probe answered confirms them all and sending resumes in full; `PROBES` probes in a row refused
  too and the dataset stops, its prompts eligible (room.py);
- at the dataset's end, what is still set aside fails as its own if the dataset answered anything
  this run or its request shape was answered by the last smoke test; otherwise the dataset stops,
  saying that an answered smoke test lets the next run fail them (ledger.py `settle_doubts`).
A drain or stop-now leaves them eligible.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftgen.core.generate.api.client import RequestFailed
from draftgen.core.generate.loop.prompts import Prompt

DOUBT_LIMIT = 5
PROBES = 3


@dataclass
class Doubt:
    prompt: Prompt
    error: RequestFailed
    attempts: int
    refused_after: int   # requests the dataset had sent when the refusal came: a later one answered confirms it


class Doubts:
    def __init__(self) -> None:
        self.items: list[Doubt] = []
        self.smoke_answered = False  # the last smoke test got an answer with this dataset's request shape
        self.probe_out = False       # a probe is in flight (held: one at a time)
        self.refused_probes = 0      # refused while held, sent after the refusal before them

    def __len__(self) -> int:
        return len(self.items)

    @property
    def held(self) -> bool:
        """Enough set aside with no later answer that the dataset waits for its requests in flight."""
        return len(self.items) >= DOUBT_LIMIT

    @property
    def given_up(self) -> bool:
        """Held, and the probes sent since were refused too: the dataset's parameters, most likely."""
        return self.held and self.refused_probes >= PROBES

    def add(self, prompt: Prompt, e: RequestFailed, attempts: int, seq: int, sent: int) -> None:
        """Set aside the prompt whose request number `seq` was refused when `sent` had been sent."""
        if self.held and seq > self.items[-1].refused_after:
            self.refused_probes += 1
        self.items.append(Doubt(prompt, e, attempts, sent))

    def clear(self) -> None:
        """Every set-aside prompt has its outcome now (failed as its own at the dataset's end)."""
        self.items.clear()

    def confirmed(self, seq: int) -> list[Doubt]:
        """The set-aside prompts that an answer to request number `seq` shows were refused for their own
        reason: it was sent after their refusal came, with the same parameters."""
        own = [d for d in self.items if d.refused_after < seq]
        if own:
            self.items = [d for d in self.items if d.refused_after >= seq]
            self.refused_probes = 0
        return own
