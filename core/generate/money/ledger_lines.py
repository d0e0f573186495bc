"""The shapes of spend.jsonl's lines (documented in spend.py), one type per kind, and a line read back checked
into one of them.

The ledger's writers (spend.py `SpendLedger`, spend_file.py `LedgerFile`) build these; its reader
(spend.py `SpendReplay`) takes them from `checked`, never a raw line: a line from disk may have been edited
by hand or written by another tool, so each value is converted to its type first (a count that is a JSON
string is read as the number it spells, as before) and a line that cannot be, or of no known kind, is None
and counts as nothing (an attempt whose end or settle line is such stays open: pending at its worst
case). A `t` is not needed to count an attempt: an odd one reads as 0.0, as an absent one does, so a `sent`
line with one still counts at its reservation. Whether a cost is one an attempt can have been billed is the
reader's question (spend.py `_sane`): `checked` only makes it a float.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NotRequired, TypedDict


class SentLine(TypedDict):
    """Before the request leaves: its reservation `w` and when it was written `t` (0.0 when a line lacks it)."""
    e: Literal["sent"]
    a: str
    ds: str
    p: str
    w: float
    t: float


class GenLine(TypedDict):
    """The attempt's generation id, when its end line did not carry it."""
    e: Literal["gen"]
    a: str
    g: str


class EndLine(TypedDict):
    """How an attempt ended: `o` an AttemptEnd, `s` a CostSource (both written as their values), `c` None
    while it is priced later."""
    e: Literal["end"]
    a: str
    o: str
    c: float | None
    s: str
    g: NotRequired[str]     # its generation id, when no gen line went out for it
    w: NotRequired[float]   # what it counts at until priced, when more than its reservation
    st: NotRequired[int]    # the HTTP status of a 408/5xx that carried a generation id
    t: NotRequired[float]   # when an attempt without a generation id was given up on


class SettleLine(TypedDict):
    """A pending attempt priced: `s` a CostSource; `o` "answered" for an answer's."""
    e: Literal["settle"]
    a: str
    c: float
    s: str
    o: NotRequired[str]


class KeyLine(TypedDict):
    """The key's usage before the directory's first attempt."""
    e: Literal["key"]
    u: float
    t: float


class PricesLine(TypedDict):
    """The worst prices per prompt token, completion token and request an answer's bill checked."""
    e: Literal["prices"]
    ds: str
    f: str
    p: float
    c: float
    r: float


class CarryLine(TypedDict):
    """Spend in responses.jsonl without `sent` lines: carried from older runs, or found at an opening."""
    e: Literal["carry", "found"]
    ds: str
    c: float
    n: NotRequired[int]


LedgerLine = SentLine | GenLine | EndLine | SettleLine | KeyLine | PricesLine | CarryLine


def checked(raw: dict[str, Any]) -> LedgerLine | None:
    """A line read back as its kind's type, None when it is of no known kind or a value will not convert."""
    kind = raw.get("e")
    check = _CHECKS.get(kind) if isinstance(kind, str) else None
    if check is None:
        return None
    try:
        return check(raw, str(raw.get("a")))
    except (KeyError, TypeError, ValueError, OverflowError):
        return None


def _sent(raw: dict[str, Any], a: str) -> SentLine:
    # An odd `t` reads as none (0.0): the attempt still counts at its reservation rather than vanishing.
    return {"e": "sent", "a": a, "ds": str(raw["ds"]), "p": str(raw["p"]), "w": float(raw["w"]),
            "t": _when(raw.get("t"))}


def _gen(raw: dict[str, Any], a: str) -> GenLine:
    return {"e": "gen", "a": a, "g": str(raw["g"])}


def _end(raw: dict[str, Any], a: str) -> EndLine:
    c = raw.get("c")
    line: EndLine = {"e": "end", "a": a, "o": str(raw.get("o")), "c": None if c is None else float(c or 0.0),
                     "s": str(raw.get("s"))}
    if g := raw.get("g"):
        line["g"] = str(g)
    if "w" in raw:
        line["w"] = float(raw["w"])
    if isinstance(st := raw.get("st"), int) and not isinstance(st, bool):
        line["st"] = st
    if t := raw.get("t"):
        line["t"] = float(t)
    return line


def _settle(raw: dict[str, Any], a: str) -> SettleLine:
    line: SettleLine = {"e": "settle", "a": a, "c": float(raw["c"]), "s": str(raw.get("s"))}
    if "o" in raw:
        line["o"] = str(raw["o"])
    return line


def _key(raw: dict[str, Any], a: str) -> KeyLine:
    return {"e": "key", "u": float(raw["u"]), "t": _when(raw.get("t"))}  # an odd `t` does not lose the baseline


def _prices(raw: dict[str, Any], a: str) -> PricesLine:
    return {"e": "prices", "ds": str(raw["ds"]), "f": str(raw["f"]), "p": float(raw["p"]), "c": float(raw["c"]),
            "r": float(raw["r"])}


def _carry(raw: dict[str, Any], a: str) -> CarryLine:
    line: CarryLine = {"e": "found" if raw["e"] == "found" else "carry", "ds": str(raw["ds"]), "c": float(raw["c"])}
    if "n" in raw:
        line["n"] = int(raw["n"])
    return line


def _when(t: object) -> float:
    """A line's `t` (a JSON string read as the number it spells), 0.0 when absent or not a number."""
    try:
        return float(t or 0.0)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return 0.0


_CHECKS: dict[str, Callable[[dict[str, Any], str], LedgerLine]] = {
    "sent": _sent, "gen": _gen, "end": _end, "settle": _settle, "key": _key, "prices": _prices, "carry": _carry,
    "found": _carry}
