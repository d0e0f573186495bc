"""The smoke test's rows of its answers: each shape's answer (content, reasoning, tool calls, model, usage,
provider, finish, its ids and prompt reconstructed with the target tokenizer), a multi-turn shape's second
turn, and the stream row from the comparison's two answers (stream_check.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from draftgen.core.bodies import ChatBody, ChatMessage, plain_messages
from draftgen.core.config import Config
from draftgen.core.config_tables import DatasetConfig
from draftgen.core.errors import DraftgenError
from draftgen.core.generate.api.answer import ChatAnswer
from draftgen.core.generate.api.prices import body_max_tokens
from draftgen.core.generate.commands.smoke_rows import Asked, SmokeRow, prompt_row, quoted, tokens_row
from draftgen.core.generate.commands.stream_check import ModeVerdict, has_text, mode_verdict, not_compared
from draftgen.core.generate.loop.conversations import history_message
from draftgen.core.records import same_model
from draftgen.core.units import usd

# The smoke test's second user turn of a multi-turn dataset: its prompt holds the first answer as history.
FOLLOW_UP = "Now say that again in one short sentence."


def turn_two_body(config: Config, body: ChatBody, a: ChatAnswer) -> ChatBody:
    """The smoke body of a multi-turn dataset's second turn: the first turn, its answer sent back by the
    engine's own rule (`conversations.history_message`, as each API documents it), `FOLLOW_UP`."""
    earlier = history_message(a.content, a.reasoning, a.reasoning_details, server=config.api.server)
    return {**body, "messages": [*body["messages"], earlier,
                                 {"role": "user", "content": FOLLOW_UP}]}


def turn_two_rows(config: Config, ds: DatasetConfig, asked: Asked,
                  reconstruct_fn: Callable[..., Any]) -> list[SmokeRow]:
    """The second turn's request and its prompt check (the history rendered by the template's rule)."""
    _, body, answer, took = asked
    label = f"{ds.name}: turn 2"
    if isinstance(answer, SmokeRow):
        return [SmokeRow(f"{label} request", False, answer.detail)]
    rows = [SmokeRow(f"{label} request", True, f"answered in {took:.2f} s, the first answer sent back as history")]
    rec = reconstruct_fn(body["messages"], answer)
    if rec is not None:
        row = prompt_row(config, label, rec, body["messages"], reconstruct_fn)
        why = "" if row.passed or rec.prompt_diff is None else (
            "; turn 1 agreeing and turn 2 not: the server renders the earlier answer otherwise than the chat "
            "template's history rule (e.g. keeps its reasoning), so every later turn's prompt would differ")
        rows.append(SmokeRow(row.check, row.passed, row.detail + why))
    return rows


def _norm(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def _asks_reasoning(body: ChatBody) -> bool:
    r = body.get("reasoning")
    if isinstance(r, dict):
        if r.get("exclude") or r.get("enabled") is False:
            return False
        return True
    return bool(body.get("include_reasoning"))


def shape_rows(config: Config, ds: DatasetConfig, body: ChatBody, a: ChatAnswer,
               reconstruct_fn: Callable[..., Any], parser: str = "") -> list[SmokeRow]:
    """The rows of one shape's answer (`parser`: the stream row's cause when the run's mode rewrites text)."""
    label = f"{ds.name}:"
    ignore = {_norm(p) for p in (body.get("provider") or {}).get("ignore", []) or []}
    rows = [SmokeRow(f"{label} content", bool(a.content.strip()),
                     quoted(a.content[:60]) if a.content.strip() else "empty content (reasoning may have used up "
                     "max_tokens)")]
    if _asks_reasoning(body):
        rows.append(SmokeRow(f"{label} reasoning", bool(a.reasoning),
                             f"{len(a.reasoning or '')} chars of reasoning" if a.reasoning else
                             "the request asks for reasoning but none came back (checked `reasoning`, "
                             "`reasoning_content`, `reasoning_details`)"))
    else:
        rows.append(SmokeRow(f"{label} reasoning", True, "not requested" if not a.reasoning else
                             f"not requested, yet {len(a.reasoning)} chars of reasoning came back"))
    tools_sent = bool(body.get("tools"))
    rows.append(SmokeRow(f"{label} tool calls", tools_sent or not a.tool_calls,
                         f"{len(a.tool_calls or [])} tool call(s)" + ("" if tools_sent or not a.tool_calls
                                                                      else " without tools in the request")))
    want = config.api.model
    model = a.model or ""
    model_ok = bool(model) and same_model(want, model)  # as the run judges it: else never a sample
    rows.append(SmokeRow(f"{label} model", model_ok, f"{quoted(a.model)} (asked for {quoted(want)})"))
    u = a.usage
    tokens = f"{u.prompt_tokens} prompt + {u.completion_tokens} completion tokens ({u.reasoning_tokens} reasoning)"
    if not config.api.server.kind.bills_answers:  # no usage.cost, no provider: tokens at [api] prices
        rows.append(SmokeRow(f"{label} usage", u.completion_tokens > 0,
                             f"{tokens}; cost n/a (self-hosted)" if u.completion_tokens > 0 else
                             f"no completion_tokens in usage ({tokens}): token budgets and prices need them"))
        rows.append(SmokeRow(f"{label} provider", True, "n/a (self-hosted)"))
    else:
        rows.append(SmokeRow(f"{label} usage", u.completion_tokens > 0 and u.cost > 0,
                             f"{tokens}, cost {usd(u.cost)}"
                             + ("" if u.cost > 0 else ": no cost in usage (budgets need it)")))
        provider_ok = bool(a.provider) and _norm(a.provider or "") not in ignore
        rows.append(SmokeRow(f"{label} provider", provider_ok,
                             quoted(a.provider) + (" is in provider.ignore" if not provider_ok else "")
                             if a.provider else "no provider in the response"))
    raise_it = ("[smoke] max_tokens" if config.smoke.max_tokens is not None else
                "the dataset's max_tokens (answers of the run cut there are kept, marked truncated)")
    cut = (f": cut at max_tokens {body_max_tokens(body, 0)}; the smoke test checks a whole answer's ids and end of "
           f"turn: raise {raise_it}" if a.finish_reason == "length" else "")
    rows.append(SmokeRow(f"{label} finish", a.finish_reason == "stop",
                         f"finish_reason {quoted(a.finish_reason)}, native {quoted(a.native_finish_reason)}{cut}"))
    rec = reconstruct_fn(body["messages"], a)
    if rec is None:
        rows.append(SmokeRow(f"{label} tokens", False, "the tokenizer could not be loaded"))
        return rows
    rows.append(tokens_row(config, label, rec, a.provider, parser))
    rows.append(prompt_row(config, label, rec, body["messages"], reconstruct_fn))
    return rows


_UNSET = object()  # the reconstruction's own default system turn


class Reconstruct:
    """The smoke answer reconstructed with the target tokenizer, loaded once (its file kept in `origin`)."""

    def __init__(self, config: Config, on_error: Callable[[SmokeRow], None]) -> None:
        self.config = config
        self.on_error = on_error
        self.loaded: list[Any] = []  # [] not tried, [None] failed, [(tokenizer, template)]
        self.origin: str | None = None

    def failed(self, row: SmokeRow) -> None:
        self.on_error(row)
        self.loaded.append(None)

    @property
    def tokenizer(self) -> Any:
        """The target tokenizer once loaded; None before it is tried, or when it failed."""
        return self.loaded[0][0] if self.loaded and self.loaded[0] is not None else None

    def __call__(self, messages: list[ChatMessage], a: ChatAnswer | None, system: Any = _UNSET,
                 tools: list[Any] | None = None) -> Any:
        """The answer `a` reconstructed; with `a` None, only the prompt (rendered with `system`); `tools`: the
        function schemas the request declared."""
        from draftgen.core.tokens.reconstruct import reconstruct
        from draftgen.core.tokens.template import load_template
        from draftgen.core.tokens.tokenizer import load_tokenizer
        config = self.config
        specials = config.tokenizer.prompt_specials(config.api.server.kind.specials_as_tokens)
        if not self.loaded:
            try:
                tok = load_tokenizer(config.tokenizer.path, config.tokenizer.trust_remote_code)
                self.origin = getattr(tok, "origin", tok.name)
                self.loaded.append((tok, load_template(config.tokenizer.template, tok,
                                                       default_system=config.tokenizer.system_turn(),
                                                       prompt_specials=specials)))
            except DraftgenError as e:
                self.failed(SmokeRow("tokenizer", False, str(e)))
        if self.loaded[0] is None:
            return None
        tok, template = self.loaded[0]
        if a is None:
            return reconstruct(tok, load_template(config.tokenizer.template, tok, default_system=system,
                                                  prompt_specials=specials), plain_messages(messages), "", "",
                               tools=tools)
        return reconstruct(tok, template, plain_messages(messages), a.reasoning, a.content,
                           billed_tokens=a.usage.completion_tokens, backend_ids=a.token_ids,
                           truncated=a.finish_reason == "length", tool_calls=a.tool_calls,
                           count_tolerance=config.validation.count_tolerance,
                           billed_prompt_tokens=a.usage.prompt_tokens, provider=a.provider, tools=tools)


def mode_row(config: Config, streamed: Any, plain: Any, how: str, sampled: bool,
             tried: int) -> tuple[SmokeRow, ModeVerdict | None]:
    """The stream row from the comparison's answers (or its failed requests)."""
    for what, a in (("streamed", streamed), ("non-streamed", plain)):
        if isinstance(a, SmokeRow):
            return SmokeRow("stream", False, f"the {what} comparison request failed: {a.detail}"), None
    verdict = mode_verdict(config.api.stream, streamed, plain, how, sampled=sampled) \
        if has_text(streamed) or has_text(plain) else not_compared(tried)
    return SmokeRow("stream", verdict.passed, verdict.detail, verdict.warning), verdict
