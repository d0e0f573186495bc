"""The run loop's parts, built once the run has opened what they need.

`Engine.run` opens the client, the money (prices, the settler, the last smoke answer) and the
datasets (what is on disk, the cross-dataset duplicates) and bundles them with the datasets, the money
budget, the spend ledger and the record book (parts.py `RunParts`); only then is a `RunLoop` built,
whole: the account watch, the room (room.py), the service and the requests' terms (service.py,
request.py: each request from its admission to its record) and admission are built from the run's
context and its parts, so none of them is half-built while the run goes.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from draftgen.core.generate.api.account import AccountStop
from draftgen.core.generate.loop.admission import Admission
from draftgen.core.generate.loop.context import RunContext
from draftgen.core.generate.loop.parts import RunParts
from draftgen.core.generate.loop.request import RunTerms
from draftgen.core.generate.loop.room import Room, price_trust
from draftgen.core.generate.loop.service import Service
from draftgen.core.generate.loop.watch import AccountWatch
from draftgen.core.live import payloads as ev


class RunLoop:
    """The account watch, the room, the service, the requests' terms and admission of one run."""

    def __init__(self, ctx: RunContext, parts: RunParts, *, rng: random.Random, drain: Callable[[], None],
                 resume: Callable[[], None]) -> None:
        self._ctx = ctx
        self._datasets = parts.datasets
        self._book = parts.book
        self._drain = drain    # the engine's drain (a refused key)
        self._resume = resume  # the engine's resume (an account condition cleared)
        self.watch = AccountWatch(ctx, parts, on_key_refused=self._key_refused, on_cleared=self._account_cleared)
        self.room = Room(ctx, parts, self.watch, trust=price_trust(ctx, parts))
        self.service = Service(ctx, parts.opened.client, rng)
        self.admission = Admission(RunTerms(ctx, parts, self.room, self.watch, self.service))

    async def run(self) -> None:
        """Every dataset admitted until it has nothing left (or a budget, drain or stop ends it)."""
        await self.service.server_ids()
        beside = [asyncio.create_task(self.admission.grow_limits()), asyncio.create_task(self.watch.watch())]
        try:
            datasets = self._datasets.values()
            if self._ctx.config.engine.parallel:
                await asyncio.gather(*(self.admission.run(ds) for ds in datasets))
            else:
                for ds in datasets:
                    await self.admission.run(ds)
        finally:
            for task in beside:
                task.cancel()
            self.watch.cancel()

    # -- what the account watch tells the run ----------------------------------------------------

    def _key_refused(self, stop: AccountStop) -> None:
        alert = stop.alert(paused=False)
        self._ctx.control.say(alert)
        self._ctx.event(ev.AccountChanged(alert=alert))
        self._drain()

    def _account_cleared(self) -> None:
        if self._book.holding and not self._book.flush_held():
            return
        self._resume()
