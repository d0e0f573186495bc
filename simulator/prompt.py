"""`usage.prompt_tokens` as a provider counts it: the conversation rendered with Kimi-K2.5's chat template.

Written here from the template's structure (roles, `<|im_middle|>`, history turns with empty
`<think></think>` whatever reasoning keys they carry, so a multi-turn request's count is exact against
the Kimi-K2.5 rendering of its history, tool results as `## Return of {id}`, a request's tools declared, the
generation prompt ending in `<think>`),
not taken from draftgen's own renderer, so the prompt check compares two renderings. `system` is the
system turn the simulated server puts in front of a conversation that has none: None (Kimi-K2.5's
template adds none), or a text to make a server that renders another prompt than the run does.
"""

from __future__ import annotations

import json
from typing import Any

from draftgen.core.records import reasoning_text
from draftgen.simulator.answers import AnswerTokenizer

_OPENERS = {"user": "<|im_user|>", "assistant": "<|im_assistant|>"}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return ""


def _kept_reasoning(m: dict[str, Any]) -> str:
    """An assistant turn's reasoning inside a tool-call loop, under whichever key the request used:
    `reasoning_content` (vLLM/SGLang), `reasoning` or `reasoning_details` (OpenRouter, which hands it to
    the provider's server as `reasoning_content`)."""
    return reasoning_text(m, ("reasoning_content", "reasoning"))


def prompt_token_count(tok: AnswerTokenizer, messages: list[Any], system: str | None = None, *,
                       keep_history_reasoning: bool = False, tools: Any = None) -> int:
    """Tokens of the rendered prompt, generation prompt (`<|im_assistant|>assistant<|im_middle|><think>`)
    included; non-dict messages count as nothing (the request was accepted as sent).
    `keep_history_reasoning`: render every earlier assistant turn's reasoning (another template's history
    rule, the misbehaviour "history_reasoning"). `tools` (the request's): declared first, as the template
    does, `<|im_system|>tool_declare<|im_middle|>` and the tools as compact JSON, then `<|im_end|>`."""
    msgs = [m for m in messages if isinstance(m, dict)]
    declared = 0
    if tools:
        text = json.dumps(tools, ensure_ascii=False, separators=(",", ":"))
        declared = 3 + len(tok.encode_text("tool_declare")) + len(tok.encode_text(text))
    if system is not None and not (msgs and msgs[0].get("role") == "system"):
        msgs = [{"role": "system", "content": system}, *msgs]
    last_plain = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant" and not m.get("tool_calls")),
                     default=-1)
    n = 0
    for i, m in enumerate(msgs):
        role = str(m.get("role", ""))
        n += 2 + len(tok.encode_text(str(m.get("name") or role)))  # opener, name, <|im_middle|>
        body = _text(m.get("content"))
        if role == "assistant":
            reasoning = "" if i <= last_plain and not keep_history_reasoning else _kept_reasoning(m)
            n += 2 + len(tok.encode_text(reasoning)) + len(tok.encode_text(body))  # <think>...</think>
            calls = m.get("tool_calls") or []
            if calls:
                n += 2  # the tool-calls section's begin and end
                for j, call in enumerate(calls):
                    fn = call.get("function") or {} if isinstance(call, dict) else {}
                    args = fn.get("arguments", "")
                    call_id = call.get("id") if isinstance(call, dict) else None
                    n += 3 + len(tok.encode_text(str(call_id or f"functions.{fn.get('name')}:{j}")))
                    n += len(tok.encode_text(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        elif role == "tool":
            n += len(tok.encode_text(f"## Return of {m.get('tool_call_id') or ''}\n{body}"))
        else:
            n += len(tok.encode_text(body))
        n += 1  # <|im_end|>
    return declared + n + 2 + len(tok.encode_text("assistant")) + 1  # generation prompt, with its <think>
