"""Chat templates rendered as segments: special tokens by name, everything else ordinary text.

A rendered conversation is three runs of segments: the prompt (through the generation prompt the
server appended), the answer span (what the target model generated) and a suffix the template
adds after the end-of-turn token (mask 0). Special segments are inserted by id; text segments are
encoded as ordinary text, so text that looks like a special token stays text.

`kimi-k2.5`, built in:
    <|im_system|>system<|im_middle|>{system}<|im_end|>
    <|im_user|>user<|im_middle|>{prompt}<|im_end|>
    <|im_assistant|>assistant<|im_middle|><think></think>{earlier answer}<|im_end|>   (history)
    <|im_assistant|>assistant<|im_middle|><think>{reasoning}</think>{content}<|im_end|>
Checked (with the `search` tool) against: llama.cpp's copy of Kimi-K2-Thinking's
`chat_template.jinja`; the opening of Kimi-K2.5's `chat_template.jinja` (same `render_content`,
`set_roles`, `render_toolcalls` macros and history/suffix split) and the descriptions of its
history split in ART's and miles' patches of it; tinker-cookbook's K2.5 renderer; SpecForge's
`specforge/data/template.py` and `parse.py`. What that gives:
- roles render as `message.name or role`; roles other than user/assistant open with `<|im_system|>`;
- assistant turns up to the last one without tool calls are history, their reasoning dropped
  (`<think></think>`); later ones (tool-call turns) keep their `reasoning_content`. A history message
  may carry its reasoning under another API's key (`history_reasoning`): OpenRouter takes back
  `reasoning_details` or `reasoning` and hands the provider's server `reasoning_content`, so inside a
  tool-call loop any of the three renders the same text; outside one none renders (the history
  split: assistant messages after the last one without tool calls keep their reasoning, those up to
  it render `<think></think>`; a step's prompt is the history it was sent, so a tool loop under way
  keeps its reasoning and an answered one does not);
- `RenderedChat.history_turns`: where each earlier assistant turn sits in the prompt (its `<think>`
  through its `<|im_end|>`, the span SpecForge masks when it trains every assistant turn), so a
  per-conversation sample can put them in the loss mask (core/merge; `auto` gives none);
- tool results render `## Return of {tool_call_id}\n{content}`; tool calls
  `<|tool_calls_section_begin|><|tool_call_begin|>{id}<|tool_call_argument_begin|>{args}<|tool_call_end|>…`;
- K2.5's generation prompt ends with `<think>` (K2-Thinking's did not), so the answer span starts
  after it while the loss mask starts at it: SpecForge's `kimi-k2-thinking` template has
  assistant_header `<|im_assistant|>assistant<|im_middle|>` and end_of_turn `<|im_end|>`, and its
  GeneralParser (under ThinkingParser) masks from the end of that header through the end-of-turn
  token inclusive. SpecForge masks every assistant turn unless `train_only_last_turn`; here only the
  last, since earlier ones came with the prompt.
- The default system turn. K2's and K2-Thinking's templates insert "You are Kimi, an AI assistant
  created by Moonshot AI." when a conversation has none (llama.cpp's copies of both). K2.5's does
  not: PrimeIntellect-ai/renderers' K2.5 renderer, parity-tested token for token against the HF
  Jinja template of moonshotai/Kimi-K2.5 on a user-only conversation with and without the generation
  prompt (tests/parity.py scenarios "user", "generation-prompt-no-system"), renders none, while its
  K2 renderer does; a downstream fork of tinker-cookbook calls tinker's inherited K2 default in its
  K2.5 renderer the thing its "corrected" variant removes. vLLM and SGLang render the model's own
  template, so a provider serving K2.5 renders no system turn: `kimi-k2.5` renders none by default.
  `[tokenizer] default_system` overrides that (a text renders that turn, as `KimiK25Template(
  default_system=...)`); the smoke test's prompt-token check shows which one the provider ran.
- `tools` (the request's function schemas) render first, before the system turn:
  `<|im_system|>tool_declare<|im_middle|>{tools as JSON}<|im_end|>`, the JSON as transformers' `tojson`
  writes `tools | tojson(separators=(',', ':'))` (non-ASCII kept, keys in the order given). The
  template's `tools_ts_str` (a TypeScript-style declaration a caller may pass instead) is never set by
  vLLM, SGLang or transformers unless asked, so it is not rendered;
- call ids and `tool_call_id`s render as the messages carry them ("" where absent, as the template
  prints an undefined value); nothing is invented.
- Checked token for token against the official template itself, bundled as
  `core/data/kimi-k2/chat_template.jinja` (tests/tokens/test_agent_template.py renders it with jinja2
  over generated agent conversations, step by step).
- Not rendered: image parts (rejected with TemplateError).

`auto`: the tokenizer's own Jinja template (transformers `apply_chat_template`, the final assistant
message carrying `reasoning_content`). Message texts are replaced by sentinels before rendering so
the template's own special tokens can be told from look-alikes typed in the texts; the answer span
starts where the generation prompt (`add_generation_prompt=True`) ends. A template that rewrites
the texts themselves (trims them, splits them on tags) is used as it renders, split at every
special token, look-alikes included.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from draftgen.core.config_tables import KIMI_DEFAULT_SYSTEM  # noqa: F401 - re-exported for callers of this module
from draftgen.core.errors import DraftgenError
from draftgen.core.records import reasoning_text
from draftgen.core.tokens.tokenizer import Tokenizer

TEMPLATES = ("kimi-k2.5", "auto")


class TemplateError(DraftgenError):
    """A conversation the template cannot render (bad message shape, unsupported content)."""


class Segment(NamedTuple):
    """A piece of a rendered conversation (a named tuple: every answer makes a dozen or more of them, and a
    tuple is made in under half the time of a frozen dataclass)."""
    text: str
    special: bool = False   # True: `text` is the name of a special token, inserted by id
    # A piece the template repeats in every rendering (Kimi-K2.5's turn headers, its generation prompt, its
    # tags) with its ids, made once by the template loaded for its tokenizer: `special` is True (it holds
    # the template's own text only, never a message's, and nothing splits it again) and the encoder inserts
    # `ids` as they are. (): encoded with each rendering.
    ids: tuple[int, ...] = ()


@dataclass(slots=True)  # one per answer in the workers: a frozen __init__ costs ~3x (setattr per field)
class RenderedChat:
    prompt: tuple[Segment, ...]      # everything before the answer span, generation prompt included
    answer: tuple[Segment, ...]      # what the target model generated
    suffix: tuple[Segment, ...]      # template text after the answer (never generated; mask 0)
    mask_prompt_tail: int            # trailing prompt segments (specials) the loss mask also covers
    eot: str                         # end-of-turn special token name
    think_open: str | None           # reasoning delimiters (None: the template has none)
    think_close: str | None
    answer_opens_think: bool = False  # the model generates the opening `<think>` itself (not in the prompt)
    # Earlier assistant turns: prompt segment ranges [start, end), from the `<think>` after the header
    # through the end-of-turn token (the span a loss mask over every assistant turn covers).
    history_turns: tuple[tuple[int, int], ...] = ()

    def answer_text(self) -> str:
        return "".join([s.text for s in self.answer])


class ChatTemplate(Protocol):
    name: str

    def render(self, messages: list[dict[str, Any]], reasoning: str | None, content: str, *,
               truncated: bool = False, tool_calls: list[dict[str, Any]] | None = None,
               tools: list[Any] | None = None) -> RenderedChat: ...


def message_text(message: dict[str, Any], where: str) -> str:
    """The text of an OpenAI-style message content: a string, None, or a list of text parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise TemplateError(f"{where}: content part of type {kind!r} is not supported (text only)")
        return "".join(parts)
    raise TemplateError(f"{where}: content must be a string or a list of parts, not {type(content).__name__}")


def history_reasoning(message: dict[str, Any]) -> str:
    """The reasoning text a history assistant message carries, under any API's key: `reasoning_content`
    (vLLM, SGLang and the chat templates), else `reasoning` (OpenRouter), else the text of OpenRouter's
    `reasoning_details` (`reasoning.text` parts' text, `reasoning.summary` parts' summary; encrypted parts
    have none). "" when it has none."""
    return reasoning_text(message, ("reasoning_content", "reasoning"))


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise TemplateError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TemplateError(f"messages[{i}] must be an object with a string role")
    return messages


def with_system(messages: list[dict[str, Any]], system: str | None) -> list[dict[str, Any]]:
    """`messages` with `system` as a first system turn when they have none (and `system` is set)."""
    if system is None or (messages and isinstance(messages[0], dict) and messages[0].get("role") == "system"):
        return messages
    return [{"role": "system", "content": system}, *messages]


def _jinja_text(value: Any) -> str:
    """A value as a Jinja `{{ }}` prints it: "" for a missing one (None prints "None" there, but a
    message key set to null is read here as missing, as the JSON layouts mean it)."""
    return "" if value is None else str(value)


def tools_json(tools: Any) -> str:
    """The `tool_declare` text of Kimi-K2.5's template: `tools | tojson(separators=(',', ':'))` under
    transformers' `tojson` (json.dumps, non-ASCII kept, keys in the order given)."""
    import json
    return json.dumps(tools, ensure_ascii=False, separators=(",", ":"))


def _tool_call_parts(tool_calls: Any, where: str) -> list[Segment]:
    """Kimi's tool-call section (`render_toolcalls`): each call's `id` as given ("" when it has none:
    the template renders only what the message carries), its arguments verbatim when a string, else
    JSON as transformers' `tojson` writes it."""
    import json
    if not isinstance(tool_calls, list):
        raise TemplateError(f"{where}.tool_calls must be a list")
    out = [Segment("<|tool_calls_section_begin|>", True)]
    for j, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise TemplateError(f"{where}.tool_calls[{j}] must have function.name")
        call_id = _jinja_text(call.get("id"))
        args = fn.get("arguments", "")
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        out += [Segment("<|tool_call_begin|>", True), Segment(str(call_id)),
                Segment("<|tool_call_argument_begin|>", True), Segment(args), Segment("<|tool_call_end|>", True)]
    out.append(Segment("<|tool_calls_section_end|>", True))
    return out


_IM_MIDDLE = Segment("<|im_middle|>", True)
_KIMI_OPENERS = {"user": "<|im_user|>", "assistant": "<|im_assistant|>"}
_KIMI_ROLES = ("system", "user", "assistant", "tool")


def _fixed(tok: Tokenizer | None, *parts: Segment) -> tuple[Segment, ...]:
    """`parts` as one Segment carrying their ids in `tok` (see Segment.ids); as they are without a tokenizer."""
    if tok is None:
        return parts
    ids: list[int] = []
    for text, special, _ in parts:
        ids += [tok.special_id(text)] if special else tok.encode_text(text)
    return (Segment("".join(p.text for p in parts), True, tuple(ids)),)


class KimiK25Template:
    """The built-in Kimi-K2.5 rendering (see the module docstring).

    `tok`: the tokenizer it renders for (load_template gives it): each turn's header (`<|im_user|>user
    <|im_middle|>` and the like), the generation prompt and the tags are then encoded once, here, and only
    the messages' texts with each answer (identical ids: the same pieces encoded the same way, once).
    Without one, every piece is encoded with each answer."""

    name = "kimi-k2.5"
    EOT, THINK_OPEN, THINK_CLOSE = "<|im_end|>", "<think>", "</think>"

    def __init__(self, default_system: str | None = None, tok: Tokenizer | None = None) -> None:
        self.default_system = default_system
        self.tok = tok  # reconstruct checks it is the tokenizer it encodes with
        (self._im_end,), (self._think_open,), (self._think_close,) = (
            _fixed(tok, Segment(name, True)) for name in (self.EOT, self.THINK_OPEN, self.THINK_CLOSE))
        headers = {role: (Segment(_KIMI_OPENERS.get(role, "<|im_system|>"), True), Segment(role), _IM_MIDDLE)
                   for role in _KIMI_ROLES}
        self._headers = {role: _fixed(tok, *parts) for role, parts in headers.items()}
        self._generation_prompt = _fixed(tok, *headers["assistant"], Segment(self.THINK_OPEN, True))

    def _header(self, message: dict[str, Any]) -> tuple[Segment, ...]:
        role = message["role"]
        name = message.get("name") or role
        if name == role and role in self._headers:  # the common case: made once, not three Segments a turn
            return self._headers[role]
        return (Segment(_KIMI_OPENERS.get(role, "<|im_system|>"), True), Segment(str(name)), _IM_MIDDLE)

    def render(self, messages: list[dict[str, Any]], reasoning: str | None, content: str, *,
               truncated: bool = False, tool_calls: list[dict[str, Any]] | None = None,
               tools: list[Any] | None = None) -> RenderedChat:
        messages = with_system(_check_messages(messages), self.default_system)
        prompt: list[Segment] = []
        if tools:
            if not isinstance(tools, list):
                raise TemplateError(f"tools must be a list of function schemas, not {type(tools).__name__}")
            prompt += [Segment("<|im_system|>", True), Segment("tool_declare"), Segment("<|im_middle|>", True),
                       Segment(tools_json(tools)), Segment(self.EOT, True)]
        # History ends at the last assistant turn without tool calls; its reasoning (and earlier) is dropped.
        last_plain = len(messages) - 1  # from the end: a loop, not a generator (~0.5 us an answer)
        while last_plain >= 0 and (messages[last_plain]["role"] != "assistant"
                                   or messages[last_plain].get("tool_calls")):
            last_plain -= 1
        history: list[tuple[int, int]] = []
        for i, m in enumerate(messages):
            prompt += self._header(m)
            text = m.get("content")
            if type(text) is not str:  # a list of parts, or None (the message's index named only on an error)
                text = message_text(m, f"messages[{i}]")
            if m["role"] == "assistant":
                opened = len(prompt)
                rc = "" if i <= last_plain else history_reasoning(m)
                prompt += [self._think_open, Segment(rc), self._think_close, Segment(text)]
                if m.get("tool_calls"):
                    prompt += _tool_call_parts(m["tool_calls"], f"messages[{i}]")
                history.append((opened, len(prompt) + 1))  # through the <|im_end|> appended below
            elif m["role"] == "tool":
                prompt.append(Segment(f"## Return of {_jinja_text(m.get('tool_call_id'))}\n{text}"))
            else:
                prompt.append(Segment(text))
            prompt.append(self._im_end)
        prompt += self._generation_prompt

        answer: list[Segment] = [Segment(reasoning or "")]
        # A truncated answer with no content was cut while still reasoning: no </think> was generated.
        if not (truncated and not content and not tool_calls):
            answer += (self._think_close, Segment(content))
        if tool_calls:
            answer += _tool_call_parts(tool_calls, "answer")
        if not truncated:
            answer.append(self._im_end)
        return RenderedChat(tuple(prompt), tuple(answer), (), 1, self.EOT, self.THINK_OPEN, self.THINK_CLOSE,
                            history_turns=tuple(history))


# Private-use code points: never produced by a tokenizer's template, cheap to find afterwards.
_SENTINEL = "\ue000{}\ue001"
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")


class AutoTemplate:
    """The tokenizer's own chat template (see the module docstring)."""

    name = "auto"

    def __init__(self, tok: Tokenizer, default_system: str | None = None) -> None:
        self.default_system = default_system
        if not tok.has_chat_template:
            raise TemplateError(f"tokenizer {tok.name} has no chat template of its own: "
                                f"tokenizer.template = \"auto\" needs one (or use \"kimi-k2.5\")")
        self.tok = tok
        specials = sorted(tok.special_tokens(), key=len, reverse=True)
        self._split = re.compile("(" + "|".join(["\ue000\\d+\ue001"] + [re.escape(s) for s in specials]) + ")")
        names = set(specials)
        self.think_open = "<think>" if "<think>" in names else None
        self.think_close = "</think>" if "</think>" in names else None

    @staticmethod
    def _hidden(messages: list[dict[str, Any]], reasoning: str | None, content: str,
                tool_calls: list[dict[str, Any]] | None,
                texts: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The conversation and the answer turn with every text swapped for a sentinel (its index in
        `texts`), so the template's own specials can be told from the texts it renders around them."""
        def hide(text: str) -> str:
            if not text:
                return text
            texts.append(text)
            return _SENTINEL.format(len(texts) - 1)

        hidden = []
        for i, m in enumerate(messages):
            h = dict(m)
            h["content"] = hide(message_text(m, f"messages[{i}]"))
            if isinstance(m.get("reasoning_content"), str):
                h["reasoning_content"] = hide(m["reasoning_content"])
            hidden.append(h)
        final: dict[str, Any] = {"role": "assistant", "content": hide(content)}
        if reasoning is not None:
            final["reasoning_content"] = hide(reasoning)
        if tool_calls:
            final["tool_calls"] = tool_calls
        return hidden, final

    def _check_continues(self, head: str, full: str) -> None:
        if not full.startswith(head):
            raise TemplateError(f"the chat template of {self.tok.name} does not render the answer as a "
                                f"continuation of its generation prompt; use tokenizer.template = \"kimi-k2.5\"")

    def _sentinel_segments(self, hidden: list[dict[str, Any]], final: dict[str, Any], texts: list[str],
                           tools: list[Any] | None) -> tuple[list[Segment], list[Segment]]:
        """The prompt's and the answer turn's segments, rendered with sentinels for the texts."""
        head = self.tok.render_chat(hidden, add_generation_prompt=True, tools=tools)
        full = self.tok.render_chat(hidden + [final], add_generation_prompt=False, tools=tools)
        self._check_continues(head, full)
        tail = full[len(head):]
        for what, sentinel in (("reasoning", final.get("reasoning_content")), ("content", final["content"])):
            if sentinel and sentinel not in tail:
                raise TemplateError(f"the chat template of {self.tok.name} drops the answer's {what} from the "
                                    f"final turn; use tokenizer.template = \"kimi-k2.5\"")
        return self._segments(head, texts), self._segments(tail, texts)

    def _segments(self, rendered: str, texts: list[str]) -> list[Segment]:
        """Split a sentinel rendering at the template's specials; sentinels become their texts."""
        out: list[Segment] = []
        pending: list[str] = []
        for k, piece in enumerate(self._split.split(rendered)):
            if k % 2 == 0:
                pending.append(piece)
                continue
            found = _SENTINEL_RE.fullmatch(piece)
            if found:
                pending.append(texts[int(found.group(1))])
                continue
            if pending:
                out.append(Segment("".join(pending)))
                pending = []
            out.append(Segment(piece, True))
        if pending:
            out.append(Segment("".join(pending)))
        return [s for s in out if s.special or s.text]

    def render(self, messages: list[dict[str, Any]], reasoning: str | None, content: str, *,
               truncated: bool = False, tool_calls: list[dict[str, Any]] | None = None,
               tools: list[Any] | None = None) -> RenderedChat:
        messages = [_reasoning_content(m) for m in with_system(_check_messages(messages), self.default_system)]
        texts: list[str] = []
        hidden, final = self._hidden(messages, reasoning, content, tool_calls, texts)
        tools = tools or None
        prompt, rest = self._sentinel_segments(hidden, final, texts, tools)
        # A template that rewrites texts (trims, splits on tags) renders something else than the
        # sentinels stand for: then take its real rendering, split at every special it contains.
        real_final = {k: v for k, v in final.items() if k not in ("content", "reasoning_content")}
        real_final["content"] = content
        if reasoning is not None:
            real_final["reasoning_content"] = reasoning
        real_head = self.tok.render_chat(messages, add_generation_prompt=True, tools=tools)
        real_full = self.tok.render_chat(messages + [real_final], add_generation_prompt=False, tools=tools)
        if "".join(s.text for s in prompt) != real_head or "".join(s.text for s in prompt + rest) != real_full:
            self._check_continues(real_head, real_full)
            prompt = self._segments(real_head, [])
            rest = self._segments(real_full[len(real_head):], [])
        last_special = max((i for i, s in enumerate(rest) if s.special), default=-1)
        if last_special < 0:
            raise TemplateError(f"the chat template of {self.tok.name} ends the assistant turn with no "
                                f"special end-of-turn token")
        answer, suffix = rest[:last_special + 1], rest[last_special + 1:]
        eot = answer[-1].text
        if truncated:
            # Cut answers end where generation stopped: no end-of-turn (and no </think> if content never began).
            answer = answer[:-1]
            if not content and self.think_close is not None:
                cut = next((i for i, s in enumerate(answer) if s.special and s.text == self.think_close), None)
                answer = answer if cut is None else answer[:cut]
            suffix = []
        tail_mask = 1 if prompt and prompt[-1].special and prompt[-1].text == self.think_open else 0
        opens = bool(answer) and answer[0].special and answer[0].text == self.think_open
        return RenderedChat(tuple(prompt), tuple(answer), tuple(suffix), tail_mask, eot,
                            self.think_open, self.think_close, opens)


def _reasoning_content(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message whose reasoning came under OpenRouter's keys, as the served model's template
    reads it (`reasoning_content`, which OpenRouter hands the provider's server); others as they are."""
    if message.get("role") != "assistant" or not any(k in message for k in ("reasoning", "reasoning_details")):
        return message
    out = {k: v for k, v in message.items() if k not in ("reasoning", "reasoning_details")}
    if not isinstance(out.get("reasoning_content"), str) and (text := history_reasoning(message)):
        out["reasoning_content"] = text
    return out


class _PromptSpecials:
    """A template whose prompt reads special-token text as the special token, as a serving stack does:
    vLLM, SGLang and transformers serve render the chat template to a string and tokenize it with
    special tokens recognised, so a `<|im_end|>` typed in a message becomes that token. Answers stay text."""

    def __init__(self, inner: ChatTemplate, names: Any) -> None:
        self._inner = inner
        self._split = special_text_pattern(names)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)

    def render(self, messages: list[dict[str, Any]], reasoning: str | None, content: str, *,
               truncated: bool = False, tool_calls: list[dict[str, Any]] | None = None,
               tools: list[Any] | None = None) -> RenderedChat:
        import dataclasses
        rendered = self._inner.render(messages, reasoning, content, truncated=truncated, tool_calls=tool_calls,
                                      tools=tools)
        if self._split is None:
            return rendered
        prompt: list[Segment] = []
        starts: list[int] = []  # where each segment of the inner rendering starts in this one
        for seg in rendered.prompt:
            starts.append(len(prompt))
            if seg.special:
                prompt.append(seg)
                continue
            for k, piece in enumerate(self._split.split(seg.text)):
                if piece:
                    prompt.append(Segment(piece, k % 2 == 1))
        starts.append(len(prompt))
        history = tuple((starts[a], starts[b]) for a, b in rendered.history_turns)
        return dataclasses.replace(rendered, prompt=tuple(prompt), history_turns=history)


def special_text_pattern(names: Any) -> re.Pattern[str] | None:
    """A regex matching any of the special-token `names` (longest first), None when there are none."""
    names = sorted((n for n in names if n), key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(n) for n in names) + ")") if names else None


def count_special_text(lines: Any, names: Any) -> int:
    """How many of `lines` (prompt-file lines, str or bytes) hold a special token's text."""
    pattern = special_text_pattern(names)
    if pattern is None:
        return 0
    raw = re.compile(pattern.pattern.encode())
    return sum(1 for line in lines if (raw if isinstance(line, bytes) else pattern).search(line))


def load_template(name: str, tok: Tokenizer, *, default_system: str | None = None,
                  prompt_specials: bool = False) -> ChatTemplate:
    """The template `name` ("kimi-k2.5" or "auto") for `tok`; `prompt_specials`: special-token text
    in the prompt becomes the special token (`[tokenizer] prompt_special_tokens = "special"`)."""
    template = _load_template(name, tok, default_system=default_system)
    return _PromptSpecials(template, tok.special_tokens()) if prompt_specials else template


def _load_template(name: str, tok: Tokenizer, *, default_system: str | None = None) -> ChatTemplate:
    if name == "kimi-k2.5":
        for special in ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>",
                        "<think>", "</think>"):
            tok.special_id(special)  # a clear TokenizerError now, not one per answer later
        return KimiK25Template(default_system, tok)
    if name == "auto":
        return AutoTemplate(tok, default_system)
    raise TemplateError(f"unknown chat template {name!r} (known: {', '.join(TEMPLATES)})")
