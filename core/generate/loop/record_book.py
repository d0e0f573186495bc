"""The record book: what each dataset has on disk, what it cost, and the writer of its records.

On start (and on resume after a crash) a dataset's responses.jsonl and failures.jsonl are opened
(a torn last line cut) and counted: every id on disk is done, and the spend and tokens of the
answers already there count against the budgets. Then each request ends in one line: an answer in
responses.jsonl (formats in core/records.py) or a failure in failures.jsonl; its request finishes
once the line is written and fsynced (`synced`: group commit, one fsync for the moment's records).
The lines of one event-loop tick go out in one write, at the tick's end or before the fsync that
covers them begins (`JsonlAppender(coalesce=True)`); an answer is handed on (the live token view)
once its line is written.

A write the disk refuses (full, read-only) is held in memory, in order, and the run pauses; every
later record queues behind it, so the files never get a gap. Resuming writes the held records first.
Held records are paid for and never dropped: at the end of the run the engine waits for the disk
(engine.py), and what it still cannot write is spooled to a fallback place (spool.py), which the
next run imports before it sends anything; only if no place takes them are they lost, and said so.

An answer whose `model` is not the model asked (records.py same_model) is written like any other (it is
paid for) but never becomes a sample: counted (`other_model`, by dataset and, in the recent errors, by
provider), and the merge leaves it out. Once OTHER_MODEL_AFTER answers are in and most of this run's
came from another model, the run is held (Hold.MODEL), as an account condition holds it: routing or a
server that answers as another model is not paid on. Said once: a resume goes on.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from draftgen.core.bodies import Sampling
from draftgen.core.errors import DiskError
from draftgen.core.files import replacing
from draftgen.core.generate.api.answer import ChatAnswer
from draftgen.core.generate.api.classify import UNRECOGNIZED_4XX
from draftgen.core.generate.api.client import RequestFailed
from draftgen.core.generate.loop.context import RunContext
from draftgen.core.generate.loop.dataset_run import DatasetRun
from draftgen.core.generate.loop.prompt_files import ReadingStopped, read_dataset, read_prompts
from draftgen.core.generate.loop.prompts import Conversation, Prompt, Rejection, turn_id
from draftgen.core.generate.loop.run_state import Hold
from draftgen.core.generate.loop.spool import SpoolRecord, write_spool
from draftgen.core.generate.loop.spool_import import SpoolImport
from draftgen.core.generate.loop.stats import RateTracker
from draftgen.core.generate.money.budget import MoneyBudget
from draftgen.core.live import payloads as ev
from draftgen.core.live.stage_payloads import Repaired, Spooled, Unsaved
from draftgen.core.records import (
    ErrorKind,
    FailureLine,
    FailureRecord,
    ResponseLine,
    ResponseRecord,
    broken_answer,
    same_model,
    stored_responses,
)
from draftgen.core.rundir import JsonlAppender, RunDir, iter_jsonl
from draftgen.core.units import to_ms

PROMPT_CHUNK = 512
# A prompt file this small is read once: the prompts its count (scan_prompts) parsed are kept and asked,
# not parsed a second time. Bounded over every dataset of the run together, so that a big file is still
# streamed (its memory stays flat) and many small ones kept at once hold no more: at most this many
# prompts, of at most this size (their text in characters and MESSAGE_SIZE per message, ~25-70 MB).
KEEP_SCANNED_PROMPTS = 20_000
KEEP_SCANNED_SIZE = 16 << 20
MESSAGE_SIZE = 64
OTHER_MODEL_AFTER = 10  # answers this run before the share of them from another model is judged


@dataclass
class _Held:
    """A record the disk refused, waiting in memory."""
    ds: DatasetRun
    appender: JsonlAppender
    line: ResponseLine | FailureLine
    answer: ResponseLine | None  # the line, when it is a responses.jsonl line (else failures.jsonl)


# A record buffered for its file's next write, as _Held's fields: a tuple (one per record; a _Held is made
# only for one the disk refused).
_Buffered = tuple[DatasetRun, JsonlAppender, ResponseLine | FailureLine, ResponseLine | None]


class RecordBook:
    def __init__(self, ctx: RunContext, rundir: RunDir, datasets: dict[str, DatasetRun], money: MoneyBudget, *,
                 on_answer: Callable[[str, ResponseLine], None] | None) -> None:
        self.rundir = rundir
        self._datasets = datasets
        self.money = money
        self.errors = ctx.errors
        self._recent = ctx.recent
        self._model = ctx.config.api.model  # the model asked: an answer from another is never a sample
        # The last `model` an answer named and whether it is another model (record_answer): an object no
        # answer names at first.
        self._judged: tuple[object, bool] = (object(), False)
        self._answers_now = self._other_now = 0  # this run's answers, and those from another model
        self._other_said = False
        self.rates = RateTracker(clock=ctx.clock)
        self._redact = ctx.redact
        self._event = ctx.event
        self._control = ctx.control  # the run's owner: a write the disk refuses holds the run through it
        self._on_answer = on_answer  # the answer handed on once on disk (the live token view, core/run)
        self._held: list[_Held] = []
        self._writing: dict[JsonlAppender, deque[_Buffered]] = {}  # per file, its records buffered, in order
        # Per dataset: the prompts its count read (scan_prompts) and their size, until its source takes them;
        # counts run in threads.
        self._scanned: dict[str, tuple[list[Prompt], int]] = {}
        self._kept_lock = threading.Lock()
        # Set by a drain or stop now: the prompt files being read (in threads) stop at their next line, so a
        # quit never waits for a file read through (prompt_files.py ReadingStopped); the prompts not read stay
        # eligible for the next run.
        self.reading_stop = threading.Event()
        self._disk_error: DiskError | None = None   # why the records are held
        # earlier runs' spools, imported as datasets open
        self._spools = SpoolImport(rundir, ctx.control.spool_imported, ctx.event)

    @property
    def holding(self) -> int:
        return len(self._held)

    @property
    def held_answers(self) -> int:
        """Paid answers held in memory, not on disk."""
        return sum(1 for item in self._held if item.answer)

    # -- resume ---------------------------------------------------------------------------------

    def open(self, ds: DatasetRun) -> None:
        """Open the dataset's files (cutting a torn last line) and count what is already on disk."""
        rd = self.rundir
        responses, failures = self._appender(rd.responses(ds.config.name)), self._appender(rd.failures(ds.config.name))
        ds.open_files(responses, failures)
        for f in (responses, failures):
            if f.cut_bytes:
                self._event(Repaired(path=str(f.path), cut_bytes=f.cut_bytes, by_crash=True))
        self._spools.import_into(ds)
        for _, raw in stored_responses(rd.responses(ds.config.name)):
            rec = ResponseRecord.from_dict(raw)  # odd values in a hand-edited line count as nothing
            if rec.id in ds.done_ids:
                continue
            ds.answered(rec.id, rec.usage.completion_tokens, rec.usage.cost, short=rec.short,
                        other_model=not same_model(self._model, raw.get("model")), now=False,
                        calls=bool(rec.tool_calls), diverged=raw.get("diverged") is True,
                        replayed=raw.get("tool_results") == "replayed", prompt_tokens=rec.usage.prompt_tokens,
                        reasoning_tokens=rec.usage.reasoning_tokens)
        for _, failure in iter_jsonl(rd.failures(ds.config.name)):
            rid = str(failure.get("id"))
            if rid not in ds.done_ids:
                ds.failed_one(rid, now=False)

    def _appender(self, path: Path) -> JsonlAppender:
        """A records file whose lines of a tick go out in one write, each record's fate heard (`_written`)."""
        queue: deque[_Buffered] = deque()
        appender = JsonlAppender(path, coalesce=True, on_flush=lambda n, refused: self._written(queue, n, refused),
                                 on_sync_error=self._sync_failed)
        self._writing[appender] = queue
        return appender

    # -- spools of earlier runs (spool.py) ----------------------------------------------------------

    def load_spools(self) -> None:
        """Read this run directory's spool files; each dataset imports its records as it opens."""
        self._spools.load()

    def finish_import(self) -> None:
        """Every dataset is open: remove the spools imported whole; say which stay, and why."""
        self._spools.finish(set(self._datasets))

    def close(self) -> None:
        for ds in self._datasets.values():
            for f in (ds.responses, ds.failures):
                if f is not None:
                    f.close()

    def scan_prompts(self, ds: DatasetRun) -> None:
        """Count usable prompts and rewrite rejected.jsonl (derived from the input, so rewritten whole)."""
        total = rejected = fresh = conversations = turn_sum = 0
        by_turn: Counter[int] = Counter()
        all_turns = ds.config.turns == "all"
        items = read_dataset(ds.config.prompts, ds.config.turns, ds.config.max_turns, self.reading_stop)
        room, room_size = self._keep_room(ds.config.name)
        kept: list[Prompt] | None = [] if not all_turns else None
        size = 0
        with replacing(self.rundir.rejected(ds.config.name)) as out:  # on an error the old one stays
            for item in items:
                if isinstance(item, Rejection):
                    rejected += 1
                    out.write(orjson.dumps({"line": item.line, "id": item.id, "reason": item.reason,
                                            "file": str(ds.config.prompts), "ts": time.time()}) + b"\n")
                elif isinstance(item, Conversation):  # turns = "all": the units are turns
                    conversations += 1
                    turn_sum += item.turns * (item.turns + 1) // 2
                    by_turn.update(range(1, item.turns + 1))
                    total += item.turns
                    fresh += sum(turn_id(item.id, k) not in ds.done_ids for k in range(1, item.turns + 1))
                else:
                    total += 1
                    fresh += item.id not in ds.done_ids
                    if kept is not None:
                        for m in item.messages:
                            size += len(m["content"]) + MESSAGE_SIZE
                        if len(kept) < room and size <= room_size:
                            kept.append(item)
                        else:
                            kept = None
        if kept is not None:
            self._keep(ds.config.name, kept, size)
        ds.counted(total, rejected, fresh, conversations=(conversations, turn_sum, by_turn) if all_turns else None)

    def _keep_room(self, name: str) -> tuple[int, int]:
        """What the kept prompts of the other datasets leave (prompts, size); `name`'s own are dropped
        first (a count taken again replaces them)."""
        with self._kept_lock:
            self._scanned.pop(name, None)
            return self._room_left()

    def _keep(self, name: str, kept: list[Prompt], size: int) -> None:
        """Keep a dataset's counted prompts if they still fit beside the others' (counts can run at once)."""
        with self._kept_lock:
            room, room_size = self._room_left()
            if len(kept) <= room and size <= room_size:
                self._scanned[name] = (kept, size)

    def _room_left(self) -> tuple[int, int]:
        held = self._scanned.values()
        return (KEEP_SCANNED_PROMPTS - sum(len(k) for k, _ in held), KEEP_SCANNED_SIZE - sum(n for _, n in held))

    async def prompts(self, ds: DatasetRun) -> AsyncIterator[list[Prompt]]:
        """The dataset's prompts not yet on disk, in chunks: those its count kept (a small file) at once,
        else read in a thread PROMPT_CHUNK at a time, until a drain or stop now stops the reading."""
        with self._kept_lock:
            kept, _ = self._scanned.pop(ds.config.name, (None, 0))
        done = ds.done_ids
        if kept is not None:
            yield [p for p in kept if p.id not in done]
            return
        it: Iterator[Prompt | Rejection] = read_prompts(ds.config.prompts, ds.config.turns, self.reading_stop)

        def chunk() -> list[Prompt]:
            out: list[Prompt] = []
            for item in it:
                if isinstance(item, Prompt) and item.id not in done:
                    out.append(item)
                    if len(out) >= PROMPT_CHUNK:
                        break
            return out

        while True:
            try:
                batch = await asyncio.to_thread(chunk)
            except ReadingStopped:
                return
            if not batch:
                return
            yield batch

    # -- records --------------------------------------------------------------------------------

    def record_answer(self, ds: DatasetRun, prompt: Prompt, a: ChatAnswer, attempts: int, seq: int = 0,
                      sampling: Sampling | None = None) -> None:
        """The answer on disk (or held while the disk refuses); and the prompts set aside by a 4xx naming
        no known cause before request `seq` was sent fail as their own: the same parameters work.
        `sampling`: the line's `sampling` field (`sampling_of` the body sent), when the dataset records it."""
        for d in ds.doubts.answered(seq):  # set-aside prompts this answer shows were their own (rare)
            self.record_failure(ds, d.prompt, d.error, d.attempts)
        truncated = a.finish_reason == "length"
        # an agent step's answer may be its calls alone (isspace: not strip(), which copies the text)
        empty = not a.tool_calls and (not (content := a.content) or content.isspace())
        if (model := a.model) is not self._judged[0]:  # the redactor's one string for a model seen before
            self._judged = (model, not same_model(self._model, model))
        other = self._judged[1]
        line = ResponseRecord.line(
            prompt.id, prompt.messages, a.reasoning, a.content, a.tool_calls, a.finish_reason,
            a.native_finish_reason, a.provider, a.model, a.generation_id, a.usage, to_ms(a.latency_s), attempts,
            truncated, empty, to_ms(time.time()), a.token_ids, a.prompt_token_ids, prompt.turn, a.reasoning_details)
        if sampling is not None:
            line["sampling"] = sampling
        if a.server is not None:
            line["server"] = a.server  # a fleet's server that answered (api/fleet.py)
        turn = prompt.turn
        diverged = replayed = False
        if turn is not None:
            if turn.expect is not None and not broken_answer(
                    a.content, a.finish_reason, a.tool_calls, agent=True) and turn.diverges(a.tool_calls):
                line["diverged"] = diverged = True  # not the dataset's next move: its conversation ends
            replayed = turn.tool_results == "replayed"
        assert ds.responses is not None
        self._write(ds, ds.responses, line, line)
        u = a.usage
        ds.answered(prompt.id, u.completion_tokens, u.cost, short=truncated or empty, other_model=other,
                    calls=bool(a.tool_calls), diverged=diverged, replayed=replayed,
                    prompt_tokens=u.prompt_tokens, reasoning_tokens=u.reasoning_tokens)
        self._answers_now += 1
        if other:
            self._other_model(ds, prompt, a, attempts)
        if truncated or empty:
            self.errors.add(ErrorKind.LENGTH if truncated else ErrorKind.EMPTY_CONTENT)
            if truncated and (cut := ds.cut_to_say()):
                name = ds.config.name
                self._event(ev.CutAnswers(cut=cut, answered=ds.answered_now, dataset=name))
        self.rates.record(u.completion_tokens)

    def _other_model(self, ds: DatasetRun, prompt: Prompt, a: ChatAnswer, attempts: int) -> None:
        """An answer from another model: counted (by provider in the recent errors); the run held the first
        time most of this run's answers are (OTHER_MODEL_AFTER in)."""
        self._other_now += 1
        self.errors.add(ErrorKind.OTHER_MODEL)
        provider = a.provider if isinstance(a.provider, str) else ""
        self._recent.add(kind=ErrorKind.OTHER_MODEL, dataset=ds.config.name, prompt_id=prompt.id, attempt=attempts,
                         message=f"answered by model {a.model!r}, not {self._model!r}: kept, never a sample",
                         provider=provider)
        if self._other_said or self._answers_now < OTHER_MODEL_AFTER or self._other_now * 2 <= self._answers_now:
            return
        self._other_said = True
        self._control.hold(Hold.MODEL, (
            f"{self._other_now} of this run's {self._answers_now} answers came from another model than "
            f"{self._model!r} (the last: {a.model!r}, provider {provider or 'unnamed'!r}): they are paid for and "
            "kept, but never a sample (the merge leaves them out). The run is held rather than paying on: check "
            "[api] model, [request] provider and the server; r resumes anyway (headless: kill -USR1 <pid>)"))

    def fail_or_doubt(self, ds: DatasetRun, prompt: Prompt, e: RequestFailed, attempts: int, seq: int) -> None:
        """Record the prompt's failure, or set it aside: a 4xx naming no known cause (doubts.py)."""
        if e.kind in UNRECOGNIZED_4XX:
            ds.doubts.add(prompt, e, attempts, seq, ds.sent)
        else:
            self.record_failure(ds, prompt, e, attempts)

    def stop_doubted(self, ds: DatasetRun) -> bool:
        """The set-aside prompts held the dataset and its probes were refused too, or it has nothing left
        to send and answered nothing: the dataset's parameters, most likely; it stops (True: just now)."""
        return bool(ds.doubts) and ds.stop_for(ds.doubts.items[-1].error, self._redact)

    def settle_doubts(self, ds: DatasetRun) -> bool:
        """The dataset has nothing left to send: set-aside prompts fail as their own when its parameters
        are shown to work (doubts.py `Doubts.settle`); the others stay eligible and the dataset stops
        (True: just now)."""
        doubts = ds.doubts
        if not doubts or ds.stopped:
            return False
        if not (ds.answered_now or doubts.smoke_answered):
            return self.stop_doubted(ds)
        own, stop = doubts.settle()
        for d in own:
            self.record_failure(ds, d.prompt, d.error, d.attempts)
        return stop and self.stop_doubted(ds)

    def record_failure(self, ds: DatasetRun, prompt: Prompt, e: RequestFailed, attempts: int) -> None:
        record = FailureRecord(id=prompt.id, messages=prompt.messages, error_kind=e.kind, status=e.status,
                               message=self._redact(e.message), attempts=attempts, ts=to_ms(time.time()),
                               turn=prompt.turn)
        assert ds.failures is not None
        self._write(ds, ds.failures, record.to_dict(), None)
        ds.failed_one(prompt.id)

    def _write(self, ds: DatasetRun, appender: JsonlAppender, line: ResponseLine | FailureLine,
               answer: ResponseLine | None) -> None:
        """The record buffered for its file's next write (`_written` hears how it went), or held in memory
        behind the records the disk refused."""
        if self._held:
            self._held.append(_Held(ds, appender, line, answer))
            return
        self._writing[appender].append((ds, appender, line, answer))
        appender.append(line)

    def _written(self, queue: deque[_Buffered], n: int, refused: DiskError | None) -> None:
        """A write of a records file: its first `n` buffered records are on disk (an answer is handed on);
        the rest, when the disk refused them, is held in memory and the run pauses."""
        on_answer = self._on_answer
        for _ in range(n):
            ds, _appender, _line, answer = queue.popleft()
            if answer and on_answer is not None:
                on_answer(ds.config.name, answer)
        if refused is not None and queue:
            self._held.extend(_Held(*item) for item in queue)
            queue.clear()
            self._disk_error = refused
            self._control.hold(Hold.DISK, f"{refused}. The run is paused with {len(self._held)} record(s) held in "
                               "memory; free space and press r to resume (headless: kill -USR1 <pid>).")

    def synced(self, ds: DatasetRun) -> Awaitable[None]:
        """The dataset's records written so far durable against an OS crash (one fsync shared by every
        request of the moment, in a thread) once it is awaited, before its request counts as finished. An
        fsync that fails pauses the run (`_sync_failed`, told by the appender), as a write the disk refuses
        does. Most requests wrote to one file: they await its appender's future itself (a coroutine more
        on the way costs each request its frame and one more level to wake)."""
        responses, failures = ds.responses, ds.failures
        if responses is not None and (failures is None or not failures.unsynced):
            return responses.synced()  # a future already done when nothing is left to make durable
        return _each_synced((responses, failures))

    def _sync_failed(self, e: DiskError) -> None:
        """A records file's group commit failed: told once for each request that waited on it."""
        self._control.hold(Hold.DISK, f"{e}. The run is paused: the last records may not survive an OS "
                           "crash; check the disk and press r to resume (headless: kill -USR1 <pid>).")

    def flush_held(self) -> bool:
        """Write the held records in order; False (and still paused) when the disk refuses again."""
        while self._held:
            item = self._held[0]
            try:
                item.appender.append_now(item.line)
            except DiskError as e:
                self._disk_error = e
                self._control.hold(Hold.DISK, f"{e}. Still paused: {len(self._held)} record(s) held in memory.")
                return False
            self._held.pop(0)
            if item.answer:
                self._control.held_written()
                if self._on_answer is not None:
                    self._on_answer(item.ds.config.name, item.answer)
            if not self._held:
                self._control.release(Hold.DISK)  # "Still paused: N record(s) held" is no longer true
        return True

    def settle_held(self) -> None:
        """At the end of a run: write what is still held (space may be back); else spool it (spool.py),
        still counted as done (the next run imports it); only what no place takes is not counted as done
        (those prompts stay eligible for the next run), and the log says so."""
        for appender in self._writing:  # what a tick buffered is written (or held) before the end is decided
            appender.flush()
        if not self._held or self.flush_held():
            return
        answers = self.held_answers
        path, refused = write_spool(self.rundir.root, [
            SpoolRecord(item.ds.config.name, "responses" if item.answer else "failures", item.line)
            for item in self._held])
        if path is not None:
            self._control.held_spooled(answers, len(self._held) - answers, str(path))
            self._held.clear()
            self._control.release(Hold.DISK)
            self._event(Spooled(answers=answers, cause=str(self._disk_error), path=str(path),
                                   run_dir=str(self.rundir.root)))
            return
        self._control.held_lost(answers)
        lost: dict[str, int] = {}
        for item in self._held:
            item.ds.unrecorded(item.line["id"], answer=item.answer is not None)
            lost[str(item.appender.path)] = lost.get(str(item.appender.path), 0) + 1
        self._held.clear()
        self._control.release(Hold.DISK)
        where = ", ".join(f"{n} for {path}" for path, n in lost.items())
        self._event(Unsaved(records=sum(lost.values()), where=where, cause=str(self._disk_error),
                            refused="; ".join(refused)))


async def _each_synced(files: tuple[JsonlAppender | None, ...]) -> None:
    """Each records file's lines durable in turn (RecordBook.synced, when a request wrote to both or neither)."""
    for f in files:
        if f is not None and f.unsynced:
            await f.synced()
