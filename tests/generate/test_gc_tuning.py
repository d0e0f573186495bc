"""The engine's garbage-collector settings (core/generate/limits.py tune_gc)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from draftgen.core.generate.api.limits import tune_gc


@pytest.fixture
def gc_settings() -> Iterator[None]:
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # Python's defaults: an engine test before may have tuned them
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


def test_the_objects_of_the_requests_in_flight_trigger_no_young_collection(gc_settings: None) -> None:
    # 2,000 requests in flight keep ~88 tracked containers each alive, aiohttp's included (coroutines,
    # lists, closure cells, bound methods, futures; counted with gc.get_objects(0) against the simulator):
    # a young generation smaller than that traverses all of them again (35-160 ms) as the run goes.
    tune_gc(2000)
    young: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 0:
            young.append(1)

    gc.collect()
    gc.callbacks.append(seen)
    try:
        alive = [[] for _ in range(2000 * 90)]
    finally:
        gc.callbacks.remove(seen)
    assert len(alive) == 180_000
    assert young == []


def test_a_small_run_keeps_the_default_young_generation(gc_settings: None) -> None:
    tune_gc(10)
    assert gc.get_threshold()[0] == 10_000
