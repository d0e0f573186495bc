"""How quantities read in text: sizes, counts and durations, the same wherever they are printed
(progress lines, headless status, TUI panels through tui/fmt.py)."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def fmt_count(n: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def compact_duration(seconds: float | None, unknown: str = "--") -> str:
    """For one-line logs: 3m05s, 1h02m; `unknown` for None."""
    if seconds is None:
        return unknown
    s = max(0, int(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s"


def clock(seconds: float) -> str:
    """Elapsed time as H:MM:SS (hours grow past 99 rather than wrap)."""
    s = max(0, int(seconds))
    return f"{s // 3600:d}:{s // 60 % 60:02d}:{s % 60:02d}"


def duration(seconds: float | None) -> str:
    """A rough span for ETAs and ages: 42 s, 7 min, 2 h 05 min."""
    if seconds is None:
        return "—"
    s = max(0, int(round(seconds)))
    if s < 90:
        return f"{s} s"
    if s < 3600:
        return f"{round(s / 60)} min"
    return f"{s // 3600} h {s // 60 % 60:02d} min"


def usd_shown(x: float) -> float:
    """`x` rounded as usd() shows it: a total of shown rows is the sum of these, so it adds up on screen."""
    return round(x, 5) if x != 0 and abs(x) < 0.01 else round(x, 2)


def usd(x: float | None) -> str:
    """Dollars as every view shows them: cents, or five decimals below a cent (a single request
    costs fractions of a cent)."""
    if x is None:
        return "—"
    if x != 0 and abs(x) < 0.01:
        return f"${x:.5f}"
    return f"${x:,.2f}"


def clip(text: str, width: int) -> str:
    """`text` whole if it fits, else cut at the last word boundary before `width` with "..." (never
    mid-word: "(name or service not)" reads as a different message)."""
    if len(text) <= width:
        return text
    cut = text[: max(0, width - 3)]
    space = cut.rfind(" ")
    if space > width // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:(") + "..."


def to_ms(seconds: float) -> float:
    """Seconds kept to the millisecond, as the files write times and latencies: for a timestamp or a
    latency (finite, never negative) only. Halves round up, on the binary product (one timestamp in
    ~10,000 ends 1 ms above round(x, 3)'s half-even), at a tenth of round()'s cost: this runs a few times
    per request."""
    return int(seconds * 1000.0 + 0.5) / 1000.0
