"""A worker spec whose worker processes load the tokenizer only once a gate file exists: a worker that
is still starting, for as long as a test needs (the main process's own load is not gated). Its own
module so that a worker process imports little more than draftgen."""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass
from pathlib import Path

from draftgen.core.tokens.workers import WorkerSpec

GATE_GIVES_UP_S = 120.0  # a guard against a hang when a test fails: the worker then starts anyway


@dataclass(frozen=True)
class GatedSpec(WorkerSpec):
    gate: str = ""

    @classmethod
    def of(cls, spec: WorkerSpec, gate: Path) -> GatedSpec:
        return cls(**{**spec.__dict__, "gate": str(gate)})

    def load(self):  # type: ignore[no-untyped-def]
        if multiprocessing.parent_process() is not None:  # a worker process: wait for the gate
            deadline = time.monotonic() + GATE_GIVES_UP_S
            while not Path(self.gate).exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return super().load()


@dataclass(frozen=True)
class BrokenWorkerSpec(WorkerSpec):
    """Loads in the main process, never in a worker: a worker that cannot start at all."""

    @classmethod
    def of(cls, spec: WorkerSpec) -> BrokenWorkerSpec:
        return cls(**spec.__dict__)

    def load(self):  # type: ignore[no-untyped-def]
        if multiprocessing.parent_process() is not None:
            raise RuntimeError("this worker cannot start")
        return super().load()
