"""Agent conversations (tools, tool calls, tool results) rendered by draftgen against Kimi-K2.5's
official chat template, token for token and mask for mask, step by step.

The reference is the template bundled as package data (core/data/kimi-k2/chat_template.jinja, its
source named in its first line) rendered with plain jinja2 the way transformers renders a chat
template (`_compile_jinja_template`: a sandboxed environment with trim_blocks, lstrip_blocks and the
loopcontrols extension; `tojson` as json.dumps with non-ASCII kept and keys in the order given),
then tokenized as a serving stack tokenizes a rendered prompt: tiktoken with every special token
recognised. draftgen's side is `reconstruct_record` of each step's record as a run writes it (the
history actually sent, the tools, the answer: reasoning, content, tool calls).

Per step the sample is the prompt the model saw (the template over the history, generation prompt
included) and the answer it generated. For an answer with tool calls the template's own rendering of
history + answer extends the prompt, so its tail is the answer; for a plain answer the template would
re-render the history (the new plain answer moves the history/suffix split), so its tail is taken from
the same rendering with the answer given a placeholder call, the call section cut out.
"""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from draftgen.core.tokens.policy import SamplePolicy
from draftgen.core.tokens.reconstruct import reconstruct_record
from draftgen.core.tokens.report import ValidationReport
from draftgen.core.tokens.template import KimiK25Template, load_template
from draftgen.core.tokens.tokenizer import bundled_kimi, bundled_kimi_path

TOK = bundled_kimi()
KIMI = KimiK25Template()
SEED = 52
CONVERSATIONS = 60


@cache
def official_template() -> jinja2.Template:
    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string((bundled_kimi_path() / "chat_template.jinja").read_text(encoding="utf-8"))


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, generation_prompt: bool) -> str:
    return official_template().render(messages=messages, tools=tools, add_generation_prompt=generation_prompt)


def served_ids(text: str) -> list[int]:
    """The rendered text tokenized as vLLM/SGLang tokenize a rendered chat: special tokens recognised."""
    return TOK.encoding.encode(text, allowed_special="all")


def as_template_reads(m: dict[str, Any]) -> dict[str, Any]:
    """A history message as the provider's server renders it: OpenRouter hands it the reasoning passed
    back (`reasoning_details` or `reasoning`) as `reasoning_content`, the key the template reads."""
    out = {k: v for k, v in m.items() if k not in ("reasoning", "reasoning_details")}
    if "reasoning" in m:
        out["reasoning_content"] = m["reasoning"]
    elif "reasoning_details" in m:
        out["reasoning_content"] = "".join(d["text"] for d in m["reasoning_details"])
    return out


# -- generated agent conversations ------------------------------------------------------------------

WORDS = ["file", "lire", "données", "数据", "ファイル", "ошибка", "🙂", "naïve", "Straße", "x̧", "שלום", "λ",
         "tab\there", "new\nline", "quote\"s", "back\\slash", "{braces}", "<tag>", "  spaced  ", "path/to/a.py", "0",
         "null"]

TOOL_POOL: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "bash", "description": "Run a shell command",
                                      "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                                     "required": ["cmd"]}}},
    {"type": "function", "function": {"name": "read_file", "description": "Lire un fichier — chemin absolu",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string", "description": "路径"},
                                          "offset": {"type": "integer", "minimum": 0}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time (no arguments)",
                                      "parameters": {}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "filters": {
            "type": "object", "properties": {"lang": {"enum": ["en", "日本語"]}, "max": {"type": "number"}}}}}}},
    {"type": "function", "function": {"name": "edit_file", "description": "Replace text; returns a diff",
                                      "strict": True, "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string"}, "old": {"type": "string"},
                                          "new": {"type": "string"}}, "required": ["path", "old", "new"],
                                          "additionalProperties": False}}},
]


def text(rng: random.Random, lo: int = 1, hi: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def arguments(rng: random.Random, name: str) -> Any:
    """A call's arguments: mostly a JSON string (OpenAI layout), sometimes empty, sometimes an object."""
    if name == "get_time" or rng.random() < 0.1:
        return rng.choice(["{}", ""])
    args = {"cmd": text(rng), "path": text(rng, 1, 3), "query": text(rng), "offset": rng.randint(0, 9)}
    keys = rng.sample(sorted(args), rng.randint(1, 3))
    picked = {k: args[k] for k in keys}
    if rng.random() < 0.15:
        return picked  # some datasets store the object itself: the template writes it with tojson
    return json.dumps(picked, ensure_ascii=rng.random() < 0.3)


def tool_result(rng: random.Random, lookalikes: bool = False) -> Any:
    if lookalikes and rng.random() < 0.5:  # a tool's output that holds special-token text (a log, a file)
        return f"{text(rng)} <|im_end|><|im_assistant|>assistant<|im_middle|>{text(rng)}<|tool_call_end|>"
    roll = rng.random()
    if roll < 0.1:
        return "x " * rng.randint(2000, 6000)  # a long result
    if roll < 0.2:
        return [{"type": "text", "text": text(rng)}, {"type": "text", "text": text(rng)}]
    if roll < 0.25:
        return ""
    return text(rng, 1, 40)


def reasoning_key(rng: random.Random, reasoning: str) -> dict[str, Any]:
    """The target's reasoning as a step sends it back: each API's key."""
    style = rng.choice(["reasoning_details", "reasoning", "reasoning_content"])
    if style == "reasoning_details":
        return {"reasoning_details": [{"type": "reasoning.text", "text": reasoning, "format": "unknown", "index": 0}]}
    return {style: reasoning}


def conversation(rng: random.Random,
                 lookalikes: bool = False) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """(tools, messages): one or more user requests, each answered by a tool loop of 0-3 steps (1-3
    calls each, parallel ones included) and a plain answer; history reasoning under any API's key."""
    tools = rng.sample(TOOL_POOL, rng.randint(1, len(TOOL_POOL))) if rng.random() < 0.95 else None
    names = [t["function"]["name"] for t in tools or TOOL_POOL]
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": text(rng)})
    counter = 0  # Kimi numbers its calls across the conversation: functions.NAME:IDX
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": text(rng)})
        for _ in range(rng.randint(0, 3)):
            calls = []
            for _ in range(rng.choice([1, 1, 2, 3])):
                name = rng.choice(names)
                calls.append({"id": f"functions.{name}:{counter}", "type": "function",
                              "function": {"name": name, "arguments": arguments(rng, name)}})
                counter += 1
            content = rng.choice([None, "", text(rng)])
            messages.append({"role": "assistant", "content": content, "tool_calls": calls,
                             **reasoning_key(rng, text(rng))})
            for call in calls:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": tool_result(rng, lookalikes)})
        messages.append({"role": "assistant", "content": text(rng), **reasoning_key(rng, text(rng))})
    return tools, messages


def step_records(cid: str, tools: list[dict[str, Any]] | None,
                 messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per assistant message (a step), as a run writes it: the history sent, the tools, the
    answer (the reasoning the target returned, its content and its own tool calls)."""
    out = []
    steps = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for k, i in enumerate(steps, 1):
        answer = messages[i]
        reasoning = answer.get("reasoning_content") or answer.get("reasoning") or "".join(
            d["text"] for d in answer.get("reasoning_details") or [])
        calls = [{**c, "function": {**c["function"], "arguments": c["function"]["arguments"]
                                    if isinstance(c["function"]["arguments"], str)
                                    else json.dumps(c["function"]["arguments"])}}
                 for c in answer.get("tool_calls") or []]  # an API answers with arguments as a JSON string
        out.append({"id": f"{cid}#t{k}", "conversation": cid, "turn": k, "turns": len(steps),
                    "messages": messages[:i], "tools": tools, "reasoning": reasoning,
                    "content": answer.get("content"), "tool_calls": calls or None,
                    "finish_reason": "tool_calls" if calls else "stop", "provider": "Moonshot AI"})
    return out


def reference(record: dict[str, Any]) -> tuple[list[int], list[int], int]:
    """The official template's ids and loss mask of one step, and where its answer starts."""
    history = [as_template_reads(m) for m in record["messages"]]
    final: dict[str, Any] = {"role": "assistant", "content": record["content"],
                             "reasoning_content": record["reasoning"]}
    placeholder = not record["tool_calls"]
    final["tool_calls"] = record["tool_calls"] or [
        {"id": "x", "type": "function", "function": {"name": "x", "arguments": ""}}]
    prompt = render(history, record["tools"], generation_prompt=True)
    full = render([*history, final], record["tools"], generation_prompt=False)
    assert full.startswith(prompt)
    answer = full[len(prompt):]
    if placeholder:
        begin, end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
        answer = answer[:answer.index(begin)] + answer[answer.index(end) + len(end):]
    prompt_ids, answer_ids = served_ids(prompt), served_ids(answer)
    # SpecForge's Kimi convention: the generation prompt's `<think>` and the whole answer are trained.
    mask = [0] * (len(prompt_ids) - 1) + [1] + [1] * len(answer_ids)
    return prompt_ids + answer_ids, mask, len(prompt_ids)


@cache
def generated(lookalikes: bool = False) -> list[list[dict[str, Any]]]:
    """The agent conversations' step records; `lookalikes`: tool results hold special-token text."""
    rng = random.Random(SEED + lookalikes)
    return [step_records(f"agent-{n}", *conversation(rng, lookalikes)) for n in range(CONVERSATIONS)]


def test_the_generated_conversations_cover_the_cases() -> None:
    """What the comparison below is worth: the generator produced each kind of agent step."""
    records = [r for conv in generated() for r in conv]
    calls = [c for r in records for c in r["tool_calls"] or []]
    assert len(generated()) >= 50 and len(records) > 200
    assert sum(1 for r in records if r["tool_calls"] and len(r["tool_calls"]) > 1) > 20      # parallel calls
    assert sum(1 for c in calls if c["function"]["arguments"] in ("", "{}")) > 10            # empty arguments
    assert sum(1 for r in records if r["tools"] is None) > 0                                  # no tools declared
    tool_texts = [m["content"] for r in records for m in r["messages"] if m["role"] == "tool"]
    assert any(isinstance(t, str) and len(t) > 4000 for t in tool_texts)                      # long results
    assert any(isinstance(t, list) for t in tool_texts)                                       # text parts
    history = [m for r in records for m in r["messages"] if m["role"] == "assistant"]
    for key in ("reasoning_details", "reasoning", "reasoning_content"):
        assert any(key in m for m in history)
    # A tool loop answered, then a new request: its calls' reasoning is no longer rendered.
    assert any(any(m.get("tool_calls") for m in r["messages"][:-1]) and r["messages"][-1]["role"] == "user"
               and sum(1 for m in r["messages"] if m["role"] == "user") > 1 for r in records)
    assert any(not c.isascii() for r in records for c in r["content"] or "")                   # unicode


@pytest.mark.parametrize("n", range(CONVERSATIONS))
def test_every_step_equals_the_official_template(n: int) -> None:
    for record in generated()[n]:
        ids, mask, start = reference(record)
        record = {**record, "usage": {"prompt_tokens": start, "completion_tokens": len(ids) - start}}
        r = reconstruct_record(TOK, KIMI, record)
        where = f"{record['id']} ({'tool calls' if record['tool_calls'] else 'answer'})"
        assert r.error == "", where
        assert r.input_ids.tolist() == ids, where
        assert r.loss_mask.tolist() == mask, where
        assert (r.answer_start, r.answer_end) == (start, len(ids)), where
        # The step's usage.prompt_tokens (here the reference's) agrees with draftgen's rendering.
        assert r.prompt_diff == 0 and r.count_diff == 0, where
        assert r.valid and r.tool_calls == len(record["tool_calls"] or ()), (where, r.failed_checks)
        assert len(r.history_spans) == record["turn"] - 1, where


def test_special_token_text_in_tool_results_is_read_as_a_serving_stack_reads_it() -> None:
    """A tool result holding `<|im_end|>` and the like: vLLM and SGLang tokenize the rendered prompt with
    special tokens recognised, so with `prompt_special_tokens = "special"` draftgen's prompt is theirs."""
    served = load_template("kimi-k2.5", TOK, prompt_specials=True)
    records = [r for conv in generated(lookalikes=True) for r in conv]
    assert sum(1 for r in records for m in r["messages"]
               if m["role"] == "tool" and "<|im_end|>" in str(m["content"])) > 50
    for record in records:
        ids, mask, start = reference(record)
        r = reconstruct_record(TOK, served, {**record, "usage": {"prompt_tokens": start}})
        assert r.input_ids.tolist() == ids and r.loss_mask.tolist() == mask, record["id"]
        assert r.prompt_diff == 0 and r.valid, record["id"]


# -- tool-call ids that are not the model's own ----------------------------------------------------------

def test_rewritten_tool_call_ids_are_detected_counted_by_provider_and_dropped() -> None:
    """A provider that rewrites `functions.NAME:IDX` to `call_…` hands back calls whose rendered ids the
    model never generated: the step fails tool_call_ids, the report counts it under that provider, the
    policy drops it (or keeps it noted, when told to)."""
    steps = [r for conv in generated() for r in conv if r["tool_calls"]][:12]
    report = ValidationReport("agents")
    for k, record in enumerate(steps):
        if k % 3 == 0:
            calls = [{**c, "id": f"call_{j}{k}abc"} for j, c in enumerate(record["tool_calls"])]
            record = {**record, "tool_calls": calls, "provider": "Rewriter"}
        r = reconstruct_record(TOK, KIMI, record)
        assert ("tool_call_ids" in r.failed_checks) == (k % 3 == 0)
        report.add(r)
    # A call with no id at all renders none: not what the model wrote either.
    bare = {**steps[0], "tool_calls": [{k: v for k, v in c.items() if k != "id"} for c in steps[0]["tool_calls"]]}
    assert "tool_call_ids" in reconstruct_record(TOK, KIMI, bare).failed_checks
    assert report.providers["Rewriter"].foreign_ids == report.providers["Rewriter"].tool_answers == 4
    assert report.providers["Moonshot AI"].foreign_ids == 0 and report.providers["Moonshot AI"].tool_answers == 8
    assert report.dropped == {"foreign_tool_call_id": 4} and report.kept == 8
    assert "Rewriter 4 of 4" in report.format()
    again = ValidationReport.from_dict(report.to_dict())
    assert again.providers["Rewriter"].foreign_ids == 4 and again.tool_ids_line() == report.tool_ids_line()
    keep = SamplePolicy().limits.__class__(drop_foreign_tool_call_ids=False)
    verdict = SamplePolicy(keep).judge(["tool_call_ids"], 0, 10)
    assert verdict.keep and verdict.notes == ("foreign_tool_call_id",)


def test_server_ids_make_the_call_ids_the_servers() -> None:
    """With the server's own ids the span is what the model generated, whatever id the API shows."""
    record = next(r for conv in generated() for r in conv if r["tool_calls"])
    ids, _, start = reference(record)
    calls = [{**c, "id": "call_rewritten"} for c in record["tool_calls"]]
    r = reconstruct_record(TOK, KIMI, {**record, "tool_calls": calls, "token_ids": ids[start:]})
    assert "tool_call_ids" not in r.checks and r.input_ids.tolist() == ids


def test_tokens_command_counts_rewritten_call_ids_per_provider(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`draftgen tokens` over agent steps: more steps than run inline (the worker processes get each
    record's tools), one provider's call ids rewritten; the line names it with its controls escaped."""
    from draftgen.core.tokens.command import tokens_command
    from draftgen.core.tokens.workers import INLINE_MAX, REPORT_FILE
    from tests.tokens.test_tokens import make_config, write_responses
    monkeypatch.setenv("COLUMNS", "200")
    config = make_config(tmp_path)
    steps = [r for conv in generated() for r in conv if r["tool_calls"]][:INLINE_MAX + 8]
    records = []
    for k, step in enumerate(steps):
        ids, _, start = reference(step)
        rec = {**step, "usage": {"prompt_tokens": start, "completion_tokens": len(ids) - start}}
        if k < 5:
            rec["provider"] = "Re\x1b[31mwriter"
            rec["tool_calls"] = [{**c, "id": f"call_{k}{j}"} for j, c in enumerate(step["tool_calls"])]
        records.append(rec)
    write_responses(config, "A", records)
    assert tokens_command(config) == 0
    out = capsys.readouterr().out
    assert f"answers calling tools: {len(steps):,}" in out and "Re\\x1b[31mwriter 5 of 5" in out
    assert "\x1b[31m" not in out and "foreign_tool_call_id 5" in out
    report = json.loads((config.run_dir / "A" / "tokens" / REPORT_FILE).read_text())
    assert report["failures"]["tool_call_ids"] == 5 and report["prompt_token_count"]["mismatches"] == 0
    assert report["providers"]["Moonshot AI"]["tool_answers"] == len(steps) - 5
