"""The simulator's error: a bad setting (a CLI flag, a control-endpoint patch, a scenario); the message names it.
Its own module, so that the settings (config.py) and the scenarios they name can both raise it."""

from __future__ import annotations

from draftgen.core.errors import DraftgenError


class SimulatorError(DraftgenError):
    """A bad simulator setting (CLI flag or control-endpoint patch); the message names it."""
