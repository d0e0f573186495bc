"""What extraction's files take on disk, and the room they need while a run writes them.

A token's bytes in a file (the states in the stored dtype, FP8's scale, the ids and the mask) and a
file's container; the disk budget (extract.max_disk_gb: the samples still to do that fit it, in merged
order); and the free-space watch: `DiskWatch.wait_for()` runs before each batch: while free space is
below the batch's bytes plus `extract.min_free_gb`, the run pauses, says so, and re-checks every few
seconds (a stop request ends the wait). Under torchrun only the writer waits; the other ranks wait
inside the next collective, which times out after specforge_backend.DIST_TIMEOUT_MIN minutes.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftgen.core.units import fmt_bytes

# torch.save's zip container per file, and ids + mask as int64.
FILE_OVERHEAD_BYTES = 4096
IDS_MASK_BYTES_PER_TOKEN = 16
DISK_RECHECK_S = 5.0

# Bytes a stored hidden-state element takes, and the bytes of scale each token adds: fp8 (float8_e4m3fn)
# carries one float32 scale per token over all its layers (speculators' FP8 layout).
STATE_DTYPES = {"bf16": (2, 0), "float32": (4, 0), "fp8": (1, 4)}


def stored_dtype(cfg: Any) -> str:
    """The dtype the files store: fp8 when [extract] dtype says so, else bf16 (a float32 forward is stored bf16)."""
    return "fp8" if getattr(cfg, "dtype", "") == "fp8" else "bf16"


def token_bytes(hidden_size: int, layers: int = 3, dtype: str = "bf16") -> int:
    """One token's bytes in a file: (layers + 1)·H states (the aux layers and the last layer's), the scale
    (fp8), the ids and the mask."""
    element, scale = STATE_DTYPES[dtype]
    return (layers + 1) * hidden_size * element + scale + IDS_MASK_BYTES_PER_TOKEN


def state_bytes(tokens: int, files: int, hidden_size: int, layers: int = 3, dtype: str = "bf16") -> int:
    """(layers + 1)·H states per token in `dtype` (STATE_DTYPES), plus the ids, the mask and each file's container."""
    return tokens * token_bytes(hidden_size, layers, dtype) + files * FILE_OVERHEAD_BYTES


def disk_budget(root: Path, indices: Sequence[int], lengths: Sequence[int], todo: Sequence[int], budget_bytes: int,
                per_sample: Callable[[int], int], fmt: str = "specforge") -> tuple[list[int], list[int], int]:
    """(the samples of `todo` that fit, those left for a later run, the bytes already on disk) under a budget.

    `indices` are the shard's samples, `lengths` every sample's tokens; what the shard's files already take
    on disk is counted first, then `todo` in merged order while each sample's estimate (`per_sample(tokens)`)
    still fits; the first that does not ends it (merged order kept: a later run resumes where this one stopped).
    `fmt` is extract.format, whose files are counted.
    """
    from draftgen.core.extract.speculators_layout import existing_file
    used = 0
    for k in indices:
        path = existing_file(fmt, root, k)  # `fmt`: extract.format (speculators: hs_{k})
        if path is not None:
            try:
                used += path.stat().st_size
            except OSError:
                pass
    room = budget_bytes - used
    fits: list[int] = []
    for n, k in enumerate(todo):
        need = per_sample(lengths[k])
        if need > room:
            return fits, list(todo[n:]), used
        room -= need
        fits.append(k)
    return fits, [], used


def bytes_needed(tokens: int, files: int, hidden_size: int, layers: int = 3, dtype: str = "bf16") -> int:
    """What `tokens` tokens in `files` files need on disk (state_bytes): what the runner checks free space and
    extract.max_disk_gb against."""
    return state_bytes(tokens, files, hidden_size, layers, dtype)


@dataclass
class DiskWatch:
    """Before each batch: pause while free space < the batch's bytes + `margin_bytes`, re-checking every `recheck_s`."""
    margin_bytes: int = 2**30
    free_space: Callable[[Path], int] = field(default=lambda p: shutil.disk_usage(p).free)
    recheck_s: float = DISK_RECHECK_S
    say: Callable[[str], None] | None = None
    pauses: int = 0

    def wait_for(self, root: Path, need: int, stop: threading.Event | None = None,
                 log: Callable[[str], None] | None = None) -> bool:
        """Return True when there is room; False when `stop` was set while waiting."""
        announced = False
        while True:
            free = self.free_space(root)
            if free >= need + self.margin_bytes:
                if announced:
                    self._tell(f"extract: {fmt_bytes(free)} free on {root} again; resuming", log)
                return True
            if not announced:
                self.pauses += 1
                announced = True
                self._tell(f"extract: paused: {fmt_bytes(free)} free on {root}, the next batch needs "
                           f"{fmt_bytes(need)} + {fmt_bytes(self.margin_bytes)} margin (extract.min_free_gb); "
                           f"free some space; re-checking every {self.recheck_s:g}s (Ctrl-C stops)", log)
            if stop is not None:
                if stop.wait(self.recheck_s):
                    return False
            else:
                time.sleep(self.recheck_s)

    def _tell(self, message: str, log: Callable[[str], None] | None) -> None:
        if self.say is not None:
            self.say(message)
        if log is not None:
            log(message)
