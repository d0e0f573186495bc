"""`draftgen prompts build`: build prompt files and their config entries, and show what was done."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from draftgen.core.config_load import load_config
from draftgen.core.errors import DraftgenError
from draftgen.core.promptsets import presets
from draftgen.core.promptsets.build import DROP_REASONS, BuildError, BuildOptions, SourceStats, build
from draftgen.core.promptsets.configfile import PricePerMtok, config_relative, estimate, header_line, write_config
from draftgen.core.promptsets.sources import parse_source, stay_offline
from draftgen.core.promptsets.split import LONG, SHORT, ClassSettings, render_histogram
from draftgen.core.quoting import sh_path
from draftgen.core.safe_text import visible

DEFAULT_TOKENIZER = "moonshotai/Kimi-K2.5"
DEFAULT_MODEL = "moonshotai/kimi-k2.5"


def parse_class(text: str, flag: str) -> ClassSettings:
    """`2000/10240` → ClassSettings(concurrency=2000, max_tokens=10240)."""
    try:
        concurrency, max_tokens = (int(x.replace(",", "").replace("_", "")) for x in text.split("/"))
        if concurrency < 1 or max_tokens < 1:
            raise ValueError
    except ValueError:
        raise DraftgenError(f"{flag} {text!r}: expected CONCURRENCY/MAX_TOKENS, e.g. 2000/10240") from None
    return ClassSettings(concurrency, max_tokens)


def parse_split(text: str) -> int | Literal["auto", "off"]:
    if text in ("auto", "off"):
        return text  # type: ignore[return-value]
    try:
        value = int(text.replace(",", "").replace("_", ""))
        if value < 1:
            raise ValueError
    except ValueError:
        raise DraftgenError(f"--split {text!r}: expected auto, off, or a prompt-token threshold such as 4096") from None
    return value


@dataclass(frozen=True)
class BuildRequest:
    """The command line of `draftgen prompts build`, parsed."""

    sources: Sequence[str]
    out_dir: Path
    config: Path | None
    preset: str | None = None
    mapping: str | None = None
    turns: Literal["first", "last", "all"] = "first"
    max_turns: int | None = None
    n: int | None = None
    seed: int = 42
    languages: str | None = None
    min_tokens: int | None = None
    max_tokens: int | None = None
    split: str = "auto"
    short: str | None = None
    long: str | None = None
    tokenizer: str | None = None
    template: str | None = None
    price_in: float | None = None
    price_out: float | None = None
    model: str = DEFAULT_MODEL
    output_dir: str | None = None
    download: bool = False
    subset: str | None = None
    force: bool = False


def _tokenizer_entry(path: str, config_dir: Path) -> str:
    """A local tokenizer folder as the config will resolve it; a hub id as it is."""
    return config_relative(Path(path), config_dir) if Path(path).expanduser().exists() else path


_SHORT_NAMES = {"duplicate_exact": "dup", "duplicate_normalised": "dup~", "too_short": "short",
                "too_long": "long", "language": "lang"}


def _source_table(stats: Sequence[SourceStats]) -> Table:
    table = Table(title="sources (dropped: dup exact, dup~ same normalised text, short/long: --min/--max-tokens)",
                  title_justify="left", box=None, pad_edge=False)
    for col in ("name", "split", "layout", "rows", "kept", *DROP_REASONS):
        table.add_column(_SHORT_NAMES.get(col, col), justify="left" if col in ("name", "split", "layout")
                         else "right")
    for s in stats:
        table.add_row(_text(s.name), _text(s.split), _text(s.mapping), f"{s.rows:,}", f"{s.kept:,}",
                      *(f"{s.dropped[r]:,}" if s.dropped[r] else "·" for r in DROP_REASONS))
    return table


def _text(value: object) -> str:
    """What a source supplies (its path, split, columns, a row's values in an error) or a name made from it,
    for a Rich string: its controls as visible escapes, `[...]` as text, not markup."""
    return escape(visible(str(value)))


def _warn_special_text(console: Console, datasets: Any, tok: Any) -> None:
    """Count the prompts holding special-token text: servers read it as the token, OpenRouter may not."""
    from draftgen.core.tokens.template import count_special_text
    for out in datasets:
        with open(out.path, "rb") as f:
            flagged = count_special_text(f, tok.special_tokens())
        if flagged:
            console.print(f"[yellow]{_text(out.name)}: {flagged:,} prompt(s) hold special-token text (e.g. a typed "
                          f"<|im_end|>)[/]: vLLM, SGLang and transformers serve read it as the special token "
                          f"([tokenizer] prompt_special_tokens, default \"special\" self-hosted, \"text\" on "
                          f"OpenRouter); the prompt tokens above count it as text", markup=True)


def _checked_prices(req: BuildRequest) -> PricePerMtok | None:
    """The prices given (both or neither), after checking --max-turns goes with --turns all."""
    if req.max_turns is not None and (req.max_turns < 1 or req.turns != "all"):
        raise DraftgenError(f"--max-turns {req.max_turns}: caps the user turns of a conversation with --turns all; "
                            "give a number >= 1 with --turns all")
    if (req.price_in is None) != (req.price_out is None):
        raise DraftgenError("give both --price-in and --price-out (USD per million tokens), or neither")
    return PricePerMtok(req.price_in, req.price_out) if req.price_in is not None and req.price_out is not None else None


def build_command(req: BuildRequest, console: Console | None = None) -> int:
    from draftgen.core.tokens.template import load_template
    from draftgen.core.tokens.tokenizer import load_tokenizer

    console = console or Console()
    if not req.download:
        stay_offline()
    existing = load_config(req.config) if req.config is not None and req.config.exists() else None
    specs = [parse_source(s) for s in req.sources]
    if existing is not None:
        taken = {d.name for d in existing.datasets}
        for spec in specs:
            clash = taken & {spec.name, f"{spec.name}_short", f"{spec.name}_long"}
            if clash:
                raise BuildError(f"{req.config}: a dataset named {sorted(clash)[0]!r} is already there; name the "
                                 f"source another way ({'NEWNAME=' + spec.where})")
    tok_path = req.tokenizer or (existing.tokenizer.path if existing else DEFAULT_TOKENIZER)
    template_name = req.template or (existing.tokenizer.template if existing else "kimi-k2.5")
    tok = load_tokenizer(tok_path)
    # The system turn the run will render in front of prompts without one counts in their length.
    template = load_template(template_name, tok,
                             default_system=existing.tokenizer.system_turn() if existing else None)
    mapping = presets.parse_mapping(req.mapping) if req.mapping else None
    languages = frozenset(x.strip().lower() for x in req.languages.split(",") if x.strip()) if req.languages else None
    prices = _checked_prices(req)

    opts = BuildOptions(
        sources=specs, out_dir=req.out_dir, tokenizer=tok, template=template, preset=req.preset, mapping=mapping,
        turns=req.turns, max_turns=req.max_turns, n=req.n, seed=req.seed, languages=languages,
        min_tokens=req.min_tokens, max_tokens=req.max_tokens, split=parse_split(req.split),
        short=parse_class(req.short, "--short") if req.short else SHORT,
        long=parse_class(req.long, "--long") if req.long else LONG,
        download=req.download, subset=req.subset, force=req.force,
        existing=[d.prompts for d in existing.datasets] if existing else ())
    result = build(opts, on_source=lambda s: console.print(
        f"[bold]{_text(s.name)}[/]: {s.kept:,} kept of {s.rows:,} rows ({_text(s.origin)}, {_text(s.mapping)})"))
    console.print()
    console.print(_source_table(result.sources))
    for s in result.sources:
        if s.example_unusable:
            console.print(f"  {_text(s.name)}: first unusable row — {_text(s.example_unusable)}")
    console.print()
    console.print(render_histogram(f"prompt length ({_text(tok_path)}, template {template_name})", result.lengths,
                                   result.threshold))
    if result.suggested is not None and result.threshold != result.suggested:
        console.print(f"  (suggested split: {result.suggested:,} tokens)")
    console.print()

    title = "prompt files (tokens: prompt tokens; est. $: answers at half max_tokens, max $: all of it"
    if req.turns == "all":
        title += "; prompts: conversations (turns asked); each turn's prompt also carries the earlier answers"
    table = Table(title=title + ")", title_justify="left", box=None, pad_edge=False)
    for col in ("dataset", "class", "prompts", "tokens", "concurrency", "max_tokens", "est. $", "max $"):
        table.add_column(col, justify="left" if col in ("dataset", "class") else "right", no_wrap=True)
    for out in result.datasets:
        cost = estimate(out, prices) if prices else None
        prompts = f"{out.prompts:,} ({out.requests:,})" if out.multi_turn else f"{out.prompts:,}"
        table.add_row(_text(out.name), out.length_class, prompts, f"{out.prompt_tokens:,}",
                      f"{out.settings.concurrency:,}", f"{out.settings.max_tokens:,}",
                      f"${cost.expected_usd:,.2f}" if cost else "—", f"${cost.max_usd:,.2f}" if cost else "—")
    console.print(table)
    _warn_special_text(console, result.datasets, tok)
    if prices is None:
        console.print("  no cost estimate: pass --price-in and --price-out (USD per million tokens, from the "
                      "provider's price listing)")
    else:
        console.print(f"  prices: ${prices.prompt:g}/M prompt, ${prices.completion:g}/M completion tokens")
    if not result.datasets:
        console.print("[yellow]no prompt was kept: nothing written[/]")
        return 1
    if req.config is not None:
        write_config(req.config, result.datasets, prices=prices,
                     header=header_line(result.sources, result.threshold, req.seed), model=req.model,
                     tokenizer=_tokenizer_entry(tok_path, req.config.parent), template=template_name,
                     output_dir=req.output_dir or f"runs/{req.config.stem}")
        verb = "added to" if existing is not None else "written:"
        console.print(f"\n{len(result.datasets)} [[datasets]] {verb} {visible(str(req.config))}", markup=False)
        config = _text(sh_path(req.config))
        console.print(f"next: [bold]draftgen smoke {config}[/] then [bold]draftgen run {config}[/]")
    return 0
