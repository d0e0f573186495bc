"""Snapshot tests: every view of the TUI, rendered by the real app from deterministic data, compared
with the SVGs accepted in tests/__snapshots__/ (update with `pytest --snapshot-update` after looking)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from tests.fixtures import VIEWS, View


@pytest.fixture(autouse=True)
def utc() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TZ", "UTC")
        time.tzset()
        yield
    time.tzset()


@pytest.mark.parametrize("view", VIEWS, ids=[v.name for v in VIEWS])
def test_view(view: View, snap_compare) -> None:
    app, _ = view.app()
    assert snap_compare(app, terminal_size=view.size, run_before=view.settle)
