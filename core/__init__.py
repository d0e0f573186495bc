"""draftgen's library: everything but the views (tui/, headless/) and the commands (cli/)."""

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it from here)
