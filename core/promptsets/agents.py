"""Agent trajectories from public layouts, as OpenAI-layout prompt lines (`tools`, `messages` with
assistant `tool_calls` and `tool` results): what a `turns = "all"` dataset asks step by step.

Layouts read (the field mapping; docs/prompts.md "Agent trajectories"):
- OpenAI (`messages`, or a `trajectory` column of OpenAI messages as nebius/SWE-rebench-openhands-
  trajectories and nvidia/SWE-Zero-openhands-trajectories store them): `role`, `content`,
  assistant `tool_calls` [{id, type, function {name, arguments}}], tool `tool_call_id`. Keys an
  Arrow struct holds as null are dropped; `role: "function"` (the legacy function role) and
  `"ipython"` are tool results. Arguments given as an object become a JSON string.
- ShareGPT with tool turns (LLaMA-Factory's `sharegpt` format, e.g. glaive-toolcall): `conversations`
  of `{from, value}` with `from` in human/gpt/system/function_call/observation. A `function_call`
  value is JSON `{"name", "arguments"}` (a list of them: parallel calls); it becomes the tool calls of
  an assistant message (of the `gpt` message just before it, when there is one). Each `observation`
  is the result of the next call not yet answered (a JSON list answering several calls at once is
  split over them).
- SWE-agent (nebius/SWE-agent-trajectories): a `trajectory` of `{role, text, system_prompt, mask,
  cutoff_date}` with roles system/user/ai. Its actions are text, not function calls: `ai` turns are
  assistant messages, `text` the content (`system_prompt` for a system turn without text); the line
  is then a multi-turn conversation like any other.

Calls without an id get the model's own shape, `functions.{name}:{index}` (index counted over the
conversation), and tool results without a `tool_call_id` the id of the call they answer, in order.
A `tools` column (a list, or a JSON string of one) is the line's `tools`; a bare function schema
`{name, description, parameters}` is wrapped as `{"type": "function", "function": ...}`.
"""

from __future__ import annotations

import json
from typing import Any

# Roles of a tool result, and of a tool call turn, in the layouts read.
RESULT_ROLES = frozenset({"tool", "function", "observation", "ipython", "tool_response"})
CALL_ROLES = frozenset({"function_call", "tool_call"})
ROLES = {"user": "user", "human": "user", "system": "system", "assistant": "assistant", "gpt": "assistant",
         "chatgpt": "assistant", "model": "assistant", "bot": "assistant", "ai": "assistant"}


def _role(turn: dict[str, Any]) -> Any:
    return turn.get("role") if turn.get("role") is not None else turn.get("from")


def _content(turn: dict[str, Any], where: str) -> str:
    for key in ("content", "value", "text"):
        value = turn.get(key)
        if value is None:
            continue
        if isinstance(value, str):
            return value
        if isinstance(value, list):  # text parts
            parts = [p.get("text") if isinstance(p, dict) else p for p in value]
            if all(isinstance(p, str) for p in parts):
                return "".join(str(p) for p in parts)
        raise ValueError(f"{where}.{key} must be text")
    return ""


def is_agent(raw: Any) -> bool:
    """A conversation list with a tool loop: a tool call or a tool result turn."""
    return isinstance(raw, list) and any(
        isinstance(t, dict) and (t.get("tool_calls") or _role(t) in RESULT_ROLES or _role(t) in CALL_ROLES)
        for t in raw)


def swe_agent_turns(raw: Any, column: str) -> Any:
    """SWE-agent's `{role, text, system_prompt}` turns as `{role, content}` (others as they are)."""
    if not isinstance(raw, list):
        return raw
    out = []
    for i, t in enumerate(raw):
        if isinstance(t, dict) and "text" in t and t.get("content") is None and t.get("value") is None:
            text = t.get("text")
            if not text and _role(t) == "system":
                text = t.get("system_prompt")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"`{column}`[{i}].text must be text")
            role = _role(t)
            t = {"role": ROLES.get(role, role) if isinstance(role, str) else role, "content": text or ""}
        out.append(t)
    return out


def parse_tools(value: Any, where: str) -> list[dict[str, Any]] | None:
    """A `tools` cell as OpenAI function tools (None when empty), or ValueError."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"`{where}` is not JSON") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise ValueError(f"`{where}` must be a list of function schemas")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise ValueError(f"`{where}`[{i}] must be an object")
        if "function" not in tool:
            if not isinstance(tool.get("name"), str):
                raise ValueError(f"`{where}`[{i}] has no function name")
            tool = {"type": "function", "function": tool}
        tools.append({k: v for k, v in tool.items() if v is not None})
    return tools or None


def _arguments(value: Any) -> str:
    if value is None:
        return "{}"
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _call(raw: Any, where: str, counter: int) -> dict[str, Any]:
    """One call in the OpenAI shape, from an OpenAI call or a ShareGPT `{name, arguments}`."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be an object")
    fn: dict[str, Any] = raw["function"] if isinstance(raw.get("function"), dict) else raw
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where} has no function name")
    call_id = raw.get("id") if isinstance(raw.get("id"), str) and raw.get("id") else f"functions.{name}:{counter}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": _arguments(fn.get("arguments"))}}


def _function_calls(turn: dict[str, Any], role: str, where: str, counter: int) -> list[dict[str, Any]]:
    """The calls of a ShareGPT `function_call` turn (a JSON call, or a list of them)."""
    try:
        value = json.loads(_content(turn, where))
    except ValueError:
        raise ValueError(f"{where} ({role}) is not JSON") from None
    return [_call(c, f"{where}[{j}]", counter + j) for j, c in enumerate(value if isinstance(value, list) else [value])]


def _results(turn: dict[str, Any], where: str, pending: list[str]) -> list[dict[str, Any]]:
    """The tool messages of a result turn; answered calls leave `pending`."""
    text = _content(turn, where)
    given = turn.get("tool_call_id")
    results = [text]
    if not isinstance(given, str) and len(pending) > 1:
        try:
            parts = json.loads(text)
        except ValueError:
            parts = None
        if isinstance(parts, list) and len(parts) == len(pending):
            results = [p if isinstance(p, str) else json.dumps(p, ensure_ascii=False) for p in parts]
    out = []
    for result in results:
        call_id = given if isinstance(given, str) and given else (pending[0] if pending else None)
        if call_id is None:
            raise ValueError(f"{where} is a tool result with no call before it")
        if call_id in pending:
            pending.remove(call_id)
        out.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return out


def agent_messages(raw: Any, column: str) -> list[dict[str, Any]]:
    """A tool-loop conversation in OpenAI layout, through its last assistant message, or ValueError."""
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"`{column}` must be a non-empty list")
    out: list[dict[str, Any]] = []
    pending: list[str] = []   # ids of calls not yet answered, in order
    counter = 0
    for i, turn in enumerate(raw):
        where = f"`{column}`[{i}]"
        if not isinstance(turn, dict):
            raise ValueError(f"{where} must be an object")
        role = _role(turn)
        if role in RESULT_ROLES:
            out += _results(turn, where, pending)
            continue
        calls = None
        if role in CALL_ROLES:
            calls = _function_calls(turn, role, where, counter)
            if out and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls"):
                out[-1]["tool_calls"] = calls  # the answer's text, then its calls: one message
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": calls})
        else:
            norm = ROLES.get(role) if isinstance(role, str) else None
            if norm is None:
                raise ValueError(f"{where} has an unknown role {role!r}")
            message: dict[str, Any] = {"role": norm, "content": _content(turn, where)}
            if norm == "assistant" and turn.get("tool_calls"):
                if not isinstance(turn["tool_calls"], list):
                    raise ValueError(f"{where}.tool_calls must be a list")
                calls = message["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]", counter + j)
                                                 for j, c in enumerate(turn["tool_calls"])]
            out.append(message)
        if calls:
            counter += len(calls)
            pending = [c["id"] for c in calls]
    last = max((i for i, m in enumerate(out) if m["role"] == "assistant"), default=-1)
    if not any(m["role"] == "user" for m in out[:max(last, 0)]):
        raise ValueError(f"`{column}` has no user turn before its first assistant message")
    return out[:last + 1]
