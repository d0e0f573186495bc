"""Errors a user can hit and act on: caught once at the command boundary, printed without a traceback."""

from __future__ import annotations


class DraftgenError(Exception):
    """An error with a message a user can act on (names the file, key or line and what is wrong)."""


class ConfigError(DraftgenError):
    pass


class PromptFileError(DraftgenError):
    pass


class TokenizerError(DraftgenError):
    pass


class DiskError(DraftgenError):
    """A write failed (full disk, read-only disk, file too large); names the path."""
