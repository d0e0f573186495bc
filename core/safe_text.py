"""Text from outside (a server, a dataset, a file) made safe for a terminal or a log.

A provider's name, a model, an error message or a line read back from a file may carry control
characters: escape sequences (`ESC [2J` wipes the screen, `ESC ]0;` sets the window title, OSC 52
writes the clipboard, OSC 8 makes a link), C1 controls (`\\x9b` is a CSI on its own), a bare `\\r` or
`\\b` that writes over what was printed, BEL. `visible` shows each as a visible escape (`\\x1b`), so
the text reads as it was sent and nothing in it reaches a terminal as a command. The Unicode bidi
embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069) are shown so too (`\\u202e`): they
reorder what follows them on screen, so `moonshotai/\\u202e5.2k-imik` would show as another name (the
Trojan Source trick). Ordinary Unicode (CJK, Arabic, emoji) is kept, and so are the zero-width
characters (U+200B-U+200F, U+FEFF: the joiners of emoji sequences and of Persian words, the plain
direction marks), newlines and tabs unless the text is shown on one line (a comment of a script or TOML
file draftgen writes: core/quoting.py).

Applied once, where outside text enters: the run's `Redactor` (core/secrets.py) returns its text
through it, and every field an upstream sends besides the answer's text, every error and every event
passes through the Redactor. The commands that print what a file holds (`tokens`, `merge`, `report`,
`ledger`) apply it to what they read. The stored answers keep their text as generated (JSON escapes it).
"""

from __future__ import annotations

import re

# C0 controls but newline and tab, DEL, C1 controls, the bidi embeddings, overrides and isolates, lone
# surrogates (the bytes of a file name that is not UTF-8: they cannot be written as UTF-8).
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
# On one line (a `# ...` comment of a script or a TOML file): newline, tab and the Unicode line and
# paragraph separators too, so nothing after them starts a line of its own.
_CONTROLS_ONE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _shown(m: re.Match[str]) -> str:
    c = m.group()
    code = ord(c)
    return _NAMED.get(c) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def visible(text: str, *, one_line: bool = False) -> str:
    """`text` with each control character and bidi override shown as an escape (`\\x1b`, `\\r`,
    `\\u202e`); newlines and tabs kept unless `one_line`. Text without any (nearly all) is returned as is
    after one regex search, or none: a printable text (str.isprintable, a third of a search's cost) holds
    none of them (controls, bidi formats, separators and surrogates are not printable)."""
    if text.isprintable():
        return text
    controls = _CONTROLS_ONE_LINE if one_line else _CONTROLS
    if controls.search(text) is None:
        return text
    return controls.sub(_shown, text)
