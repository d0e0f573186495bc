"""The smoke test's agent exchange: one small tool loop per request shape of a dataset with agent lines.

A run whose `turns = "all"` dataset holds agent lines (`tools`, tool calls, tool results: docs/agents.md)
sends `tools` and tool histories; a provider may refuse either (a 400 on `tools`, a 400 on a history
with tool calls or without their reasoning), or rewrite the model's call ids (`functions.NAME:IDX`) to
its own (`call_…`). Each is found here, before the run pays for step 1 of every conversation:

- step 1: the shape's body with `AGENT_PROMPT` and `AGENT_TOOLS` (a tool call or an answer, either
  passes); refused, the row fails naming the provider's message;
- call ids: step 1's calls of Kimi's own shape, or the row says they were rewritten and what merge does
  with such samples (`[validation] drop_foreign_tool_call_ids`: dropped, the row fails; kept flagged,
  it warns);
- step 2 (when step 1 called): the target's own message sent back by the engine's rule
  (`conversations.history_message`: its calls under its own ids, its reasoning as the API documents:
  OpenRouter `reasoning_details`, a self-hosted server `reasoning_content`), then `TOOL_RESULT` under
  each call's own id; it must answer;
- each step's answer reconstructed (step 1's calls as the template renders them) and counted against
  `usage.completion_tokens`, and its `usage.prompt_tokens` against that step's rendering (the tools
  declared, the tool history by the template's rule), as the chat rows check them.

The requests are the smoke test's own (`_SmokeTest.ask`): reserved against `max_usd` at the worst case
of the body sent (tools and history included), on the ledger's "(smoke)" dataset, retried on an outage.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Any, Protocol

from draftgen.core.bodies import ChatBody, ChatMessage
from draftgen.core.generate.api.answer import ChatAnswer
from draftgen.core.generate.commands.smoke_rows import Asked, SmokeRow, prompt_row, quoted, smoke_body, tokens_row
from draftgen.core.generate.loop.conversations import history_message
from draftgen.core.tokens.reconstruct import model_call_id

if TYPE_CHECKING:
    from draftgen.core.config import Config
    from draftgen.core.config_tables import DatasetConfig
    from draftgen.core.generate.api.client import ChatClient


class SmokeAsker(Protocol):
    """What the exchange needs of the smoke test (smoke.py `_SmokeTest`): its shapes, their answers, and its
    `ask`, which reserves, books and retries each request."""

    config: Config
    shapes: dict[str, DatasetConfig]
    answers: list[Asked]

    async def ask(self, client: ChatClient, fp: str, ds: DatasetConfig,
                  body: ChatBody | None = None) -> Asked: ...


# The exchange's task and its one tool: small, so the check costs little; a model asked this calls the
# tool (the simulator's plan calls it once, simulator/tools.py), and either answer passes.
AGENT_PROMPT = "What time is it in Paris? Use the get_time tool, then answer in one sentence."
AGENT_TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_time", "description": "The current local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_RESULT = '{"time": "14:05"}'  # the result sent after each of step 1's calls


def step_one_body(config: Config, ds: DatasetConfig) -> ChatBody:
    """The shape's smoke body (its parameters and answer cap) with the agent task and its tool."""
    return {**smoke_body(config, ds), "messages": [{"role": "user", "content": AGENT_PROMPT}], "tools": AGENT_TOOLS}


def step_two_body(config: Config, body: ChatBody, a: ChatAnswer) -> ChatBody:
    """Step 2: step 1's messages, the target's answer as the engine sends it back (its calls under its own
    ids, its reasoning as the API documents it), and a result under each call's id."""
    earlier = history_message(a.content, a.reasoning, a.reasoning_details, server=config.api.server,
                              tool_calls=a.tool_calls)
    results: list[ChatMessage] = [{"role": "tool", "tool_call_id": call["id"], "content": TOOL_RESULT}
                                  for call in earlier["tool_calls"]]
    return {**body, "messages": [*body["messages"], earlier, *results]}


async def ask_agent(test: SmokeAsker, client: ChatClient,
                    agents: set[str]) -> dict[str, tuple[DatasetConfig, list[Asked]]]:
    """Each shape of a dataset with agent lines (`agents`: their names): step 1, and step 2 when it called;
    per shape, the first such dataset (its rows are named after it) and its steps."""
    config = test.config
    answered = {fp for fp, _, a, _ in test.answers if isinstance(a, ChatAnswer)}  # a failed shape: its row says why
    shapes: dict[str, DatasetConfig] = {}
    for d in config.datasets:
        if d.name in agents and (fp := config.fingerprint(d)) in answered:
            shapes.setdefault(fp, d)

    async def exchange(fp: str, ds: DatasetConfig) -> list[Asked]:
        first = await test.ask(client, fp, ds, step_one_body(config, ds))
        answer = first[2]
        if not isinstance(answer, ChatAnswer) or not _callable(answer):
            return [first]
        return [first, await test.ask(client, fp, ds, step_two_body(config, first[1], answer))]

    done = await asyncio.gather(*(exchange(fp, ds) for fp, ds in shapes.items()))
    return {fp: (ds, asked) for (fp, ds), asked in zip(shapes.items(), done, strict=True)}


def _callable(a: ChatAnswer) -> bool:
    """Step 1 called, with calls a history can carry (each an id and a name): step 2 can be sent."""
    calls = a.tool_calls or []
    return bool(calls) and all(isinstance(c, dict) and isinstance(c.get("id"), str) and c["id"]
                               and isinstance((c.get("function") or {}).get("name"), str) for c in calls)


def agent_rows(config: Config, ds: DatasetConfig, asked: list[Asked], reconstruct_fn: Any) -> list[SmokeRow]:
    """The exchange's rows: each step's request, its answer's tokens (the calls as the template renders them)
    and its prompt tokens; step 1's call ids."""
    tools_fn = functools.partial(reconstruct_fn, tools=AGENT_TOOLS)
    rows: list[SmokeRow] = []
    for k, (_, body, answer, took) in enumerate(asked, 1):
        label = f"{ds.name}: agent step {k}"
        what = ("a request carrying `tools`, as every agent step of the run sends its line's tools" if k == 1 else
                "a request carrying the target's own tool call, its reasoning and a tool result under its id, "
                "as every later agent step sends such a history")
        if isinstance(answer, SmokeRow):  # the provider's message first: the summary line cuts the detail
            rows.append(SmokeRow(f"{label} request", False, f"{answer.detail} ({what}; no dataset request is sent "
                                 "until this passes)"))
            return rows
        calls = answer.tool_calls or []
        said = (f"{len(calls)} tool call(s): " + ", ".join(quoted(str((c.get("function") or {}).get("name")))
                                                          for c in calls if isinstance(c, dict))
                if calls else f"answered without a call ({quoted(answer.content[:60])})")
        rows.append(SmokeRow(f"{label} request", True, f"answered in {took:.2f} s, {said}"))
        own = all(model_call_id(c) for c in calls)
        if k == 1:
            rows.append(_ids_row(config, ds, answer))
        rec = tools_fn(body["messages"], answer)
        if rec is not None:
            if own:  # (rewritten ids: the ids row says what becomes of those answers)
                rows.append(tokens_row(config, label, rec, answer.provider))
            rows.append(prompt_row(config, label, rec, body["messages"], tools_fn))
    if len(asked) == 1 and isinstance(first := asked[0][2], ChatAnswer):
        if first.tool_calls:  # calls no result can be sent under: the run ends each conversation at them
            rows.append(SmokeRow(f"{ds.name}: agent step 2 request", False, "not sent: a call of step 1 carries no "
                                 "id or no function name, so no tool result can follow it; the run would end every "
                                 "agent conversation at its first call"))
        else:
            rows.append(SmokeRow(f"{ds.name}: agent step 2 request", True, "not sent: step 1 answered without a "
                                 "call (a tool history is first sent by the run's own step 2)", warning=True))
    return rows


def _ids_row(config: Config, ds: DatasetConfig, a: ChatAnswer) -> SmokeRow:
    """Step 1's call ids: Kimi's own `functions.NAME:IDX`, or rewritten, and what merge does with such samples."""
    check = f"{ds.name}: agent call ids"
    calls = [c for c in a.tool_calls or [] if isinstance(c, dict)]
    if not calls:
        return SmokeRow(check, True, "no call to check (step 1 answered)", warning=True)
    ids = ", ".join(quoted(str(c.get("id"))) for c in calls)
    if all(model_call_id(c) for c in calls):
        return SmokeRow(check, True, f"Kimi's own shape functions.NAME:IDX ({ids})")
    who = quoted(a.provider) if a.provider else "the server"
    detail = f"{who} rewrote the call ids ({ids}; the model's own are functions.NAME:IDX): "
    why = ("its samples are rendered with ids the model did not generate (a step whose answer calls tools, and "
           "every later step's history)")
    if config.validation.drop_foreign_tool_call_ids:
        return SmokeRow(check, False, detail + "merge would drop every sample of a step that calls tools as "
                        f"foreign_tool_call_id ([validation] drop_foreign_tool_call_ids = true): {why}; route around "
                        "this provider ([request.provider] ignore) or set it to false to keep them, flagged")
    return SmokeRow(check, True, detail + "merge keeps those samples, flagged foreign_tool_call_id ([validation] "
                    f"drop_foreign_tool_call_ids = false): {why}", warning=True)
