"""Build prompt files: open each source, map rows to prompts, filter, dedupe, sample, measure, split.

Per source, rows are visited in a seeded random order (`random.Random(f"{seed}:{name}")`, so adding
a source never changes another's sample) until N prompts are kept. A row is dropped, with the
reason counted, when it cannot be mapped, is in another language, is a duplicate, or is outside
the length bounds. Duplicates are checked against everything kept so far in this build and against
the prompt files already listed in the target config (core/dedupe.py: exact, then normalised text).

Ids are `NAME:SPLIT:ROW` (ROW the row's index in the split): the same source gives the same ids on
every build, whatever N or the seed, so a rebuilt file resumes a run instead of redoing it.

With `turns="all"` a prompt is a conversation whose user turns are each asked (presets.py): its length
(filters, split) is its last turn's prompt side (system and every user turn, without the answers),
it is deduplicated on that prompt side (dedupe.turn_key), and each turn's prompt side is measured for
the cost estimate (configfile.py), to which the target's earlier answers in each history are added.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

from draftgen.core import dedupe
from draftgen.core.errors import DraftgenError, NoPromptError
from draftgen.core.generate.loop.prompt_files import read_prompts
from draftgen.core.generate.loop.prompts import Prompt
from draftgen.core.promptsets import language, presets
from draftgen.core.promptsets.sources import Source, SourceSpec, open_source
from draftgen.core.promptsets.split import LONG, SHORT, ClassSettings, suggest_threshold

LengthClass = Literal["all", "short", "long"]  # which of a source's length classes a dataset file holds
DROP_REASONS = ("unusable", "language", "duplicate_exact", "duplicate_normalised", "too_short", "too_long")


class BuildError(DraftgenError):
    """Options that cannot give prompt files (a clash of names, files in the way)."""


@dataclass(frozen=True)
class BuildOptions:
    sources: Sequence[SourceSpec]
    out_dir: Path
    tokenizer: Any                               # core.tokens.tokenizer.Tokenizer
    template: Any                                # core.tokens.template.ChatTemplate
    preset: str | None = None                    # None/"auto": detected from the columns
    mapping: dict[str, str] | None = None
    turns: Literal["first", "last", "all"] = "first"
    max_turns: int | None = None                 # turns="all": user turns kept per conversation at most
    n: int | None = None                         # per source; None: every usable row
    seed: int = 42
    languages: frozenset[str] | None = None
    min_tokens: int | None = None
    max_tokens: int | None = None
    split: int | Literal["auto", "off"] = "auto"
    short: ClassSettings = SHORT
    long: ClassSettings = LONG
    download: bool = False
    subset: str | None = None
    existing: Sequence[Path] = ()                # prompt files already in the config: dedupe against them
    force: bool = False                          # overwrite prompt files already in out_dir


@dataclass
class SourceStats:
    name: str
    origin: str
    split: str
    mapping: str
    rows: int
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    example_unusable: str | None = None  # the first reason a row could not be used


@dataclass(frozen=True)
class Kept:
    id: str
    messages: list[dict[str, str]]
    tokens: int
    # turns="all": each turn's prompt side (system + user turns 1..k) in tokens; else (tokens,): one request.
    turn_tokens: tuple[int, ...] = ()
    tools: list[dict[str, Any]] | None = None  # an agent line's tools (written as the line's `tools`)

    @property
    def requests(self) -> int:
        return len(self.turn_tokens) or 1


@dataclass(frozen=True)
class DatasetOut:
    """One prompt file written, and the `[[datasets]]` entry it gets."""

    name: str
    path: Path
    source: str
    length_class: LengthClass
    settings: ClassSettings
    prompts: int
    prompt_tokens: int
    turns: Literal["first", "last", "all"] = "first"
    max_turns: int | None = None
    requests: int = 0                 # requests the dataset sends: prompts, or every conversation's turns
    request_prompt_tokens: int = 0    # their prompt sides summed (turns="all": turn k's system + user turns 1..k)
    history_answers: int = 0          # the target's earlier answers their histories carry, all together

    @property
    def multi_turn(self) -> bool:
        return self.turns == "all"


@dataclass
class BuildResult:
    sources: list[SourceStats]
    datasets: list[DatasetOut]
    lengths: list[int]
    threshold: int | None
    suggested: int | None


def prompt_tokens(tok: Any, template: Any, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None = None) -> int:
    """Prompt tokens as the target sees them: the chat template through the generation prompt."""
    from draftgen.core.tokens.reconstruct import encode_segments
    return len(encode_segments(tok, template.render(messages, None, "", tools=tools).prompt))


def step_prompt_tokens(tok: Any, template: Any, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None) -> tuple[int, ...]:
    """Each step's prompt side of an agent line: its tools, and the system turn, user turns and tool
    results before its k-th assistant message, through the generation prompt. The dataset's assistant
    messages are left out: the target's own earlier answers (their calls included) are what each step
    carries, and they come on top (`DatasetOut.history_answers`, as for chat turns); counting the
    dataset's too priced every history twice."""
    steps = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return tuple(prompt_tokens(tok, template, [m for m in messages[:i] if m["role"] != "assistant"], tools)
                 for i in steps)


def turn_prompt_tokens(tok: Any, template: Any, messages: list[dict[str, Any]]) -> tuple[int, ...]:
    """Each turn's prompt side of a conversation asked turn by turn: system and user turns 1..k rendered
    through the generation prompt, for k = 1..K (the target's own answers in between come on top)."""
    side = dedupe.prompt_side(messages)
    users = [i for i, m in enumerate(side) if m["role"] == "user"]
    return tuple(prompt_tokens(tok, template, side[: i + 1]) for i in users)


def _key(messages: Sequence[Mapping[str, Any]], turns: str) -> bytes:
    """The normalised dedupe key: a conversation asked turn by turn on its prompt side (dedupe.turn_key)."""
    return dedupe.turn_key(messages) if turns == "all" else dedupe.prompt_key(messages)


def seen_keys(paths: Iterable[Path], turns: str = "first") -> tuple[set[bytes], set[bytes]]:
    """Exact and normalised keys of the prompts in existing prompt files (normalised as `turns` keys them)."""
    exact: set[bytes] = set()
    norm: set[bytes] = set()
    for path in paths:
        if not path.exists():
            continue
        with contextlib.suppress(NoPromptError):  # nothing in it to dedupe against
            for item in read_prompts(path):
                if isinstance(item, Prompt):
                    exact.add(dedupe.exact_key(item.messages))
                    norm.add(_key(item.messages, turns))
    return exact, norm


def _select(source: Source, opts: BuildOptions, stats: SourceStats, exact: set[bytes],
            norm: set[bytes]) -> list[Kept]:
    mapping = presets.resolve(source.columns, preset=opts.preset, mapping=opts.mapping, turns=opts.turns,
                              label=source.spec.where, max_turns=opts.max_turns)
    stats.mapping = mapping.describe()
    order = list(range(len(source)))
    random.Random(f"{opts.seed}:{source.name}").shuffle(order)
    kept: list[Kept] = []
    for index, row in source.rows(order):
        if opts.n is not None and len(kept) >= opts.n:
            break
        try:
            messages, tools = presets.to_line(row, mapping)
        except ValueError as e:
            stats.dropped["unusable"] += 1
            stats.example_unusable = stats.example_unusable or f"row {index}: {e}"
            continue
        if opts.languages and not language.matches(
                row, "\n".join(m["content"] for m in messages), opts.languages):
            stats.dropped["language"] += 1
            continue
        ek, nk = dedupe.exact_key(messages), _key(messages, opts.turns)
        if ek in exact:
            stats.dropped["duplicate_exact"] += 1
            continue
        if nk in norm:
            stats.dropped["duplicate_normalised"] += 1
            continue
        try:
            if any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
                per_turn = step_prompt_tokens(opts.tokenizer, opts.template, messages, tools)
            else:
                per_turn = turn_prompt_tokens(opts.tokenizer, opts.template, messages) if opts.turns == "all" else ()
            tokens = per_turn[-1] if per_turn else prompt_tokens(opts.tokenizer, opts.template, messages)
        except DraftgenError as e:  # a prompt the template cannot render would fail at run time too
            stats.dropped["unusable"] += 1
            stats.example_unusable = stats.example_unusable or f"row {index}: {e}"
            continue
        if opts.min_tokens is not None and tokens < opts.min_tokens:
            stats.dropped["too_short"] += 1
            continue
        if opts.max_tokens is not None and tokens > opts.max_tokens:
            stats.dropped["too_long"] += 1
            continue
        exact.add(ek)
        norm.add(nk)
        kept.append(Kept(f"{source.name}:{source.split}:{index}", messages, tokens, per_turn, tools))
    kept.sort(key=lambda k: int(k.id.rsplit(":", 1)[1]))  # file order follows the dataset, not the draw
    stats.kept = len(kept)
    return kept


def _dataset_out(name: str, path: Path, source: str, cls: LengthClass, settings: ClassSettings,
                 group: Sequence[Kept], opts: BuildOptions) -> DatasetOut:
    """A prompt file's entry, with what its requests send: a conversation of K turns asks K requests, the
    k-th carrying k-1 earlier answers (K(K-1)/2 in all)."""
    turns = [k.turn_tokens or (k.tokens,) for k in group]
    return DatasetOut(name, path, source, cls, settings, len(group), sum(k.tokens for k in group),
                      turns=opts.turns, max_turns=opts.max_turns if opts.turns == "all" else None,
                      requests=sum(len(t) for t in turns), request_prompt_tokens=sum(sum(t) for t in turns),
                      history_answers=sum(len(t) * (len(t) - 1) // 2 for t in turns))


def _write_jsonl(path: Path, prompts: Sequence[Kept]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for k in prompts:
                line: dict[str, Any] = {"id": k.id, "messages": k.messages}
                if k.tools:
                    line["tools"] = k.tools
                f.write(orjson.dumps(line) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def build(opts: BuildOptions, on_source: Callable[[SourceStats], None] | None = None) -> BuildResult:
    """Select, measure and split every source; write the prompt files; say what was kept and dropped."""
    names = [s.name for s in opts.sources]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise BuildError(f"two sources are named {twice!r}: name them with NAME=PATH")
    exact, norm = seen_keys(opts.existing, opts.turns)
    selected: list[tuple[SourceStats, list[Kept]]] = []
    for spec in opts.sources:
        source = open_source(spec, download=opts.download, subset=opts.subset)
        stats = SourceStats(spec.name, source.origin, source.split, "", len(source))
        selected.append((stats, _select(source, opts, stats, exact, norm)))
        if on_source is not None:
            on_source(stats)
    lengths = [k.tokens for _, kept in selected for k in kept]
    suggested = suggest_threshold(lengths)
    threshold = None if opts.split == "off" else (suggested if opts.split == "auto" else int(opts.split))

    plan: list[tuple[DatasetOut, list[Kept]]] = []
    for stats, kept in selected:
        groups: list[tuple[LengthClass, str, list[Kept], ClassSettings]]
        if threshold is None:
            groups = [("all", stats.name, kept, opts.short)]
        else:
            groups = [("short", f"{stats.name}_short", [k for k in kept if k.tokens < threshold], opts.short),
                      ("long", f"{stats.name}_long", [k for k in kept if k.tokens >= threshold], opts.long)]
        for cls, name, group, settings in groups:
            if not group:
                continue
            path = opts.out_dir / f"{name}.jsonl"
            plan.append((_dataset_out(name, path, stats.name, cls, settings, group, opts), group))
    in_the_way = [out.path for out, _ in plan if out.path.exists()]
    if in_the_way and not opts.force:
        raise BuildError(f"{in_the_way[0]}: already exists (pass --force to overwrite"
                         f"{f', {len(in_the_way) - 1} more' if len(in_the_way) > 1 else ''})")
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    for out, group in plan:
        _write_jsonl(out.path, group)
    return BuildResult([s for s, _ in selected], [out for out, _ in plan], lengths, threshold, suggested)
