"""What a run reads and writes before its first request.

- `run.json`: the config (no key), fingerprints and versions, written first, so a full disk says
  so before anything is spent.
- The costs (`OpenedMoney`): the spend ledger of every earlier run (a half-written last line cut), the worst-case
  prices (a run with a ceiling and no price refuses to start), the last smoke answer for the
  projection, the streaming mode it decided for a self-hosted server, and the settler, handed what
  earlier runs left pending to look up.
- The datasets: answers, failures and spend already on disk, every prompt file counted (so the
  projection covers datasets not started yet), and the cross-dataset duplicates. The answers are
  held against the spend ledger: those it has no `sent` line for (it lost lines in a crash) count at
  their recorded cost, once (`count_unledgered`).
"""

from __future__ import annotations

import asyncio
import contextlib
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
import orjson

from draftgen.core import __version__
from draftgen.core.config import Config
from draftgen.core.errors import DraftgenError
from draftgen.core.files import write_json_atomic
from draftgen.core.generate.api.account import read_account, read_key_usage
from draftgen.core.generate.api.client import ChatClient
from draftgen.core.generate.api.prices import Prices, fetch_prices, require_prices
from draftgen.core.generate.loop.dataset_run import DatasetRun
from draftgen.core.generate.loop.duplicates import CrossDatasetDuplicates
from draftgen.core.generate.loop.prompt_files import ReadingStopped
from draftgen.core.generate.loop.record_book import RecordBook
from draftgen.core.generate.loop.smoke_record import apply_smoke_stream, load_smoke_answer, load_smoke_answered
from draftgen.core.generate.money.forecast import SmokeFigures
from draftgen.core.generate.money.settle import Settler
from draftgen.core.generate.money.spend import CostSource, Pending, SpendLedger
from draftgen.core.live import payloads as ev
from draftgen.core.live.events import EventSink, Level, no_event
from draftgen.core.live.stage_payloads import Repaired
from draftgen.core.records import cost_of, count_of, stored_responses
from draftgen.core.rundir import RunDir


def _estimate(usage: object, p: Prices | None) -> float:
    """An answer without usage.cost: its tokens at the worst prices ($0 with none known: no ceiling)."""
    if p is None or not isinstance(usage, dict):
        return 0.0
    return count_of(usage.get("prompt_tokens")) * p.prompt + count_of(usage.get("completion_tokens")) * p.completion \
        + p.request


@dataclass
class Unledgered:
    """One dataset's answers against the spend ledger (`count_unledgered`)."""
    answers: int = 0    # in responses.jsonl with no `sent` line, not covered by a carry/found line
    usd: float = 0.0    # their recorded cost (an estimate for those without one)
    lost: int = 0       # answered on the ledger, with no answer in responses.jsonl


def count_unledgered(rundir: RunDir, datasets: Mapping[str, DatasetRun], spend: SpendLedger,
                     prices: Mapping[str, Prices | None]) -> dict[str, Unledgered]:
    """Compare each dataset's answers with the spend ledger's `sent` lines (read by `spend.open`): the
    answers it has no line for and no carry/found line covers (booked by the caller on a `found` line,
    so counted once), and the ledger's answers missing from responses.jsonl (they stay counted)."""
    out: dict[str, Unledgered] = {}
    for name, ds in datasets.items():
        sent = spend.sent_prompts(name)
        found = out[name] = Unledgered(lost=sum(1 for pid, answered in sent.items()
                                                if answered and pid not in ds.done_ids))
        covered = spend.covered.get(name, 0)
        by_cost = spend.carried_by_cost.get(name, 0.0)
        unmatched = sum(1 for i in ds.done_ids if i not in sent)  # answers and failures: an upper bound
        if unmatched <= covered and not by_cost:
            continue
        seen: set[str] = set()
        for _, raw in stored_responses(rundir.responses(name)):
            rid = str(raw.get("id"))
            if rid in sent or rid in seen:
                continue
            seen.add(rid)
            usage = raw.get("usage")
            cost = usage.get("cost") if isinstance(usage, dict) else None
            usd = cost_of(cost) if cost is not None else _estimate(usage, prices.get(name))
            if covered > 0:  # carried or found by an earlier opening: counted already
                covered -= 1
                continue
            if by_cost > 1e-9 and usd <= by_cost + 1e-9:  # an old carry line without its count
                by_cost -= usd
                continue
            by_cost = 0.0
            found.answers += 1
            found.usd += usd
    spend.forget_prompts()
    return out


def recorded_answers(rundir: RunDir, datasets: Mapping[str, DatasetRun],
                     spend: SpendLedger) -> list[tuple[Pending, float, CostSource]]:
    """Attempts left open on the ledger (a run killed between writing an answer and its end line, or a full
    disk that refused the ledger's lines while the answers went to a spool, imported since) whose
    prompt has an answer in responses.jsonl that the ledger does not have: each such prompt's last
    attempt left open (the one whose generation id the answer carries, when the ledger has it), with the
    answer's recorded usage.cost to settle it at, rather than at its worst case for good. A record
    with a generation id was priced by its own usage.cost ("usage.cost"); one without may hold the
    token estimate (above the bill), so it stays an "estimate". Reads only (a thread may run it); call
    before `count_unledgered`, which forgets the `sent` lines."""
    open_by: dict[str, dict[str, list[Pending]]] = {}
    for p in list(spend.pending.values()):
        if p.left_open and p.ds in datasets and not spend.sent_prompts(p.ds).get(p.prompt_id, True):
            open_by.setdefault(p.ds, {}).setdefault(p.prompt_id, []).append(p)
    out: list[tuple[Pending, float, CostSource]] = []
    for name, by_prompt in open_by.items():
        for _, raw in stored_responses(rundir.responses(name)):
            attempts = by_prompt.pop(str(raw.get("id")), None)
            usage = raw.get("usage")
            cost = usage.get("cost") if isinstance(usage, dict) else None
            if not attempts or cost is None:
                continue
            gen = raw.get("generation_id")
            p = next((a for a in attempts if gen and a.gen == gen), max(attempts, key=lambda a: a.sent_at))
            out.append((p, cost_of(cost), CostSource.USAGE if isinstance(gen, str) and gen else CostSource.ESTIMATE))
    return out


def write_run_json(rundir: RunDir, config: Config) -> None:
    info = {"config": config.public_dict(), "config_file": str(config.path),
            "fingerprint": config.run_fingerprint(),
            "fingerprints": {d.name: config.fingerprint(d) for d in config.datasets},
            "versions": {"draftgen": __version__, "python": platform.python_version(),
                         "aiohttp": aiohttp.__version__, "orjson": orjson.__version__},
            "started_at": time.time()}
    write_json_atomic(rundir.run_json, info)  # a full disk at the start: a clear message


@dataclass
class OpenedMoney:
    prices: dict[str, Prices | None]
    smoke: SmokeFigures | None
    settler: Settler


@dataclass(frozen=True)
class Opened:
    """What the run opened before its first request."""
    client: ChatClient
    costs: OpenedMoney
    duplicates: CrossDatasetDuplicates | None


async def open_costs(config: Config, rundir: RunDir, spend: SpendLedger, client: ChatClient,
                     event: EventSink, on_settled: Callable[[], None]) -> OpenedMoney:
    cut = await asyncio.to_thread(spend.open)
    if cut:
        event(Repaired(path=str(spend.path), cut_bytes=cut))
    # the key's usage before the directory's first attempt (`draftgen ledger`)
    if not spend.existed and config.api.server.kind.has_account:
        with contextlib.suppress(Exception):
            usage = (await read_account(client, management_key=config.api.management_key())).key_usage
            if usage is not None:
                spend.set_key_baseline(usage)
    prices, listing_error = await fetch_prices(client, config)
    require_prices(config, prices, listing_error)
    for name, p in prices.items():
        event(ev.PriceNote(prices=p.describe(), dataset=name) if p is not None else
              ev.PriceNote(cause=listing_error or "no provider allowed", dataset=name))
    smoke = await asyncio.to_thread(load_smoke_answer, rundir, config.run_fingerprint())
    await asyncio.to_thread(apply_smoke_stream, config, rundir)
    if config.api.stream_decided:
        event(ev.RequestKeys(url=config.api.base_url, smoke_json=str(rundir.smoke_json)))
    def over(p: Pending, cost: float, provider: str) -> None:
        event(ev.OverReservation(provider=provider or "(unnamed)", prompt_id=p.prompt_id, reserved_usd=p.worst,
                                 billed_usd=cost, by_record=True, dataset=p.ds))

    said: list[bool] = []

    def doubt(p: Pending, figure: str) -> None:  # said once a run (the settler counts them all)
        if not said:
            said.append(True)
            event(ev.BadBill(prompt_id=p.prompt_id, doubt=figure, by_record=True, counted_usd=p.worst, dataset=p.ds))

    def key_priced(n: int, cost: float, worst: float) -> None:
        event(ev.PendingAttempts(case="key_priced", attempts=n, usd=cost, worst_usd=worst))

    settler = Settler(spend, client, config.api.generation_lookup_s, on_settled=on_settled,
                      bills_answers=config.api.server.kind.bills_answers, on_over=over, on_doubt=doubt,
                      key_usage=lambda: read_key_usage(client), request_timeout_s=config.api.request_timeout_s,
                      on_key_priced=key_priced)
    settler.start()
    left = spend.lookups()
    if spend.pending:
        unknown = len(spend.unknown())
        by_key = bool(unknown) and settler.prices_unknown
        event(ev.PendingAttempts(case="open", attempts=len(spend.pending), worst_usd=spend.pending_usd,
                                 looked_up=len(left),
                                 unknown=unknown if by_key or config.api.server.kind.has_account else 0,
                                 due_s=settler.unknown_due_s() if by_key else None, at=Level.WARN))
    settler.add(left)
    return OpenedMoney(prices, smoke, settler)


async def open_datasets(config: Config, rundir: RunDir, datasets: dict[str, DatasetRun], book: RecordBook,
                        spend: SpendLedger, prices: Mapping[str, Prices | None] | None = None,
                        event: EventSink | None = None) -> CrossDatasetDuplicates | None:
    """Returns the duplicates check, or None when there is nothing to compare."""
    # Spend and answers already on disk count against the budgets from the start.
    for ds in datasets.values():
        await asyncio.to_thread(book.open, ds)
    # A smoke test answered with a dataset's request shape shows its parameters work (doubts.py).
    smoke_answered = await asyncio.to_thread(load_smoke_answered, rundir, config.run_fingerprint())
    for name, ds in datasets.items():
        ds.smoke_answered(name in smoke_answered)
    for ds in datasets.values():  # a directory from before the spend ledger: its answers' cost carries in
        spend.carry(ds.config.name, ds.cost, ds.done)
    say = event or no_event
    settled: dict[str, tuple[int, float]] = {}
    for p, cost, source in await asyncio.to_thread(recorded_answers, rundir, datasets, spend):
        p.answer = True  # on the loop: the settler writes the ledger too
        spend.settle(p, cost, source)
        n, total = settled.get(p.ds, (0, 0.0))
        settled[p.ds] = (n + 1, total + cost)
    for name, (n, total) in settled.items():
        say(ev.PendingAttempts(case="recorded", attempts=n, responses=str(rundir.responses(name)), usd=total,
                               dataset=name))
    # A ledger behind its answers (or the reverse), e.g. after an OS crash of a version without fsync.
    for name, found in (await asyncio.to_thread(count_unledgered, rundir, datasets, spend, prices or {})).items():
        if found.lost:
            say(ev.AnswersLost(lost=found.lost, responses=str(rundir.responses(name)), dataset=name))
        if found.answers:
            spend.found(name, found.answers, found.usd)  # on the loop: the settler writes the ledger too
            say(ev.UnledgeredAnswers(answers=found.answers, usd=found.usd, responses=str(rundir.responses(name)),
                              ledger=str(spend.path), dataset=name))
    # A file that cannot be read fails when its dataset starts, as before; a quit stops the count.
    for ds in datasets.values():
        with contextlib.suppress(DraftgenError, ReadingStopped):
            await asyncio.to_thread(book.scan_prompts, ds)
    if not config.engine.skip_cross_dataset_duplicates:
        return None
    duplicates = CrossDatasetDuplicates()
    await asyncio.to_thread(duplicates.load, rundir.root, list(datasets))
    # One dataset: nothing to compare with, so no key is computed per prompt.
    return duplicates if duplicates.needed else None
