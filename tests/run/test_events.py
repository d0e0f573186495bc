"""The run's events on their way out (core/run/events.py): the one redaction covers the payload's
text fields and the message, before the views, events.log and the attach stream get them."""

from __future__ import annotations

from pathlib import Path

import orjson

from draftgen.core.live.events import Event, Level
from draftgen.core.live.hub import Hub
from draftgen.core.live.payloads import ProviderPastCap
from draftgen.core.live.snapshot import event_from_dict
from draftgen.core.run.events import EventPublisher
from draftgen.core.rundir import EventLog
from draftgen.core.secrets import Redactor
from tests.helpers import TEST_KEY


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
