"""Fixtures shared by several test files. Builders that tests call as functions (configs, prompt
files, waiting for a condition) are in tests/helpers.py; the TUI's snapshot fixtures in
tests/fixtures.py; the pinned GPU releases' source (downloaded once per cache, never installed)
in tests/pinned.py."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from draftgen.core import runtime
from draftgen.core.tokens import tokenizer as tokmod
from tests.pinned import pinned_source

# Torch's CPU threads spin against each other on a busy 2-core machine (the CPU self-check took 22 s
# instead of 12): one each, here and in every subprocess; an OMP_NUM_THREADS set by hand wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The async tests run on the loop the commands run on (core/runtime.py: uvloop where installed); the
# policy is how pytest-asyncio is told which loop to make without renaming every test.
if runtime.loop_factory() is not None:
    import uvloop
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


@pytest.fixture
def utc() -> Iterator[None]:
    """Event times are wall-clock: pin the zone so rendered texts compare the same everywhere."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TZ", "UTC")
        time.tzset()
        yield
    time.tzset()


@pytest.fixture
def fresh_tokenizers() -> Iterator[None]:
    """No tokenizer loaded by an earlier test (they are cached by path) stands in for this test's."""
    tokmod._load_cached.cache_clear()
    yield
    tokmod._load_cached.cache_clear()


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
def speculators_pythonpath(request: pytest.FixtureRequest) -> str:
    """PYTHONPATH of the unpacked speculators 0.9.0 and hs-connectors 0.9.0 wheels (tests/pinned.py)."""
    from tests.pinned import speculators_path
    return speculators_path(_cache(request))


@pytest.fixture(scope="session")
def sglang_tree(request: pytest.FixtureRequest) -> Path:
    return pinned_source("sglang", _cache(request))
