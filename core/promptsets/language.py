"""The language filter: a row's own language column when it has one, else the writing script.

Without a model to detect languages (the core install stays light), the fallback looks at the
letters of the prompt: each language code maps to a script, and a prompt passes when that script
carries the text. This tells English from Chinese, Russian or Arabic, not English from French
(both Latin): for that, use a dataset's language column (`language`, `lang` or `locale`).
- a Latin-script language passes when at least 90% of the letters are Latin (code and maths with
  a few Greek letters still pass; a Chinese prompt with English code in it does not);
- another script passes when at least 20% of the letters are in it (prompts mix in code and names).
Japanese is told from Chinese by its kana.
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from collections.abc import Mapping
from typing import Any

LANGUAGE_COLUMNS = ("language", "lang", "locale")

_SCRIPT_OF = {
    "zh": "han", "ja": "kana", "ko": "hangul", "ru": "cyrillic", "uk": "cyrillic", "bg": "cyrillic",
    "ar": "arabic", "fa": "arabic", "he": "hebrew", "el": "greek", "hi": "devanagari", "th": "thai",
}
_SCRIPT_PREFIXES = (("CJK", "han"), ("HIRAGANA", "kana"), ("KATAKANA", "kana"), ("HANGUL", "hangul"),
                    ("LATIN", "latin"), ("CYRILLIC", "cyrillic"), ("ARABIC", "arabic"), ("HEBREW", "hebrew"),
                    ("GREEK", "greek"), ("DEVANAGARI", "devanagari"), ("THAI", "thai"))


def script_of(language: str) -> str:
    """The script a language code is written in (anything not listed is taken as Latin)."""
    return _SCRIPT_OF.get(language.lower().split("-")[0].split("_")[0], "latin")


def scripts(text: str) -> Counter[str]:
    """Letters per script."""
    counts: Counter[str] = Counter()
    for ch in text:
        if not ch.isalpha():
            continue
        name = unicodedata.name(ch, "")
        counts[next((s for prefix, s in _SCRIPT_PREFIXES if name.startswith(prefix)), "other")] += 1
    return counts


def text_matches(text: str, languages: frozenset[str]) -> bool:
    counts = scripts(text)
    total = sum(counts.values())
    if total == 0:
        return True  # digits and symbols only: nothing says it is another language
    for lang in languages:
        script = script_of(lang)
        if script == "latin":
            if counts["latin"] >= 0.9 * total:
                return True
        elif script == "han":
            if counts["han"] >= 0.2 * total and counts["kana"] == 0:
                return True
        elif script == "kana":
            if counts["kana"] > 0 and counts["kana"] + counts["han"] >= 0.2 * total:
                return True
        elif counts[script] >= 0.2 * total:
            return True
    return False


def row_language(row: Mapping[str, Any]) -> str | None:
    for column in LANGUAGE_COLUMNS:
        value = row.get(column)
        if isinstance(value, str) and value.strip():
            return value.strip().lower()
    return None


def matches(row: Mapping[str, Any], text: str, languages: frozenset[str]) -> bool:
    """Whether a row (its language column, else its prompt text) is in one of `languages`."""
    declared = row_language(row)
    if declared is not None:
        base = declared.split("-")[0].split("_")[0]
        return declared in languages or base in languages
    return text_matches(text, languages)
