"""Admission: which prompt goes out, and when.

A dataset's requests are run by a pool of request coroutines, as many as its concurrency. Each one
admits its own next prompt and runs its `Request` (request.py), then the next, until the dataset's prompt source
(source.py: the prompts handed back first, then the file's next ones not on disk) has none left. One
coroutine admits at a time (the dataset's admission lock): the prompts go out in the source's order,
and only one waits for room while the run is paused, the concurrency limit is reached or the budgets
say wait (room.py); the others wait for the lock, not on the dataset's wake. An admitted prompt is
started, skipped or handed back. A budget that runs out ends the dataset: the rest of its prompts is
counted skipped (eligible for a later run). Once the source has nothing left (or a drain or stop
halts admission) the coroutines end as their requests do, and the dataset's final status is left.
No task is made per request. The limit adapts (AIMD) to 429 storms, not to a trickle (concurrency.py
`AdaptiveConcurrency`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from draftgen.core.generate.loop.conversations import ConversationSource
from draftgen.core.generate.loop.prompt_files import ReadingStopped
from draftgen.core.generate.loop.request import Request, RunTerms
from draftgen.core.generate.loop.room import VERDICT_GO, Admit, Decision
from draftgen.core.generate.loop.source import Booked, PromptSource, open_source
from draftgen.core.live import payloads as ev
from draftgen.core.live.snapshot import DatasetStatus

if TYPE_CHECKING:
    from draftgen.core.generate.loop.dataset_run import DatasetRun



START_BURST = 64  # request coroutines started between yields to the event loop (2,000 at once would stall it)


class _Admitting:
    """One dataset's admission, shared by its request coroutines: one admits at a time."""
    __slots__ = ("ds", "source", "lock", "over", "budget_reason")

    def __init__(self, ds: DatasetRun, source: PromptSource) -> None:
        self.ds = ds
        self.source = source
        self.lock = asyncio.Lock()
        self.over = False        # nothing more is admitted: the source is empty, or a drain, stop or halt
        self.budget_reason = ""  # the budget that ended the dataset ('' if none): the rest is skipped


class Admission:
    """Admits the prompts of every dataset: each dataset's loop pulls its source, makes each prompt's
    `Request` (request.py), admits it and runs it, until nothing is left or a budget, drain or stop
    ends it."""

    def __init__(self, terms: RunTerms) -> None:
        ctx, parts = terms.ctx, terms.parts
        self._terms = terms  # each prompt's `Request` is made on the run's terms
        self._datasets = parts.datasets
        self._money = parts.money
        self._room = terms.room
        self._book = parts.book
        self._duplicates = parts.opened.duplicates
        self._control = ctx.control
        self._event = ctx.event
        self._server = ctx.config.api.server  # a conversation's history is sent as its kind's API documents it

    async def run(self, ds: DatasetRun) -> None:
        """Admit and ask the dataset's prompts until its source has none left (or a budget, drain or stop
        ends admission) and its requests have ended; leaves the dataset's final status."""
        if self._control.closed:
            return
        try:
            await self._open(ds)
        except ReadingStopped:
            return  # a drain or stop now while its file was counted: nothing admitted
        admitting = _Admitting(ds, self._source(ds))
        pool: list[asyncio.Task[None]] = []
        try:
            for n in range(1, ds.config.concurrency + 1):
                pool.append(asyncio.create_task(self._requests_of(admitting)))
                if n % START_BURST == 0:
                    await asyncio.sleep(0)  # each asks its first request in its first step: the UI runs between
            await asyncio.wait(pool)
        finally:
            for task in pool:  # only when the run itself is cancelled: each hands its prompt back
                task.cancel()
        for task in pool:
            if not task.cancelled() and (error := task.exception()) is not None:
                raise error
        self._end(ds, admitting.budget_reason)

    async def _requests_of(self, admitting: _Admitting) -> None:
        """One request coroutine of a dataset: admits the next prompt, asks it, and again, until nothing
        more is admitted. A stop now cancels it while it asks (its prompt is handed back)."""
        task = asyncio.current_task()
        assert task is not None
        lock = admitting.lock
        while True:
            await lock.acquire()  # what `async with` does, without its two coroutines a request
            try:
                req = await self._admit_next(admitting)
            finally:
                lock.release()
            if req is None:
                return
            await req.run(task)

    async def _admit_next(self, admitting: _Admitting) -> Request | None:
        """The next prompt admitted (its request, to ask), the ones skipped before it booked as such; None
        once nothing more is admitted (the source is empty, a drain, stop or stopped dataset halted it).
        Once a budget ends the dataset, the source's prompts are counted skipped."""
        ds, source = admitting.ds, admitting.source
        while not admitting.over:
            prompt = await source.next()
            if prompt is None:
                admitting.over = True
                return None
            if admitting.budget_reason:
                ds.skipped_some()
                source.booked(prompt, Booked.skipped(admitting.budget_reason))
                continue
            req = Request(self._terms, prompt, ds, source)
            decision = req.admit_now()
            if decision is None:  # it waits for room
                decision = await req.admit()
            if decision.verdict is VERDICT_GO:  # Admit.GO (room.py says why it is read so)
                return req
            if decision.verdict is Admit.HALT:
                admitting.over = True
            elif decision.verdict is Admit.BUDGET:
                admitting.budget_reason = decision.reason
                ds.skipped_some()
                source.booked(prompt, Booked.skipped(decision.reason))
                self._budget_ends(ds, decision)
        return None

    def _source(self, ds: DatasetRun) -> PromptSource:
        """The dataset's prompt source: its conversations turn by turn (turns = "all"), else its file."""
        if ds.config.turns == "all":
            rd = self._book.rundir
            return ConversationSource(ds, server=self._server, responses=rd.responses(ds.config.name),
                                      failures=rd.failures(ds.config.name), on_event=self._event,
                                      stop=self._book.reading_stop)
        return open_source(ds, self._book)

    async def _open(self, ds: DatasetRun) -> None:
        """Count the dataset's prompt file (if the run's opening could not), say it starts."""
        name = ds.config.name
        if not ds.scanned:
            await asyncio.to_thread(self._book.scan_prompts, ds)
        ds.running()
        if ds.rejected:
            self._event(ev.Rejected(lines=ds.rejected, path=str(self._book.rundir.rejected(name)), dataset=name))
        units = (f"turns of {ds.conversations.total} conversations (turns = \"all\")" if ds.config.turns == "all"
                 else "prompts")
        self._event(ev.DatasetStart(total=ds.total, units=units, answered=ds.done, failed=ds.failed,
                                     concurrency=ds.config.concurrency, dataset=name))

    def _budget_ends(self, ds: DatasetRun, decision: Decision) -> None:
        """A budget ends the dataset: the rest of its prompts is skipped (eligible for a later run)."""
        name = ds.config.name
        if decision.money:
            self._room.stop_for_money(name)
        ds.end(DatasetStatus.BUDGET, decision.reason)
        self._event(ev.Budget(reason=decision.reason, dataset=name))

    def _end(self, ds: DatasetRun, budget_reason: str) -> None:
        """Nothing left in flight: settle the set-aside prompts, leave the dataset's final status, say it."""
        name = ds.config.name
        if not self._control.closed and not budget_reason and self._book.settle_doubts(ds):
            self._event(ev.DatasetStopped(cause=ds.message, dataset=name))
        if ds.stopped:
            ds.end(DatasetStatus.STOPPED)
        elif budget_reason:
            ds.end(DatasetStatus.BUDGET)
        elif self._control.closed:
            ds.end(DatasetStatus.STOPPED, ds.message or "stopped before the end; the next run resumes")
        elif self._room.money_skipped.get(name):
            ds.end(DatasetStatus.BUDGET, f"max_usd: {self._room.money_skipped[name]} prompts skipped, their worst case "
                   "above what max_usd leaves (they stay eligible for a later run)")
        else:
            ds.end(DatasetStatus.DONE)
        duplicates = self._duplicates.skipped.get(name, 0) if self._duplicates is not None else 0
        costly = self._room.money_skipped.get(name, 0)
        cost = self._money.spend.by_dataset.get(name, ds.cost)  # the ledger's, as in the panel
        self._event(ev.DatasetDone(status=str(ds.status), answered=ds.done, total=ds.total, failed=ds.failed,
                                    skipped=ds.skipped, cost_usd=cost, by_max_usd=costly, duplicates=duplicates,
                                    conversations=_conversations_done(ds), dataset=name))

    async def grow_limits(self) -> None:
        """Every second: let the limits cut by 429s grow back (runs for the life of the run)."""
        while True:
            await asyncio.sleep(1.0)
            for ds in self._datasets.values():
                if ds.concurrency.tick():
                    ds.wake.set()



def _conversations_done(ds: DatasetRun) -> str:
    """A turns = "all" dataset's conversations, for its dataset_done line ("" for a single-turn one)."""
    if ds.config.turns != "all":
        return ""
    c = ds.conversations
    why = ", ".join(f"{n} {kind}" for kind, n in c.reasons.most_common())
    return (f" (turns; conversations: {c.done}/{c.total} done, {c.ended} ended early{f': {why}' if why else ''})")
