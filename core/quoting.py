"""Values written into text another program reads: a shell script draftgen writes, a TOML comment.

A path, a model name or a config file's name may hold any character: a user's or a colleague's
config, a run directory named after a dataset. Written into a file that `sh` runs or a TOML
reader parses, each is either an argument, quoted (`sh_path`: read back verbatim, never taken for
an option), or part of a comment (`# ...` in both), which ends at the line's end: there it is
`one_line` (safe_text's `visible` on one line), every line break and control character shown as
its escape, so that the comment stays one line and nothing after it becomes a command or a key. A
backslash is kept as it is (a path may hold one): a comment is for reading, the arguments are what
runs.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from draftgen.core.safe_text import visible


def one_line(text: str) -> str:
    """`text` on one line, for a comment: line breaks and control characters as escapes (`\\n`,
    `\\x1b`, `\\u2028`); everything else, other scripts and emoji included, as it is."""
    return visible(text, one_line=True)


def sh_path(path: str | Path) -> str:
    """`path` as one argument of a `sh` command line: quoted, and `./` before a relative path
    starting with `-`, so that the command reads it as a file, not an option."""
    text = str(path)
    return shlex.quote(f"./{text}" if text.startswith("-") else text)
