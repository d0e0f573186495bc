"""The run's events on their way out (core/run/events.py): the one redaction covers the payload's
text fields and the message, before the views, events.log and the attach stream get them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson

from draftgen.core.live.events import Event, Level
from draftgen.core.live.hub import Hub
from draftgen.core.live.payloads import PriceNote, ProviderPastCap
from draftgen.core.live.snapshot import RunState, event_from_dict
from draftgen.core.live.stage_payloads import RunDone
from draftgen.core.run.events import EventPublisher
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.rundir import EventLog
from draftgen.core.secrets import Redactor
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import TEST_KEY, make_config


def test_an_event_is_redacted_once_on_its_way_out_its_payload_fields_and_its_message(tmp_path: Path) -> None:
    """A provider's error that quotes the key: the engine's part sends the payload as it is (no
    redaction of its own); the publisher cuts the key from every text field and the message, so the
    views, events.log and the attach JSON carry neither, and the figures stay as they were."""
    hub = Hub()
    sub = hub.subscribe(maxsize=10)
    publisher = EventPublisher(hub, Redactor(TEST_KEY))
    publisher.open_log(EventLog(tmp_path / "events.log"))
    publisher.emit(ProviderPastCap(provider=f"Solo {TEST_KEY}", prompt_id="p-1", times=2, dataset="a",
                                   cause=f"upstream refused Authorization: Bearer {TEST_KEY}"))
    publisher.close()
    item = sub.get_nowait()
    assert item is not None and item[0] == "event"
    event = item[1]
    assert isinstance(event, Event) and isinstance(event.payload, ProviderPastCap)
    wire = event.to_json().decode()
    assert TEST_KEY not in wire and TEST_KEY[-12:] not in wire and TEST_KEY[-12:] not in event.message
    assert TEST_KEY[-12:] not in (tmp_path / "events.log").read_text()
    assert event.message == event.payload.text() and "upstream refused Authorization" in event.message
    assert (event.payload.prompt_id, event.payload.times, event.dataset, event.level) == ("p-1", 2, "a", Level.WARN)
    assert event_from_dict(orjson.loads(wire)) == event


async def test_a_run_says_its_end_and_prices_as_figures_the_views_read_not_words(tmp_path: Path) -> None:
    """A run against the simulator: the events that were one line made at the call site now carry the
    figures it computed: the run's end its spend (this run, all runs) as the ledger has it, each
    dataset's price note its worst-case prices; the message is the payload's text, word for word."""
    async with SimServer(SimConfig(seed=3, latency_scale=0.0, mean_completion_tokens=30), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 3, "concurrency": 2}])
        pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True, serve_attach=False, reconstruct=False)
        seen: list[Event] = []
        pipeline.hub.publish_event = seen.append  # type: ignore[method-assign]
        await pipeline.start()
        try:
            assert await asyncio.wait_for(pipeline.generate(), 120) == RunState.DONE
        finally:
            await pipeline.close()
        spend = pipeline.engine.spend
    assert all(e.message == e.payload.text() for e in seen)
    done = [e.payload for e in seen if isinstance(e.payload, RunDone)]
    assert len(done) == 1 and done[0].state == RunState.DONE and done[0].ended.startswith("DONE: 3 of 3 answered")
    assert done[0].spent_usd == spend.spent_usd > 0
    assert done[0].spent_run_usd == done[0].spent_usd and done[0].pending_usd is None
    prices = [e.payload for e in seen if isinstance(e.payload, PriceNote)]
    assert [(p.dataset, p.prices.startswith("$")) for p in prices if p.prices] == [("a", True)], prices
