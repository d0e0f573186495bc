"""The smoke test's rows that more than one of its parts builds (smoke.py's checklist and the modules of its
rows, smoke_agent.py's agent exchange): the row itself, the smoke body of a shape, a server's text quoted,
the prompt tokens row, the tokens row."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from draftgen.core.bodies import ChatBody, ChatMessage, any_keys
from draftgen.core.config import Config
from draftgen.core.config_tables import DatasetConfig
from draftgen.core.generate.api.answer import ChatAnswer
from draftgen.core.quoting import one_line
from draftgen.core.request_keys import COMPLETION_LIMIT_KEYS


@dataclass(frozen=True)
class SmokeRow:
    check: str
    passed: bool
    detail: str
    warning: bool = False  # passed, but worth reading (an unknown balance)


Asked = tuple[str, ChatBody, "ChatAnswer | SmokeRow", float]  # (shape, body sent, answer or row, seconds)


def smoke_body(config: Config, ds: DatasetConfig) -> ChatBody:
    """The body the smoke test sends for `ds`: the run's, with the smoke prompt (and `[smoke] max_tokens`
    in every answer-cap key the body carries, so the server and the reservation see the same cap); with
    sampling cycles, the first prompt's values (index 0)."""
    body = config.request_body(ds, [{"role": "user", "content": config.smoke.prompt}], index=0)
    if config.smoke.max_tokens is not None:
        for key in COMPLETION_LIMIT_KEYS:
            if key in body or key == "max_tokens":
                any_keys(body)[key] = config.smoke.max_tokens
    return body


def quoted(text: str | None) -> str:
    """`text` in quotes on one line, its controls shown as escapes once (quoting.one_line): a row quotes
    a server's text so, not by its repr, whose backslashes would be doubled (`\\\\x1b` for the `\\x1b` the
    Redactor already wrote). None as None."""
    return "None" if text is None else f"'{one_line(text)}'"


def prompt_row(config: Config, label: str, rec: Any, messages: list[ChatMessage],
                reconstruct_fn: Callable[..., Any]) -> SmokeRow:
    """The prompt the provider ran (usage.prompt_tokens) against the prompt the run reconstructs."""
    from draftgen.core.config_tables import KIMI_DEFAULT_SYSTEM
    if rec.prompt_diff is None:
        return SmokeRow(f"{label} prompt tokens", False,
                        "no usage.prompt_tokens in the answer: the prompt cannot be checked")
    tol = config.validation.prompt_tolerance
    detail = (f"{rec.prompt_tokens} prompt tokens rendered vs {rec.billed_prompt_tokens} in usage.prompt_tokens "
              f"(diff {rec.prompt_diff}; system turn: {config.tokenizer.system_turn_why()})")
    if abs(rec.prompt_diff) <= tol:
        return SmokeRow(f"{label} prompt tokens", True, detail)
    # Would the other default system turn explain it? Say which setting matches the provider.
    current = config.tokenizer.system_turn()
    other = None if current is not None else KIMI_DEFAULT_SYSTEM
    alt = reconstruct_fn(messages, None, system=other)
    if alt is not None and alt.prompt_tokens is not None and abs(alt.prompt_tokens - rec.billed_prompt_tokens) <= tol:
        setting = "\"none\"" if other is None else '"' + other + '"'
        detail += (f"; the provider's count matches the prompt rendered with "
                   f"{'no default system turn' if other is None else 'the Kimi default system turn'}: "
                   f"set [tokenizer] default_system = {setting}")
    elif rec.count_diff == 0:
        # The answer counts exactly, so the template's turns agree with the server's: the text encodes otherwise.
        detail += (f"; the answer counts exactly, so the chat template is not the cause: possible tokenizer "
                   f"mismatch: draftgen encodes with {origin(reconstruct_fn, config)}, the server loads its own "
                   f"tokenizer for the model (set [tokenizer] path to the folder the server serves)")
    else:
        detail += ("; the provider ran another prompt than the one reconstructed (a different chat template, "
                   "system turn or tool declarations), so every row's prompt would differ from what produced "
                   f"its answer; or a possible tokenizer mismatch (draftgen encodes with "
                   f"{origin(reconstruct_fn, config)})")
    return SmokeRow(f"{label} prompt tokens", False, detail)


def tokens_row(config: Config, label: str, rec: Any, provider: str | None, parser: str = "") -> SmokeRow:
    """The answer's ids: structure checked, count judged by the sample policy (a BPE split passes)."""
    from draftgen.core.tokens.fidelity import routing_name, toml_list
    from draftgen.core.tokens.policy import SamplePolicy
    verdict = SamplePolicy.from_config(config).judge(rec.failed_checks, rec.count_diff, rec.billed_tokens)
    detail = (f"{rec.span_tokens} answer tokens vs {rec.billed_tokens} billed (diff {rec.count_diff})"
              + (f"; failed: {', '.join(rec.failed_checks)}" if rec.failed_checks else "; all checks pass"))
    if rec.source == "backend" or "matches_backend" in rec.failed_checks:
        detail += ("; the server's token ids " + ("differ from" if "matches_backend" in rec.failed_checks
                                                   else "equal") + " the reconstruction")
    if verdict.cause == "count_mismatch" and provider:
        routing = config.request.get("provider")
        ignore = routing.get("ignore") if isinstance(routing, dict) else None
        names = [*(str(x) for x in ignore if isinstance(ignore, list)), routing_name(provider)] \
            if isinstance(ignore, list) else [routing_name(provider)]
        detail += (f"; {provider} counts this answer {abs(rec.count_diff) / max(1, rec.billed_tokens or 1):.1%} "
                   f"off: another tokenizer or quantization? To route around it, in [request.provider]: "
                   f"{toml_list('ignore', names)}")
    passed = verdict.keep and not rec.truncated
    if config.api.server.kind.one_tokenizer and passed and rec.count_diff:
        # One server, one tokenizer: a finished answer's ids are exact or not the model's (no BPE split
        # between providers to excuse a difference, and no other provider to compare with).
        passed = False
        if parser:  # the stream row saw the server's parser rewrite this mode's text: that is the cause
            return SmokeRow(f"{label} tokens", passed, detail + f"; a self-hosted answer that ended must count "
                            f"exactly: {rec.count_diff:+d} is the server's parser, not the chat template: {parser}")
        detail += (f"; a self-hosted answer that ended must count exactly: {rec.count_diff:+d} is the chat "
                   f"template (a generation prompt or end of turn a token off the server's: [tokenizer] "
                   f"template = \"auto\" with the served model's tokenizer), or a reasoning parser rewriting the "
                   f"text (see the stream row: [api] stream = true), or another tokenizer ([tokenizer] path)")
    return SmokeRow(f"{label} tokens", passed, detail)


def origin(reconstruct_fn: Callable[..., Any], config: Config) -> str:
    """The tokenizer file the smoke test encoded with (set once the tokenizer loaded)."""
    return str(getattr(reconstruct_fn, "origin", None) or config.tokenizer.path)
