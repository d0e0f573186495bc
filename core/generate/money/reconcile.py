"""`draftgen ledger CONFIG`: the spend ledger's reconciliation, after pricing what is still pending.

Looks up every pending attempt that has a generation id (as a run does at its start), then prints
what was answered, refused, abandoned and priced, what is still pending or unknown (counted at the
worst case), the ledger's total, and the key's own usage from `GET /key` to hold it against (the
key's usage covers everything the key ever ran, this directory's runs among them).

An attempt a killed run sent but whose headers it never read has no generation id: it cannot be
looked up. Once none of those can still be running (a non-streamed generation runs on, and is
billed in full, after its client died, for up to `api.request_timeout_s` after it was sent) they
are priced together from the key's usage since the baseline the directory's first run recorded
(unknown.py: never below what they were billed, never above their worst case), as a run does; those
that may still be running stay at their worst case, and the report says when to look again. With
`--unknown-from-key` that is an error (exit 1), for a script that must not take them as priced.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass

from draftgen.core import runtime
from draftgen.core.config import Config
from draftgen.core.errors import LedgerBusyError
from draftgen.core.generate.api.account import read_account
from draftgen.core.generate.api.client import ChatClient, RequestFailed, get_failure
from draftgen.core.generate.money.settle import Settler
from draftgen.core.generate.money.spend import Reconciliation, SpendLedger
from draftgen.core.generate.money.unknown import due_unknown, settle_from_key
from draftgen.core.rundir import RunDir


def running_left_s(spend: SpendLedger, request_timeout_s: float, now: float | None = None) -> float:
    """Seconds until no attempt without a generation id can still be running (0: none can)."""
    unknown = spend.unknown()
    if not unknown:
        return 0.0
    last = max(p.sent_at for p in unknown)
    return max(0.0, last + request_timeout_s - (time.time() if now is None else now))


@dataclass(frozen=True)
class LedgerReport:
    reconciliation: Reconciliation
    looked_up: int
    key_usage_usd: float | None
    key_note: str
    max_usd: float | None
    from_key_usd: float | None = None   # what --unknown-from-key settled (None: nothing)
    from_key_note: str = ""
    busy_note: str = ""   # another process had the ledger open: read as it was, nothing priced
    from_key_wait_s: float = 0.0   # --unknown-from-key: the unknown attempts may run this long yet (exit 1)


async def reconcile(config: Config, api_key: str, *, lookup_s: float | None = None,
                    unknown_from_key: bool = False) -> LedgerReport:
    rd = RunDir(config.run_dir)
    spend = SpendLedger(rd.spend)
    busy = ""
    try:
        await asyncio.to_thread(spend.open)
    except LedgerBusyError:
        # A run (or a smoke test) has the ledger: it prices its own pending attempts. Show the
        # ledger as it is now, without writing to it.
        spend = await asyncio.to_thread(SpendLedger.read, rd.spend)
        busy = (f"another draftgen process (a run?) has {rd.spend} open: shown as it is now, nothing looked up "
                "or priced here (the run prices its own); its requests in flight count as pending or unknown "
                "here, at their worst case")
    todo = [] if busy else spend.lookups()
    try:
        async with ChatClient(config.api.base_url, api_key, concurrency=16, request_timeout_s=60,
                              connect_timeout_s=config.api.connect_timeout_s, referer=config.api.referer,
                              title=config.api.title) as client:
            look = config.api.generation_lookup_s if lookup_s is None else lookup_s
            settler = Settler(spend, client, look, bills_answers=config.api.server.kind.bills_answers or bool(busy))
            settler.start()
            settler.add(todo)
            # Each lookup gives up after `look`; the slack lets the last ones finish (it returns as soon
            # as they have), so a 5xx's missing record settles at $0 here rather than next time.
            await settler.drain(look + 10)
            # The attempts without a generation id that cannot still be running, with the ledger's exact
            # costs as they are before the key's usage is read (unknown.py).
            timeout = config.api.request_timeout_s
            due = None if busy or not config.api.server.kind.has_account else due_unknown(spend, timeout)
            if due is not None and due.attempts:
                await asyncio.sleep(settler.key_lag_s)  # a charge the key's usage shows late is in it
            try:
                usage = (await read_account(client, management_key=config.api.management_key())).key_usage
                key_usage, note = (usage, "GET /key usage: everything this key ran") if usage is not None \
                    else (None, "GET /key shows no usage")
            except RequestFailed as e:
                key_usage, note = None, get_failure("/key", e)
            except (TimeoutError, OSError) as e:
                key_usage, note = None, f"GET /key: {type(e).__name__}"
            unknown = 0 if due is None else len(spend.unknown())
            from_key = None if due is None or key_usage is None else settle_from_key(spend, due, key_usage)
            wait_s = 0.0 if busy else running_left_s(spend, timeout)
            from_key_note = ""
            if from_key is not None:
                from_key_note = (f"priced {len(due.attempts) if due else 0} attempt(s) without a generation id at "
                                 f"${from_key:.6f} together from the key's usage since the directory's first run")
            elif busy and unknown_from_key:
                from_key_note = "--unknown-from-key: nothing priced (a run has the ledger open)"
            elif unknown and key_usage is None:
                from_key_note = f"attempts without a generation id not priced: {note}"
            elif unknown and spend.key_baseline is None:
                from_key_note = ("attempts without a generation id not priced: the ledger has no key usage "
                                 "baseline (its first run could not read GET /key)")
            if wait_s > 0:
                later = (f"{len(spend.unknown())} attempt(s) without a generation id may still be generating (the "
                         f"last was sent less than api.request_timeout_s = {timeout:g} s ago): they count at their "
                         f"worst case; run `draftgen ledger` again in {wait_s:.0f} s to price them")
                from_key_note = f"{from_key_note}; {later}" if from_key_note else later
            if not unknown_from_key:
                wait_s = 0.0  # only the flag makes it an error
    finally:
        spend.close()
    return LedgerReport(spend.reconcile(), len(todo), key_usage, note, config.budget.max_usd, from_key, from_key_note,
                        busy, wait_s)


def print_report(report: LedgerReport) -> None:
    from rich.console import Console
    from rich.table import Table
    r = report.reconciliation
    table = Table(title="draftgen spend ledger (all runs of the directory)")
    table.add_column("attempts")
    table.add_column("count", justify="right")
    table.add_column("USD", justify="right")
    table.add_row("answered (usage.cost, or priced from the record)", str(r.answered), f"{r.answered_usd:.6f}")
    table.add_row("refused or not sent (not billed)", str(r.refused), "0")
    table.add_row("abandoned, priced (generation record)", str(r.abandoned_settled), f"{r.abandoned_settled_usd:.6f}")
    table.add_row("abandoned, still pending (worst case)", str(r.pending), f"<= {r.pending_worst_usd:.6f}")
    table.add_row("unknown: no generation id (worst case)", str(r.unknown), f"<= {r.unknown_worst_usd:.6f}")
    if r.carried_usd:
        table.add_row("carried from responses.jsonl (before the ledger)", "", f"{r.carried_usd:.6f}")
    table.add_row("total known", "", f"{r.total_usd:.6f}")
    table.add_row("counted against max_usd", "", f"{r.committed_usd:.6f}"
                  + (f" of {report.max_usd:.2f}" if report.max_usd is not None else ""))
    console = Console()
    console.print(table)
    # The notes quote the service's error messages: text, not Rich markup ("[/x]" must print, not raise).
    say = functools.partial(console.print, markup=False, highlight=False)
    say(report.busy_note or f"looked up {report.looked_up} pending generation(s)")
    if report.from_key_note:
        say(report.from_key_note)
    if report.key_usage_usd is not None:
        say(f"key usage ${report.key_usage_usd:.6f} ({report.key_note}); ledger total ${r.total_usd:.6f}, "
            f"difference ${report.key_usage_usd - r.total_usd:+.6f}")
    else:
        say(f"key usage not shown ({report.key_note})")


def ledger_command(config: Config, api_key: str, *, unknown_from_key: bool = False) -> int:
    report = runtime.run(reconcile(config, api_key, unknown_from_key=unknown_from_key))
    print_report(report)
    return 1 if report.from_key_wait_s else 0  # refused for now: a script must not take it as priced
