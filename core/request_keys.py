"""Every key a request table (`[request]`, a dataset's `request`) may put in a body, per server kind.

A body is a contract: whatever it carries is generated and billed. Each key draftgen knows is one of:

- PLAIN: changes how an answer is sampled or routed, not how many tokens may be billed (temperature,
  top_p, seed, stop, provider, include_reasoning, stream_options, ...);
- CAP: an answer cap (`max_tokens` and its other names): it must equal the dataset's max_tokens, which
  the reservation and the token budget use (config_load.py `_completion_limit`; one number, or the load
  stops). `reasoning.max_tokens` (a reasoning budget, counted inside the completion) may not exceed it;
- RESERVED: priced by the reservation: `models` (with `route = "fallback"`): every fallback model's
  endpoints listing is read and the reservation takes the worst of them (prices.py);
- REFUSED: refused at load, with why: `model` and `messages` (they come from api.model and the prompt
  files), `n`/`best_of` above 1 (n answers billed, the first one kept), `logprobs`/`top_logprobs`
  (see REFUSED_WHY), and keys that bill what no listing prices (web search plugins, predicted outputs,
  service tiers).

A key in none of these tables is refused unless the user lists it in `[api] request_pass_through`: it
is then sent as written and reserved as if it changed nothing (docs/money.md says the risk).

Kinds: OpenRouter-only keys (OPENROUTER_ONLY_KEYS) are left out of the body for an openai-compatible
server (config.py says so in one warning); keys only an openai-compatible server reads are refused for a
config that is OpenRouter's (`kind = "openrouter"`, or `auto` on openrouter.ai).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from draftgen.core.errors import ConfigError

# Request keys only OpenRouter takes: a strict OpenAI-compatible server answers them with a 422.
OPENROUTER_ONLY_KEYS = ("include_reasoning", "provider", "reasoning", "usage", "transforms", "models", "route")
# Keys only an openai-compatible server (vLLM, SGLang) reads: sampling and template options.
SELF_HOSTED_ONLY_KEYS = ("chat_template_kwargs", "skip_special_tokens", "spaces_between_special_tokens",
                         "separate_reasoning", "include_stop_str_in_output", "stop_token_ids", "return_token_ids")
# Keys that change how an answer is sampled or routed, not how much of it is billed (both kinds).
PLAIN_KEYS = ("temperature", "top_p", "top_k", "min_p", "top_a", "seed", "stop", "frequency_penalty",
              "presence_penalty", "repetition_penalty", "logit_bias", "tools", "tool_choice", "parallel_tool_calls",
              "response_format", "user", "stream_options", "reasoning_effort", "verbosity")
# Answer caps: each must equal the dataset's max_tokens (config_load.py `_completion_limit`).
COMPLETION_LIMIT_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens")
# Keys of the OpenRouter `reasoning` table.
REASONING_KEYS = ("effort", "max_tokens", "exclude", "enabled", "summary")
# How many answers a body asks for: only 1 is accepted (the client keeps choices[0]).
COUNT_KEYS = ("n", "best_of")

REFUSED_WHY: dict[str, str] = {
    "messages": "messages come from the prompt files: a fixed list would answer every prompt with one "
                "conversation while responses.jsonl stores each prompt's own",
    "model": "the model comes from api.model (what the prices are read for and the smoke test checks); "
             "for fallback models use models = [...] in [request]",
    "prompt": "prompts come from the prompt files",
    "stream": "set api.stream instead (the client reads the answer the way api.stream says)",
    "logprobs": "draftgen keeps no logprobs: they only multiply the size of every answer (a stream of top "
                "alternatives per token) and narrow the routing to providers that return them",
    "top_logprobs": "draftgen keeps no logprobs: they only multiply the size of every answer (a stream of top "
                    "alternatives per token) and narrow the routing to providers that return them",
    "echo": "the prompt would come back inside the answer",
    "ignore_eos": "the answer would run past the model's own end to max_tokens: not the model's answer",
    "prediction": "predicted outputs bill rejected prediction tokens, which no reservation prices",
    "service_tier": "a service tier bills at prices the endpoints listing does not show",
    "plugins": "plugins (web search, file parsing) bill per request at prices no reservation covers",
    "web_search_options": "web search bills per request at prices no reservation covers",
    "modalities": "only text answers are kept",
    "audio": "only text answers are kept",
}
COUNT_WHY = ("the client keeps only choices[0]: {n} answers would be billed (the reservation is {n} x the worst "
             "case) and {m} thrown away")


def known_key(key: str) -> bool:
    """A key this module decides about (so it cannot be listed in `[api] request_pass_through`; the
    openai-compatible-only keys can, to send them to OpenRouter anyway)."""
    return (key in REFUSED_WHY or key in COUNT_KEYS or key in PLAIN_KEYS or key in OPENROUTER_ONLY_KEYS
            or key in COMPLETION_LIMIT_KEYS)


def _where(table: str, dataset: str) -> str:
    return "[request]" if table == "request" else f"dataset {dataset}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_request_table(file: Path, table: str, request: Mapping[str, Any], *, openrouter: bool,
                        pass_through: Sequence[str], dataset: str = "") -> None:
    """Refuse (ConfigError naming the key, `table` and `file`) any key of `request` draftgen does not
    know for this kind, or knows to change what is billed past the reservation. `table` is "request" or
    "datasets[i].request" (of `dataset`, its name); `openrouter`: the config is OpenRouter's for sure
    (its kind or base_url).
    Answer caps are checked against max_tokens by config_load.py `_completion_limit`."""
    where = _where(table, dataset)
    for key, value in request.items():
        name = f"{table}.{key}"
        _check_finite(file, name, where, value)
        if key in pass_through:
            continue
        why = REFUSED_WHY.get(key)
        if why is not None:
            raise ConfigError(f"{file}: {name} ({where}) cannot be set in a request table: {why}")
        if key in COUNT_KEYS:
            if not _is_int(value) or value < 1:
                raise ConfigError(f"{file}: {name} ({where}) must be a positive integer, not {value!r}")
            if value > 1:
                raise ConfigError(f"{file}: {name} = {value} ({where}) cannot be set in a request table: "
                                  + COUNT_WHY.format(n=value, m=value - 1) + "; remove it (or set it to 1)")
            continue
        if key == "models":
            if not isinstance(value, list) or not value or not all(isinstance(m, str) and m.strip() for m in value):
                raise ConfigError(f"{file}: {name} ({where}) must be a non-empty list of model ids, not {value!r}")
            continue
        if key == "route":
            if value != "fallback":
                raise ConfigError(f"{file}: {name} ({where}) must be \"fallback\" (the only routing "
                                  f"OpenRouter documents), not {value!r}")
            continue
        if key == "reasoning":
            _check_reasoning(file, f"{name} ({where})", value)
            continue
        if key in SELF_HOSTED_ONLY_KEYS:
            if openrouter:
                raise ConfigError(f"{file}: {name} ({where}) is read only by an openai-compatible server "
                                  f"(vLLM, SGLang), not by OpenRouter (api.base_url, api.kind): remove it, or "
                                  f"list it in [api] request_pass_through to send it anyway")
            continue
        if key in PLAIN_KEYS or key in OPENROUTER_ONLY_KEYS or key in COMPLETION_LIMIT_KEYS:
            continue
        raise ConfigError(f"{file}: {name} ({where}) is a request key draftgen does not know, so it cannot tell "
                          f"what it makes the server generate or bill: remove it, or list it in "
                          f"[api] request_pass_through to send it as written (its cost is then reserved as if it "
                          f"changed nothing; see docs/money.md)")


def _check_finite(file: Path, name: str, where: str, value: Any) -> None:
    """TOML has nan and inf, JSON has neither: orjson would send null, and the server's default would
    apply instead of the value set. Refused wherever it is inside the value, the key named."""
    inner, bad = _non_finite(value)
    if inner is not None:
        raise ConfigError(f"{file}: {name}{inner} = {bad!r} ({where}) must be a finite number: JSON has no nan "
                          f"or inf, so it would be sent as null (the server's default instead of yours)")


def _non_finite(value: Any) -> tuple[str | None, Any]:
    """Where inside `value` (a table or list, looked through) a float is nan or infinite ("" for `value`
    itself, ".x" or "[i]" inside it), and that float; (None, None) when there is none."""
    if isinstance(value, float):
        return ("", value) if not math.isfinite(value) else (None, None)
    items = value.items() if isinstance(value, Mapping) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        inner, bad = _non_finite(v)
        if inner is not None:
            return (f"[{k}]" if isinstance(k, int) else f".{k}") + inner, bad
    return None, None


def _check_reasoning(file: Path, name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise ConfigError(f"{file}: {name}: must be a table ({{ effort = \"high\" }}, {{ max_tokens = N }}), "
                          f"not {value!r}")
    for sub in value:
        if sub not in REASONING_KEYS:
            raise ConfigError(f"{file}: {name}: {sub!r} is not a reasoning key draftgen knows "
                              f"(known: {', '.join(REASONING_KEYS)})")
    budget = value.get("max_tokens")
    if budget is not None and (not _is_int(budget) or budget < 1):
        raise ConfigError(f"{file}: {name}: max_tokens must be a positive integer, not {budget!r}")


def check_reasoning_budget(file: Path, table: str, request: Mapping[str, Any], max_tokens: int, dataset: str) -> None:
    """A reasoning budget counts inside the answer cap: one above the dataset's max_tokens would be billed
    past the reservation by a provider that raises the cap to fit it, so the load refuses it."""
    reasoning = request.get("reasoning")
    budget = reasoning.get("max_tokens") if isinstance(reasoning, dict) else None
    if isinstance(budget, int) and not isinstance(budget, bool) and budget > max_tokens:
        raise ConfigError(f"{file}: {table}.reasoning.max_tokens = {budget} is more than the answer cap "
                          f"max_tokens = {max_tokens} of dataset {dataset}: reasoning tokens are completion tokens, "
                          f"billed within max_tokens; lower it to at most {max_tokens}, or raise the dataset's "
                          f"max_tokens")


def fallback_models(request: Mapping[str, Any]) -> tuple[str, ...]:
    """The fallback models a body names (`models`), in order, without repeats."""
    models = request.get("models")
    if not isinstance(models, list):
        return ()
    return tuple(dict.fromkeys(m for m in models if isinstance(m, str) and m))


def body_max_tokens(body: Mapping[str, Any], default: int) -> int:
    """The most completion tokens `body` lets the server produce: the largest answer cap it carries
    (`max_tokens`, `max_completion_tokens`, `max_output_tokens`, `max_new_tokens`: a server may honour
    any of them; a reasoning budget `reasoning.max_tokens`, which a provider may raise the cap to fit),
    `default` without any."""
    cap = 0
    for k in COMPLETION_LIMIT_KEYS:
        if k in body:  # most are absent: `in` costs less than get()'s call (once or twice per request)
            v = body[k]
            if type(v) is int and v > cap:
                cap = v
    reasoning = body.get("reasoning")
    if reasoning is not None and type(reasoning) is dict:
        v = reasoning.get("max_tokens")
        if type(v) is int and v > cap:
            cap = v
    return cap or default


def body_answers(body: Mapping[str, Any]) -> int:
    """How many answers `body` asks the server to generate (and bill): the larger of `n` and `best_of`."""
    n = body.get("n", 1)
    best = body.get("best_of", 1)
    count = max(n if type(n) is int else 1, best if type(best) is int else 1)
    return count if count > 1 else 1


# A provider that runs past the body's answer cap (docs/money.md). Counted tokens (a usage object,
# mid-stream or final) may pass the cap by PAST_CAP_COUNTED_MARGIN or a tenth of the cap, whichever is
# more, for counting differences (a provider's native tokens against the cap it applied). Streamed text
# without counts is measured at TEXT_CHARS_PER_TOKEN characters a token (Kimi's tokenizer averages ~4
# on code and prose, 2 on Chinese, far more on runs of one symbol, so this undercounts ordinary text)
# and may pass the cap by a quarter of it plus PAST_CAP_TEXT_MARGIN tokens: an honest answer is cut
# only if its text averages over 6 characters a token.
PAST_CAP_COUNTED_MARGIN = 16
PAST_CAP_TEXT_MARGIN = 64
TEXT_CHARS_PER_TOKEN = 5


def past_cap_limits(cap: int) -> tuple[int, int]:
    """(completion tokens counted, characters streamed) past which an answer under answer cap `cap` has
    run past it; (0, 0) when the body carries no cap."""
    if cap <= 0:
        return 0, 0
    return cap + max(PAST_CAP_COUNTED_MARGIN, cap // 10), (cap + cap // 4 + PAST_CAP_TEXT_MARGIN) * TEXT_CHARS_PER_TOKEN
