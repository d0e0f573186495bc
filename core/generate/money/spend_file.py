"""spend.jsonl while one process writes it (the spend ledger's file; its lines: spend.py)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import Callable
from pathlib import Path

from draftgen.core.errors import DiskError, LedgerBusyError
from draftgen.core.files import lock_file
from draftgen.core.generate.money.ledger_lines import EndLine, GenLine, LedgerLine
from draftgen.core.generate.money.spend_sums import Ticket
from draftgen.core.rundir import JsonlAppender


class LedgerFile:
    """spend.jsonl while one process writes it: locked (one writer at a time: a second would keep the
    ceiling against only its own half of the spend, and could cut the other's line in flight), lines
    appended whole, and a line the disk refused after its attempt left held back for the next write.
    Inside the event loop the lines of one tick go out in one write (`JsonlAppender(coalesce=True)`);
    `sync`/`synced` write what is buffered and make it durable against an OS crash (a `sent` line,
    before its request). An attempt's generation id waits for that write (`generation`): its end line
    carries it when the answer came in the same tick (`end`), else a gen line of its own goes out."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = lock_file(path)
        if lock is None:
            raise LedgerBusyError(f"{path} is open in another draftgen process (a run, a smoke test or "
                                  "`draftgen ledger` on this run directory): one at a time, so that max_usd "
                                  "counts every request; wait for it to end, or stop it")
        try:
            # Cuts a torn last line first; a tick's lines, one write, the generation ids still due added to it.
            self._out = JsonlAppender(path, coalesce=True, before_write=self._gens_due)
        except BaseException:
            os.close(lock)
            raise
        self._lock = lock
        self.cut_bytes = self._out.cut_bytes
        # Resolves once every line appended so far is written and durable (group commit: one fsync for all the
        # callers of a tick, or of the time the previous fsync ran, in a thread); DiskError when not. The
        # appender's own method, bound here: a `sent` line's wait, one call a request, forwards through nothing.
        self.synced: Callable[[], asyncio.Future[None]] = self._out.synced
        self._unwritten: list[LedgerLine] = []
        self._gens: list[Ticket] = []  # attempts whose generation id waits for the tick's write

    def generation(self, t: Ticket) -> None:
        """`t.gen` on the ledger: with its end line when that comes before the tick's write (most answers:
        the id and the body arrive together), else in a gen line of its own in that write; outside the
        event loop, a gen line now."""
        if self._out.write_soon():
            t.gen_due = True
            self._gens.append(t)
        else:
            self.append_or_hold(_gen_line(t))

    def end(self, t: Ticket, line: EndLine) -> None:
        """t's end line (`append_or_hold`), carrying its generation id when no gen line has gone out for it yet."""
        if t.gen_due:
            t.gen_due = False
            line["g"] = _gen(t)
        self.append_or_hold(line)

    def _gens_due(self) -> None:
        """The gen lines of the attempts that did not end since their id came, added to the write being made."""
        gens, self._gens = self._gens, []
        for t in gens:
            if t.gen_due:
                t.gen_due = False
                line = _gen_line(t)
                if self._unwritten:  # behind the lines held back (outside the loop the disk refused)
                    self._unwritten.append(line)
                else:
                    self._out.buffer(line)

    def append(self, line: LedgerLine) -> None:
        """Written after any held-back lines: at once outside the event loop (raises DiskError: for a `sent`
        line, do not send), at the tick's end or the next fsync inside it (`sync`/`synced` raise then)."""
        if self._unwritten:
            self._flush()
        self._out.append(line)

    def sync(self) -> None:
        """Every line appended so far written and durable against an OS crash before it returns (raises DiskError)."""
        self._out.sync()

    def _flush(self) -> None:
        while self._unwritten:
            self._out.append(self._unwritten[0])
            self._unwritten.pop(0)

    def append_or_hold(self, line: LedgerLine) -> None:
        """A line after the attempt left. A refused write is kept and written before the next line that
        goes through; lost with the process, it only makes the next run count the attempt at its
        worst case (its `sent` line is on disk)."""
        try:
            if self._unwritten:  # `append`, inline: its end line, one a request
                self._flush()
            self._out.append(line)
        except (DiskError, OSError):
            self._unwritten.append(line)

    def close(self) -> None:
        with contextlib.suppress(DiskError, OSError):
            self._flush()
        self._out.close()
        with contextlib.suppress(OSError):
            fcntl.flock(self._lock, fcntl.LOCK_UN)  # released even if a child still holds a copy
        os.close(self._lock)


def _gen(t: Ticket) -> str:
    gen = t.gen
    assert gen is not None  # set before the ledger is told (SpendLedger.generation)
    return gen


def _gen_line(t: Ticket) -> GenLine:
    return {"e": "gen", "a": t.id, "g": _gen(t)}
