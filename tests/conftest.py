"""Session fixtures: the pinned GPU releases' source (downloaded once per cache, never installed)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.pinned import pinned_source


def _cache(request: pytest.FixtureRequest) -> Path:
    """pytest's cache folder; a shared temp folder when the cache plugin is off (-p no:cacheprovider)."""
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("pinned-releases"))
    return Path(tempfile.gettempdir()) / "draftgen-pinned-releases"


@pytest.fixture(scope="session")
def specforge_tree(request: pytest.FixtureRequest) -> Path:
    """The unpacked SpecForge wheel the `gpu` extra pins: its pure-python reader runs from here."""
    return pinned_source("specforge", _cache(request))


@pytest.fixture(scope="session")
def sglang_tree(request: pytest.FixtureRequest) -> Path:
    return pinned_source("sglang", _cache(request))
