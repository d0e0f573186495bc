"""What a run reads and writes before its first request.

- `run.json`: the config (no key), fingerprints and versions, written first, so a full disk says
  so before anything is spent.
- The money: the spend ledger of every earlier run (a half-written last line cut), the worst-case
  prices (a run with a ceiling and no price refuses to start), the last smoke answer for the
  projection, and the settler, handed what earlier runs left pending to look up.
- The datasets: answers, failures and spend already on disk, every prompt file counted (so the
  projection covers datasets not started yet), and the cross-dataset duplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import orjson

from draftgen.core.config import Config
from draftgen.core.errors import DraftgenError
from draftgen.core.files import write_json_atomic
from draftgen.core.generate.account import read_account
from draftgen.core.generate.client import ChatClient
from draftgen.core.generate.duplicates import CrossDatasetDuplicates
from draftgen.core.generate.forecast import SmokeFigures
from draftgen.core.generate.ledger import DatasetRun, Ledger
from draftgen.core.generate.prices import Prices, fetch_prices, require_prices
from draftgen.core.generate.settle import Settler
from draftgen.core.generate.smoke import load_smoke_answer, load_smoke_answered
from draftgen.core.generate.spend import SpendLedger
from draftgen.core.rundir import RunDir


def write_run_json(rundir: RunDir, config: Config) -> None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        dg_version = version("draftgen")
    except PackageNotFoundError:
        dg_version = "unknown"
    info = {"config": config.public_dict(), "config_file": str(config.path),
            "fingerprint": config.run_fingerprint(),
            "fingerprints": {d.name: config.fingerprint(d) for d in config.datasets},
            "versions": {"draftgen": dg_version, "python": platform.python_version(),
                         "aiohttp": aiohttp.__version__, "orjson": orjson.__version__},
            "started_at": time.time()}
    write_json_atomic(rundir.run_json, info)  # a full disk at the start: a clear message


@dataclass
class Money:
    prices: dict[str, Prices | None]
    smoke: SmokeFigures | None
    settler: Settler


async def open_money(config: Config, rundir: RunDir, spend: SpendLedger, client: ChatClient,
                     event: Callable[[str, str, str], None], on_settled: Callable[[], None]) -> Money:
    cut = await asyncio.to_thread(spend.open)
    if cut:
        event("warn", "repaired", f"{spend.path}: cut a half-written last line ({cut} bytes)")
    if not spend.existed and not config.api.self_hosted:  # the key's usage before the directory's first attempt (`draftgen ledger`)
        with contextlib.suppress(Exception):
            usage = (await read_account(client, management_key=config.api.management_key())).key_usage
            if usage is not None:
                spend.set_key_baseline(usage)
    prices, listing_error = await fetch_prices(client, config)
    require_prices(config, prices, listing_error)
    for name, p in prices.items():
        event("info", "prices", f"{name}: worst case {p.describe()}" if p is not None else
              f"{name}: no price known ({listing_error or 'no provider allowed'}); no ceiling is set")
    smoke = await asyncio.to_thread(load_smoke_answer, rundir, config.run_fingerprint())
    settler = Settler(spend, client, config.api.generation_lookup_s, on_settled=on_settled,
                      self_hosted=config.api.self_hosted)
    settler.start()
    left = spend.lookups()
    if spend.pending:
        event("warn", "pending", f"{len(spend.pending)} attempt(s) of earlier runs not priced yet "
              f"count at their worst case (${spend.pending_usd:.4f}); {len(left)} looked up now")
    settler.add(left)
    return Money(prices, smoke, settler)


async def open_datasets(config: Config, rundir: RunDir, datasets: dict[str, DatasetRun], ledger: Ledger,
                        spend: SpendLedger) -> CrossDatasetDuplicates | None:
    """Returns the duplicates check, or None when there is nothing to compare."""
    # Spend and answers already on disk count against the budgets from the start.
    for ds in datasets.values():
        await asyncio.to_thread(ledger.open, ds)
    # A smoke test answered with a dataset's request shape shows its parameters work (doubts.py).
    smoke_answered = await asyncio.to_thread(load_smoke_answered, rundir, config.run_fingerprint())
    for name, ds in datasets.items():
        ds.doubts.smoke_answered = name in smoke_answered
    for ds in datasets.values():  # a directory from before the spend ledger: its answers' cost carries in
        spend.carry(ds.config.name, ds.cost)
    # A file that cannot be read fails when its dataset starts, as before.
    for ds in datasets.values():
        with contextlib.suppress(DraftgenError):
            await asyncio.to_thread(ledger.scan_prompts, ds)
    if not config.engine.skip_cross_dataset_duplicates:
        return None
    duplicates = CrossDatasetDuplicates()
    await asyncio.to_thread(duplicates.load, rundir.root, list(datasets))
    # One dataset: nothing to compare with, so no key is computed per prompt.
    return duplicates if duplicates.needed else None
