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
- at the dataset's end (record_book.py `settle_doubts`), what is still set aside fails as its own if
  the last smoke test answered the dataset's request shape; else a prompt whose request was sent
  before one that was answered fails as its own (the parameters worked after it went out), and so do
  the rest when they are fewer than `DOUBT_LIMIT` and the dataset answered anything this run (the last
  prompt of a dataset refused alone). `DOUBT_LIMIT` or more refused with every answer sent before them
  (a parameter the provider started refusing while the answers in flight were sent before it): the
  dataset stops, they stay eligible, and so it does when it answered nothing this run; the stop says
  that an answered smoke test lets the next run fail them.
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
    seq: int = 0         # the refused request's own number (DatasetRun.sent when it left)


class Doubts:
    def __init__(self) -> None:
        self.items: list[Doubt] = []
        self.smoke_answered = False  # the last smoke test got an answer with this dataset's request shape
        self.probe_out = False       # a probe is in flight (held: one at a time)
        self.refused_probes = 0      # refused while held, sent after the refusal before them
        self.last_answered = 0       # the number of the latest-sent request answered this run (settle_doubts)

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
        self.items.append(Doubt(prompt, e, attempts, sent, seq))

    def answered(self, seq: int) -> list[Doubt] | tuple[()]:
        """Request number `seq` was answered: the set-aside prompts that shows were refused for their own
        reason (`confirmed`), taken out; none on almost every answer (nothing set aside)."""
        if seq > self.last_answered:
            self.last_answered = seq
        return self.confirmed(seq) if self.items else ()

    def settle(self) -> tuple[list[Doubt], bool]:
        """At the dataset's end (answered this run or in the last smoke test): the set-aside prompts that
        fail as their own, taken out, and whether the rest, left set aside (eligible), stop the dataset."""
        own, rest = self.items, []
        if not self.smoke_answered:
            unproven = [d for d in own if d.seq >= self.last_answered]
            if len(unproven) >= DOUBT_LIMIT:
                own, rest = [d for d in own if d.seq < self.last_answered], unproven
        self.items = rest
        return own, bool(rest)

    def confirmed(self, seq: int) -> list[Doubt]:
        """The set-aside prompts that an answer to request number `seq` shows were refused for their own
        reason: it was sent after their refusal came, with the same parameters."""
        own = [d for d in self.items if d.refused_after < seq]
        if own:
            self.items = [d for d in self.items if d.refused_after >= seq]
            self.refused_probes = 0
        return own
