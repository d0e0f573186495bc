"""Keeping the API key out of everything draftgen writes or prints.

Providers quote keys back in every shape: whole, without the `sk-or-v1-` prefix, upper- or
lower-cased, or a fragment. `Redactor` cuts out any stretch of text that contains a 12-character
window of the key (compared without case), so every such form is caught, as one `[redacted]` per
stretch. It runs on error messages and events, not on answers; a compiled regex finds the runs of
the key's own characters first, so text without a long run of them costs one C-speed scan.
"""

from __future__ import annotations

import re

# Providers sometimes echo part of a key in an error; 12 of its characters are enough to leak it.
PREFIX = 12
# Shorter than this, a "key" (a test or demo placeholder) is too common a string to cut out of text.
MIN_NEEDLE = 6
MARK = "[redacted]"
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
        if not self._width:
            return
        chars = set(secret.lower()) | set(secret.upper())
        # Case folded one character to one, so positions in the folded text are positions in the text.
        self._fold = {ord(c): c.lower() for c in chars if len(c.lower()) == 1}
        folded = secret.translate(self._fold)
        self._windows = frozenset(folded[i:i + self._width] for i in range(len(folded) - self._width + 1))
        self._runs = re.compile("[" + re.escape("".join(sorted(chars))) + f"]{{{self._width},}}")

    def __call__(self, text: str) -> str:
        for other in self._others:
            text = other(text)
        if self._runs is None:
            return text
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
        if not spans:
            return text
        out, pos = [], 0
        for a, b in spans:
            out.append(text[pos:a])
            out.append(MARK)
            pos = b
        out.append(text[pos:])
        return "".join(out)
