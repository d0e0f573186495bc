"""The prompt source of a turns = "all" dataset: each conversation's user turns asked in order, every
request's history made of the target's own earlier answers.

Turn k of conversation C goes out as a Prompt with id `C#tk` and messages = the system turn, user
turns 1..k and, between them, the target's stored answers to turns 1..k-1 (never the dataset's),
sent back the way the API documents it (`history_message`): OpenRouter gets the answer's
`reasoning_details` unmodified (else its `reasoning` text), a self-hosted vLLM/SGLang server its
`reasoning_content`. A conversation has at most one turn in flight: turn k+1 is ready only once turn k
is booked answered; turns of different conversations interleave under the dataset's concurrency
(ready turns go before new conversations, so few conversations are open at once).

An agent line (prompts.py parse_agent) is asked step by step the same way: step k sends the line's
tools, the system turn, and for each earlier step the target's own message (its content, reasoning and
calls under its own ids) followed by the dataset's recorded tool results under those ids, and the user
turns. `tool_results = "match"` sends a result only after the same calls as the dataset's; an answer
that is not the dataset's next move is flagged diverged (records.py TurnFields.diverges) and ends its
conversation; "replay" sends them after as many other calls, the step flagged "replayed".

A broken turn ends its conversation there: failed for good, cut at max_tokens, an empty answer, an
answer with tool calls (an agent step's: one that diverged), or skipped (a budget, max_usd, a
duplicate). Its later turns are counted skipped ("conversation ended at turn k: why"), never
written, and recomputed from the records on the next run. Nothing is ever conditioned on a broken answer.

Resume is at turn level: the records of the dataset (responses.jsonl, failures.jsonl: `conversation`,
`turn`, `prompt_hash`) say where each conversation stands; its next turn is 1 + its highest answered
turn, its history rebuilt from the stored answers. A stored turn whose `prompt_hash` is not the
file's fingerprint at that turn means the prompt file was edited between runs: that conversation is
not continued (its stored turns stay; its rest is counted skipped) and the first one is said, naming
the file, the line and the turn. `retry-failed` removing a failed turn's line resumes the
conversation at that turn.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftgen.core.bodies import ChatMessage, ToolCall
from draftgen.core.generate.loop.prompt_files import ReadingStopped, read_conversations
from draftgen.core.generate.loop.prompts import Conversation, Prompt, Rejection, turn_id
from draftgen.core.generate.loop.source import Booked, BookedAs
from draftgen.core.live import payloads as ev
from draftgen.core.live.events import EventSink, Level
from draftgen.core.records import (
    TurnFields,
    arguments_text,
    broken_answer,
    own_calls,
    same_calls,
    stored_responses,
)
from draftgen.core.rundir import iter_jsonl
from draftgen.core.servers import ServerProfile

if TYPE_CHECKING:
    from draftgen.core.generate.loop.dataset_run import DatasetRun

CHUNK = 256  # conversations read from the prompt file per thread hop


def history_message(content: str, reasoning: str | None, reasoning_details: list[Any] | None, *,
                    server: ServerProfile, tool_calls: list[Any] | None = None) -> ChatMessage:
    """The target's answer as the assistant message of a later turn's request, as the API of the run's
    server kind documents it (`history_reasoning`, core/server_kinds.py): OpenRouter, its
    `reasoning_details` passed back unmodified (else the `reasoning` text, when it had one); vLLM and
    SGLang, `reasoning_content`. Rendering is the chat template's rule (Kimi-K2.5
    renders earlier turns without their reasoning, except inside a tool-call loop, core/tokens/template.py).
    An agent step's `tool_calls` go back as the target made them: its own ids, names and argument text
    (`tool_call`), each as OpenAI's assistant message carries a call."""
    msg: ChatMessage = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = [tool_call(c) for c in tool_calls]
    server.kind.history_reasoning(msg, reasoning, reasoning_details)
    return msg


def tool_call(call: Any) -> ToolCall:
    """One of the target's calls as an assistant message of the history sends it back: its id, its name
    and its arguments' text as the answer gave them (what the model generated, not re-serialised)."""
    fn = call.get("function") if isinstance(call, dict) else None
    fn = fn if isinstance(fn, dict) else {}
    return {"id": call.get("id") if isinstance(call, dict) else None, "type": "function",
            "function": {"name": fn.get("name"), "arguments": arguments_text(fn.get("arguments"))}}


def skip_kind(reason: str) -> str:
    """What a skipped turn's conversation ended for, as its dataset's end line counts it: the token
    budget, max_usd (room.py, budget.py, request.py word every such skip with the key's name) or a
    duplicate of another dataset's turn (source.py TAKEN_ELSEWHERE)."""
    if reason.startswith("token budget"):
        return "skipped for the token budget"
    if "max_usd" in reason:
        return "skipped for max_usd"
    if "another dataset" in reason:
        return "skipped as a duplicate"
    return "skipped"


@dataclass(slots=True)
class _Stored:
    """One turn's outcome on disk."""
    answered: bool
    prompt_hash: str | None
    broken: str          # why it ends its conversation ("" for a good answer)


@dataclass(slots=True)
class _Open:
    """A conversation being asked: its turns, the target's answers so far."""
    conv: Conversation
    history: list[ChatMessage]   # assistant messages for turns 1..len(history)
    stored: set[int] = field(default_factory=set)  # turns with an outcome on disk when it opened
    lines: list[str] = field(default_factory=list)  # one a turn so far, for the views (`ConversationCounts.last`)


class ConversationSource:
    """The prompts of a turns = "all" dataset: next() the next ready turn, booked() each outcome."""

    def __init__(self, ds: DatasetRun, *, server: ServerProfile, responses: Path, failures: Path,
                 on_event: EventSink, max_turns: int | None = None, stop: threading.Event | None = None) -> None:
        self._ds = ds
        self._name = ds.config.name
        self._path = ds.config.prompts
        self._max_turns = max_turns if max_turns is not None else ds.config.max_turns
        self._stop = stop  # set by a drain or stop now: the file's reading stops (no more conversations)
        self._server = server  # a conversation's history is sent as its kind's API documents it
        self._replay = ds.config.tool_results == "replay"
        self._responses = responses
        self._failures = failures
        self._event = on_event
        self._stored: dict[str, dict[int, _Stored]] | None = None  # loaded on the first next()
        self._history: dict[str, dict[int, ChatMessage]] = {}   # stored answers of unfinished conversations
        self._open: dict[str, _Open] = {}
        self._ready: deque[Prompt] = deque()
        self._out = 0                     # turns yielded, not booked yet
        self._changed = asyncio.Event()
        self._file: Iterator[Conversation | Rejection] | None = None
        self._batch: deque[Conversation] = deque()
        self._exhausted = False
        self._reading: asyncio.Future[list[Conversation]] | None = None
        self.counts = ds.conversations
        self._edited = 0
        self._said_ended = False

    # -- the PromptSource protocol ------------------------------------------------------------------

    async def next(self) -> Prompt | None:
        """The next turn ready to ask; waits while every open conversation has its turn out; None once
        every conversation has ended (or the file has no more and nothing is out)."""
        if self._stored is None:
            await asyncio.to_thread(self._load)
        while True:
            if self._ready:
                prompt = self._ready.popleft()
                self._out += 1
                return prompt
            if not self._exhausted:
                conv = await self._next_conversation()
                if conv is None:
                    self._exhausted = True
                    continue
                first = self._begin(conv)
                if first is not None:
                    self._out += 1
                    return first
                continue
            if not self._out:
                return None
            self._changed.clear()
            await self._changed.wait()

    def booked(self, prompt: Prompt, result: Booked) -> None:
        """A yielded turn's outcome: the next turn made ready, or its conversation ended."""
        assert prompt.turn is not None, f"{prompt.id}: not a conversation's turn"
        self._out -= 1
        self._changed.set()
        t = prompt.turn
        o = self._open.get(t.conversation)
        if o is None:
            return
        if result.kind is BookedAs.HANDED_BACK:
            self._ready.appendleft(prompt)
            return
        if result.kind is BookedAs.FAILED:
            self._end(o, t.turn, f"failed ({result.reason})" if result.reason else "failed")
            return
        if result.kind is BookedAs.SKIPPED:
            kind = skip_kind(result.reason)
            self._end(o, t.turn, f"{kind} ({result.reason})" if result.reason else kind)
            return
        a = result.answer
        assert a is not None
        agent = o.conv.steps is not None
        why = broken_answer(a.content, a.finish_reason, a.tool_calls, agent=agent)
        if not why and t.diverges(a.tool_calls):  # as record_book.record_answer flagged its record
            why = "diverged"
        calls = f", {len(a.tool_calls)} tool call(s)" if agent and a.tool_calls else ""
        if why:
            o.lines.append(f"turn {t.turn}: answered{calls}")
            self._end(o, t.turn, why)
            return
        o.history.append(history_message(a.content, a.reasoning, a.reasoning_details, server=self._server,
                                         tool_calls=a.tool_calls if agent else None))
        o.lines.append(f"turn {t.turn}: answered{calls}, {a.usage.prompt_tokens:,} prompt + "
                       f"{a.usage.completion_tokens:,} answer tokens")
        self._advance(o)

    @property
    def in_flight(self) -> int:
        """Turns yielded and not booked yet."""
        return self._out

    @property
    def open(self) -> int:
        """Conversations being asked (a turn out or ready)."""
        return len(self._open)

    @property
    def would_wait(self) -> bool:
        """next() has nothing to give until a turn out is booked."""
        return not self._ready and self._exhausted and self._out > 0

    # -- the conversations ------------------------------------------------------------------------

    def _advance(self, o: _Open) -> None:
        """After turn len(history) was answered: the next turn ready, or the conversation done."""
        if len(o.history) >= o.conv.turns:
            del self._open[o.conv.id]
            self.counts.done += 1
            self.counts.last = (f"{o.conv.id} ({o.conv.turns} turns, line {o.conv.line}): done", *o.lines)
            return
        self._ready.append(self._turn(o))

    def _turn(self, o: _Open) -> Prompt:
        """The request of the conversation's next turn: its history is the target's own answers."""
        conv = o.conv
        k = len(o.history) + 1
        if conv.steps is not None:
            return self._step(o, k)
        messages: list[ChatMessage] = list(conv.system)
        for user, answer in zip(conv.user_turns, o.history, strict=False):
            messages.append(user)
            messages.append(answer)
        messages.append(conv.user_turns[k - 1])
        return Prompt(turn_id(conv.id, k), messages, conv.line,
                      TurnFields(conv.id, k, conv.turns, conv.fingerprint[k - 1]))

    def _step(self, o: _Open, k: int) -> Prompt:
        """The request of an agent line's step k: the system turn, then for each step j <= k the target's
        own answer to step j-1 (its content, reasoning and calls), the dataset's tool results after it, each
        under the target's own id of the call it answers, and the dataset's user turns; the line's tools."""
        conv = o.conv
        steps = conv.steps
        assert steps is not None
        messages: list[ChatMessage] = list(conv.system)
        spliced = ""
        for j in range(1, k + 1):
            step = steps[j - 1]
            if j > 1:
                answer = o.history[j - 2]
                messages.append(answer)
                if step.results:
                    calls = answer.get("tool_calls") or []
                    # Booked only when its calls can take these results (same calls, or as many with "replay");
                    # stored answers are checked when the conversation opens (_begin).
                    messages += [{"role": "tool", "tool_call_id": c["id"], "content": r}
                                 for c, r in zip(calls, step.results, strict=True)]
                    if spliced != "replayed":
                        spliced = "matched" if same_calls(own_calls(calls), steps[j - 2].calls) else "replayed"
            messages += step.users
        last = k == conv.turns
        return Prompt(turn_id(conv.id, k), messages, conv.line,
                      TurnFields(conv.id, k, conv.turns, conv.fingerprint[k - 1], agent=True, tools=conv.tools,
                                 tool_results=spliced or None, expect=None if last else steps[k - 1].calls,
                                 replay=self._replay))

    def _end(self, o: _Open, k: int, why: str) -> None:
        """Turn k broke (its own outcome is counted by whoever booked it): the conversation ends; its
        later turns with no outcome on disk are counted skipped."""
        self._open.pop(o.conv.id, None)
        self._ended(o.conv, k, why, o.stored)
        self.counts.last = (f"{o.conv.id} ({o.conv.turns} turns, line {o.conv.line}): ended at turn {k}",
                            *o.lines, f"turn {k}: {why}")

    def _ended(self, conv: Conversation, k: int, why: str, stored: set[int]) -> None:
        rest = sum(1 for j in range(k + 1, conv.turns + 1) if j not in stored)
        if rest:
            self._ds.skipped_some(rest)
        self.counts.ended += 1
        kind = why.split(" (")[0]
        self.counts.reasons[kind] += 1
        if not self._said_ended and rest:
            self._said_ended = True
            self._event(ev.Budget(reason=why, conversation=conv.id, turn=k, turns=conv.turns, later=rest,
                                  dataset=self._name, at=Level.INFO) if kind.startswith("skipped")
                        else ev.ConversationEnded(conversation=conv.id, turn=k, turns=conv.turns, why=why, later=rest,
                                                  dataset=self._name))

    def _begin(self, conv: Conversation) -> Prompt | None:
        """A conversation read from the file: its first turn with no outcome on disk, or None when it
        is done, ended, or edited since its stored turns were asked."""
        assert self._stored is not None
        stored = self._stored.pop(conv.id, None)
        if not stored:
            o = _Open(conv, [])
            self._open[conv.id] = o
            return self._turn(o)
        kept = set(stored)
        for k in sorted(stored):
            if k <= conv.turns and stored[k].prompt_hash != conv.fingerprint[k - 1]:
                self._edited_at(conv, k, kept)
                self._history.pop(conv.id, None)
                return None
        m = _answered_prefix(stored, conv.turns)
        history = self._history.pop(conv.id, {})
        if m >= conv.turns:
            self.counts.done += 1
            return None
        nxt = stored.get(m + 1)
        if nxt is not None:  # a failure, or a broken answer: the conversation ended there
            self._ended(conv, m + 1, nxt.broken or "failed", kept)
            return None
        if any(j not in history for j in range(1, m + 1)):
            history = self._reread(conv.id)
            if any(j not in history for j in range(1, m + 1)):  # its answers left the file since _load
                self._ended(conv, m, "stored answers not readable", kept)
                return None
        answers = [history[j] for j in range(1, m + 1)]
        if conv.steps is not None and any(len(a.get("tool_calls") or ()) != len(step.results)
                                          for a, step in zip(answers, conv.steps[1:], strict=False)):
            # (a record edited by hand: its calls cannot take the dataset's results after them)
            self._ended(conv, m, "stored calls do not fit the dataset's tool results", kept)
            return None
        o = _Open(conv, answers, kept, [f"turn {j}: answered in an earlier run" for j in range(1, m + 1)])
        self._open[conv.id] = o
        return self._turn(o)

    def _edited_at(self, conv: Conversation, k: int, stored: set[int]) -> None:
        self._edited += 1
        rest = sum(1 for j in range(1, conv.turns + 1) if j not in stored)
        if rest:
            self._ds.skipped_some(rest)
        self.counts.ended += 1
        self.counts.reasons["prompt file edited"] += 1
        if self._edited == 1:
            self._event(ev.ConversationEnded(conversation=conv.id, turn=k, path=str(self._path), line_no=conv.line,
                                             dataset=self._name, at=Level.WARN))

    @property
    def edited(self) -> int:
        """Conversations not continued because the prompt file changed under their stored turns."""
        return self._edited

    # -- reading --------------------------------------------------------------------------------------

    async def _next_conversation(self) -> Conversation | None:
        if not self._batch:
            # A next() cancelled while a chunk is read leaves the read to the next call: nothing is lost.
            if self._reading is None:
                self._reading = asyncio.ensure_future(asyncio.to_thread(self._read_chunk))
            try:
                batch = await asyncio.shield(self._reading)
            except ReadingStopped:
                batch = []
            self._reading = None
            if not batch:
                return None
            self._batch.extend(batch)
        return self._batch.popleft()

    def _read_chunk(self) -> list[Conversation]:
        if self._file is None:
            self._file = read_conversations(self._path, self._max_turns, self._stop)
        out: list[Conversation] = []
        for item in self._file:
            if isinstance(item, Conversation):
                out.append(item)
                if len(out) >= CHUNK:
                    break
        return out

    def _load(self) -> None:
        """Where each conversation stands on disk: every stored turn's outcome, and the stored answers
        of the conversations not finished by their records (the history their next turn sends)."""
        stored: dict[str, dict[int, _Stored]] = {}
        recorded_turns: dict[str, int] = {}
        for path, answered in ((self._failures, False), (self._responses, True)):  # an answer wins
            for _, raw in iter_jsonl(path):
                where = _where(raw)
                if where is None:
                    continue
                conv, k, turns = where
                ph = raw.get("prompt_hash")
                broken = broken_answer(_str(raw.get("content")), raw.get("finish_reason"), raw.get("tool_calls"),
                                       agent="tools" in raw) \
                    if answered else "failed" + (f" ({raw['error_kind']})" if isinstance(raw.get("error_kind"), str)
                                                 else "")
                if answered and (raw.get("truncated") or raw.get("empty_content")) and not broken:
                    broken = "cut at max_tokens" if raw.get("truncated") else "empty answer"
                if answered and raw.get("diverged") is True and not broken:
                    broken = "diverged"
                stored.setdefault(conv, {})[k] = _Stored(answered, ph if isinstance(ph, str) else None, broken)
                if turns:
                    recorded_turns[conv] = turns
        # History is kept for the conversations whose records say a turn is still to ask.
        unfinished = {c for c, turns in stored.items()
                      if (m := _answered_prefix(turns, 1 << 30)) < recorded_turns.get(c, 1 << 30)
                      and m + 1 not in turns}
        self._stored = stored
        self._history = self._answers(unfinished)

    def _answers(self, convs: set[str]) -> dict[str, dict[int, ChatMessage]]:
        out: dict[str, dict[int, ChatMessage]] = {}
        if not convs:
            return out
        for _, raw in stored_responses(self._responses):
            where = _where(raw)
            if where is None or where[0] not in convs:
                continue
            rd = raw.get("reasoning_details")
            reasoning = raw.get("reasoning")
            calls = raw.get("tool_calls")
            out.setdefault(where[0], {})[where[1]] = history_message(
                _str(raw.get("content")), reasoning if isinstance(reasoning, str) else None,
                rd if isinstance(rd, list) else None, server=self._server,
                tool_calls=calls if "tools" in raw and isinstance(calls, list) else None)
        return out

    def _reread(self, conv: str) -> dict[int, ChatMessage]:
        """The stored answers of one conversation its records said was finished, when the file now
        has more turns (max_turns raised, a turn added at its end): read again (rare)."""
        return self._answers({conv}).get(conv, {})


def _answered_prefix(stored: dict[int, _Stored], turns: int) -> int:
    """The last turn m such that turns 1..m are stored answered and unbroken (at most `turns`)."""
    m = 0
    while m < turns and (s := stored.get(m + 1)) is not None and s.answered and not s.broken:
        m += 1
    return m


def _str(value: object) -> str:
    return value if isinstance(value, str) else ""


def _where(raw: Mapping[str, object]) -> tuple[str, int, int] | None:
    """(conversation, turn, turns) of a record, None for a line that is no conversation's turn."""
    conv, k, turns = raw.get("conversation"), raw.get("turn"), raw.get("turns")
    if not isinstance(conv, str) or not isinstance(k, int) or isinstance(k, bool) or k < 1:
        return None
    return conv, k, turns if isinstance(turns, int) and not isinstance(turns, bool) and turns > 0 else 0
