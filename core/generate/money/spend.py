"""The spend ledger: every request attempt's cost, on one append-only file per run directory.

`<run dir>/spend.jsonl` holds every attempt sent to the API, by every run of the directory. Each
line is one JSON object, written whole (the lines of one event-loop tick in one `write`, at the tick's
end or before an fsync begins, whichever is first; outside a loop before the call returns), so a
`kill -9` loses at most the last tick's gen/end/settle lines, never a `sent` line of a request that
left (it leaves after its fsync); `JsonlAppender` cuts a torn last line on the next open:

    {"e":"sent","a":ID,"ds":DATASET,"p":PROMPT_ID,"w":WORST_USD,"t":UNIX_TIME}
        written before the request leaves; w is the reservation (worst-case cost, see prices.py);
        t bounds how long it may run on: one without a generation id is priced from the key's usage
        once api.request_timeout_s has passed since t (unknown.py)
    {"e":"gen","a":ID,"g":GENERATION_ID}
        the generation id, from the X-Generation-Id header (known with the first bytes), written with
        the tick's other lines; when the attempt ended in that same tick (most answers: the header and
        the body arrive together) there is no gen line: its end line carries "g" instead
    {"e":"end","a":ID,"o":OUTCOME,"c":USD|null,"s":SOURCE[,"g":GENERATION_ID]}
        OUTCOME answered: c is the answer's usage.cost (SOURCE "usage.cost"), or, for an answer that
            carried no cost and cannot be looked up, tokens x the worst prices (SOURCE "estimate");
            an answer without a cost that can be looked up: c null, SOURCE "pending", "w" its estimate;
            neither c nor "w" is capped at the reservation "w" of its sent line (a provider that bills
            past it is booked at what it billed);
        OUTCOME refused: an HTTP error status, nothing generated, or not sent after all (the disk
            refused the fsync, or the run paused before it left) (c 0, SOURCE "not billed");
        OUTCOME abandoned: timed out, dropped, cut short or stopped: c null, SOURCE "pending"; with
            "st": the HTTP status of a 408/5xx that carried a generation id (see billing.py); with
            "w": what it counts at until priced, when that is more than the reservation (an answer a
            provider ran past max_tokens: its tokens at the worst prices); with "t" (no generation id):
            when it was given up on, a generation that may run on for api.request_timeout_s more (so
            the key's usage prices it only then, unknown.py)
    {"e":"settle","a":ID,"c":USD,"s":"generation"}
        an abandoned attempt priced from GET /api/v1/generation?id= (its record's total_cost); a settle
        line of an answer (one without a cost, or one below) also has "o":"answered"
    {"e":"settle","a":ID,"c":USD,"s":"usage.cost"|"estimate","o":"answered"}
        an attempt a run left open (killed between writing the answer and this line, or its disk refused
        the ledger's lines and the answer was spooled) whose answer is in responses.jsonl: priced at its
        recorded usage.cost when the next run opens the directory ("estimate" for a record without a
        generation id, whose cost may be the token estimate; opening.py `recorded_answers`)
    {"e":"settle","a":ID,"c":USD,"s":"usage.cost"|"estimate"}
        right after its abandoned end line: an answer a provider ran past max_tokens (not kept), priced
        from its own usage.cost, or its tokens x the worst prices (billing.py)
    {"e":"settle","a":ID,"c":USD,"s":"worst case"}
        an abandoned attempt whose generation record's cost was not believed (negative, not a number, or
        past ten times what it counted at: settle.py): settled at what it counted at
    {"e":"settle","a":ID,"c":0,"s":"no record"}
        a 500/502/503 whose generation id has no record after `generation_lookup_s`: nothing ran
    {"e":"settle","a":ID,"c":0|USD,"s":"self-hosted"|"estimate"}
        an openai-compatible server's pending attempt (settle.py): lost ones bill nothing, an answer
        without a cost keeps its token estimate
    {"e":"settle","a":ID,"c":USD,"s":"key usage"}
        an attempt without a generation id priced from the key's usage since the baseline, once it
        cannot still be running (by a run or `draftgen ledger`, see unknown.py)
    {"e":"key","u":USD,"t":UNIX_TIME}
        the key's usage (GET /key) before the directory's first attempt: the baseline for that
    {"e":"prices","ds":DATASET,"f":FINGERPRINT,"p":USD,"c":USD,"r":USD}
        the worst prices per prompt token, completion token and request that an answer's bill checked for
        the dataset's request shape (`Config.fingerprint`): the listing's, or the higher ones bills implied
        (trust.py); the next run of that shape reserves at no less, without a first wave. Each figure must
        be a finite price from 0 to $100 per million tokens (the request price up to $1), else the line
        counts as nothing
    {"e":"carry","ds":DATASET,"c":USD,"n":ANSWERS}
        spend already in responses.jsonl when the directory got its ledger (older runs): the cost of
        its first n answers (n absent in lines from before it was written: then the answers carried
        are the first ones without a `sent` line whose costs add up to c)
    {"e":"found","ds":DATASET,"c":USD,"n":ANSWERS}
        answers in responses.jsonl with no `sent` line (the ledger lost their lines, e.g. a crash of
        a version that did not fsync, or a ledger restored from an older copy), found when a run
        opened the directory: c is their recorded usage.cost (an answer without one: its tokens x
        the worst prices), counted once; n is how many, taken in file order after those carried or
        found before (opening.py `count_unledgered`)

A `sent` line is fsynced before its request leaves (group commit: one fsync for every request of
the moment, `send_grouped`), so an OS crash or a power cut loses no attempt that may be billed; the
lines after it (gen, end, settle) go in the next fsync, and one lost only makes the next run count
its attempt at worst case (or look it up).

A cost read back that no attempt can have been billed (not a finite number, negative, or $1,000 or more:
`MAX_ATTEMPT_USD`, e.g. a figure a server sent that an older version booked as given) counts as the
attempt's reservation (its `w`), so no one line can make the directory's ledger unusable; a `w` that is
not one counts as `MAX_ATTEMPT_USD`. A line whose
values will not convert to its kind's (ledger_lines.py, where each kind's type is) counts as nothing: the
attempt of such an end or settle line stays open, pending at its worst case.

Money is then three sums over all runs: settled (known costs), pending (abandoned attempts not yet
priced, and attempts a killed run left open, each at its worst case) and reserved (the worst case
of the attempts in flight in this process). The ceiling holds because an attempt is on disk as
"sent" before it leaves and counts at its worst case until its real cost is known:
settled + pending + reserved + the next reservation <= max_usd, whatever crashed when.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum
from operator import attrgetter
from pathlib import Path
from typing import Generic, TypeVar

from draftgen.core.errors import DiskError
from draftgen.core.generate.money.ledger_lines import (
    CarryLine,
    EndLine,
    KeyLine,
    LedgerLine,
    PricesLine,
    SentLine,
    SettleLine,
    checked,
)
from draftgen.core.generate.money.spend_file import LedgerFile

# Reconciliation, Pending and Ticket are imported from here by the rest of the engine.
from draftgen.core.generate.money.spend_sums import ANSWERED, AttemptEnd, Pending, Reconciliation, SpendSums, Ticket
from draftgen.core.rundir import iter_jsonl
from draftgen.core.units import to_ms

# No attempt of a chat model costs this much (a million tokens at the highest listed price, $600/M, is $600):
# a figure at or above it read back from the ledger counts as the attempt's reservation instead.
MAX_ATTEMPT_USD = 1000.0
# The most a "prices" line may say per prompt token, completion token and request ($100 per million tokens,
# billing.py SANE_USD_PER_TOKEN; $1 a request): a line past them counts as nothing.
PRICE_CAPS = (1e-4, 1e-4, 1.0)


def _sane(cost: float, worst: float) -> float:
    """A cost read back from the ledger (a float: ledger_lines.py `checked`), or `worst` when it is not one an
    attempt can have been billed."""
    return cost if 0 <= cost < MAX_ATTEMPT_USD else worst  # NaN: worst


class CostSource(StrEnum):
    """Where an attempt's cost came from."""
    USAGE = "usage.cost"
    ESTIMATE = "estimate"      # an answer without usage.cost and no generation id: tokens x worst prices
    NOT_BILLED = "not billed"
    GENERATION = "generation"
    NO_RECORD = "no record"    # a 500/502/503's generation id never got a record: nothing ran
    WORST = "worst case"       # a generation record's cost not believed (settle.py): what the attempt counted at
    KEY_USAGE = "key usage"
    SELF_HOSTED = "self-hosted"  # an attempt lost on an openai-compatible server: it bills nothing
    PENDING = "pending"


# What was billed, not an estimate above it: the key's usage since the baseline surely holds these
# costs (unknown.py subtracts them from it). A $0 "not billed" or "no record" adds nothing either way.
EXACT_SOURCES = frozenset({CostSource.USAGE, CostSource.GENERATION})


# HTTP errors after which no generation runs on: a provider or OpenRouter answered with the error at
# once. A 408, 504 or 524 is someone giving up on a generation that may still run (and be billed), so
# those wait for their record like a timeout does.
ENDED_STATUSES = frozenset({500, 502, 503})


@dataclass(slots=True)
class _Opened:
    """A `sent` line with no end line yet (while the ledger is read back)."""
    ds: str
    p: str
    w: float
    t: float
    g: str | None = None


class SpendReplay:
    """spend.jsonl read back into a `SpendSums`: attempts ended, settled, or left open by a run that died
    (pending at worst case); with `sent_prompts`, also each dataset's prompts with a `sent` line."""

    def __init__(self, sums: SpendSums, sent_prompts: dict[str, dict[str, bool]] | None = None) -> None:
        self.sums = sums
        self.sent_prompts = sent_prompts  # per dataset, prompt id -> answered on the ledger
        self._opened: dict[str, _Opened] = {}  # sent, with no end line yet

    def read(self, path: Path) -> None:
        for _, raw in iter_jsonl(path):
            line = checked(raw)  # a hand-edited line of the wrong shape counts as nothing
            if line is not None:
                self.line(line)
        for aid, rec in self._opened.items():  # sent by a run that died before the end line
            self.sums.add_pending(Pending(aid, rec.ds, rec.p, rec.w, rec.g, sent_at=rec.t, left_open=True))
        self._opened = {}

    def line(self, line: LedgerLine) -> None:
        sums, opened = self.sums, self._opened
        if line["e"] == "sent":
            # A reservation no attempt can have had (NaN, negative: hand-edited) counts at the most one can:
            # as given, a NaN or negative one would let every later check pass.
            rec = opened[line["a"]] = _Opened(line["ds"], line["p"], _sane(line["w"], MAX_ATTEMPT_USD), line["t"])
            if self.sent_prompts is not None:
                self.sent_prompts.setdefault(rec.ds, {}).setdefault(rec.p, False)
        elif line["e"] == "gen":
            aid = line["a"]
            if aid in opened:
                opened[aid].g = line["g"]
            elif aid in sums.pending and sums.pending[aid].gen is None:
                sums.pending[aid].gen = line["g"]
        elif line["e"] == "end":
            self._end(line)
        elif line["e"] == "settle":
            self._settle(line)
        elif line["e"] == "prices":
            self._prices(line)
        elif line["e"] == "key":
            if sums.key_baseline is None:
                sums.key_baseline = line["u"]
        else:  # carry, found
            cost, ds, answers = line["c"], line["ds"], line.get("n")
            if answers is None:
                sums.carried_by_cost[ds] = sums.carried_by_cost.get(ds, 0.0) + cost
            (sums.book_carried if line["e"] == "carry" else sums.book_found)(ds, cost, answers)

    def _settle(self, line: SettleLine) -> None:
        sums, aid = self.sums, line["a"]
        rec = self._opened.pop(aid, None)  # left open by a killed run, priced by a later one
        p = sums.drop_pending(aid) if rec is None else Pending(aid, rec.ds, rec.p, rec.w, None)
        if p is not None:
            p.answer = p.answer or line.get("o") == AttemptEnd.ANSWERED
            cost, source = _sane(line["c"], p.worst), line["s"]
            sums.book_settled(p, cost, run=False, exact=source in EXACT_SOURCES,
                              from_key=source == CostSource.KEY_USAGE)
            if p.answer:
                sums.note_answer(p.ds, p.prompt_id, cost)

    def _prices(self, line: PricesLine) -> None:
        seen = (line["p"], line["c"], line["r"])
        if all(0 <= v <= cap for v, cap in zip(seen, PRICE_CAPS, strict=True)):  # NaN: False
            self.sums.see_prices(line["ds"], line["f"], seen)

    def _end(self, line: EndLine) -> None:
        aid = line["a"]
        rec = self._opened.pop(aid, None)
        if rec is None:
            return
        sums = self.sums
        outcome, cost = line["o"], line["c"]
        if outcome == AttemptEnd.ABANDONED:
            worst = max(rec.w, _sane(line.get("w", 0.0), rec.w))
            sums.add_pending(Pending(aid, rec.ds, rec.p, worst, rec.g or line.get("g"),
                                     ended=line.get("st") in ENDED_STATUSES, sent_at=line.get("t") or rec.t))
        elif outcome == AttemptEnd.ANSWERED and cost is None:
            sums.add_pending(Pending(aid, rec.ds, rec.p, _sane(line.get("w", rec.w), rec.w),
                                     rec.g or line.get("g"), answer=True))
        else:
            usd = _sane(cost or 0.0, rec.w)
            sums.book(rec.ds, usd, AttemptEnd.ANSWERED if outcome == AttemptEnd.ANSWERED else AttemptEnd.REFUSED,
                      run=False, exact=line["s"] in EXACT_SOURCES)
            if outcome == AttemptEnd.ANSWERED:
                sums.note_answer(rec.ds, rec.p, usd)
        if outcome == AttemptEnd.ANSWERED and self.sent_prompts is not None:
            self.sent_prompts.setdefault(rec.ds, {})[rec.p] = True


T = TypeVar("T")


class _OnSums(Generic[T]):
    """A SpendLedger attribute that lives on its `sums` (read and written there). Once its class is made it
    puts a `property` in its place whose getter is an `attrgetter` (C, no Python frame: the ceiling's checks
    read some of these for every request); this class's `__get__` and `__set__` say what it does, for mypy."""

    def __set_name__(self, owner: type, name: str) -> None:
        def put(ledger: SpendLedger, value: T) -> None:
            setattr(ledger.sums, name, value)
        setattr(owner, name, property(attrgetter(f"sums.{name}"), put))

    def __get__(self, ledger: SpendLedger | None, owner: type | None = None) -> T:
        raise NotImplementedError  # replaced by the property (__set_name__)

    def __set__(self, ledger: SpendLedger, value: T) -> None:
        raise NotImplementedError


class SpendLedger:
    """The writer of spend.jsonl: each line on disk, then on its `sums` (which the ceiling reads)."""

    settled_usd: _OnSums[float] = _OnSums()
    spent_run: _OnSums[float] = _OnSums()
    reserved_usd: _OnSums[float] = _OnSums()
    pending: _OnSums[dict[str, Pending]] = _OnSums()
    pending_usd: _OnSums[float] = _OnSums()
    by_dataset: _OnSums[dict[str, float]] = _OnSums()
    key_baseline: _OnSums[float | None] = _OnSums()
    exact_usd: _OnSums[float] = _OnSums()  # read only, like key_priced_*
    key_priced_usd: _OnSums[float] = _OnSums()
    key_priced_worst: _OnSums[float] = _OnSums()
    found_usd: _OnSums[float] = _OnSums()
    covered: _OnSums[dict[str, int]] = _OnSums()
    carried_by_cost: _OnSums[dict[str, float]] = _OnSums()
    answer_costs: _OnSums[dict[str, dict[str, float]] | None] = _OnSums()
    committed_usd: _OnSums[float] = _OnSums()  # read only, like the next two
    carried_usd: _OnSums[float] = _OnSums()
    spent_usd: _OnSums[float] = _OnSums()

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.sums = SpendSums()
        # An attempt's worst case reserved on the sums: its `Ticket` (bound here: one call a request, not two).
        self.reserve = self.sums.reserve
        self._file: LedgerFile | None = None
        self.existed = False
        # For `count_unledgered` (opening.py), while a run opens the directory: per dataset, each prompt
        # with a `sent` line (True: answered on the ledger).
        self._ids: dict[str, dict[str, bool]] | None = None

    # -- opening ----------------------------------------------------------------------------

    @classmethod
    def read(cls, path: Path, *, answer_costs: bool = False) -> SpendLedger:
        """The sums of an existing ledger, read only (smoke, `draftgen ledger` before it settles, report,
        merge); with `answer_costs`, also each answered prompt's cost."""
        ledger = cls(path)
        if answer_costs:
            ledger.sums.answer_costs = {}
        ledger._load()
        return ledger

    def open(self) -> int:
        """Lock the file (LedgerBusyError when another process has it), read what earlier runs left and
        open it for appending; returns the bytes cut from a torn last line."""
        self._file = LedgerFile(self.path)
        self._ids = {}
        try:
            self._load()
        except BaseException:
            self.close()
            raise
        return self._file.cut_bytes

    def _load(self) -> None:
        self.existed = self.path.exists() and self.path.stat().st_size > 0
        SpendReplay(self.sums, self._ids).read(self.path)

    def carry(self, ds: str, cost: float, answers: int | None = None) -> None:
        """Spend found in responses.jsonl of a directory that had no ledger yet (only then: later the
        ledger already counts those answers); `answers`: how many answers it covers."""
        if (cost > 0 or answers) and not self.existed:
            line: CarryLine = {"e": "carry", "ds": ds, "c": round(cost, 10)}
            if answers is not None:
                line["n"] = answers
            self._write(line)
            self.sums.book_carried(ds, cost, answers)

    def found(self, ds: str, answers: int, cost: float) -> None:
        """Answers in responses.jsonl that the ledger has no `sent` line for: their cost on the ledger,
        once (the next run counts them as covered)."""
        if answers:
            found: CarryLine = {"e": "found", "ds": ds, "c": round(cost, 10), "n": answers}
            self._write(found)
            self.sums.book_found(ds, cost, answers)

    def sent_prompts(self, ds: str) -> dict[str, bool]:
        """The dataset's prompts with a `sent` line (True: one answered on the ledger), read by `open`."""
        return (self._ids or {}).get(ds, {})

    def forget_prompts(self) -> None:
        """Frees what `sent_prompts` reads, once the opening compared it with the answers."""
        self._ids = None

    def prices_checked(self, ds: str, fingerprint: str, prompt: float, completion: float, request: float) -> None:
        """The worst prices an answer's bill checked for the dataset's request shape (trust.py), for later runs."""
        line: PricesLine = {"e": "prices", "ds": ds, "f": fingerprint, "p": prompt, "c": completion, "r": request}
        self._write(line)
        self.sums.see_prices(ds, fingerprint, (prompt, completion, request))

    def set_key_baseline(self, usage: float) -> None:
        """The key's usage before this directory's first attempt (only then: later it would count
        this directory's own spend as someone else's)."""
        if not self.existed and self.sums.key_baseline is None:
            self.sums.key_baseline = usage
            line: KeyLine = {"e": "key", "u": usage, "t": round(time.time(), 3)}
            self._write(line)

    @property
    def is_open(self) -> bool:
        return self._file is not None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- one attempt -----------------------------------------------------------------------

    def send(self, t: Ticket) -> None:
        """Durable (fsynced) before it returns, so before the request leaves (raises DiskError when the
        disk refuses: do not send). For a few requests (the smoke test); a run uses `send_grouped`."""
        file = self._append_sent(t)
        try:
            file.sync()
        except DiskError:
            self.refused(t)  # written but maybe not durable: not sent, and the ledger says so
            raise
        t.sent = True

    async def send_grouped(self, t: Ticket) -> None:
        """`send` with group commit: the line is appended now (written with the tick's other lines, at the
        latest just before the fsync that covers it begins) and the call returns once that fsync has
        completed, one fsync shared by every request of the moment (raises DiskError: do not send; a
        cancel while it waits: not sent either)."""
        file = self._append_sent(t)
        try:
            await file.synced()
        except BaseException:
            self.refused(t)
            raise
        t.sent = True

    def _append_sent(self, t: Ticket) -> LedgerFile:
        if self._file is None:  # closed: the run that owned it ended (or it was never opened)
            raise DiskError(f"{self.path}: the spend ledger is closed; nothing more is sent on it")
        t.sent_at = to_ms(time.time())
        line: SentLine = {"e": "sent", "a": t.id, "ds": t.ds, "p": t.prompt_id, "w": t.worst, "t": t.sent_at}
        self._file.append(line)
        return self._file

    def generation(self, t: Ticket, gen_id: str) -> None:
        if t.gen is None and t.open:
            t.gen = gen_id
            if self._file is not None:
                self._file.generation(t)  # with its end line when that comes in this tick

    def answered(self, t: Ticket, cost: float, source: CostSource = CostSource.USAGE) -> None:
        sums, file = self.sums, self._file
        if sums.close(t):
            if file is not None:  # `_end`, inline (one call a request saved)
                # The StrEnums as they are: orjson writes their values (two .value lookups a request saved).
                file.end(t, {"e": "end", "a": t.id, "o": ANSWERED, "c": cost, "s": source})
            sums.book(t.ds, cost, ANSWERED, run=True, exact=source in EXACT_SOURCES)

    def answered_unpriced(self, t: Ticket, estimate: float) -> Pending | None:
        """An answer that carried no usage.cost but has a generation id: pending (at `estimate`, above the
        reservation when its tokens say so) until its record prices it. Returns what to look up."""
        if not self.sums.close(t):
            return None
        worst = estimate
        self._end(t, {"e": "end", "a": t.id, "o": AttemptEnd.ANSWERED.value, "c": None, "s": CostSource.PENDING.value,
                      "w": worst})
        p = Pending(t.id, t.ds, t.prompt_id, worst, t.gen, answer=True)
        self.sums.add_pending(p)
        return p

    def refused(self, t: Ticket) -> None:
        """An HTTP error status, or nothing could be sent: no generation ran, nothing is billed."""
        if self.sums.close(t):
            self._end(t, {"e": "end", "a": t.id, "o": AttemptEnd.REFUSED.value, "c": 0,
                          "s": CostSource.NOT_BILLED.value})
            self.sums.book_refused()

    def abandoned(self, t: Ticket, status: int | None = None, at_least: float = 0.0) -> Pending | None:
        """The client gave up (timeout, drop, stop-now), the answer was unusable, or (`status`) a 408/5xx
        came with a generation id: the cost stays at the worst case (or `at_least`, when more: what an
        answer run past its cap has cost by its tokens) until the generation record says otherwise.
        Returns what to look up."""
        if not self.sums.close(t):
            return None
        line: EndLine = {"e": "end", "a": t.id, "o": AttemptEnd.ABANDONED.value, "c": None,
                         "s": CostSource.PENDING.value}
        if status is not None:
            line["st"] = status
        worst = t.worst
        if at_least > worst:
            worst = at_least
            line["w"] = at_least
        since = t.sent_at
        if t.gen is None:  # priced from the key's usage once it cannot still be running (unknown.py)
            since = line["t"] = to_ms(time.time())
        self._end(t, line)
        p = Pending(t.id, t.ds, t.prompt_id, worst, t.gen, ended=status in ENDED_STATUSES, sent_at=since)
        self.sums.add_pending(p)
        return p

    def release(self, t: Ticket) -> None:
        """A reservation never sent (cancelled before it left, or the disk refused its line)."""
        self.sums.release(t)

    def settle(self, p: Pending, cost: float, source: CostSource = CostSource.GENERATION) -> None:
        """An abandoned attempt priced from its generation record (or, without one, the key's usage)."""
        if self.sums.drop_pending(p.id) is not None:
            line: SettleLine = {"e": "settle", "a": p.id, "c": cost, "s": source.value}
            if p.answer:
                line["o"] = AttemptEnd.ANSWERED.value
            self._write(line)
            self.sums.book_settled(p, cost, run=True, exact=source in EXACT_SOURCES,
                                   from_key=source is CostSource.KEY_USAGE)

    def lookups(self) -> list[Pending]:
        """Pending attempts that can still be priced (they have a generation id)."""
        return self.sums.lookups()

    def unknown(self) -> list[Pending]:
        """Pending attempts without a generation id (priced from the key's usage, unknown.py)."""
        return self.sums.unknown()

    def reconcile(self) -> Reconciliation:
        return self.sums.reconcile()

    def _write(self, line: LedgerLine) -> None:
        if self._file is not None:  # closed (the run ended): the next run counts the attempt at worst case
            self._file.append_or_hold(line)

    def _end(self, t: Ticket, line: EndLine) -> None:
        """An attempt's end line, with its generation id when that has no gen line yet (spend_file.py)."""
        if self._file is not None:
            self._file.end(t, line)
