"""GPU: utilisation, memory, power and temperature per GPU during extraction, or "no GPU".

Rows are the GPUs this process may use, numbered as CUDA numbers them (`0→3`: cuda:0 is NVML's GPU 3,
under CUDA_VISIBLE_DEVICES); a device whose NVML query failed shows the error on its own row."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from draftgen.core.live.snapshot import RunSnapshot, StageState
from draftgen.tui import fmt
from draftgen.tui.panels.panel import Panel


def _wanted(s: RunSnapshot) -> bool:
    extract = s.stage("extract")
    return s.gpus is not None or (extract is not None and extract.state != StageState.IDLE)


class GpuPanel(Panel):
    TITLE = "GPU"

    def key(self, s: RunSnapshot) -> Any:
        return (s.gpus, _wanted(s))

    def fit(self) -> Any:
        return self.short

    def shape(self, s: RunSnapshot) -> Any:
        return (_wanted(s), None if s.gpus is None else len(s.gpus))

    def wanted(self, s: RunSnapshot) -> bool:
        return _wanted(s)

    def draw(self, s: RunSnapshot) -> RenderableType:
        if not s.gpus:
            return Text("no GPU (NVML not available)", style="dim")
        # Short screens drop the header row: each cell carries its unit.
        table = Table(box=None, expand=True, padding=(0, 1, 0, 0), show_edge=False, header_style="bold",
                      show_header=not self.short)
        table.add_column("GPU", no_wrap=True, overflow="ellipsis", max_width=20)
        table.add_column("util", no_wrap=True, ratio=1, min_width=9)
        table.add_column("memory", justify="right", no_wrap=True)
        table.add_column("power", justify="right", no_wrap=True)
        table.add_column("temp", justify="right", no_wrap=True)
        errors: list[Text] = []
        for g in s.gpus:
            label = f"{g.index}" if g.physical in (None, g.index) else f"{g.index}→{g.physical}"
            if g.error is not None:  # this device alone: the others keep their rows; the message goes below
                table.add_row(Text(f"{label} {g.name.removeprefix('NVIDIA ')}"), Text("NVML error", style="red"),
                              "—", "—", "—")
                errors.append(Text(f"GPU {label}: NVML: {g.error}", style="red"))
                continue
            mem = f"{g.mem_used_mb / 1024:.0f}/{g.mem_total_mb / 1024:.0f} GiB"
            table.add_row(
                Text(f"{label} {g.name.removeprefix('NVIDIA ')}"),  # the driver's text, not Rich markup
                fmt.Bar(g.util_pct / 100, style="green", label=f"{g.util_pct:.0f}%".rjust(4), max_width=20),
                mem,
                "—" if g.power_w is None else f"{g.power_w:.0f} W",
                "—" if g.temp_c is None else f"{g.temp_c:.0f}°C",
            )
        return Group(table, *errors) if errors else table
