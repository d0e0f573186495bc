"""draftgen's self-hosted client against vLLM's and SGLang's released protocol code, without a GPU.

The wheels of vLLM 0.12, 0.13 and 0.33 (the latest when written) and SGLang 0.5.14 (the `gpu` extra's
pin), 0.5.17 and 0.5.23 (the latest) are downloaded once per pytest cache (`pip download --no-deps`,
tests/pinned.py; vLLM's wheel is dropped once its `vllm/entrypoints` sources are unpacked) and skipped
when PyPI cannot be reached.

vLLM's protocol modules import torch and vLLM's own engine, so they are read with `ast`: each pydantic
class's field names (its bases' included) and the engine's finish reasons; responses and stream
chunks are built from exactly those names. SGLang's protocol module needs only pydantic and `openai`
beside two names of its own package (`sglang.utils.convert_json_schema_to_str`, and `msgspec.Struct`
from 0.5.23), which are stubbed for the import: its own classes build the responses and stream
chunks, serialized as the server serializes them (ast is used for its request fields and the stream
refusals in serving_chat.py). Everything is run through draftgen's parser (core/generate/api/answer.py);
the request keys draftgen sends each release (core/servers.py) must be fields of its request class,
and a stream must never carry a key the release refuses on streams.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import orjson
import pytest

from draftgen.core.generate.api.answer import ANSWER_FINISH_REASONS, StreamState, feed_lines, parse_completion
from draftgen.core.generate.api.client import RequestFailed
from draftgen.core.generate.loop.conversations import history_message
from draftgen.core.records import ErrorKind
from draftgen.core.server_kinds import OpenAICompatible
from draftgen.core.servers import SGLANG, VLLM, Server, ServerProfile, parse_version, server_from_answers
from tests.pinned import Offline, release_source

RELEASES = [(VLLM, "0.12.0"), (VLLM, "0.13.0"), (VLLM, "0.33.0"),
            (SGLANG, "0.5.14"), (SGLANG, "0.5.17"), (SGLANG, "0.5.23")]
UNDER = {VLLM: ("vllm/entrypoints/", "vllm/v1/engine/__init__.py"), SGLANG: ("sglang/srt/entrypoints/",)}
IDS = [11, 12, 13]
PROMPT_IDS = [1, 2]


class Protocol:
    """One release's pydantic classes, read with ast: field names (bases' included) by class name."""

    def __init__(self, name: str, version: str, root: Path) -> None:
        self.name, self.version, self.root = name, version, root
        self.server = Server(name, parse_version(version) or ())
        self.sources = {p: p.read_text() for p in (root / UNDER[name][0]).rglob("*.py")}
        self.classes: dict[str, list[ast.ClassDef]] = {}
        for path, text in self.sources.items():
            if path.name != "protocol.py":
                continue
            for node in ast.walk(ast.parse(text, str(path))):
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, []).append(node)

    def fields(self, cls: str) -> dict[str, ast.expr]:
        """Annotated fields of `cls` and of its bases defined here (a name defined twice: the first)."""
        node = self.classes[cls][0]
        out: dict[str, ast.expr] = {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in self.classes and base.id != cls:
                out.update(self.fields(base.id))
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                out[stmt.target.id] = stmt.annotation
        return out

    def literals(self, cls: str, name: str) -> set[str]:
        """The string constants of a field's annotation (its `Literal[...]` values)."""
        return {n.value for n in ast.walk(self.fields(cls)[name]) if isinstance(n, ast.Constant)
                and isinstance(n.value, str)}

    def source_with(self, pattern: str) -> str:
        return next((t for t in self.sources.values() if re.search(pattern, t)), "")


@cache
def _protocol(name: str, version: str, cache_dir: str) -> Protocol | str:
    """The release's protocol, or why it cannot be read (offline: asked once per session)."""
    try:
        root = release_source(name, version, Path(cache_dir), under=UNDER[name], drop_wheel=name == VLLM)
    except Offline as e:
        return str(e).splitlines()[0]
    return Protocol(name, version, root)


@pytest.fixture(params=RELEASES, ids=[f"{n}-{v}" for n, v in RELEASES])
def release(request: pytest.FixtureRequest) -> Protocol:
    from tests.conftest import _cache
    name, version = request.param
    found = _protocol(name, version, str(_cache(request)))
    if isinstance(found, str):
        pytest.skip(found)
    return found


def _ids_fields(p: Protocol, cls: str) -> list[str]:
    return [f for f in ("token_ids", "response_token_ids") if f in p.fields(cls)]


def _body(p: Protocol, finish: str = "stop") -> dict[str, Any]:
    """A non-streamed answer built from the release's own field names, ids where the classes hold them."""
    message = {"role": "assistant", "content": "the answer"}
    for field in ("reasoning", "reasoning_content"):
        if field in p.fields("ChatMessage"):
            message[field] = "the reasoning"
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
    for field in _ids_fields(p, "ChatCompletionResponseChoice"):
        choice[field] = IDS
    if "prompt_token_ids" in p.fields("ChatCompletionResponseChoice"):
        choice["prompt_token_ids"] = PROMPT_IDS
    body: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
                            "choices": [choice], "usage": _usage(p)}
    if "prompt_token_ids" in p.fields("ChatCompletionResponse"):
        body["prompt_token_ids"] = PROMPT_IDS
    assert set(choice) <= set(p.fields("ChatCompletionResponseChoice"))
    assert set(body) <= set(p.fields("ChatCompletionResponse"))
    return body


def _usage(p: Protocol) -> dict[str, Any]:
    usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert set(usage) <= set(p.fields("UsageInfo"))
    return usage


def test_the_non_streamed_answer_is_read_ids_and_all(release: Protocol) -> None:
    p = release
    asked = p.server.ids_request(streamed=False)
    request = p.fields("ChatCompletionRequest")
    assert set(asked) <= set(request), f"{p.server.label} has no request field {set(asked) - set(request)}"
    answer = parse_completion(_body(p), 0.1)
    assert answer.content == "the answer" and answer.reasoning == "the reasoning"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (2, 3)
    gives = bool(_ids_fields(p, "ChatCompletionResponseChoice")) and "return_token_ids" in request
    # draftgen asks exactly the releases that give ids, and reads them where the release puts them.
    assert bool(asked) == gives
    if gives:
        assert answer.token_ids == IDS and answer.prompt_token_ids == PROMPT_IDS


def _stream_lines(p: Protocol, asked: dict[str, Any]) -> list[bytes]:
    """A stream as the release sends it: role, reasoning, content, finish, ids and usage chunks."""
    choice_fields, delta = p.fields("ChatCompletionResponseStreamChoice"), p.fields("DeltaMessage")
    reasoning = "reasoning" if "reasoning" in delta else "reasoning_content"
    vllm_ids = p.name == VLLM and "token_ids" in choice_fields and asked.get("return_token_ids")

    def chunk(delta: dict[str, Any], ids: list[int], finish: str | None = None, **top: Any) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        if vllm_ids:
            choice["token_ids"] = ids
        assert set(choice) <= set(choice_fields) and set(delta) <= set(p.fields("DeltaMessage"))
        return {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice], **top}

    head = {"prompt_token_ids": PROMPT_IDS} if vllm_ids else {}
    chunks = [chunk({"role": "assistant", "content": ""}, [], **head), chunk({reasoning: "the reasoning"}, IDS[:1]),
              chunk({"content": "the answer"}, IDS[1:2]), chunk({}, IDS[2:], "stop")]
    ext = p.fields("SglExt") if "SglExt" in p.classes else {}
    if asked.get("return_output_ids_in_sglext"):
        assert {"input_ids", "output_ids"} <= set(ext)
        chunks.append({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                       "sglext": {"input_ids": PROMPT_IDS, "output_ids": [IDS]}})
    chunks.append({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                   "usage": _usage(p)})
    for c in chunks:
        assert set(c) <= set(p.fields("ChatCompletionStreamResponse"))
    return [b"data: " + orjson.dumps(c) for c in chunks] + [b"data: [DONE]"]


def _refused_on_streams(p: Protocol) -> set[str]:
    """The request keys the release's chat serving refuses when `stream` is set ("... is not supported
    with streaming")."""
    text = p.source_with(r"not supported with streaming")
    return set(re.findall(r"if request\.(\w+):\s*raise ValueError\(\s*\"\1 is not supported with streaming", text))


def test_the_streamed_answer_is_read_and_no_refused_key_is_sent(release: Protocol) -> None:
    p = release
    asked = p.server.ids_request(streamed=True)
    assert set(asked) <= set(p.fields("ChatCompletionRequest"))
    assert not set(asked) & _refused_on_streams(p)
    if p.name == SGLANG and p.server.at_least(0, 5, 17):
        assert "return_token_ids" in _refused_on_streams(p)  # why draftgen never streams it there
    state = StreamState()
    assert feed_lines(_stream_lines(p, asked), state)
    answer = parse_completion(state.body(), 0.1)
    assert answer.content == "the answer" and answer.reasoning == "the reasoning"
    assert answer.usage.completion_tokens == 3
    if asked:
        assert answer.token_ids == IDS and answer.prompt_token_ids == PROMPT_IDS
    else:
        assert answer.token_ids is None and p.server.no_ids_reason(streamed=True)
    stream_ids = "token_ids" in p.fields("ChatCompletionResponseStreamChoice") or "output_ids" in (
        p.fields("SglExt") if "SglExt" in p.classes else {})
    if p.name == SGLANG:
        assert bool(asked) == stream_ids  # SGLang gives streamed ids exactly from 0.5.20 (sglext)
    else:
        assert stream_ids and bool(asked) == p.server.at_least(0, 13)  # vLLM's miss steps before 0.13


def test_finish_reasons_that_end_no_answer_are_failed_attempts(release: Protocol) -> None:
    p = release
    if p.name == SGLANG:
        reasons = p.literals("ChatCompletionResponseChoice", "finish_reason")
        assert "abort" in reasons
    else:  # vLLM's finish_reason is a str: its engine's FinishReason names the values
        names = (p.root / "vllm" / "v1" / "engine" / "__init__.py").read_text()
        m = re.search(r"FINISH_REASON_STRINGS\s*=\s*\(([^)]*)\)", names)
        assert m, "vLLM's engine no longer names its finish reasons in FINISH_REASON_STRINGS"
        reasons = set(re.findall(r"\"(\w+)\"", m.group(1)))
        assert {"stop", "length", "abort"} <= reasons
    reasons |= {"tool_calls"}
    for reason in sorted(reasons):
        if reason in ANSWER_FINISH_REASONS:
            assert parse_completion(_body(p, reason), 0.1).finish_reason == reason
        else:
            with pytest.raises(RequestFailed) as e:
                parse_completion(_body(p, reason), 0.1, ServerProfile(OpenAICompatible()))  # a self-hosted server
            assert e.value.kind is ErrorKind.FINISH_ERROR and reason in e.value.message


def test_the_server_says_its_release_where_draftgen_asks(release: Protocol) -> None:
    p = release
    if p.name == VLLM:
        text = p.source_with(r"get\(\"/version\"\)")
        assert re.search(r"\{\"version\": VLLM_VERSION\}", text), "vLLM's GET /version answers {\"version\": ...}"
        assert server_from_answers(version={"version": p.version}) == Server(VLLM, p.server.version, p.version)
    else:
        text = p.source_with(r"get\(\"/get_server_info\"\)")
        assert "@app.get(\"/server_info\")" in text and "\"version\": __version__" in text
        assert server_from_answers(server_info={"version": p.version, "tp_size": 1}).name == SGLANG


def test_unknown_request_keys_are_taken_not_refused(release: Protocol) -> None:
    """vLLM's request models allow extra keys (logged as ignored); SGLang's ignore them (pydantic's
    default): neither answers extra_forbidden, which is why a key a release lacks is silently lost."""
    p = release
    base = p.classes["ChatCompletionRequest"][0].bases[0]
    name = base.id if isinstance(base, ast.Name) else ""
    config = ast.unparse(p.classes[name][0]) if name in p.classes else ""
    request = ast.unparse(p.classes["ChatCompletionRequest"][0])
    assert "extra='forbid'" not in config + request and 'extra="forbid"' not in config + request
    if p.name == VLLM:
        assert "extra='allow'" in config or 'extra="allow"' in config


# A later turn's request carries the target's earlier answer as an assistant message with its reasoning
# under `reasoning_content` (core/generate/loop/conversations.py history_message): a release that did
# not read that key would render the history without it, and the turn's ids would be built on a
# prompt the server never saw.
VLLM_READS_HISTORY_REASONING = (
    re.compile(r"""message\.get\(\s*["']reasoning_content["']\s*\)"""),    # 0.12, 0.13: chat_utils.py
    re.compile(r"""msg\.pop\(\s*["']reasoning_content["']"""),  # 0.33: renamed to `reasoning` by the request
)


@pytest.fixture(params=[v for n, v in RELEASES if n == VLLM], ids=lambda v: f"vllm-{v}")
def vllm(request: pytest.FixtureRequest) -> Protocol:
    from tests.conftest import _cache
    found = _protocol(VLLM, request.param, str(_cache(request)))
    if isinstance(found, str):
        pytest.skip(found)
    return found


def test_vllm_reads_the_reasoning_of_a_later_turns_history(vllm: Protocol) -> None:
    """vLLM takes an assistant message's `reasoning_content` (0.12 and 0.13 read it beside `reasoning` in
    chat_utils.py; 0.33's request renames it to `reasoning` before validation)."""
    p = vllm
    history = history_message("the answer", "the reasoning", None, server=ServerProfile(OpenAICompatible()))
    assert history["reasoning_content"] == "the reasoning"
    assert any(rule.search(text) for text in p.sources.values() for rule in VLLM_READS_HISTORY_REASONING), \
        f"vLLM {p.version} reads no `reasoning_content` of a history message"


# -- SGLang's own classes ----------------------------------------------------------------------------

SGLANG_RELEASES = [v for n, v in RELEASES if n == SGLANG]


@contextmanager
def _stubbed(names: dict[str, types.ModuleType]) -> Iterator[None]:
    """`names` in sys.modules for the length of an import, whatever was there put back after."""
    saved = {n: sys.modules.get(n) for n in names}
    sys.modules.update({n: m for n, m in names.items() if saved[n] is None})
    try:
        yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)


def _sglang_protocol(p: Protocol) -> types.ModuleType:
    """SGLang's protocol.py of release `p`, imported under a name of its own with its two package
    imports stubbed (needs pydantic and openai, skipped without them)."""
    pytest.importorskip("pydantic")
    pytest.importorskip("openai")
    package = types.ModuleType("sglang")
    package.__path__ = []
    utils = types.ModuleType("sglang.utils")
    utils.convert_json_schema_to_str = str  # type: ignore[attr-defined]
    stubs = {"sglang": package, "sglang.utils": utils}
    if importlib.util.find_spec("msgspec") is None:
        msgspec = types.ModuleType("msgspec")

        class Struct:
            def __init_subclass__(cls, **_: Any) -> None: ...
        msgspec.Struct = Struct  # type: ignore[attr-defined]
        stubs["msgspec"] = msgspec
    name = f"_sglang_protocol_{p.version.replace('.', '_')}"
    if name in sys.modules:
        return sys.modules[name]
    path = p.root / UNDER[SGLANG][0] / "openai" / "protocol.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with _stubbed(stubs):
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception:
            sys.modules.pop(name, None)
            raise
    assert sys.modules.get("sglang") is not package  # the stubs never outlive the import
    return module


@pytest.fixture(params=SGLANG_RELEASES, ids=[f"sglang-{v}" for v in SGLANG_RELEASES])
def sglang(request: pytest.FixtureRequest) -> tuple[Protocol, types.ModuleType]:
    from tests.conftest import _cache
    found = _protocol(SGLANG, request.param, str(_cache(request)))
    if isinstance(found, str):
        pytest.skip(found)
    return found, _sglang_protocol(found)


def _sglang_answer(m: types.ModuleType, finish: str) -> dict[str, Any]:
    fields = m.ChatCompletionResponseChoice.model_fields
    ids = {f: IDS for f in ("token_ids", "response_token_ids") if f in fields}
    if ids:
        ids["prompt_token_ids"] = PROMPT_IDS
    choice = m.ChatCompletionResponseChoice(
        index=0, message=m.ChatMessage(role="assistant", content="the answer", reasoning_content="the reasoning"),
        finish_reason=finish, **ids)
    usage = m.UsageInfo(prompt_tokens=2, completion_tokens=3, total_tokens=5)
    return orjson.loads(m.ChatCompletionResponse(id="x", model="m", choices=[choice], usage=usage).model_dump_json())


def test_sglang_answers_built_by_its_own_classes_are_read(sglang: tuple[Protocol, types.ModuleType]) -> None:
    p, m = sglang
    answer = parse_completion(_sglang_answer(m, "stop"), 0.1)
    assert (answer.content, answer.reasoning) == ("the answer", "the reasoning")
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (2, 3)
    gives = p.server.ids_request(streamed=False)
    assert (answer.token_ids, answer.prompt_token_ids) == ((IDS, PROMPT_IDS) if gives else (None, None))
    with pytest.raises(RequestFailed) as e:  # an aborted request, as SGLang returns it: a 200 with a body
        parse_completion(_sglang_answer(m, "abort"), 0.1)
    assert e.value.kind is ErrorKind.FINISH_ERROR


def test_sglang_streams_built_by_its_own_classes_are_read(sglang: tuple[Protocol, types.ModuleType]) -> None:
    p, m = sglang
    asked = p.server.ids_request(streamed=True)

    def chunk(delta: dict[str, Any] | None, finish: str | None = None, **top: Any) -> bytes:
        choices = [] if delta is None else [m.ChatCompletionResponseStreamChoice(
            index=0, delta=m.DeltaMessage(**delta), finish_reason=finish)]
        return b"data: " + m.ChatCompletionStreamResponse(id="x", model="m", choices=choices, **top
                                                          ).model_dump_json().encode()
    lines = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "the reasoning"}),
             chunk({"content": "the answer"}), chunk({}, "stop")]
    if asked:  # 0.5.20+: both id lists at the response level, in the stream's last chunks
        lines.append(chunk(None, sglext=m.SglExt(input_ids=PROMPT_IDS, output_ids=[IDS])))
    lines += [chunk(None, usage=m.UsageInfo(prompt_tokens=2, completion_tokens=3, total_tokens=5)),
              b"data: [DONE]"]
    state = StreamState()
    assert feed_lines(lines, state)
    answer = parse_completion(state.body(), 0.1)
    assert (answer.content, answer.reasoning, answer.usage.completion_tokens) == ("the answer", "the reasoning", 3)
    assert (answer.token_ids, answer.prompt_token_ids) == ((IDS, PROMPT_IDS) if asked else (None, None))


def test_sglang_takes_a_later_turns_history_reasoning_and_all(sglang: tuple[Protocol, types.ModuleType]) -> None:
    """SGLang's own request class, given a later turn's messages as draftgen sends them to a self-hosted
    server, keeps the earlier answer's text and reasoning on its assistant message (what its template
    renders the history from)."""
    _, m = sglang
    history = history_message("the answer", "the reasoning", None, server=ServerProfile(OpenAICompatible()))
    request = m.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "first"}, history,
                                                            {"role": "user", "content": "second"}])
    assistant = request.messages[1]
    assert (assistant.role, assistant.content, assistant.reasoning_content) == \
        ("assistant", "the answer", "the reasoning")
