"""Short and long prompts: a length histogram, a suggested threshold, and the two classes' settings.

Lengths are prompt tokens measured with the target tokenizer through the run's chat template
(what OpenRouter bills as prompt tokens, give or take the provider's own template).

The suggested threshold is Otsu's: on log2 of the lengths, the cut that best separates two groups
(largest between-group variance), then rounded down to two significant digits so a config reads well. A
single-peaked set still gets a cut; `--split N` overrides it and `--split off` keeps one class.
Long prompts hold more memory and take longer per request, so the long class runs at lower
concurrency with a larger max_tokens (the reference run: 2,000/10,240 short, 500/16,384 long).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Group
from rich.table import Table
from rich.text import Text


@dataclass(frozen=True)
class ClassSettings:
    concurrency: int
    max_tokens: int


SHORT = ClassSettings(concurrency=2000, max_tokens=10240)
LONG = ClassSettings(concurrency=500, max_tokens=16384)


def _round_down(value: float) -> int:
    """`value` rounded down to two significant digits (4,551 → 4,500), at least 1."""
    if value < 10:
        return max(1, int(value))
    step = 10 ** (int(math.floor(math.log10(value))) - 1)
    return int(value // step) * step


def suggest_threshold(lengths: Sequence[int]) -> int | None:
    """Otsu's cut on log2(length), rounded down; None when fewer than two distinct lengths."""
    values = sorted(math.log2(max(1, n)) for n in lengths)
    if len(values) < 2 or values[0] == values[-1]:
        return None
    n = len(values)
    total = sum(values)
    best, best_cut = -1.0, None
    left = 0.0
    for i in range(1, n):
        left += values[i - 1]
        if values[i] == values[i - 1]:
            continue  # a cut only between distinct values
        w0, w1 = i / n, (n - i) / n
        m0, m1 = left / i, (total - left) / (n - i)
        between = w0 * w1 * (m0 - m1) ** 2
        if between > best:
            best, best_cut = between, (values[i - 1] + values[i]) / 2
    assert best_cut is not None
    # The cut is in log space: round the length it stands for, never below the largest short length.
    lo = 2 ** max(v for v in values if v <= best_cut)
    hi = 2 ** min(v for v in values if v > best_cut)
    cut = _round_down(2 ** best_cut)
    return cut if lo < cut <= hi else int(round(hi))


@dataclass(frozen=True)
class Bin:
    lo: int   # inclusive
    hi: int   # exclusive
    count: int


def histogram(lengths: Sequence[int], bins_per_octave: int = 2) -> list[Bin]:
    """Counts in log-spaced bins (`bins_per_octave` per doubling) from the shortest to the longest."""
    if not lengths:
        return []
    lo, hi = max(1, min(lengths)), max(1, max(lengths))
    start = math.floor(math.log2(lo) * bins_per_octave)
    stop = math.floor(math.log2(hi) * bins_per_octave) + 1
    edges = [int(math.ceil(2 ** (k / bins_per_octave))) for k in range(start, stop + 1)]
    edges[0] = min(edges[0], lo)
    counts = [0] * (len(edges) - 1)
    for n in lengths:
        k = min(len(counts) - 1, max(0, math.floor(math.log2(max(1, n)) * bins_per_octave) - start))
        counts[k] += 1
    return [Bin(edges[k], edges[k + 1], c) for k, c in enumerate(counts)]


def render_histogram(title: str, lengths: Sequence[int], threshold: int | None, width: int = 40) -> Group:
    """A terminal picture: one bar per bin, the bins at or above the threshold in the long colour."""
    bins = histogram(lengths)
    table = Table(box=None, show_header=True, pad_edge=False, title=title, title_justify="left")
    table.add_column("prompt tokens", justify="right")
    table.add_column("", no_wrap=True)
    table.add_column("prompts", justify="right")
    peak = max((b.count for b in bins), default=0) or 1
    for b in bins:
        long = threshold is not None and b.lo >= threshold
        straddles = threshold is not None and b.lo < threshold < b.hi
        bar = "█" * max(1 if b.count else 0, round(b.count / peak * width))
        style = "magenta" if long else ("yellow" if straddles else "cyan")
        table.add_row(f"{b.lo:,}–{b.hi - 1:,}", Text(bar, style=style), f"{b.count:,}")
    parts: list = [table]
    if lengths:
        s = sorted(lengths)
        p = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
        parts.append(Text(f"  p50 {p(0.5):,}  p90 {p(0.9):,}  p99 {p(0.99):,}  max {s[-1]:,} tokens"))
    if threshold is not None:
        short = sum(1 for n in lengths if n < threshold)
        parts.append(Text(f"  split at {threshold:,} tokens: {short:,} short (cyan), "
                          f"{len(lengths) - short:,} long (magenta)"))
    return Group(*parts)
