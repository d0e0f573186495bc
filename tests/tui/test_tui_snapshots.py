"""Snapshot tests: every view of the TUI, rendered by the real app from deterministic data, compared
with the SVGs accepted in tests/tui/__snapshots__/ (update with `pytest --snapshot-update` after looking)."""

from __future__ import annotations

import pytest

from tests.fixtures import VIEWS, View

pytestmark = pytest.mark.usefixtures("utc")


@pytest.mark.parametrize("view", VIEWS, ids=[v.name for v in VIEWS])
def test_view(view: View, snap_compare) -> None:
    app, _ = view.app()
    assert snap_compare(app, terminal_size=view.size, run_before=view.settle)
