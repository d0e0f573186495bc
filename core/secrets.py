"""Keeping the API key out of everything draftgen writes or prints.

Providers quote keys back in every shape: whole, without the `sk-or-v1-` prefix, upper- or
lower-cased, or a fragment. `Redactor` cuts out any stretch of text that contains a 12-character
window of the key (compared without case), so every such form is caught, as one `[redacted]` per
stretch. It runs on error messages and events, and on every field that comes from upstream (the
client, core/generate/api/client.py), not on answers. Most texts are ruled out at C speed first: a
window of the key holds one of its anchors (blocks at every half window), so a text holding none of
them (a generation id, a provider's name) skips the per-position scan.

Upstreams also quote a key encoded: JSON-escaped (`\\u0073k-or-...`, any of its characters), percent-
encoded (`%73k%2Dor...`, either case) or in base64 (a Basic credential, a token echoed in a header).
Text holding a `\\u` or `%` escape is matched on its decoded form (the cut covers the escapes); base64
is matched on the key's encodings at each of the three byte alignments (16 characters: 12 bytes).

What the Redactor returns has its control characters shown as escapes as well (core/safe_text.py
`visible`): every text that passes through it on its way to a view or a log is made safe for a
terminal in the same place, once.
"""

from __future__ import annotations

import base64
import re
from typing import Any

from draftgen.core.safe_text import visible

# Providers sometimes echo part of a key in an error; 12 of its characters are enough to leak it.
PREFIX = 12
# Shorter than this, a "key" (a test or demo placeholder) is too common a string to cut out of text.
MIN_NEEDLE = 6
MARK = "[redacted]"
MEMO_CHARS, MEMO_SIZE = 200, 4096  # texts this short are remembered, this many at most
B64_WIDTH = 16  # base64 characters of the key (12 of its bytes) that are enough to leak it
_ESCAPE = re.compile(r"\\+u([0-9a-fA-F]{4})|%([0-9a-fA-F]{2})")  # `\\u0073`: a JSON text escaped once more
_B64_RUNS = re.compile(rf"[A-Za-z0-9+/_-]{{{B64_WIDTH},}}")
_B64_STANDARD = str.maketrans("-_", "+/")  # the URL-safe alphabet compared as the standard one
_EITHER_ALPHABET = {"+": "[+-]", "/": "[/_]"}  # a character of the standard alphabet or its URL-safe one


def _decoded(text: str) -> tuple[str, list[int]]:
    """`text` with its `\\uXXXX` and `%XX` escapes decoded, and where each decoded character starts in
    `text` (one more entry: `len(text)`), so a span of the decoded text maps back to the escapes."""
    parts: list[str] = []
    starts: list[int] = []
    pos = 0
    for m in _ESCAPE.finditer(text):
        parts.append(text[pos:m.start()])
        starts.extend(range(pos, m.start()))
        parts.append(chr(int(m.group(1) or m.group(2), 16)))
        starts.append(m.start())
        pos = m.end()
    parts.append(text[pos:])
    starts.extend(range(pos, len(text) + 1))
    return "".join(parts), starts


def _b64_windows(secret: str) -> tuple[frozenset[str], tuple[str, ...]]:
    """Every B64_WIDTH-character window of the key's base64, at the three alignments a key inside
    longer encoded text can have (the last 4 characters of each depend on what follows: left out),
    and their anchors (_anchors)."""
    out: set[str] = set()
    anchors: set[str] = set()
    for k in range(3):
        enc = base64.b64encode(secret[k:].encode()).decode()[:-4]
        out.update(enc[i:i + B64_WIDTH] for i in range(len(enc) - B64_WIDTH + 1))
        anchors.update(_anchors(enc, B64_WIDTH))
    return frozenset(out), tuple(sorted(anchors))


def _anchors(s: str, width: int) -> list[str]:
    """Blocks of `s` at multiples of (width + 1) // 2: every `width`-character window of `s` holds one whole,
    so a text without any of them holds no window (a C-speed `in` per block rules most texts out)."""
    step = (width + 1) // 2
    return [s[i:i + step] for i in range(0, len(s) - step + 1, step)]
# `sk-or-v1-`, `sk-proj-`, `sk-`: the non-secret prefix a key's body follows.
_KEY_PREFIX = re.compile(r"^sk-(?:[A-Za-z0-9]{1,8}-){0,2}")


def key_body(key: str) -> str:
    """The key without whitespace around it and without its `sk-...-` prefix."""
    key = key.strip()
    prefix = _KEY_PREFIX.match(key)
    return key[prefix.end():] if prefix else key


def key_problem(key: str) -> str | None:
    """What makes `key` unusable in an Authorization header (never quoting it), or None."""
    for i, ch in enumerate(key):
        if ch == "\n" or ch == "\r":
            where = "ends with" if not key[i:].strip() else f"contains at character {i + 1}"
            return f"{where} a line break (a key pasted or read from a file with its newline?)"
        if ch.isspace():
            where = ("starts with" if not key[:i].strip() else "ends with" if not key[i:].strip()
                     else f"contains at character {i + 1}")
            return f"{where} whitespace (a key pasted with a space?)"
        if not ch.isprintable() or ord(ch) > 126:
            return (f"contains a control or non-ASCII character at character {i + 1} (an HTTP header carries "
                    f"printable ASCII only)")
    return None


class Redactor:
    def __init__(self, secret: str, *others: str) -> None:
        # Other keys of the run (the management key) are cut the same way, each in all its forms.
        self._others = [Redactor(o) for o in others if o and o.strip() and o.strip() != secret.strip()]
        secret = secret.strip()
        body = key_body(secret)
        width = min(PREFIX, len(body)) if len(body) >= MIN_NEEDLE else len(secret)
        self._width = width if width >= MIN_NEEDLE else 0
        self._windows: frozenset[str] = frozenset()
        self._runs: re.Pattern[str] | None = None
        # Upstream fields repeat (a provider's name, the model, "stop"): each short text is cut once.
        # `known` is that memo: a caller on a hot path looks a text up itself (`known.get(t) or redact(t)`)
        # and spends a call only on a text not seen yet.
        self.known: dict[str, str] = {}
        if not self._width:
            return
        chars = set(secret.lower()) | set(secret.upper())
        # Case folded one character to one, so positions in the folded text are positions in the text.
        self._fold = {ord(c): c.lower() for c in chars if len(c.lower()) == 1}
        folded = secret.translate(self._fold)
        self._windows = frozenset(folded[i:i + self._width] for i in range(len(folded) - self._width + 1))
        self._runs = re.compile("[" + re.escape("".join(sorted(chars))) + f"]{{{self._width},}}")
        self._anchors = tuple(dict.fromkeys(_anchors(folded, self._width)))
        # An ASCII key (every usable one: a header carries nothing else) is folded like str.lower() folds
        # its characters; lower() on a whole text may also fold others, or lengthen them (one character
        # to two), which only adds a match to the check below, never takes one away.
        self._lower = secret.isascii()
        self._b64, self._b64_anchors = _b64_windows(secret)
        # (no anchors, a key too short to have a base64 window: a pattern that never matches). It searches
        # the text as it is, in either alphabet (a `+` of an anchor also matches `-`, a `/` also `_`): no
        # copy of the text in the standard alphabet first.
        self._b64_any = re.compile("|".join("".join(_EITHER_ALPHABET.get(c) or re.escape(c) for c in anchor)
                                            for anchor in self._b64_anchors) or r"(?!)")

    def __call__(self, text: str) -> str:
        short = len(text) <= MEMO_CHARS
        known = self.known
        if short and (done := known.get(text)) is not None:
            return done
        out = self._cut(text)
        if not out.isprintable():  # visible's first check, here: a printable text is shown as it is
            out = visible(out)
        if short:
            if len(known) >= MEMO_SIZE:
                known.clear()
            known[text] = out
        return out

    def _cut(self, text: str) -> str:
        for other in self._others:
            text = other(text)
        if self._runs is None:
            return text
        if "\\" in text or "%" in text:  # escapes: matched on the decoded text, cut in the original
            decoded, starts = _decoded(text)
            spans = [[starts[a], starts[b]] for a, b in self._spans(decoded)] if self._may_hold(decoded) else []
        else:  # _may_hold, inline: every new upstream text comes here (a generation id per request)
            spans = []
            folded = text.lower() if self._lower else text.translate(self._fold)
            for anchor in self._anchors:
                if anchor in folded:
                    spans = self._spans(text)
                    break
        if self._b64_any.search(text) is not None:  # an anchor of the key's base64, either alphabet
            spans += self._b64_spans(text)
        if not spans:
            return text
        spans = _merged(spans)
        out, pos = [], 0
        for a, b in spans:
            out.append(text[pos:a])
            out.append(MARK)
            pos = b
        out.append(text[pos:])
        return "".join(out)

    def _may_hold(self, text: str) -> bool:
        """False when `text` (case folded) holds none of the key's anchors, so no window of it. Runs on
        every unique upstream text (a generation id per request): lower() and a loop, not translate()."""
        folded = text.lower() if self._lower else text.translate(self._fold)
        for a in self._anchors:
            if a in folded:
                return True
        return False

    def _spans(self, text: str) -> list[list[int]]:
        """The stretches of `text` that hold a window of the key (case folded), in order, merged."""
        assert self._runs is not None
        spans: list[list[int]] = []
        w = self._width
        for run in self._runs.finditer(text):
            start = run.start()
            folded = run.group().translate(self._fold)
            for i in range(len(folded) - w + 1):
                if folded[i:i + w] in self._windows:
                    a, b = start + i, start + i + w
                    if spans and a <= spans[-1][1]:
                        spans[-1][1] = b
                    else:
                        spans.append([a, b])
        return spans

    def _b64_spans(self, text: str) -> list[list[int]]:
        """The stretches of `text` that hold a window of the key's base64 (standard or URL-safe)."""
        spans: list[list[int]] = []
        w = B64_WIDTH
        for run in _B64_RUNS.finditer(text):
            start, chunk = run.start(), run.group().translate(_B64_STANDARD)
            for i in range(len(chunk) - w + 1):
                if chunk[i:i + w] in self._b64:
                    spans.append([start + i, start + i + w])
        return spans

    def deep(self, value: Any) -> Any:
        """`value` with every string in it redacted (dict keys included), through lists and dicts: an
        error's metadata, a generation record."""
        if isinstance(value, str):
            return self(value)
        if isinstance(value, dict):
            return {self(k) if isinstance(k, str) else k: self.deep(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.deep(v) for v in value]
        return value


def _merged(spans: list[list[int]]) -> list[list[int]]:
    """Spans sorted, overlapping or touching ones joined."""
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out
