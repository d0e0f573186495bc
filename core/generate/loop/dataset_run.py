"""One dataset's live state in a run, and its counts, changed only through its methods.

Every usable prompt of the dataset's file is, at each moment, exactly one of: answered, failed,
skipped (a budget, max_usd, a duplicate of another dataset's), or left (not asked yet, in flight,
handed back to its source, set aside). Once the file is counted (`counted`),

    answered + failed + skipped + left = total + stale

is asserted after every change, where `stale` is the outcomes on disk whose id the file no longer
has (0 unless the prompt file was edited between runs). Outcomes read from disk before the file is
counted are only added up.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

from draftgen.core.config_tables import DatasetConfig
from draftgen.core.generate.api.classify import UNRECOGNIZED_4XX
from draftgen.core.generate.api.client import RequestFailed
from draftgen.core.generate.loop.concurrency import AdaptiveConcurrency
from draftgen.core.generate.loop.doubts import Doubts
from draftgen.core.generate.money.budget import TokenBudget
from draftgen.core.live.snapshot import DatasetStatus
from draftgen.core.records import ErrorKind
from draftgen.core.rundir import JsonlAppender
from draftgen.core.secrets import Redactor

# Unreadable answers in a row past the dataset's concurrency before it stops (DatasetRun.unreadable).
UNREADABLE_SLACK = 20
CUT_SAY_AFTER = 10  # answers of a dataset this run before the share of them cut at max_tokens is judged


@dataclass
class ConversationCounts:
    """A turns = "all" dataset's conversations, beside its turns (DatasetRun's units), for the views."""
    total: int = 0      # usable conversations in the file
    done: int = 0       # every turn answered
    ended: int = 0      # ended early: a broken turn, a skip, an edit of the prompt file
    reasons: Counter[str] = field(default_factory=Counter)  # why they ended, by kind
    turn_sum: int = 0           # the turn numbers of every turn of the file, added up
    answered_turn_sum: int = 0  # the turn numbers of the answered turns, added up
    by_turn_total: Counter[int] = field(default_factory=Counter)  # turns of the file, by turn number
    by_turn_done: Counter[int] = field(default_factory=Counter)   # answered turns, by turn number
    last: tuple[str, ...] = ()  # the last conversation that finished or ended: its id, then one line a turn
    # Agent lines (docs/multi-turn.md), counted from the records (this run's and earlier ones):
    tool_calls: int = 0         # answers that called tools
    replayed: int = 0           # steps sent with a replayed tool result (tool_results = "replay")
    diverged: int = 0           # conversations ended by an answer that was not the dataset's next move
    by_turn_calls: Counter[int] = field(default_factory=Counter)     # answers that called tools, by step
    by_turn_diverged: Counter[int] = field(default_factory=Counter)  # diverged conversations, by the step

    def growth(self, turns_left: int, answered: int) -> float:
        """How much bigger the prompts of the turns left are than those answered so far: a turn's history
        grows with its number k (a k-turn conversation sends about k^2 history tokens in all), so the
        ratio of the mean turn number left to the mean answered (1.0 when either is unknown)."""
        if turns_left <= 0 or answered <= 0 or not self.answered_turn_sum:
            return 1.0
        left_mean = max(1.0, (self.turn_sum - self.answered_turn_sum) / turns_left)
        return max(1.0, left_mean / (self.answered_turn_sum / answered))

    def history_answers(self, turns_left: int) -> float:
        """The mean earlier answers the prompt of a turn left carries (turn k carries k-1): forecast's
        prior for a dataset with too few answers to price from (forecast.DatasetFigures.history_answers)."""
        if turns_left <= 0:
            return 0.0
        return max(0.0, (self.turn_sum - self.answered_turn_sum) / turns_left - 1.0)


@dataclass(eq=False)
class DatasetRun:
    """One dataset's live state: counts, budgets, the requests in flight and its two record files."""
    config: DatasetConfig
    token_budget: TokenBudget
    concurrency: AdaptiveConcurrency
    done_ids: set[str] = field(default_factory=set)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    stopped: bool = False      # 404 "no endpoints": admit nothing more
    doubts: Doubts = field(default_factory=Doubts)  # set aside by a 4xx naming no known cause (doubts.py)
    _responses: JsonlAppender | None = field(default=None, init=False)
    _failures: JsonlAppender | None = field(default=None, init=False)
    # turns = "all": the counts are turns; its conversations are counted here (conversations.py).
    conversations: ConversationCounts = field(default_factory=ConversationCounts)
    # The state and the counts: read through the properties below, changed through the methods.
    _status: DatasetStatus = field(default=DatasetStatus.PENDING, init=False)
    _message: str = field(default="", init=False)
    _in_flight: int = field(default=0, init=False)
    _parked: int = field(default=0, init=False)   # of those, retries waiting for a slot under a lowered limit
    _sent: int = field(default=0, init=False)     # requests sent this run (request.py numbers each one)
    _total: int = field(default=0, init=False)
    _done: int = field(default=0, init=False)
    _failed: int = field(default=0, init=False)
    _skipped: int = field(default=0, init=False)
    _left: int = field(default=0, init=False)
    _stale: int = field(default=0, init=False)
    _rejected: int = field(default=0, init=False)
    _truncated: int = field(default=0, init=False)
    _other_model: int = field(default=0, init=False)  # answers from another model than the one asked
    _unreadable: int = field(default=0, init=False)   # answers in a row that could not be read (BAD_BODY)
    _cost: float = field(default=0.0, init=False)
    _prompt_tokens: int = field(default=0, init=False)     # usage.prompt_tokens of the answers on disk
    _reasoning_tokens: int = field(default=0, init=False)  # of their completion tokens, the reasoning's
    _answered_now: int = field(default=0, init=False)
    _cut_now: int = field(default=0, init=False)   # answers this run cut at max_tokens (cut_to_say)
    _cut_said: bool = field(default=False, init=False)
    _scanned: bool = field(default=False, init=False)

    # -- the state ------------------------------------------------------------------------------

    @property
    def status(self) -> DatasetStatus:
        return self._status

    @property
    def message(self) -> str:
        """Why the dataset stopped or ended early (empty while it runs)."""
        return self._message

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def parked(self) -> int:
        return self._parked

    @property
    def sent(self) -> int:
        return self._sent

    @property
    def responses(self) -> JsonlAppender | None:
        """responses.jsonl, once the record book opened it (record_book.py)."""
        return self._responses

    @property
    def failures(self) -> JsonlAppender | None:
        """failures.jsonl, once the record book opened it."""
        return self._failures

    def open_files(self, responses: JsonlAppender, failures: JsonlAppender) -> None:
        """The dataset's two record files, opened (a torn last line cut) by the record book."""
        self._responses, self._failures = responses, failures

    def smoke_answered(self, answered: bool) -> None:
        """Whether the last smoke test got an answer with this dataset's request shape (doubts.py)."""
        self.doubts.smoke_answered = answered

    def running(self) -> None:
        self._status = DatasetStatus.RUNNING

    def end(self, status: DatasetStatus, why: str | None = None) -> None:
        """The dataset's status from now on (BUDGET as soon as a budget skips its rest); `why` replaces
        the message, None keeps the one a stop already gave."""
        self._status = status
        if why is not None:
            self._message = why

    def request_started(self, tokens: int = 0, *, probe: bool = False) -> None:
        """A request starts: in flight, its expected `tokens` counted against the token budget, and
        (`probe`) the one request its doubts let out (doubts.py)."""
        self._in_flight += 1
        self.token_budget.in_flight += tokens
        if probe:
            self.doubts.probe_out = True

    def request_ended(self, tokens: int = 0, *, probe: bool = False) -> None:
        """The request `request_started` counted ended (answered, failed, handed back or cancelled)."""
        self._in_flight -= 1
        self.token_budget.in_flight -= tokens
        if probe:
            self.doubts.probe_out = False

    def park(self) -> None:
        """A retry waits for a slot under a lowered limit (it stays in flight)."""
        self._parked += 1

    def unpark(self) -> None:
        self._parked -= 1

    def note_sent(self) -> int:
        """One more request sent this run; returns its number (what doubts.py compares)."""
        self._sent += 1
        return self._sent

    # -- the counts -----------------------------------------------------------------------------

    @property
    def total(self) -> int:
        """Usable prompts in the file."""
        return self._total

    @property
    def done(self) -> int:
        """Answered (on disk, this run's included)."""
        return self._done

    @property
    def failed(self) -> int:
        return self._failed

    @property
    def skipped(self) -> int:
        return self._skipped

    @property
    def left(self) -> int:
        """The file's prompts with no outcome yet (not asked, in flight, handed back, set aside)."""
        return self._left

    @property
    def rejected(self) -> int:
        return self._rejected

    @property
    def truncated(self) -> int:
        return self._truncated

    @property
    def other_model(self) -> int:
        """Answers from another model than the one asked (records.py same_model): kept, never a sample."""
        return self._other_model

    @property
    def cost(self) -> float:
        return self._cost

    @property
    def usage_tokens(self) -> tuple[int, int]:
        """(prompt, reasoning) tokens of the answers on disk, as billed (completion: `token_budget.used`)."""
        return self._prompt_tokens, self._reasoning_tokens

    @property
    def answered_now(self) -> int:
        """Answers this run."""
        return self._answered_now

    @property
    def scanned(self) -> bool:
        """Total and rejected counted (at the start, for the whole-run projection)."""
        return self._scanned

    def counted(self, total: int, rejected: int, fresh: int,
                conversations: tuple[int, int, Counter[int]] | None = None) -> None:
        """The prompt file is counted: `total` usable prompts, `fresh` of them with no outcome on disk;
        a turns = "all" file's `conversations`: how many, their turn numbers added up, their turns by number."""
        if conversations is not None:
            c = self.conversations
            c.total, c.turn_sum, c.by_turn_total = conversations[0], conversations[1], conversations[2]
        self._total, self._rejected, self._left = total, rejected, fresh
        # Outcomes on disk for ids the file no longer has: counted, but not the file's.
        self._stale = self._done + self._failed - (total - fresh)
        self._scanned = True
        self._check()

    def answered(self, prompt_id: str, tokens: int, cost: float, *, short: bool, other_model: bool = False,
                 now: bool = True, calls: bool = False, diverged: bool = False, replayed: bool = False,
                 prompt_tokens: int = 0, reasoning_tokens: int = 0) -> None:
        """An answer on disk (`now`: this run's; else one read back from disk); `other_model`: from another
        model than the one asked; an agent step's: it `calls` tools, it `diverged` from the dataset (its
        conversation ends), its request carried a `replayed` tool result."""
        self._done += 1
        self._unreadable = 0
        self.done_ids.add(prompt_id)
        self.token_budget.used += tokens
        self.token_budget.answers += 1
        self._cost += cost
        self._prompt_tokens += prompt_tokens
        self._reasoning_tokens += reasoning_tokens
        if self.config.turns == "all":
            _, _, k = prompt_id.rpartition("#t")
            turn = int(k) if k.isdigit() else 1
            c = self.conversations
            c.answered_turn_sum += turn
            c.by_turn_done[turn] += 1
            if calls:
                c.tool_calls += 1
                c.by_turn_calls[turn] += 1
            if diverged:
                c.diverged += 1
                c.by_turn_diverged[turn] += 1
            c.replayed += replayed
        if short:
            self._truncated += 1
        if other_model:
            self._other_model += 1
        if now:
            self._answered_now += 1
            if self._scanned:  # _leaves, inline: this runs once per answer
                self._left -= 1
                self._check()

    def cut_to_say(self) -> int:
        """One more answer this run was cut at max_tokens: the count of them, the first time most of this
        run's answers are (CUT_SAY_AFTER answers in), else 0 (said once: a drain still saves money)."""
        self._cut_now += 1
        if self._cut_said or self._answered_now < CUT_SAY_AFTER or self._cut_now * 2 <= self._answered_now:
            return 0
        self._cut_said = True
        return self._cut_now

    def failed_one(self, prompt_id: str, *, now: bool = True) -> None:
        """A failure on disk (`now`: this run's; else one read back from disk)."""
        self._failed += 1
        self.done_ids.add(prompt_id)
        if now:
            self._leaves()

    def skipped_some(self, n: int = 1) -> None:
        """Prompts skipped this run (a budget, max_usd, a duplicate): they stay eligible for a later run."""
        self._skipped += n
        self._leaves(n)

    def unrecorded(self, prompt_id: str, *, answer: bool) -> None:
        """A held record no place took (ledger.py settle_held): not done after all, asked again next run."""
        if answer:
            self._done -= 1
        else:
            self._failed -= 1
        self.done_ids.discard(prompt_id)
        if self._scanned:
            self._left += 1
            self._check()

    def _leaves(self, n: int = 1) -> None:
        if self._scanned:
            self._left -= n
            self._check()

    def _check(self) -> None:
        assert self._left >= 0 and (self._done + self._failed + self._skipped + self._left
                                    == self._total + self._stale), (
            f"{self.config.name}: {self._done} answered + {self._failed} failed + {self._skipped} skipped + "
            f"{self._left} left != {self._total} prompts (+ {self._stale} on disk not in the file)")

    # -- stopping the dataset -------------------------------------------------------------------

    def unreadable(self, e: RequestFailed) -> RequestFailed | None:
        """One more answer that could not be read (`e`: a body that is not JSON, a stream that ended before
        the answer finished) with none answered since: the error that stops the dataset once more than a
        whole wave of its requests (its concurrency) and UNREADABLE_SLACK more came so in a row. Such faults
        are the server's while the other prompts fare the same, so no prompt spends an attempt on them
        (request.py `_spends_attempt`): without this, a server whose every answer is unreadable would be
        asked, and paid, without end."""
        self._unreadable += 1
        limit = self.config.concurrency + UNREADABLE_SLACK
        if self._unreadable <= limit:
            return None
        return RequestFailed(ErrorKind.BAD_BODY, f"more than {limit:,} answers in a row could not be read and none "
                             f"was answered since (the last: {e.message})")

    def stop_for(self, e: RequestFailed, redact: Redactor) -> bool:
        """The dataset's routing or settings refuse every prompt: it admits nothing more, its prompts
        stay eligible, the message says what to change. False when it was stopped already."""
        if self.stopped:
            return False
        self.stopped = True
        why = redact(e.message)[:300]
        todo = {ErrorKind.MAX_TOKENS_EXCEEDED: f"lower max_tokens (now {self.config.max_tokens}) for this dataset",
                ErrorKind.WEIGHT_EXCEEDS_BUDGET: f"lower max_tokens (now {self.config.max_tokens}) or add credits",
                ErrorKind.NOT_FOUND: "check [api] model",
                ErrorKind.REDIRECT: "set [api] base_url to the address that answers (no redirect is followed)",
                ErrorKind.BAD_BODY: "check the server and what stands between it and draftgen (a proxy that cuts "
                                    "or rewrites answers; with a stream, [api] stream = false may help)",
                # The message names each field and its config key; OpenRouter-only keys are dropped by the kind.
                ErrorKind.UNEXPECTED_FIELD: "change the config as said (OpenRouter-only keys: [api] kind = "
                                            "\"openai-compatible\" leaves them out)",
                }.get(e.kind, "check the provider routing ([request] provider, the account's privacy settings)")
        if e.kind in UNRECOGNIZED_4XX:
            todo = (f"{len(self.doubts)} prompt(s) got it and no request sent after them was answered, so it is "
                    "likely this dataset's request parameters ([request], the dataset's settings): fix them; if "
                    "they are right, run `draftgen smoke` (an answer there shows they work, and the next run "
                    "fails these prompts as their own)")
        self._message = f"stopped: {why}; {todo}, then run again (its prompts stay eligible)"
        self.wake.set()
        return True
