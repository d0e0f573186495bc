"""Errors a user can hit and act on: caught once at the command boundary, printed without a traceback."""

from __future__ import annotations


class DraftgenError(Exception):
    """An error with a message a user can act on (names the file, key or line and what is wrong)."""


class ConfigError(DraftgenError):
    pass


class PromptFileError(DraftgenError):
    pass


class NoPromptError(PromptFileError):
    """A prompt file read to its end without one usable prompt (empty, a JSON array, ...)."""


class TokenizerError(DraftgenError):
    pass


class DiskError(DraftgenError):
    """A write failed (full disk, read-only disk, file too large); names the path."""


class LedgerBusyError(DraftgenError):
    """Another process has the run directory's spend ledger open (a run, a smoke test, `draftgen
    ledger`): two writers would each keep the ceiling against half the spend."""


# Exit status of a run whose API key was refused (401), at start or mid-run: distinct from 2 (bad
# config or input) and 3 (incomplete) so that a script can tell "fix the key" apart.
EXIT_KEY_REFUSED = 4


class KeyRefusedError(DraftgenError):
    """The service refused the API key (401): missing, invalid or revoked."""
    exit_code = EXIT_KEY_REFUSED


class UnreachableError(DraftgenError):
    """The API at base_url cannot be reached at all."""
