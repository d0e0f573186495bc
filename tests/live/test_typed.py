"""The typed control surface: actions, stages, drill targets and the reason a
request may not go out are enums, not strings whose meaning a second call has to find out."""

from __future__ import annotations

from pathlib import Path

from draftgen.core.generate.money.budget import BlockReason, MoneyBudget
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.live.control import Action
from draftgen.core.live.snapshot import STAGE_NAMES, Stage
from draftgen.tui.keys import CONTROL_ACTIONS
from draftgen.tui.panels.datasets import DatasetsPanel
from draftgen.tui.panels.errors import ErrorsPanel
from draftgen.tui.panels.panel import DrillKind
from draftgen.tui.panels.providers import ProvidersPanel


def test_the_keys_ask_for_exactly_the_actions_the_controls_know() -> None:
    assert CONTROL_ACTIONS == frozenset(Action)
    assert "pause" in CONTROL_ACTIONS  # Textual names actions by string: the enum compares equal


def test_stages_are_one_enum_in_the_order_a_run_goes() -> None:
    assert STAGE_NAMES == (Stage.SMOKE, Stage.GENERATION, Stage.TOKENS, Stage.MERGE, Stage.EXTRACT)


def test_each_selectable_panel_names_what_its_rows_drill_into() -> None:
    assert (DatasetsPanel.WHAT, ErrorsPanel.WHAT, ProvidersPanel.WHAT) == (
        DrillKind.DATASET, DrillKind.KIND, DrillKind.PROVIDER)


def test_a_blocked_request_says_which_limit_holds_it(tmp_path: Path) -> None:
    spend = SpendLedger(tmp_path / "spend.jsonl")
    spend.open()
    try:
        money = MoneyBudget(max_usd=1.0, floor_usd=0.5, spend=spend)
        assert money.blocked(0.1) is None
        over = money.blocked(2.0)
        assert over is not None and over.reason == BlockReason.MAX_USD and "max_usd reached" in str(over)
        money.set_balance(0.55, "credits")
        floor = money.blocked(0.1)  # under the ceiling, but the balance would fall below the floor
        assert floor is not None and floor.reason == BlockReason.CREDIT_FLOOR and "credit floor" in floor.message
        assert money.blocked(2.0).reason == BlockReason.MAX_USD  # the ceiling is said first
    finally:
        spend.close()
