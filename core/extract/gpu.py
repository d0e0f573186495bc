"""GPU utilisation, memory, power and temperature through NVML (nvidia-ml-py), for the GPU panel.

`GpuMonitor.sample()` returns one `GpuStat` per GPU, or None where there is no GPU to show:
NVML's library is absent (no driver), it fails to initialise, or it reports no device. The
`nvml` module is injectable so tests can stand in for a GPU that does not exist here.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from draftgen.core.live.snapshot import GpuStat

log = logging.getLogger(__name__)

GpuCallback = Callable[[tuple[GpuStat, ...] | None], Awaitable[None] | None]


class GpuMonitor:
    def __init__(self, nvml: Any = None) -> None:
        self._nvml = nvml
        self._initialised: bool | None = None  # None: not tried yet
        self._lock = threading.Lock()  # sample() runs in worker threads; NVML init must happen once

    def _init(self) -> bool:
        if self._initialised is None:
            try:
                if self._nvml is None:
                    import pynvml
                    self._nvml = pynvml
                self._nvml.nvmlInit()
                self._initialised = True
            except Exception as e:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
                log.debug("NVML unavailable: %s", e)
                self._initialised = False
        return self._initialised

    def _optional(self, fn: Callable[..., float], *args: Any) -> float | None:
        """Power and temperature are unsupported on some boards: show them as unknown, not the GPU as gone."""
        try:
            return float(fn(*args))
        except Exception:
            return None

    def sample(self) -> tuple[GpuStat, ...] | None:
        with self._lock:
            if not self._init():
                return None
            nv = self._nvml
            try:
                stats = []
                for index in range(nv.nvmlDeviceGetCount()):
                    handle = nv.nvmlDeviceGetHandleByIndex(index)
                    name = nv.nvmlDeviceGetName(handle)
                    if isinstance(name, bytes):  # older nvidia-ml-py returns bytes
                        name = name.decode("utf-8", "replace")
                    memory = nv.nvmlDeviceGetMemoryInfo(handle)
                    temp_kind = getattr(nv, "NVML_TEMPERATURE_GPU", 0)
                    power_mw = self._optional(nv.nvmlDeviceGetPowerUsage, handle)
                    stats.append(GpuStat(
                        index=index, name=str(name),
                        util_pct=float(nv.nvmlDeviceGetUtilizationRates(handle).gpu),
                        mem_used_mb=memory.used / 2**20, mem_total_mb=memory.total / 2**20,
                        power_w=None if power_mw is None else power_mw / 1000.0,
                        temp_c=self._optional(nv.nvmlDeviceGetTemperature, handle, temp_kind),
                    ))
            except Exception as e:  # a GPU fell off the bus, the driver went away mid-run
                log.debug("NVML query failed: %s", e)
                return None
            return tuple(stats) or None

    def close(self) -> None:
        with self._lock:
            if self._initialised:
                try:
                    self._nvml.nvmlShutdown()
                except Exception:
                    pass
            self._initialised = None

    async def run(self, callback: GpuCallback, interval_s: float = 1.0) -> None:
        """Sample every `interval_s` and hand each result to `callback` until cancelled.

        NVML calls block (tens of ms on a busy 8-GPU box), so they run in a thread, never on the
        loop. Without NVML the callback gets one None and the loop ends: there is nothing to poll.
        """
        try:
            while True:
                stats = await asyncio.to_thread(self.sample)
                result = callback(stats)
                if inspect.isawaitable(result):
                    await result
                if stats is None and self._initialised is False:
                    return
                await asyncio.sleep(interval_s)
        finally:
            await asyncio.to_thread(self.close)
