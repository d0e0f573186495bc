"""`draftgen extract` served to `draftgen attach RUN_DIR`: the extract stage and the GPU panel, live.

Under torchrun only rank 0 serves (it plans, writes and reports). The attach server and the NVML
poll run on an event loop in a thread of their own, so the forwards never wait for a viewer; the
runner's progress callback only swaps in its latest StageProgress. When another draftgen process
already serves the run directory, extraction goes on unserved and says so.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from draftgen.core.config import Config
from draftgen.core.live.events import Event
from draftgen.core.live.snapshot import RunSnapshot, RunState, StageProgress, StageState
from draftgen.core.live.stage_payloads import ExtractDone
from draftgen.core.safe_text import visible


class ExtractPublisher:
    def __init__(self, config: Config, *, interval_s: float = 1.0, nvml: Any = None) -> None:
        self.config = config
        self.interval_s = interval_s
        self.nvml = nvml
        self.serving = False
        self.error = ""                     # why it is not serving, for one line of output
        self._latest = StageProgress("extract", state=StageState.RUNNING)
        self._stop = threading.Event()
        self._started = threading.Event()
        self._final: ExtractDone | None = None  # the closing event
        self._thread: threading.Thread | None = None

    def progress(self, p: StageProgress) -> None:
        self._latest = p

    def finish(self, done: ExtractDone) -> None:
        self._final = done

    def __enter__(self) -> ExtractPublisher:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name="extract-attach", daemon=True)
        self._thread.start()
        self._started.wait(timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _snapshot(self, seq: int, started: float, gpus: Any, state: RunState) -> RunSnapshot:
        """Extraction alone, no run around it: its state is its label, finished once extraction ended."""
        return RunSnapshot(run_name=visible(self.config.run_dir.name), model=self.config.extract.model, state=state,
                           elapsed_s=time.monotonic() - started, seq=seq, gpus=gpus, stages=(self._latest,),
                           label=str(state), finished=state != RunState.RUNNING)

    async def _serve(self) -> None:
        from draftgen.core.extract.gpu import GpuMonitor
        from draftgen.core.live.attach import AttachError, AttachServer
        from draftgen.core.live.hub import Hub
        from draftgen.core.rundir import RunDir
        hub = Hub()
        server = AttachServer(hub, RunDir(self.config.run_dir).socket)
        try:
            await server.start()
            self.serving = True
        except AttachError as e:
            self.error = str(e)
        finally:
            self._started.set()
        if not self.serving:
            return
        monitor = GpuMonitor(self.nvml)
        started = time.monotonic()
        seq = 0
        try:
            gpus = None
            while not self._stop.is_set():
                gpus = await asyncio.to_thread(monitor.sample)
                seq += 1
                hub.publish_snapshot(self._snapshot(seq, started, gpus, RunState.RUNNING))
                await asyncio.to_thread(self._stop.wait, self.interval_s)
            seq += 1
            done = self._latest.state == "done"
            hub.publish_snapshot(self._snapshot(seq, started, gpus, RunState.DONE if done else RunState.STOPPED))
            if self._final is not None:
                hub.publish_event(Event.of(self._final))
            await asyncio.sleep(0.05)  # let the viewers' pumps take the last items
        finally:
            await asyncio.to_thread(monitor.close)
            await server.close("extraction ended")
