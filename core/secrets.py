"""Keeping the API key out of everything draftgen writes or prints."""

from __future__ import annotations

# Providers sometimes echo part of a key in an error; its first 12 characters are enough to leak it.
PREFIX = 12


class Redactor:
    def __init__(self, secret: str) -> None:
        self._needles = [s for s in {secret, secret[:PREFIX]} if len(s) >= 6]
        self._needles.sort(key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for needle in self._needles:
            if needle in text:
                text = text.replace(needle, "[redacted]")
        return text
