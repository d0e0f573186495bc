"""GPU utilisation, memory, power and temperature through NVML (nvidia-ml-py), for the GPU panel and the GPU plan.

`GpuMonitor.sample()` returns one `GpuStat` per GPU this process may use, or None where there is no
GPU to show: NVML's library is absent (no driver), it fails to initialise, or it reports no device.
One device whose query fails gets a row with its error; the others keep theirs.

NVML numbers GPUs physically (PCI order); CUDA numbers those CUDA_VISIBLE_DEVICES lists, in its
order, by index or by UUID (`GPU-…`, a unique prefix is enough), up to the first entry it cannot
use. `visible_devices()` applies the same rule, so `GpuStat.index` is the `cuda:N` of this process
and `GpuStat.physical` the NVML index. `card_memory()` gives the GPU plan (gpu_plan.py) the cards' total
and free memory the same way. The `nvml` module is injectable so tests can stand in for a GPU that
does not exist here.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from draftgen.core.live.snapshot import GpuStat

log = logging.getLogger(__name__)

GpuCallback = Callable[[tuple[GpuStat, ...] | None], Awaitable[None] | None]


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _by_uuid(nv: Any, count: int, wanted: str) -> int | None:
    """The NVML index whose UUID `wanted` names (whole or a unique prefix, with or without "GPU-")."""
    key = wanted.lower().removeprefix("gpu-")
    found = []
    for index in range(count):
        try:
            uuid = _text(nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(index))).lower().removeprefix("gpu-")
        except Exception:
            continue
        if uuid.startswith(key):
            found.append(index)
    return found[0] if len(found) == 1 else None


def visible_devices(nv: Any, env: Mapping[str, str] | None = None) -> list[int]:
    """NVML indices of the GPUs CUDA shows this process, in CUDA's order (`cuda:0` first).

    CUDA_VISIBLE_DEVICES unset: every device. Set: its entries (indices, or GPU UUIDs) up to the first
    it cannot use (out of range, unknown, repeated; MIG instances are not listed here), as CUDA does.
    """
    count = int(nv.nvmlDeviceGetCount())
    spec = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return list(range(count))
    out: list[int] = []
    for item in (part.strip() for part in spec.split(",")):
        if item.lstrip("-").isdigit():
            index: int | None = int(item) if 0 <= int(item) < count else None
        elif item.lower().startswith("gpu-"):
            index = _by_uuid(nv, count, item)
        else:
            index = None
        if index is None or index in out:
            break
        out.append(index)
    return out


@dataclass(frozen=True)
class Card:
    """One GPU this process may use: CUDA's index, NVML's, and its memory in bytes."""
    index: int
    physical: int
    name: str
    total_bytes: int
    free_bytes: int


def card_memory(nvml: Any = None, env: Mapping[str, str] | None = None) -> tuple[list[Card], str]:
    """The visible cards' memory, and "" or why there is none to read (no NVML, no driver, a failed query)."""
    try:
        if nvml is None:
            import pynvml
            nvml = pynvml
        nvml.nvmlInit()
    except Exception as e:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        return [], f"NVML not available ({e or type(e).__name__})"
    try:
        cards = []
        for cuda_index, physical in enumerate(visible_devices(nvml, env)):
            handle = nvml.nvmlDeviceGetHandleByIndex(physical)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            cards.append(Card(cuda_index, physical, _text(nvml.nvmlDeviceGetName(handle)),
                              int(memory.total), int(memory.free)))
        return cards, "" if cards else "NVML lists no GPU visible to this process (CUDA_VISIBLE_DEVICES?)"
    except Exception as e:
        return [], f"NVML query failed: {e or type(e).__name__}"
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


class GpuMonitor:
    def __init__(self, nvml: Any = None, env: Mapping[str, str] | None = None) -> None:
        self._nvml = nvml
        self._env = env
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
                devices = visible_devices(nv, self._env)
            except Exception as e:  # the driver went away mid-run
                log.debug("NVML query failed: %s", e)
                return None
            return tuple(self._device(cuda_index, physical) for cuda_index, physical in enumerate(devices)) or None

    def _device(self, cuda_index: int, physical: int) -> GpuStat:
        """One device's row; a query that fails (a GPU fallen off the bus) gives its error on that row only."""
        nv = self._nvml
        name = f"GPU {physical}"
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(physical)
            name = _text(nv.nvmlDeviceGetName(handle))
            memory = nv.nvmlDeviceGetMemoryInfo(handle)
            util = float(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception as e:
            log.debug("NVML query of GPU %s failed: %s", physical, e)
            return GpuStat(index=cuda_index, name=name, util_pct=0.0, mem_used_mb=0.0, mem_total_mb=0.0,
                           power_w=None, temp_c=None, physical=physical, error=str(e) or type(e).__name__)
        temp_kind = getattr(nv, "NVML_TEMPERATURE_GPU", 0)
        return GpuStat(
            index=cuda_index, name=name, util_pct=util,
            mem_used_mb=memory.used / 2**20, mem_total_mb=memory.total / 2**20,
            power_w=self._optional(lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1000.0),
            temp_c=self._optional(lambda: float(nv.nvmlDeviceGetTemperature(handle, temp_kind))),
            physical=physical)

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
