"""The parts of a run its loop's objects share, handed down as one bundle (`RunParts`), built once by
the engine (engine.py) when the run has opened what they need: every dataset of the run, the money
budget and its spend ledger, the record book, and what the opening opened (the client, the costs,
the cross-dataset duplicates). With the `RunContext` (context.py) it is what the account watch, the
room, the requests and admission are built from."""

from __future__ import annotations

from dataclasses import dataclass

from draftgen.core.generate.loop.dataset_run import DatasetRun
from draftgen.core.generate.loop.opening import Opened
from draftgen.core.generate.loop.record_book import RecordBook
from draftgen.core.generate.money.budget import MoneyBudget
from draftgen.core.generate.money.spend import SpendLedger


@dataclass(frozen=True, slots=True)
class RunParts:
    datasets: dict[str, DatasetRun]
    money: MoneyBudget
    spend: SpendLedger
    book: RecordBook
    opened: Opened
