"""The `[[datasets]]` entries for built prompt files, with an estimated cost, written into a config.

Into a config that exists, the entries are appended at the end (a `[[datasets]]` table may follow
any other table; nothing already in the file is rewritten, comments included). A new config gets
a starting point around them: [api], [request], [budget], [tokenizer] and [output]. Either way the
whole text is loaded with draftgen's own config loader before it replaces the file, atomically.

Estimated cost per dataset, with prices in USD per million tokens (the provider's listing):
prompt tokens × input price + prompts × expected answer tokens × output price, where the expected
answer is half of max_tokens (what the engine assumes before answers land); the upper bound takes
every answer at max_tokens. A `turns = "all"` dataset sends one request per user turn, and turn k's
prompt carries the target's k-1 earlier answers: its prompt tokens are every turn's prompt side plus
K(K-1)/2 answers per K-turn conversation (at the same expected or maximal length), so its cost grows
about with K² — the entry's comment says how many turns and earlier answers it counted.
"""

from __future__ import annotations

import os
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftgen.core.config import Config
from draftgen.core.config_load import config_from_dict
from draftgen.core.config_values import toml_value
from draftgen.core.errors import ConfigError
from draftgen.core.promptsets.build import DatasetOut
from draftgen.core.quoting import one_line


@dataclass(frozen=True)
class PricePerMtok:
    """USD per million tokens."""

    prompt: float
    completion: float


@dataclass(frozen=True)
class CostEstimate:
    expected_usd: float
    max_usd: float


def estimate(out: DatasetOut, prices: PricePerMtok) -> CostEstimate:
    requests = out.requests or out.prompts
    prompt_tokens = out.request_prompt_tokens or out.prompt_tokens

    def at(answer: float) -> float:  # every answer `answer` tokens long, in its own turn and in later histories
        return ((prompt_tokens + out.history_answers * answer) * prices.prompt
                + requests * answer * prices.completion) / 1e6
    return CostEstimate(at(out.settings.max_tokens / 2), at(out.settings.max_tokens))


def config_relative(path: Path, config_dir: Path) -> str:
    """`path` as the config will resolve it: relative when it is under the config's folder, else absolute."""
    full, base = path.expanduser().resolve(), config_dir.resolve()
    return full.relative_to(base).as_posix() if full.is_relative_to(base) else full.as_posix()


def _entry(out: DatasetOut, config_dir: Path, prices: PricePerMtok | None) -> list[str]:
    rel = config_relative(out.path, config_dir)
    lines = ["[[datasets]]",
             f"name = {toml_value(out.name)}",
             f"prompts = {toml_value(rel)}",
             f"concurrency = {out.settings.concurrency}",
             f"max_tokens = {out.settings.max_tokens}"]
    if out.multi_turn:
        lines.append('turns = "all"')
        if out.max_turns is not None:
            lines.append(f"max_turns = {out.max_turns}")
        note = (f"# {out.prompts:,} conversations ({out.length_class}) from {out.source}, {out.requests:,} turns asked "
                f"one by one: {out.request_prompt_tokens:,} prompt tokens of user turns over them, plus "
                f"{out.history_answers:,} earlier answers carried in their histories")
    else:
        note = f"# {out.prompts:,} prompts ({out.length_class}) from {out.source}, {out.prompt_tokens:,} prompt tokens"
    if prices is not None:
        cost = estimate(out, prices)
        note += f"; estimated ${cost.expected_usd:,.2f}, at most ${cost.max_usd:,.2f}"
    return [one_line(note), *lines]


def _starter(model: str, tokenizer: str, template: str, output_dir: str, max_usd: float | None) -> list[str]:
    lines = ["[api]",
             'base_url = "https://openrouter.ai/api/v1"',
             'api_key_env = "OPENROUTER_API_KEY"       # the variable holding the key (never the key itself)',
             f"model = {toml_value(model)}",
             "",
             "[request]",
             "temperature = 0.6",
             "include_reasoning = true",
             "",
             "[budget]"]
    if max_usd is not None:
        lines.append(f"max_usd = {max_usd:.2f}                    # the estimated upper bound of the datasets below")
    else:
        lines.append("# max_usd = 100.0                 # set a cap (no prices were given to estimate one)")
    lines += ["", "[tokenizer]", f"path = {toml_value(tokenizer)}", f"template = {toml_value(template)}",
              "", "[output]", f"dir = {toml_value(output_dir)}"]
    return lines


def write_config(path: Path, outs: Sequence[DatasetOut], *, prices: PricePerMtok | None, header: str,
                 model: str, tokenizer: str, template: str, output_dir: str) -> Config:
    """Append the entries to `path` (or start it); the result, loaded, or ConfigError and no change."""
    existing = path.read_text(encoding="utf-8") if path.exists() else None
    blocks = [f"# {one_line(header)}"]  # one line, whatever a source's path or name holds
    for out in outs:
        blocks += ["", *_entry(out, path.parent, prices)]
    if existing is None:
        bound = sum(estimate(o, prices).max_usd for o in outs) if prices is not None else None
        text = "\n".join(["# draftgen config, started by `draftgen prompts build`", "",
                          *_starter(model, tokenizer, template, output_dir, bound), "", *blocks]) + "\n"
    else:
        text = existing + ("" if existing.endswith("\n") or not existing else "\n") + "\n" + "\n".join(blocks) + "\n"
    try:
        config = config_from_dict(tomllib.loads(text), path)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: the entries would not make valid TOML ({e}); nothing was written") from None
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return config


def header_line(sources: Sequence[Any], threshold: int | None, seed: int) -> str:
    what = ", ".join(f"{s.name} ({s.origin})" for s in sources)
    split = f"split at {threshold:,} prompt tokens" if threshold is not None else "no length split"
    return f"Added by `draftgen prompts build` on {time.strftime('%Y-%m-%d %H:%M')}: {what}; {split}; seed {seed}"
