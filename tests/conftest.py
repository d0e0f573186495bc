"""Session fixtures: the pinned GPU releases' source (downloaded once per pytest cache, never installed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.pinned import pinned_source


@pytest.fixture(scope="session")
def specforge_tree(request: pytest.FixtureRequest) -> Path:
    """The unpacked SpecForge wheel the `gpu` extra pins: its pure-python reader runs from here."""
    return pinned_source("specforge", Path(request.config.cache.mkdir("pinned-releases")))


@pytest.fixture(scope="session")
def sglang_tree(request: pytest.FixtureRequest) -> Path:
    return pinned_source("sglang", Path(request.config.cache.mkdir("pinned-releases")))
