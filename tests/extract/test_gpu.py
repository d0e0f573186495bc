"""GpuMonitor against a fake NVML (the one thing that cannot exist here) and against the real, GPU-less one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from draftgen.core.extract.gpu import GpuMonitor, card_memory, visible_devices
from draftgen.core.live.snapshot import GpuStat


class NVMLError(Exception):
    pass


class FakeNvml:
    """The slice of pynvml's API GpuMonitor uses, with two H200s; GPU 1 cannot report power."""

    NVMLError = NVMLError
    NVML_TEMPERATURE_GPU = 0

    def __init__(self) -> None:
        self.init_calls = 0
        self.shutdown_calls = 0
        self.gpus = [
            dict(name=b"NVIDIA H200", util=97, used=120_000 * 2**20, total=143_771 * 2**20, power=612_345, temp=71,
                 uuid="GPU-5f1c0a2e-0000-0000-0000-000000000000"),
            dict(name="NVIDIA H200", util=3, used=512 * 2**20, total=143_771 * 2**20, power=None, temp=38,
                 uuid="GPU-9a7b3c4d-1111-1111-1111-111111111111"),
        ]

    def nvmlInit(self) -> None:
        self.init_calls += 1

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> dict:
        return self.gpus[i]

    def nvmlDeviceGetName(self, h: dict) -> str | bytes:
        return h["name"]

    def nvmlDeviceGetUUID(self, h: dict) -> str:
        return h["uuid"]

    def nvmlDeviceGetUtilizationRates(self, h: dict) -> SimpleNamespace:
        return SimpleNamespace(gpu=h["util"], memory=0)

    def nvmlDeviceGetMemoryInfo(self, h: dict) -> SimpleNamespace:
        return SimpleNamespace(used=h["used"], total=h["total"], free=h["total"] - h["used"])

    def nvmlDeviceGetPowerUsage(self, h: dict) -> int:
        if h["power"] is None:
            raise NVMLError("Not Supported")
        return h["power"]

    def nvmlDeviceGetTemperature(self, h: dict, kind: int) -> int:
        assert kind == self.NVML_TEMPERATURE_GPU
        return h["temp"]


def test_two_gpus_give_their_values() -> None:
    nvml = FakeNvml()
    stats = GpuMonitor(nvml=nvml, env={}).sample()
    assert stats == (
        GpuStat(index=0, name="NVIDIA H200", util_pct=97.0, mem_used_mb=120_000.0, mem_total_mb=143_771.0,
                power_w=612.345, temp_c=71.0, physical=0),
        GpuStat(index=1, name="NVIDIA H200", util_pct=3.0, mem_used_mb=512.0, mem_total_mb=143_771.0,
                power_w=None, temp_c=38.0, physical=1),
    )
    assert nvml.init_calls == 1


def test_nvml_initialised_once_and_shut_down() -> None:
    nvml = FakeNvml()
    monitor = GpuMonitor(nvml=nvml, env={})
    monitor.sample()
    monitor.sample()
    monitor.close()
    assert (nvml.init_calls, nvml.shutdown_calls) == (1, 1)


def test_no_nvml_library_gives_none() -> None:
    # The real nvidia-ml-py on this GPU-less machine: the NVML shared library is not there.
    assert GpuMonitor().sample() is None


def test_init_failure_gives_none() -> None:
    class NoDriver(FakeNvml):
        def nvmlInit(self) -> None:
            raise NVMLError("Driver Not Loaded")

    assert GpuMonitor(nvml=NoDriver()).sample() is None


def test_one_devices_error_shows_on_its_row_and_the_others_keep_theirs() -> None:
    class Lost(FakeNvml):
        def nvmlDeviceGetMemoryInfo(self, h: dict) -> SimpleNamespace:
            if h["util"] == 3:
                raise NVMLError("GPU is lost")
            return super().nvmlDeviceGetMemoryInfo(h)

    stats = GpuMonitor(nvml=Lost(), env={}).sample()
    assert stats is not None and len(stats) == 2
    assert stats[0].error is None and stats[0].util_pct == 97.0 and stats[0].mem_total_mb == 143_771.0
    assert stats[1].error == "GPU is lost" and stats[1].index == 1 and stats[1].name == "NVIDIA H200"


def test_count_failure_gives_none() -> None:
    class Gone(FakeNvml):
        def nvmlDeviceGetCount(self) -> int:
            raise NVMLError("Driver Not Loaded")

    assert GpuMonitor(nvml=Gone(), env={}).sample() is None


@pytest.mark.parametrize(("spec", "expected"), [
    ("1", [1]),                       # cuda:0 is physical GPU 1
    ("1,0", [1, 0]),                  # CUDA's order, not NVML's
    ("GPU-9a7b", [1]),                # a unique UUID prefix
    ("GPU-9a7b3c4d-1111-1111-1111-111111111111,0", [1, 0]),
    ("0,7,1", [0]),                   # CUDA stops at the first entry it cannot use
    ("0,0", [0]),                     # a repeat ends the list too
    ("", []),
    ("-1", []),
    ("MIG-1234", []),
])
def test_visible_devices_follow_cuda_visible_devices(spec: str, expected: list[int]) -> None:
    assert visible_devices(FakeNvml(), {"CUDA_VISIBLE_DEVICES": spec}) == expected


def test_panel_rows_are_the_visible_devices_numbered_as_cuda_numbers_them() -> None:
    stats = GpuMonitor(nvml=FakeNvml(), env={"CUDA_VISIBLE_DEVICES": "1"}).sample()
    assert stats is not None and len(stats) == 1
    assert (stats[0].index, stats[0].physical, stats[0].util_pct, stats[0].power_w) == (0, 1, 3.0, None)


def test_nothing_visible_gives_none() -> None:
    assert GpuMonitor(nvml=FakeNvml(), env={"CUDA_VISIBLE_DEVICES": ""}).sample() is None


def test_card_memory_reads_the_visible_cards() -> None:
    nvml = FakeNvml()
    cards, why = card_memory(nvml, {"CUDA_VISIBLE_DEVICES": "1,0"})
    assert why == "" and [(c.index, c.physical) for c in cards] == [(0, 1), (1, 0)]
    assert cards[0].total_bytes == 143_771 * 2**20 and cards[0].free_bytes == (143_771 - 512) * 2**20
    assert nvml.shutdown_calls == 1


def test_card_memory_without_nvml_says_why() -> None:
    class NoLib(FakeNvml):
        def nvmlInit(self) -> None:
            raise NVMLError("NVML Shared Library Not Found")

    cards, why = card_memory(NoLib(), {})
    assert cards == [] and "NVML not available" in why and "Library Not Found" in why


def test_zero_devices_gives_none() -> None:
    nvml = FakeNvml()
    nvml.gpus = []
    assert GpuMonitor(nvml=nvml, env={}).sample() is None


async def test_run_samples_until_cancelled() -> None:
    nvml = FakeNvml()
    seen: list[tuple[GpuStat, ...] | None] = []
    got_three = asyncio.Event()

    def callback(stats: tuple[GpuStat, ...] | None) -> None:
        seen.append(stats)
        if len(seen) == 3:
            got_three.set()

    task = asyncio.create_task(GpuMonitor(nvml=nvml, env={}).run(callback, interval_s=0.01))
    await asyncio.wait_for(got_three.wait(), timeout=10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert all(s is not None and len(s) == 2 for s in seen)
    assert nvml.shutdown_calls == 1


async def test_run_without_nvml_reports_none_once_and_ends() -> None:
    seen: list[object] = []

    async def callback(stats: object) -> None:
        seen.append(stats)

    await asyncio.wait_for(GpuMonitor().run(callback, interval_s=0.01), timeout=10)
    assert seen == [None]
