"""The app's keys (tui/app.py): each one wired to a `Controls` call or a view, and which ones an
attached viewer (read-only) gets: the keys that change the run leave its footer and say why instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from textual.app import App

from draftgen.core.live import snapshot as snap
from draftgen.core.live.control import Action, Controls
from draftgen.core.live.snapshot import RunSnapshot
from draftgen.tui.panels.eventlog import EventLogPanel, EventStore
from draftgen.tui.panels.panel import SelectablePanel
from draftgen.tui.panels.stages import active_stages
from draftgen.tui.screens.choice import MERGE_ANYWAY, OTHER_MERGE, ChoiceScreen
from draftgen.tui.screens.drill import DrillScreen, Target
from draftgen.tui.screens.help import HelpScreen
from draftgen.tui.screens.history import HistoryScreen
from draftgen.tui.screens.logview import LogScreen
from draftgen.tui.screens.quitdialog import SPOOL, STOP, QuitScreen
from draftgen.tui.screens.smoke import SmokeScreen

# Actions that change the run: hidden from the footer when attached read-only, where their keys
# answer that the viewer is read-only.
CONTROL_ACTIONS = frozenset(Action)  # p, r and the stages' keys: named like the actions they ask for
VIEW_ACTIONS = frozenset({"log", "search", "history"})
APP_ACTIONS = CONTROL_ACTIONS | VIEW_ACTIONS | {"quit_run", "help", "read_only"}
FINAL_STATES = (snap.RunState.DONE, snap.RunState.STOPPED, snap.RunState.DRAINED, snap.RunState.WAITING,
                snap.RunState.LIMITED)
VIEW_SCREENS = (LogScreen, HistoryScreen, DrillScreen)

# Typed as the App it is mixed into; a plain class at run time, so the App stays DraftgenApp's own base.
if TYPE_CHECKING:
    _App = App[None]
else:
    _App = object


def stage_action(name: str) -> str:
    """The action a stage's key runs: RunKeys' own `action_<name>` when it asks something first (the
    smoke screen, merge's and extract's questions), else the plain `stage(name)`."""
    return name if hasattr(RunKeys, f"action_{name}") else f"stage({name!r})"


class RunKeys(_App):
    """The actions behind DraftgenApp's BINDINGS, mixed into it: the app's controls, latest snapshot and
    event store are what they act on."""

    controls: Controls
    latest: RunSnapshot | None
    events: EventStore
    quit_requested: bool
    run_dir: Path | None

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action not in APP_ACTIONS:
            return True
        if len(self.screen_stack) > 1:
            # A view (log, history, drill-down) still quits like the main screen; a dialog has its own keys.
            return action == "quit_run" and isinstance(self.screen, VIEW_SCREENS)
        if action == "read_only":
            return self.controls.read_only
        if self.controls.read_only and action in CONTROL_ACTIONS:
            return False  # hidden from the footer; the key answers through action_read_only
        return True

    def action_read_only(self) -> None:
        self.clear_notifications()  # one toast that is replaced, not a stack that covers the screen
        self.notify("read-only: attached viewer (control keys work in the terminal that runs it)",
                    title="attached", severity="warning")

    # -- views ------------------------------------------------------------------------------------

    def on_selectable_panel_open(self, message: SelectablePanel.Open) -> None:
        if self.latest is not None:
            self.push_screen(DrillScreen(Target(message.what, message.name), self.latest, run_dir=self.run_dir))

    def action_log(self) -> None:
        self.push_screen(LogScreen(self.events, self._dataset_names()))

    def action_search(self) -> None:
        self.push_screen(LogScreen(self.events, self._dataset_names(), search=True))

    def action_history(self) -> None:
        self.push_screen(HistoryScreen(self.latest))

    def action_scroll_log(self, how: str) -> None:
        log = self.screen_stack[0].query_one(EventLogPanel)
        getattr(log, f"action_{how}")()

    def _dataset_names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.latest.datasets) if self.latest else ()

    def _allowed(self, action: Action | str) -> bool:
        """Ask the controls first; a stage that cannot start yet says why instead."""
        reason = self.controls.unavailable(action)
        if reason:
            self.clear_notifications()
            # The reason quotes config keys ("[extract] model"): text, not Textual markup.
            self.notify(reason, title=f"{action}: not available", severity="warning", markup=False)
            return False
        return True

    def action_stage(self, name: str) -> None:
        """A stage of the registry that asks nothing first: started, its progress in the stages panel."""
        if self._allowed(name):
            self.controls.start_stage(name)
            self.notify(f"{name} started: progress in the stages panel", title=name)

    def action_pause(self) -> None:
        if self._allowed(Action.PAUSE):
            self.controls.pause()

    def action_resume(self) -> None:
        if self._allowed(Action.RESUME):
            self.controls.resume()

    def action_smoke(self) -> None:
        if self._allowed(Action.SMOKE):
            self.controls.run_smoke()
            self.push_screen(SmokeScreen(self.latest))

    def action_merge(self) -> None:
        if not self._allowed(Action.MERGE):
            return
        question = self.controls.merge_question()  # hidden states exist: they belong to the merge now in merged/
        if question is None:
            self._start_merge(replace_hidden_states=False)
        else:
            self.push_screen(ChoiceScreen("merge", "Merge again?", question, MERGE_ANYWAY),
                             lambda choice: None if choice is None else self._start_merge(replace_hidden_states=True))

    def _start_merge(self, *, replace_hidden_states: bool) -> None:
        self.controls.start_merge(replace_hidden_states=replace_hidden_states)
        self.notify("merge started: progress in the stages panel", title="merge")

    def action_extract(self) -> None:
        if not self._allowed(Action.EXTRACT):
            return
        question = self.controls.extract_question()  # hidden states of another merge: never added to
        if question is None:
            self._start_extract("refuse")
        else:
            self.push_screen(ChoiceScreen("extract", "Hidden states of another merge.", question, OTHER_MERGE),
                             self._start_extract)

    def _start_extract(self, choice: str | None) -> None:
        if choice is None:
            return  # cancelled
        self.controls.start_extract(on_other_merge=choice)
        self.notify("extraction started: progress in the stages and GPU panels", title="extract")

    def action_quit_run(self) -> None:
        if self.controls.read_only:
            self.exit()  # a viewer closes itself only; the run goes on
            return
        while len(self.screen_stack) > 1 and isinstance(self.screen, VIEW_SCREENS):
            self.pop_screen()
        if len(self.screen_stack) > 1:
            return
        # Quit is never refused (it is not an Action: the dialog below asks drain or stop).
        s = self.latest
        busy = s is None or s.state not in (*FINAL_STATES, snap.RunState.IDLE) or any(
            st.state == "running" for st in active_stages(s))
        if not busy:
            self.controls.quit(drain=True)  # nothing in flight: nothing to choose between
            self.exit()
            return
        self.controls.quit_asked(True)  # a run not started yet (the smoke test runs) waits for the answer
        self.push_screen(QuitScreen(s.throughput.in_flight if s else 0, s.held_answers if s else 0, snapshot=s),
                         self._quit_chosen)

    def _quit_chosen(self, choice: str | None) -> None:
        if choice is None:
            self.controls.quit_asked(False)
            return
        self.quit_requested = True
        drain = choice != STOP  # wait and spool both let the requests in flight finish
        self.controls.quit(drain=drain)
        self.controls.quit_asked(False)
        if choice == SPOOL:
            self.controls.spool_held()
        # Stop now means now: the engine winds down after the screen is gone. A drain keeps the
        # screen up until the engine reports the run stopped (q again offers stop now).
        if not drain or (self.latest is not None and self.latest.finished):
            self.exit()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.controls.read_only))
