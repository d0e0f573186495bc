"""A request is one object (issue 51): a run's and a smoke test's requests are the same `Request`, asked
by the same `Request.attempts`, and the objects on the request path take at most 5 constructor
parameters (the run's parts handed down as one bundle)."""

from __future__ import annotations

import inspect

import pytest

from draftgen.core.generate.commands.smoke import SMOKE, run_smoke
from draftgen.core.generate.loop.admission import Admission
from draftgen.core.generate.loop.engine import Engine
from draftgen.core.generate.loop.record_book import RecordBook
from draftgen.core.generate.loop.request import Outcome, Request, RunTerms, Terms
from draftgen.core.generate.loop.room import Room
from draftgen.core.generate.loop.run_loop import RunLoop
from draftgen.core.generate.loop.service import Service
from draftgen.core.generate.loop.smoke_request import SmokeTerms
from draftgen.core.generate.loop.watch import AccountWatch
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import TEST_KEY, make_config


@pytest.mark.parametrize("cls", [Admission, RunTerms, Room, RecordBook, AccountWatch, Request, Service, RunLoop,
                                 SmokeTerms])
def test_constructors_on_the_request_path_take_at_most_five_parameters(cls: type) -> None:
    params = [p for p in inspect.signature(cls).parameters.values()]
    assert len(params) <= 5, f"{cls.__name__}({', '.join(p.name for p in params)})"


def test_the_request_books_through_its_terms_never_asking_which_terms_they_are() -> None:
    """Booking the outcome is a step of the `Terms` protocol, which the run's and the smoke test's terms
    both supply: the request has no booking step of its own that tells a run from a smoke test."""
    steps = {name for name, value in vars(Terms).items() if inspect.isfunction(value) and not name.startswith("_")}
    assert {"prices", "reserve", "failed", "answered", "book"} <= steps
    for terms in (RunTerms, SmokeTerms):
        assert steps <= {name for name, value in vars(terms).items() if inspect.isfunction(value)}, terms
        assert inspect.iscoroutinefunction(terms.book)
    assert not hasattr(Request, "_book")
    assert "RunTerms" not in inspect.getsource(Request.attempts)


async def test_a_smoke_test_and_a_run_ask_through_the_same_request(tmp_path, monkeypatch):
    """The smoke test's requests and the run's are `Request`s asked by `Request.attempts` and booked by their
    own terms' `book`; the smoke's answers are on the ledger as the run's are (at what the simulator billed)."""
    asked: list[tuple[str, str, Outcome]] = []
    booked: list[tuple[str, str, Outcome]] = []
    attempts = Request.attempts

    async def counted(self: Request) -> Outcome:
        outcome = await attempts(self)
        asked.append((type(self.terms).__name__, self.prompt.id, outcome))
        return outcome
    monkeypatch.setattr(Request, "attempts", counted)
    for cls in (RunTerms, SmokeTerms):
        def booking(book):  # each terms class's own book, as it is, with the request it booked noted
            async def noted(self, req: Request, outcome: Outcome) -> None:
                booked.append((type(self).__name__, req.prompt.id, outcome))
                await book(self, req, outcome)
            return noted
        monkeypatch.setattr(cls, "book", booking(cls.book))
    async with SimServer(SimConfig(seed=3, latency_scale=0.0, mean_completion_tokens=40), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 3, "max_tokens": 400}],
                          tables={"budget": {"max_usd": 5.0}, "tokenizer": {"path": str(bundled_kimi_path())}})
        result = await run_smoke(cfg, TEST_KEY)
        assert result.passed, result.summary()
        smoke_billed = sim.stats.billed_usd
        await Engine(cfg, TEST_KEY, seed=1).run()
    assert asked[0] == ("SmokeTerms", "smoke:a", Outcome.ANSWERED)
    assert sorted(asked[1:]) == [("RunTerms", f"a-{i}", Outcome.ANSWERED) for i in range(3)]
    assert booked[0] == asked[0] and sorted(booked[1:]) == sorted(asked[1:])
    records = RunDir(cfg.run_dir).responses("a").read_bytes().splitlines()
    assert len(records) == 3  # the run's terms recorded what they booked
    spend = SpendLedger.read(RunDir(cfg.run_dir).spend)
    assert spend.by_dataset[SMOKE] == pytest.approx(smoke_billed, abs=1e-9) and smoke_billed > 0
