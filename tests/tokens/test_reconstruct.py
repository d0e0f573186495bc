"""Reconstruction on the real Kimi vocabulary: exact ids, loss mask, each validation check, the report."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draftgen.core.tokens.policy import SamplePolicy
from draftgen.core.tokens.reconstruct import CHECKS, PROMPT_TEXT_MIN, PromptTexts, reconstruct, reconstruct_record
from draftgen.core.tokens.report import ValidationReport
from draftgen.core.tokens.template import (
    KIMI_DEFAULT_SYSTEM,
    AutoTemplate,
    KimiK25Template,
    TemplateError,
    load_template,
)
from draftgen.core.tokens.tokenizer import bundled_kimi, bundled_kimi_path, load_tokenizer
from tests.multiturn import HISTORY_STYLES, Turn, conversation_records, three_turns
from tests.tokens.test_tokenizer import ROUND_TRIPS, build_tokenizer_json

TABLE = json.loads((bundled_kimi_path() / "special_tokens.json").read_text())
TOK = bundled_kimi()
KIMI = load_template("kimi-k2.5", TOK)
SPECIAL = {name: TOK.special_id(name) for name in TABLE["named"]}


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def by_hand(messages: list[dict[str, Any]], reasoning: str | None, content: str,
            *, truncated: bool = False) -> tuple[list[int], int, int]:
    """An independent reconstruction: the Kimi-K2.5 rendering of docs/files.md written out as one string and encoded by
    tiktoken with every special allowed (valid when the texts hold no special look-alikes)."""
    last_plain = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    text = ""
    for i, m in enumerate(messages):
        opener = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>"}[m["role"]]
        text += f"{opener}{m['role']}<|im_middle|>"
        if m["role"] == "assistant":
            text += "<think></think>" if i <= last_plain else f"<think>{m.get('reasoning_content', '')}</think>"
        text += f"{m['content']}<|im_end|>"
    text += "<|im_assistant|>assistant<|im_middle|><think>"
    start = len(TOK.encoding.encode(text, allowed_special="all"))
    answer = reasoning or ""
    if not (truncated and not content):
        answer += f"</think>{content}"
    if not truncated:
        answer += "<|im_end|>"
    ids = TOK.encoding.encode(text + answer, allowed_special="all")
    return ids, start, len(ids)


SYSTEM_MULTI = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back (dropped)"},
    {"role": "user", "content": "What is 2+2? Answer in one word."},
]

CASES = {
    "single": (user("What is 2+2?"), "Simple sum.", "Four."),
    "system_multi_turn": (SYSTEM_MULTI, "2 plus 2 is 4.", "Four"),
    "no_reasoning": (user("Say hi"), None, "Hi!"),
    "empty_content": (user("Think only"), "I will think but say nothing.", ""),
    "code": (user("Factorial?"), "Recursion.", ROUND_TRIPS["code"]),
    "cjk": (user(ROUND_TRIPS["cjk"]), "中文推理。", ROUND_TRIPS["cjk"]),
    "emoji": (user("Emoji?"), "🚀 thinking", ROUND_TRIPS["emoji"]),
    "whitespace": (user("  spaced\n\n"), "\n\n  lead and trail  \n", ROUND_TRIPS["whitespace"]),
}


def test_chat_vector_through_the_template() -> None:
    vec = TABLE["test_vectors"]["chat_with_specials"]
    r = reconstruct(TOK, KIMI, user("Hi"), "ok", "Hello", billed_tokens=4)
    assert r.input_ids.tolist() == vec["ids"]
    assert (r.answer_start, r.answer_end) == (9, 13)
    assert r.loss_mask.tolist() == [0] * 8 + [1] * 5  # from the <think> through <|im_end|>
    assert r.valid and r.count_diff == 0 and r.source == "reconstructed"
    # No server ids given: nothing to compare them with, no text to check against them; no tool calls.
    assert set(r.checks) == set(CHECKS) - {"matches_backend", "matches_backend_prompt", "text_matches_ids",
                                           "tool_call_ids"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_an_independent_reconstruction(case: str) -> None:
    messages, reasoning, content = CASES[case]
    expected, start, end = by_hand(messages, reasoning, content)
    r = reconstruct(TOK, KIMI, messages, reasoning, content)
    assert r.input_ids.tolist() == expected
    assert (r.answer_start, r.answer_end) == (start, end)
    assert r.valid, r.failed_checks
    span = r.input_ids[r.answer_start:r.answer_end].tolist()
    assert TOK.decode(span) == f"{reasoning or ''}</think>{content}<|im_end|>"
    assert span[-1] == SPECIAL["<|im_end|>"] and span.count(SPECIAL["</think>"]) == 1


def test_loss_mask_on_a_multi_turn_prompt_with_a_system_turn() -> None:
    r = reconstruct(TOK, KIMI, SYSTEM_MULTI, "2 plus 2 is 4.", "Four")
    ids, mask = r.input_ids.tolist(), r.loss_mask.tolist()
    think = SPECIAL["<think>"]
    last_think = len(ids) - 1 - ids[::-1].index(think)
    assert last_think == r.answer_start - 1
    assert mask == [0] * last_think + [1] * (len(ids) - last_think)
    # The earlier assistant turn: <think></think>Hello!<|im_end|>, its reasoning dropped, not in the mask.
    assert TOK.decode(ids).count("greet back") == 0
    first_assistant = ids.index(SPECIAL["<|im_assistant|>"])
    assert ids[first_assistant + 3:first_assistant + 5] == [think, SPECIAL["</think>"]]
    assert ids[0] == SPECIAL["<|im_system|>"] and sum(mask) == r.answer_end - r.answer_start + 1


def test_kimis_fixed_pieces_are_encoded_once_with_the_same_ids() -> None:
    """The template loaded for a tokenizer encodes each turn's header, the generation prompt and the tags when
    it is loaded: an answer encodes its messages' texts only, and its ids, mask and history spans are those
    of every piece encoded with the answer (the template made without a tokenizer) and of the official
    rendering (by_hand). A lone surrogate still encodes as tiktoken's own encode_ordinary replaces it."""
    tok = copy.copy(TOK)  # its own encode_text to count on, the same vocabulary
    template = load_template("kimi-k2.5", tok)
    encoded: list[str] = []
    encode_text = tok.encode_text
    tok.encode_text = lambda text: encoded.append(text) or encode_text(text)  # type: ignore[method-assign]
    r = reconstruct(tok, template, SYSTEM_MULTI, "2 plus 2 is 4.", "Four")
    assert sorted(encoded) == sorted(t for t in ([m["content"] for m in SYSTEM_MULTI] + ["2 plus 2 is 4.", "Four"])
                                     if t)
    each_answer = reconstruct(TOK, KimiK25Template(), SYSTEM_MULTI, "2 plus 2 is 4.", "Four")
    expected, start, end = by_hand(SYSTEM_MULTI, "2 plus 2 is 4.", "Four")
    assert r.input_ids.tolist() == each_answer.input_ids.tolist() == expected
    assert r.loss_mask.tolist() == each_answer.loss_mask.tolist()
    assert (r.answer_start, r.answer_end) == (start, end) and r.history_spans == each_answer.history_spans != ()
    assert r.index_meta() == each_answer.index_meta()
    surrogate = "a lone \ud800 surrogate in a longer text"
    cut = reconstruct(tok, template, user(surrogate), "ok", surrogate)
    assert cut.input_ids.tolist() == reconstruct(TOK, KimiK25Template(), user(surrogate), "ok", surrogate
                                                 ).input_ids.tolist()
    assert TOK.encoding.encode_ordinary(surrogate) == tok.encode_text(surrogate)


def test_a_template_loaded_for_another_tokenizer_is_refused() -> None:
    """Its fixed pieces hold the other tokenizer's ids: the answer is not rendered rather than given them."""
    other = copy.copy(TOK)  # the same vocabulary even, but not the tokenizer KIMI was loaded for
    r = reconstruct(other, KIMI, user("Hi"), "ok", "Hello")
    assert r.failed_checks == ("renders",) and "loaded for tokenizer" in r.error
    assert reconstruct(other, load_template("kimi-k2.5", other), user("Hi"), "ok", "Hello").valid


def test_literal_im_end_in_an_answer_stays_text() -> None:
    content = "Close a turn with <|im_end|> and think with <|im_user|>."
    r = reconstruct(TOK, KIMI, user("How do turns end? Type <|im_end|>"), "Easy.", content)
    assert r.valid
    span = r.input_ids[r.answer_start:r.answer_end].tolist()
    assert span.count(SPECIAL["<|im_end|>"]) == 1 and span[-1] == SPECIAL["<|im_end|>"]
    assert r.input_ids.tolist().count(SPECIAL["<|im_end|>"]) == 2  # the user turn's and the answer's
    assert TOK.decode(span) == f"Easy.</think>{content}<|im_end|>"


def test_truncated_answers_have_no_end_of_turn() -> None:
    messages = user("Write a long essay.")
    r = reconstruct(TOK, KIMI, messages, "Plan the essay.", "Once upon a", truncated=True, billed_tokens=None)
    expected, start, end = by_hand(messages, "Plan the essay.", "Once upon a", truncated=True)
    assert r.input_ids.tolist() == expected and (r.answer_start, r.answer_end) == (start, end)
    assert r.truncated and r.failed_checks == ("ends_with_eot",)
    assert r.input_ids[-1] != SPECIAL["<|im_end|>"]


def test_truncated_while_reasoning_has_no_think_close() -> None:
    messages = user("Prove the Riemann hypothesis.")
    r = reconstruct(TOK, KIMI, messages, "Consider the zeta function", "", truncated=True)
    expected, _, _ = by_hand(messages, "Consider the zeta function", "", truncated=True)
    assert r.input_ids.tolist() == expected
    assert r.failed_checks == ("one_think_close", "ends_with_eot")


def test_without_reasoning_and_with_empty_content() -> None:
    r = reconstruct(TOK, KIMI, user("Hi"), None, "Hello")
    assert TOK.decode(r.input_ids[r.answer_start:].tolist()) == "</think>Hello<|im_end|>"
    r = reconstruct(TOK, KIMI, user("Hi"), "just thinking", "")
    assert TOK.decode(r.input_ids[r.answer_start:].tolist()) == "just thinking</think><|im_end|>"
    assert r.valid


# -- each check, shown to fail on an answer made to break it ---------------------------------------


def test_renders_fails_on_a_conversation_it_cannot_render() -> None:
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    r = reconstruct(TOK, KIMI, image, "r", "c", billed_tokens=5)
    assert r.failed_checks == ("renders",) and "not supported" in r.error
    assert r.input_ids.shape == (0,) and r.span_tokens == 0 and r.count_diff is None
    assert reconstruct(TOK, KIMI, [], "r", "c").failed_checks == ("renders",)


def test_one_think_close_fails_on_a_second_think_close_in_the_text() -> None:
    r = reconstruct(TOK, KIMI, user("Hi"), "first thoughts", "more thoughts</think>The answer.")
    assert r.failed_checks == ("one_think_close",)


def test_no_think_open_fails_when_the_provider_left_the_tag_in() -> None:
    r = reconstruct(TOK, KIMI, user("Hi"), "<think>reasoning the provider did not strip", "Answer.")
    assert r.failed_checks == ("no_think_open",)
    # Reasoning delivered inside content, tags and all: both tag checks fail.
    r = reconstruct(TOK, KIMI, user("Hi"), None, "<think>reasoning</think>Answer.")
    assert r.failed_checks == ("one_think_close", "no_think_open")


def test_ends_with_eot_fails_on_backend_ids_without_the_stop_token() -> None:
    good = reconstruct(TOK, KIMI, user("Hi"), "ok", "Hello")
    span = good.input_ids[good.answer_start:good.answer_end].tolist()
    r = reconstruct(TOK, KIMI, user("Hi"), "ok", "Hello", backend_ids=span[:-1])
    assert "ends_with_eot" in r.failed_checks and "matches_backend" in r.failed_checks


def test_round_trip_fails_on_text_the_tokenizer_cannot_hold() -> None:
    r = reconstruct(TOK, KIMI, user("Hi"), "ok", "broken \ud800 surrogate")
    assert r.failed_checks == ("round_trip",)


def test_token_count_against_billed_with_a_tolerance() -> None:
    r = reconstruct(TOK, KIMI, user("Hi"), "ok", "Hello", billed_tokens=6)  # span is 4 tokens
    assert r.count_diff == -2 and r.valid
    r = reconstruct(TOK, KIMI, user("Hi"), "ok", "Hello", billed_tokens=6, count_tolerance=1)
    assert r.count_diff == -2 and r.failed_checks == ("token_count",)
    r = reconstruct(TOK, KIMI, user("Hi"), "ok", "Hello", billed_tokens=400)
    assert r.count_diff == -396 and r.failed_checks == ("token_count",)


def test_backend_ids_are_used_and_compared() -> None:
    good = reconstruct(TOK, KIMI, user("Hi"), "ok", "Hello")
    span = good.input_ids[good.answer_start:good.answer_end].tolist()
    same = reconstruct(TOK, KIMI, user("Hi"), "ok", "Hello", backend_ids=span, billed_tokens=4)
    assert same.valid and same.source == "backend" and same.checks["matches_backend"]
    assert same.input_ids.tolist() == good.input_ids.tolist()
    # Same text, other ids (the server split "Hello" in two): used as given, flagged as a mismatch.
    hello = TOK.encode_text("Hello")
    split = TOK.encode_text("Hel") + TOK.encode_text("lo")
    assert len(hello) == 1 and len(split) == 2
    assert span[2:3] == hello
    other = span[:2] + split + span[3:]
    r = reconstruct(TOK, KIMI, user("Hi"), "ok", "Hello", backend_ids=other)
    assert r.failed_checks == ("matches_backend",) and r.checks["round_trip"]
    assert r.input_ids[r.answer_start:r.answer_end].tolist() == other
    # The server's ids of a text its parser rewrote afterwards ("Hello" sent, "Hello " generated): the
    # ids stay the sample, the text is measured against them, and the sample is kept.
    spaced = reconstruct(TOK, KIMI, user("Hi"), "ok", "Hello ")
    true_ids = spaced.input_ids[spaced.answer_start:spaced.answer_end].tolist()
    r = reconstruct(TOK, KIMI, user("Hi"), "ok", "Hello", backend_ids=true_ids)
    assert r.failed_checks == ("matches_backend", "text_matches_ids") and r.checks["round_trip"]
    assert r.input_ids[r.answer_start:r.answer_end].tolist() == true_ids
    verdict = SamplePolicy().judge(r.failed_checks, r.count_diff, r.billed_tokens)
    assert verdict.keep and verdict.notes == ("backend_mismatch", "text_rewritten")
    # Ids the tokenizer does not have: the reconstruction is kept, the mismatch flagged.
    bad = reconstruct(TOK, KIMI, user("Hi"), "ok", "Hello", backend_ids=span[:-1] + [TOK.vocab_size + 5])
    assert bad.source == "reconstructed" and bad.failed_checks == ("matches_backend",)
    assert bad.input_ids.tolist() == good.input_ids.tolist()


def test_reconstruct_record_reads_a_response_line() -> None:
    record = {"id": "7", "messages": user("Hi"), "reasoning": "ok", "content": "Hello", "finish_reason": "length",
              "usage": {"completion_tokens": 3, "prompt_tokens": 10}, "truncated": True, "provider": "Together"}
    r = reconstruct_record(TOK, KIMI, record)
    assert r.truncated and r.billed_tokens == 3 and r.count_diff == 0
    # The prompt is 9 tokens (user turn, generation prompt and its <think>); the provider billed 10.
    assert r.index_meta() == {"answer_start": 9, "answer_end": 12, "valid": False,
                              "failed_checks": ["ends_with_eot"], "span_tokens": 3, "billed_tokens": 3,
                              "count_diff": 0, "truncated": True, "source": "reconstructed",
                              "prompt_tokens": 9, "billed_prompt_tokens": 10, "prompt_diff": -1,
                              "provider": "Together", "prompt_source": "rendered"}


PIECES = st.lists(st.one_of(st.text(max_size=40), st.sampled_from(
    ["\ud800", "\udfff", "<|im_end|>", "</think>", "<think>", "  \n\n", "你好", "🚀", "\r\n", "QUJD" * 10])),
    max_size=6).map("".join)


@settings(max_examples=150, deadline=None)
@given(reasoning=st.one_of(st.none(), PIECES), content=PIECES, prompt=PIECES, truncated=st.booleans())
def test_skipping_the_decode_of_our_own_ids_changes_no_outcome(reasoning: str | None, content: str, prompt: str,
                                                                truncated: bool) -> None:
    """Kimi's BPE is lossless on valid Unicode, so reconstruction does not decode its own ids; decoding
    them anyway must give the same checks on any text, broken Unicode and look-alikes included."""
    assert TOK.lossless_text
    fast = reconstruct(TOK, KIMI, user(prompt), reasoning, content, truncated=truncated)
    full = reconstruct(TOK, KIMI, user(prompt), reasoning, content, truncated=truncated, verify_decode=True)
    assert fast.checks == full.checks
    assert fast.input_ids.tolist() == full.input_ids.tolist()


class _SpanCounted:
    """The bundled tokenizer, not saying that its text ids are never special: reconstruction then counts
    the think tags by its pass over the answer span."""

    text_ids_plain = False

    def __getattr__(self, name: str) -> Any:
        return getattr(TOK, name)


SPAN_COUNTED = _SpanCounted()
KIMI_SPAN_COUNTED = load_template("kimi-k2.5", SPAN_COUNTED)  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(reasoning=st.one_of(st.none(), PIECES), content=PIECES, prompt=PIECES, truncated=st.booleans(),
       calls=st.booleans())
def test_think_tags_counted_among_the_answers_special_pieces_as_in_the_span(
        reasoning: str | None, content: str, prompt: str, truncated: bool, calls: bool) -> None:
    """Our own ids from Kimi's tiktoken: no text id is a special token's, so the think tags are counted
    among the answer's special pieces; the checks are those of the pass over the span, on any text
    (look-alikes of the tags typed in it included)."""
    assert TOK.text_ids_plain
    assert all(i < min(SPECIAL.values()) for i in TOK.encode_text(prompt + (reasoning or "") + content))
    tool_calls = [{"id": "functions.ls:0", "type": "function",
                   "function": {"name": "ls", "arguments": '{"path":"</think>"}'}}] if calls else None
    fast = reconstruct(TOK, KIMI, user(prompt), reasoning, content, truncated=truncated, tool_calls=tool_calls)
    span = reconstruct(SPAN_COUNTED, KIMI_SPAN_COUNTED, user(prompt), reasoning, content,  # type: ignore[arg-type]
                       truncated=truncated, tool_calls=tool_calls)
    assert fast.checks == span.checks
    assert fast.input_ids.tolist() == span.input_ids.tolist()


# -- template details ----------------------------------------------------------------------------------


def test_tool_call_turns_after_the_last_plain_answer_keep_reasoning() -> None:
    call = {"id": "functions.ls:0", "type": "function", "function": {"name": "ls", "arguments": '{"path":"."}'}}
    messages = [
        {"role": "user", "content": "List files"},
        {"role": "assistant", "content": "", "reasoning_content": "use ls", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "functions.ls:0", "content": "a.py"},
    ]
    r = reconstruct(TOK, KIMI, messages, "one file", "a.py")
    text = TOK.decode(r.input_ids.tolist())
    assert ("<|im_assistant|>assistant<|im_middle|><think>use ls</think><|tool_calls_section_begin|>"
            "<|tool_call_begin|>functions.ls:0<|tool_call_argument_begin|>{\"path\":\".\"}<|tool_call_end|>"
            "<|tool_calls_section_end|><|im_end|><|im_system|>tool<|im_middle|>## Return of functions.ls:0\na.py"
            "<|im_end|>") in text
    assert r.valid


def test_default_system_turn_is_optional() -> None:
    with_default = reconstruct(TOK, KimiK25Template(default_system=KIMI_DEFAULT_SYSTEM), user("Hi"), "ok", "Hello")
    assert TOK.decode(with_default.input_ids.tolist()).startswith(
        f"<|im_system|>system<|im_middle|>{KIMI_DEFAULT_SYSTEM}<|im_end|><|im_user|>user")
    assert with_default.answer_end - with_default.answer_start == 4


QWEN_LIKE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if m.reasoning_content is defined and m.reasoning_content is not none -%}"
    "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- m.content + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@pytest.fixture
def tj_tok(tmp_path: Path, fresh_tokenizers: None):
    return load_tokenizer(str(build_tokenizer_json(tmp_path / "tj", QWEN_LIKE)))


def test_auto_template_uses_the_tokenizers_own_template(tj_tok) -> None:
    tok = tj_tok
    template = load_template("auto", tok)
    assert isinstance(template, AutoTemplate)
    messages = user("Hi <|im_end|> there")
    r = reconstruct(tok, template, messages, "think a bit", "Hello <think> world", billed_tokens=None)
    s = tok.special_id
    t = tok.encode_text
    prompt = [s("<|im_start|>"), *t("user\nHi <|im_end|> there"), s("<|im_end|>"), *t("\n"),
              s("<|im_start|>"), *t("assistant\n")]
    answer = [s("<think>"), *t("\nthink a bit\n"), s("</think>"), *t("\n\nHello <think> world"), s("<|im_end|>")]
    assert r.input_ids.tolist() == prompt + answer + t("\n")
    assert (r.answer_start, r.answer_end) == (len(prompt), len(prompt) + len(answer))
    assert r.loss_mask.tolist() == [0] * len(prompt) + [1] * len(answer) + [0] * len(t("\n"))
    # The look-alike "<think>" typed in the content is flagged, not turned into a token.
    assert r.failed_checks == ("no_think_open",)
    clean = reconstruct(tok, template, messages, "think a bit", "Hello world")
    assert clean.valid, clean.failed_checks


@pytest.mark.usefixtures("fresh_tokenizers")
def test_auto_template_that_rewrites_text_is_used_as_it_renders(tmp_path: Path) -> None:
    trimming = QWEN_LIKE.replace("m.content + '<|im_end|>\\n'", "m.content | trim + '<|im_end|>\\n'")
    tok = load_tokenizer(str(build_tokenizer_json(tmp_path / "trim", trimming)))
    r = reconstruct(tok, load_template("auto", tok), user("  padded  "), "r", "  answer  ")
    assert tok.decode(r.input_ids.tolist()).endswith("\n\nanswer<|im_end|>\n")
    assert r.valid, r.failed_checks  # the span decodes to what the template rendered


@pytest.mark.usefixtures("fresh_tokenizers")
def test_auto_template_that_drops_the_final_reasoning_is_refused(tmp_path: Path) -> None:
    drops = ("{%- for m in messages -%}{%- if m.role == 'assistant' -%}"
             "{{- '<|im_start|>assistant\\n<think></think>' + m.content + '<|im_end|>' -}}"
             "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' -}}{%- endif -%}"
             "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>' -}}{%- endif -%}")
    tok = load_tokenizer(str(build_tokenizer_json(tmp_path / "drops", drops)))
    r = reconstruct(tok, load_template("auto", tok), user("Hi"), "lost reasoning", "Hello")
    assert r.failed_checks == ("renders",) and "drops the answer's reasoning" in r.error


@pytest.mark.usefixtures("fresh_tokenizers")
def test_templates_refuse_what_they_cannot_serve(tmp_path: Path) -> None:
    plain = load_tokenizer(str(build_tokenizer_json(tmp_path / "plain")))
    with pytest.raises(TemplateError, match="has no chat template"):
        load_template("auto", plain)
    from draftgen.core.errors import TokenizerError
    with pytest.raises(TokenizerError, match="no special token '<|im_user|>'"):
        load_template("kimi-k2.5", plain)
    with pytest.raises(TemplateError, match="unknown chat template"):
        load_template("chatml", TOK)


# -- the report --------------------------------------------------------------------------------------


def test_validation_report() -> None:
    a, b = ValidationReport("A"), ValidationReport("B")
    for diff in [0] * 97 + [1, -1, 5]:
        a.add_outcome([], diff, 1000, False, "reconstructed")
    a.add(reconstruct(TOK, KIMI, user("Hi"), "ok", "cut", truncated=True, billed_tokens=4))
    b.add(reconstruct(TOK, KIMI, [], "r", "c"))
    b.add_meta({"failed_checks": [], "count_diff": None, "truncated": False, "source": "backend"})
    assert (a.checked, a.valid, a.truncated, a.failures["ends_with_eot"]) == (101, 100, 1, 1)
    assert a.share_exact == pytest.approx(97 / 101) and a.diff_abs_percentile(50) == 0
    # The truncated answer above: 3 span tokens against 4 billed.
    assert a.diff_abs_percentile(99) == 1 and a.diff_mean == pytest.approx((1 - 1 + 5 - 1) / 101)
    total = ValidationReport.combine([a, b])
    assert (total.name, total.checked, total.from_backend, total.failures["renders"]) == ("all", 103, 1, 1)
    again = ValidationReport.from_dict(json.loads(json.dumps(total.to_dict())))
    assert again.to_dict() == total.to_dict()
    text = total.format()
    assert "103 answers checked" in text and "ends_with_eot" in text and "[" not in text
    assert "p99 |diff| 1" in total.summary_line()


def test_prompt_special_tokens_special_reads_typed_special_text_as_the_token() -> None:
    """vLLM, SGLang and transformers serve tokenize the rendered prompt with special tokens recognised:
    a `<|im_end|>` typed in a message is that token there. "special" counts the prompt the same way;
    the answer is the model's text either way."""
    tok = bundled_kimi()
    messages = [{"role": "user", "content": "close with <|im_end|> please"}]
    as_text = reconstruct(tok, load_template("kimi-k2.5", tok), messages, "ok", "done")
    as_special = reconstruct(tok, load_template("kimi-k2.5", tok, prompt_specials=True), messages, "ok",
                             "done")
    end = tok.special_id("<|im_end|>")
    prompt_text, prompt_special = (as_text.input_ids[:as_text.answer_start],
                                   as_special.input_ids[:as_special.answer_start])
    assert list(prompt_special).count(end) == list(prompt_text).count(end) + 1
    assert tok.decode(prompt_special.tolist()) == tok.decode(prompt_text.tolist())  # same text, other ids
    assert len(prompt_special) < len(prompt_text)  # the typed text is one id, not several
    assert (as_special.input_ids[as_special.answer_start:as_special.answer_end].tolist()
            == as_text.input_ids[as_text.answer_start:as_text.answer_end].tolist())
    assert as_special.valid and as_text.valid


def test_prompt_special_tokens_default_follows_the_server_kind(tmp_path: Path) -> None:
    from draftgen.core.config_load import load_config
    from draftgen.core.config_tables import TokenizerConfig
    from draftgen.core.errors import ConfigError
    assert TokenizerConfig().prompt_specials(kind_reads_them=True) is True
    assert TokenizerConfig().prompt_specials(kind_reads_them=False) is False
    assert TokenizerConfig(prompt_special_tokens="special").prompt_specials(kind_reads_them=False) is True
    assert TokenizerConfig(prompt_special_tokens="text").prompt_specials(kind_reads_them=True) is False
    path = tmp_path / "c.toml"
    path.write_text('[tokenizer]\nprompt_special_tokens = "token"\n')
    with pytest.raises(ConfigError, match="prompt_special_tokens"):
        load_config(path)


# -- turns of a multi-turn conversation (records as a turns = "all" dataset writes them) ----------------


@pytest.mark.parametrize("style", HISTORY_STYLES)
def test_a_later_turn_renders_its_history_without_reasoning_and_masks_only_its_own_answer(style: str) -> None:
    records = conversation_records("c7", three_turns(), system="Be brief.", style=style)
    turn3 = records[2]
    r = reconstruct_record(TOK, KIMI, turn3)
    # The tokenizer's own encoding of the rendered text: earlier answers as `<think></think>{content}`.
    ids, start, end = by_hand(turn3["messages"], turn3["reasoning"], turn3["content"])
    assert r.input_ids.tolist() == ids and (r.answer_start, r.answer_end) == (start, end)
    assert r.valid and r.turn == 3 and r.prompt_diff == 0  # the simulator's count of the same history
    # The loss mask: this turn's answer only (from the generation prompt's <think>), never the history.
    assert r.loss_mask.tolist() == [0] * (start - 1) + [1] * (end - start + 1)
    assert TOK.decode(r.input_ids[r.loss_mask == 1].tolist()) == \
        f"<think>{turn3['reasoning']}</think>{turn3['content']}<|im_end|>"
    history = TOK.decode(r.input_ids[:start].tolist())
    assert all(m["reasoning_details"][0]["text"] not in history if "reasoning_details" in m
               else (m.get("reasoning") or m.get("reasoning_content")) not in history
               for m in turn3["messages"] if m["role"] == "assistant")
    # Where the earlier answers sit, for a merge that masks every assistant turn.
    assert len(r.history_spans) == 2
    for (s, e), earlier in zip(r.history_spans, records[:2]):
        assert TOK.decode(r.input_ids[s:e].tolist()) == f"<think></think>{earlier['content']}<|im_end|>"
    assert r.index_meta()["turn"] == 3 and r.index_meta()["history_spans"] == [list(s) for s in r.history_spans]
    # Turn 1 has no history; a single-turn record's index line is as before.
    first = reconstruct_record(TOK, KIMI, records[0])
    assert first.history_spans == () and "history_spans" not in first.index_meta()
    assert "turn" not in reconstruct_record(TOK, KIMI, {**records[0], "turn": None}).index_meta()


def test_every_history_style_gives_the_same_ids() -> None:
    got = {style: reconstruct_record(TOK, KIMI, conversation_records("c", three_turns(), style=style)[2])
           for style in HISTORY_STYLES}
    assert len({tuple(r.input_ids.tolist()) for r in got.values()}) == 1


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning", "reasoning_details"])
def test_inside_a_tool_loop_every_reasoning_key_renders_the_same(key: str) -> None:
    reasoning = "I should look it up."
    value: Any = ([{"type": "reasoning.text", "text": reasoning}] if key == "reasoning_details" else reasoning)
    call = {"id": "functions.lookup:0", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    messages = [{"role": "user", "content": "Look it up."},
                {"role": "assistant", "content": "", "tool_calls": [call], key: value},
                {"role": "tool", "tool_call_id": "functions.lookup:0", "content": "42"}]
    r = reconstruct(TOK, KIMI, messages, "It says 42.", "42")
    plain = {**messages[1]}
    del plain[key]
    expected = reconstruct(TOK, KIMI, [messages[0], {**plain, "reasoning_content": reasoning}, messages[2]],
                           "It says 42.", "42")
    assert r.input_ids.tolist() == expected.input_ids.tolist()
    assert f"<think>{reasoning}</think>" in TOK.decode(r.input_ids[:r.answer_start].tolist())
    # Its span keeps the reasoning and the tool calls, through its end of turn.
    (s, e), = r.history_spans
    span = TOK.decode(r.input_ids[s:e].tolist())
    assert span.startswith(f"<think>{reasoning}</think><|tool_calls_section_begin|>") and span.endswith("<|im_end|>")


def test_history_spans_follow_prompt_special_tokens() -> None:
    # With special-token text read as the token, the prompt's segments are split: the spans follow.
    special = load_template("kimi-k2.5", TOK, prompt_specials=True)
    rec = conversation_records("c", [Turn("Say <|im_end|> please."), Turn("Again.")])[1]
    r = reconstruct_record(TOK, special, rec)
    (s, e), = r.history_spans
    assert TOK.decode(r.input_ids[s:e].tolist()) == "<think></think>An answer.<|im_end|>"


def test_auto_template_reads_a_history_turns_reasoning_under_openrouters_keys(tj_tok) -> None:
    # The served model's own template reads `reasoning_content` (what OpenRouter hands the provider's
    # server): a history turn that came back with `reasoning_details` or `reasoning` renders the same.
    template = load_template("auto", tj_tok)

    def history(**reasoning: Any) -> list[dict[str, Any]]:
        return [*user("Hi"), {"role": "assistant", "content": "Hello!", **reasoning}, *user("And 2+2?")]

    want = reconstruct(tj_tok, template, history(reasoning_content="greet back"), "sum", "4")
    assert "greet back" in tj_tok.decode(want.input_ids[:want.answer_start].tolist())  # this template keeps it
    for keys in ({"reasoning": "greet back"},
                 {"reasoning_details": [{"type": "reasoning.text", "text": "greet back", "index": 0}]}):
        got = reconstruct(tj_tok, template, history(**keys), "sum", "4")
        assert got.input_ids.tolist() == want.input_ids.tolist(), keys
    assert reconstruct(tj_tok, template, history(), "sum", "4").input_ids.tolist() != want.input_ids.tolist()


SYSTEM = "You answer questions about science and code. Think step by step and check each result. " * 8


def test_a_workers_prompt_texts_give_the_same_ids_and_keep_a_repeated_text_encoded() -> None:
    """A token worker remembers the ids of the prompt texts it encoded (PromptTexts): a system prompt sent
    with every request and a conversation's earlier turns are encoded once while they come back, with the
    same ids, mask and checks as encoding them again; the answers' texts are never kept."""
    texts = PromptTexts(TOK)
    earlier = "An earlier answer, long enough to be kept: " + "the sky scatters blue light more. " * 4
    conversations = [
        [{"role": "system", "content": SYSTEM}, *user("Why is the sky blue?")],
        [{"role": "system", "content": SYSTEM}, *user("Why is the sky blue?"),
         {"role": "assistant", "content": earlier}, *user("And at sunset, " + "what changes then? " * 4)],
        [{"role": "system", "content": SYSTEM}, *user("Another question " * 5)],
    ]
    for messages in conversations * 2:
        plain = reconstruct(TOK, KIMI, messages, "Rayleigh scattering " * 5, "Short waves scatter " * 5)
        kept = reconstruct(TOK, KIMI, messages, "Rayleigh scattering " * 5, "Short waves scatter " * 5, texts=texts)
        assert kept.input_ids.tolist() == plain.input_ids.tolist()
        assert kept.loss_mask.tolist() == plain.loss_mask.tolist()
        assert kept.checks == plain.checks and kept.history_spans == plain.history_spans
    assert SYSTEM in texts and earlier in texts
    assert "Rayleigh scattering " * 5 not in texts and "Why is the sky blue?" not in texts  # an answer; too short
    assert texts.encode(SYSTEM) is texts.encode(SYSTEM)  # kept, not encoded again
    assert texts.chars == sum(len(t) for t in (SYSTEM, earlier, "And at sunset, " + "what changes then? " * 4,
                                               "Another question " * 5))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["a " * 40, "b " * 50, "c " * 60, "δ " * 70, "e" * 120, "short"]), max_size=30),
       st.integers(80, 400))
def test_prompt_texts_stay_within_their_bound_and_give_the_tokenizers_ids(sequence: list[str], bound: int) -> None:
    """Whatever order texts come in, PromptTexts gives the tokenizer's own ids, keeps at most `max_chars`
    characters of text (a longer text is encoded and not kept), and forgets the least recently used first."""
    texts = PromptTexts(TOK, max_chars=bound)
    used: list[str] = []
    for text in sequence:
        assert list(texts.encode(text)) == TOK.encode_text(text)
        assert texts.chars <= bound and texts.chars == sum(len(t) for t in set(used + [text]) if t in texts)
        if PROMPT_TEXT_MIN <= len(text) <= bound:  # one it can keep
            if text in used:
                used.remove(text)
            used.append(text)
        kept = [t for t in used if t in texts]
        assert kept == used[len(used) - len(kept):]  # the most recently used ones
        assert (text in texts) == (PROMPT_TEXT_MIN <= len(text) <= bound)


def test_a_token_worker_keeps_its_prompt_texts_between_batches() -> None:
    """reconstruct_batch encodes with its worker's PromptTexts: a system prompt of one batch is kept for the
    next, and the batch's bytes are those of answers reconstructed without it."""
    from draftgen.core.tokens import workers
    from draftgen.core.tokens.reconstruct import answer_fields, reconstruct_answer
    workers._init_worker(workers.WorkerSpec(str(bundled_kimi_path()), False, "kimi-k2.5"))
    records = [{"id": f"s{i}", "messages": [{"role": "system", "content": SYSTEM}, *user(f"Question {i}")],
                "reasoning": "thinking " * i, "content": f"Answer {i}", "finish_reason": "stop"} for i in range(4)]
    first = workers.reconstruct_batch([answer_fields(r) for r in records[:2]])
    assert workers._worker is not None and SYSTEM in workers._worker[4]
    second = workers.reconstruct_batch([answer_fields(r) for r in records[2:]])
    for results, part in ((first, records[:2]), (second, records[2:])):
        alone = [reconstruct_answer(TOK, KIMI, answer_fields(r)) for r in part]
        assert results[0] == b"".join(r.input_ids.astype("<u4").tobytes() for r in alone)
        assert results[1] == b"".join(r.loss_mask.tobytes() for r in alone)
