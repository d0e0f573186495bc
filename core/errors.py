"""Errors a user can hit and act on: caught once at the command boundary, printed without a traceback."""

from __future__ import annotations

import enum
from typing import ClassVar


class ExitCode(enum.IntEnum):
    """What `draftgen` exits with: the exit code table of docs/run-end.md (and `draftgen` alone lists them)."""
    COMPLETE = 0        # every prompt answered, failed for a reason of its own, or skipped by a token budget
    SMOKE_FAILED = 1    # the smoke test failed (`smoke`, or `run` without a passing smoke test)
    ERROR = 2           # a bad config or input file, a stage that failed, an internal error
    INCOMPLETE = 3      # DRAINED, STOPPED, WAITING or LIMITED, or answers spooled: run again to resume
    KEY_REFUSED = 4     # the API key was refused (401): distinct so that a script can tell "fix the key" apart
    INTERRUPTED = 130   # interrupted before the run started


class DraftgenError(Exception):
    """An error with a message a user can act on (names the file, key or line and what is wrong)."""
    exit_code: ClassVar[ExitCode] = ExitCode.ERROR


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


EXIT_KEY_REFUSED = ExitCode.KEY_REFUSED  # the older name, kept for callers


class KeyRefusedError(DraftgenError):
    """The service refused the API key (401): missing, invalid or revoked."""
    exit_code = ExitCode.KEY_REFUSED


class UnreachableError(DraftgenError):
    """The API at base_url cannot be reached at all."""
