"""Drill-down (enter on a dataset, an error kind or a provider): its figures and its recent failed
attempts with prompt ids, providers, attempts and messages, newest first, updated live. A turns =
"all" dataset's also shows a conversation step by step (tool calls and results included), read from
its responses.jsonl: the newest, or an older one with [ and ] (screens/conversation.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from draftgen.core.live.snapshot import ErrorRecord, RunSnapshot
from draftgen.core.rundir import RunDir
from draftgen.tui import fmt
from draftgen.tui.panels.datasets import is_agent
from draftgen.tui.panels.header import RunHeader
from draftgen.tui.panels.panel import DrillKind
from draftgen.tui.screens.conversation import ShownConversation, conversations, draw_conversation, pick, read_tail

DATASET, KIND, PROVIDER = DrillKind.DATASET, DrillKind.KIND, DrillKind.PROVIDER


@dataclass(frozen=True)
class Target:
    what: DrillKind
    name: str

    def matches(self, r: ErrorRecord) -> bool:
        field = {DATASET: r.dataset, KIND: r.kind, PROVIDER: r.provider}[self.what]
        return field == self.name


def _facts(rows: list[tuple[str, str | Text]]) -> Table:
    table = Table.grid(padding=(0, 2, 0, 0))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    for k, v in rows:
        table.add_row(k, Text(v) if isinstance(v, str) else v)  # a server's text, not Rich markup
    return table


def _dataset_facts(s: RunSnapshot, name: str) -> list[tuple[str, str | Text]]:
    d = next((d for d in s.datasets if d.name == name), None)
    if d is None:
        return [("dataset", Text("not in this run", style="dim"))]
    budget = (f"{fmt.tokens(d.tokens_used)} of {fmt.tokens(d.token_budget)}" if d.token_budget
              else fmt.tokens(d.tokens_used))
    rows: list[tuple[str, str | Text]] = [
        ("status", d.status),
        ("answered", f"{fmt.count(d.done)} of {fmt.count(d.total)} "
                     f"({fmt.percent(d.done + d.failed, d.total)} finished)"),
        ("failed for good", fmt.count(d.failed)),
        ("skipped (budget)", fmt.count(d.skipped)),
        ("truncated", fmt.count(d.truncated)),
        ("rejected lines", fmt.count(d.rejected)),
        ("in flight", f"{fmt.count(d.in_flight)} (limit {fmt.count(d.effective_concurrency)} of "
                      f"{fmt.count(d.concurrency)})"),
        ("tokens", budget),
        ("cost", f"{fmt.usd(d.cost_usd)}, projected {fmt.usd(d.projected_cost_usd)}"),
    ]
    if d.other_model:
        rows.insert(5, ("other model", Text(f"{fmt.count(d.other_model)} answered by another model than the one "
                                            "asked: kept, never a sample", style="bold red")))
    if d.conversations:  # turns = "all": the counts above are turns (an agent dataset's: steps)
        agent = is_agent(d)
        rows.append(("conversations", f"{fmt.count(d.conversations_done)} of {fmt.count(d.conversations)} done, "
                                      f"{fmt.count(d.conversations_ended)} ended early"
                                      + (f" ({fmt.count(d.diverged)} diverged)" if agent else "")))
        if agent:
            rows.append(("tool calls", f"{fmt.count(d.tool_calls)} answers called tools"
                         + (f" (by step: {_by_step(d.tool_calls_by_number)})" if any(d.tool_calls_by_number) else "")))
            if any(d.diverged_by_number):
                rows.append(("diverged at step", _by_step(d.diverged_by_number)))
            if d.replayed:  # tool_results = "replay"
                rows.append(("replayed results", f"{fmt.count(d.replayed)} steps sent with a replayed tool result"))
        if d.turns_by_number:
            word, letter = ("step", "s") if agent else ("turn", "t")
            rows.append((f"answered by {word}", "  ".join(f"{letter}{k} {fmt.count(done)}/{fmt.count(total)}"
                                                         for k, (done, total) in enumerate(d.turns_by_number, 1))))
        if d.last_conversation:
            head, *turns = d.last_conversation
            rows.append(("last conversation", "\n".join([head, *(f"  {t}" for t in turns)])))
    if d.message:
        rows.append(("note", d.message))
    return rows


def _by_step(counts: tuple[int, ...]) -> str:
    """Counts by step number, those above 0: "s1 20  s2 12"."""
    return "  ".join(f"s{k} {fmt.count(n)}" for k, n in enumerate(counts, 1) if n)


def _kind_facts(s: RunSnapshot, kind: str) -> list[tuple[str, str | Text]]:
    counts = dict(s.errors)
    total = sum(counts.values())
    n = counts.get(kind, 0)
    return [("attempts", f"{fmt.count(n)} ({fmt.percent(n, total)} of all errors)"),
            ("retries (all kinds)", fmt.count(s.retries))]


def _provider_facts(s: RunSnapshot, name: str) -> list[tuple[str, str | Text]]:
    answers = dict(s.providers)
    total = sum(answers.values())
    st = next((p for p in s.provider_stats if p.name == name), None)
    rows: list[tuple[str, str | Text]] = [("share", f"{fmt.percent(answers.get(name, 0), total)} of "
                                                    f"{fmt.count(total)} answers ({fmt.count(answers.get(name, 0))})")]
    if st is not None:
        tried = st.answers + st.errors
        rows += [("errors", f"{fmt.count(st.errors)} attributed ({fmt.percent(st.errors, tried)} of its attempts)"),
                 ("latency", f"mean {st.latency_mean_s:.1f} s, p90 {st.latency_p90_s:.1f} s (recent answers)"),
                 ("avg completion", f"{fmt.count(st.completion_tokens / st.answers) if st.answers else '—'} tokens")]
    f = next((f for f in s.fidelity if f.name == name), None)
    if f is None or f.answer_exact is None:
        rows.append(("token-count agreement", Text("no answer reconstructed yet", style="dim")))
    else:
        agreement = f"answer counts exact in {f.answer_exact:.0%} of {fmt.count(f.answers)} reconstructed"
        if f.prompt_exact is not None:
            agreement += f", prompt counts in {f.prompt_exact:.0%}"
        rows.append(("token-count agreement", agreement))
        if f.prompt_by_turn:  # multi-turn answers: the history rendering checked turn by turn
            rows.append(("prompt by turn", ", ".join(
                f"{t.turn}: {'—' if t.exact is None else f'{t.exact:.0%}'} exact"
                + (f" ({t.mean_diff:+.1f})" if t.mean_diff else "") for t in f.prompt_by_turn)))
        if f.flagged:
            rows.append(("flagged", Text(f.flagged, style="bold red")))
    return rows


def draw_drill(s: RunSnapshot, target: Target, conversation: RenderableType | None = None) -> RenderableType:
    facts = {DATASET: _dataset_facts, KIND: _kind_facts, PROVIDER: _provider_facts}[target.what](s, target.name)
    records = [r for r in reversed(s.recent_errors) if target.matches(r)]
    table = Table(box=None, expand=True, padding=(0, 1, 0, 0), show_edge=False, header_style="bold")
    table.add_column("time", no_wrap=True, style="dim")
    if target.what != DATASET:
        table.add_column("dataset", no_wrap=True, max_width=14, overflow="ellipsis")
    table.add_column("prompt", no_wrap=True, max_width=18, overflow="ellipsis")
    if target.what != KIND:
        table.add_column("kind", no_wrap=True, max_width=18, overflow="ellipsis")
    if target.what != PROVIDER:
        table.add_column("provider", no_wrap=True, max_width=16, overflow="ellipsis")
    table.add_column("try", justify="right", no_wrap=True)
    table.add_column("message", ratio=1, overflow="fold")
    for r in records:
        row: list[str | Text] = [fmt.wall_time(r.ts)]
        if target.what != DATASET:
            row.append(r.dataset)
        row.append(r.prompt_id)
        if target.what != KIND:
            row.append(r.kind)
        if target.what != PROVIDER:
            row.append(r.provider or Text("—", style="dim"))
        row.append(Text(f"{r.attempt}" + (" ✗" if r.final else ""), style="bold red" if r.final else ""))
        row.append(r.message)
        # The dataset, prompt id, provider and message quote files and servers: text, not Rich markup.
        table.add_row(*(Text(c) if isinstance(c, str) else c for c in row))
    head = Text.assemble((f"{target.what} ", "dim"), (target.name, "bold"))
    recent = Text("recent errors, newest first (✗: the prompt failed for good)", style="bold underline") \
        if records else Text("no errors recorded for it in this run", style="green")
    parts: list[RenderableType] = [head, Text(""), _facts(facts), Text("")]
    if conversation is not None:
        parts += [conversation, Text("")]
    return Group(*parts, recent, table if records else Text(""))


# A running dataset's file is read again at most this often (while its answered count moves).
REREAD_S = 2.0


class DrillScreen(Screen[None]):
    BINDINGS = [
        Binding("escape", "back", "back"),
        Binding("j,down", "scroll(1)", "scroll", show=False),
        Binding("k,up", "scroll(-1)", show=False),
        Binding("left_square_bracket", "browse(-1)", "older conversation"),
        Binding("right_square_bracket", "browse(1)", "newer conversation"),
    ]

    def __init__(self, target: Target, snapshot: RunSnapshot, *, run_dir: Path | None = None) -> None:
        super().__init__()
        self.target = target
        self.latest = snapshot
        self._key: object = None
        # A turns = "all" dataset's responses file, when the run directory is known.
        self._responses = RunDir(run_dir).responses(target.name) if run_dir is not None and \
            target.what == DATASET else None
        self._found: list[ShownConversation] = []
        self._pinned: str | None = None   # the conversation browsed to (None: the newest)
        self._read_at: tuple[float, int] | None = None  # when the file was read, and the count then
        self._reads = 0

    def compose(self) -> ComposeResult:
        yield RunHeader("draftgen", id="header")
        with VerticalScroll(id="drill", classes="panel") as box:
            # A provider's name is a server's text, a dataset's the config's: text, not markup ("[/x]" raised).
            box.border_title = Text(f"{self.target.what}: {self.target.name}")
            yield Static(id="drill-body")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.show(self.latest)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "browse":
            return self._responses is not None and self._conversational(self.latest)
        return True

    def _conversational(self, s: RunSnapshot) -> bool:
        d = next((d for d in s.datasets if d.name == self.target.name), None)
        return d is not None and d.conversations > 0

    def _read(self, s: RunSnapshot) -> None:
        """Read the file's tail again when the dataset's answered count moved (at most every REREAD_S)."""
        if self._responses is None or not self._conversational(s):
            return
        d = next(d for d in s.datasets if d.name == self.target.name)
        now = time.monotonic()
        if self._read_at is not None and (self._read_at[1] == d.done or now - self._read_at[0] < REREAD_S):
            return
        self._read_at = (now, d.done)
        self._found = conversations(read_tail(self._responses))
        self._reads += 1

    def _conversation(self) -> RenderableType | None:
        if self._responses is None or not self._conversational(self.latest):
            return None
        i = pick(self._found, self._pinned)
        if i is None:
            return Text("no conversation answered yet", style="dim")
        newest = "the newest" if i == len(self._found) - 1 else f"{len(self._found) - 1 - i} before the newest"
        return draw_conversation(self._found[i], position=f"{newest} of {len(self._found)} read; [ ] to browse")

    def show(self, s: RunSnapshot) -> None:
        self.latest = s
        self.query_one(RunHeader).show(s)
        self._read(s)
        key = (s.recent_errors, s.datasets, s.errors, s.providers, s.provider_stats, self._pinned, self._reads)
        if key == self._key:
            return
        self._key = key
        self.query_one("#drill-body", Static).update(draw_drill(s, self.target, self._conversation()))

    def action_browse(self, step: int) -> None:
        i = pick(self._found, self._pinned)
        if i is None:
            return
        i = min(max(0, i + step), len(self._found) - 1)
        self._pinned = None if i == len(self._found) - 1 else self._found[i].id
        self._key = None
        self.show(self.latest)

    def action_scroll(self, rows: int) -> None:
        self.query_one("#drill").scroll_relative(y=rows, animate=False)

    def action_back(self) -> None:
        self.dismiss(None)
