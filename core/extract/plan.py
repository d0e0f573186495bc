"""What an extraction will do, before any weights load, and the free-space watch while it runs.

`make_plan()` reads only `merged/tokens/index.jsonl`, the files already in `hidden_states/`, the
model's config.json (only when something is left to do: it gives H) and earlier stats files (the
measured rate). `draftgen extract CONFIG --plan` prints it and exits; `extract` prints it first
and exits without loading the model when nothing is left to do.

`DiskWatch.wait_for()` runs before each batch: while free space is below the batch's bytes plus
`extract.min_free_gb`, the run pauses, says so, and re-checks every few seconds (a stop request
ends the wait). Under torchrun only the writer waits; the other ranks wait inside the next
collective, which times out after specforge_backend.DIST_TIMEOUT_MIN minutes.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from draftgen.core.config import Config
from draftgen.core.errors import DraftgenError
from draftgen.core.units import compact_duration, fmt_bytes, fmt_count

# torch.save's zip container per file, and ids + mask as int64 (must match runner.bytes_needed).
FILE_OVERHEAD_BYTES = 4096
IDS_MASK_BYTES_PER_TOKEN = 16
# gzip level 1 on bf16 activations, when no .gz file of this run is on disk to measure: a guess.
ASSUMED_GZ_RATIO = 0.85
DISK_RECHECK_S = 5.0


def state_bytes(tokens: int, files: int, hidden_size: int) -> int:
    """(3H + H)·2 bytes of bf16 states per token, plus the ids, the mask and each file's container."""
    return tokens * (4 * hidden_size * 2 + IDS_MASK_BYTES_PER_TOKEN) + files * FILE_OVERHEAD_BYTES


@dataclass
class ShardPlan:
    index: int
    count: int
    samples: int = 0
    done: int = 0           # files already on disk
    todo: int = 0
    tokens_todo: int = 0
    bytes_bf16: int = 0
    bytes_gz: int = 0


@dataclass
class Plan:
    shards: list[ShardPlan]
    mine: int                      # which of `shards` this machine runs
    hidden_size: int | None        # None when nothing is left to do (the model config was not read)
    free_bytes: int
    root: Path
    rate: float | None             # tokens/s
    rate_source: str
    gz_ratio: float
    gz_source: str
    compress: bool
    notes: list[str] = field(default_factory=list)

    @property
    def this(self) -> ShardPlan:
        return self.shards[self.mine]

    @property
    def nothing_to_do(self) -> bool:
        return self.this.todo == 0


def _earlier_rate(root: Path) -> tuple[float | None, str]:
    """The newest tokens/s an earlier run of this folder measured (stats*.json)."""
    best: tuple[float, float, str] | None = None
    for path in root.glob("stats*.json"):
        try:
            rate = float(json.loads(path.read_text(encoding="utf-8")).get("tokens_per_s") or 0)
            mtime = path.stat().st_mtime
        except (OSError, ValueError, AttributeError, TypeError):
            continue
        if rate > 0 and (best is None or mtime > best[0]):
            best = (mtime, rate, path.name)
    return (best[1], f"measured, {best[2]}") if best else (None, "")


def make_plan(config: Config, shard: tuple[int, int], *, free_space: Callable[[Path], int] | None = None) -> Plan:
    """The plan of every shard of `shard`'s N; the model config is read only if this shard has work."""
    from draftgen.core.extract import layout
    from draftgen.core.extract.model_info import read_model_dims
    from draftgen.core.rundir import RunDir
    from draftgen.core.tokens.store import INDEX_FILE, TokenReader
    cfg = config.extract
    rundir = RunDir(config.run_dir)
    tokens_dir = rundir.merged / "tokens"
    if not (tokens_dir / INDEX_FILE).exists():
        raise DraftgenError(f"{tokens_dir / INDEX_FILE}: not found; run `draftgen merge` first")
    reader = TokenReader(tokens_dir)
    root = rundir.hidden_states
    i, n = shard
    shards = [ShardPlan(j, n) for j in range(n)]
    gz_bytes = gz_tokens = gz_files = 0
    todo_lengths: list[list[int]] = [[] for _ in range(n)]
    for k, entry in enumerate(reader.entries):
        s = shards[k % n]
        s.samples += 1
        path = layout.existing_sample(root, k)
        if path is None:
            s.todo += 1
            s.tokens_todo += entry.length
            todo_lengths[k % n].append(entry.length)
        else:
            s.done += 1
            if path.name.endswith(".gz"):
                try:
                    gz_bytes += path.stat().st_size
                    gz_tokens += entry.length
                    gz_files += 1
                except OSError:
                    pass
    hidden = None
    notes: list[str] = []
    if shards[i].todo:
        hidden = read_model_dims(cfg.model, trust_remote_code=cfg.trust_remote_code).hidden_size
    gz_ratio, gz_source = ASSUMED_GZ_RATIO, "assumed"
    if hidden is not None and gz_files:
        gz_ratio = gz_bytes / max(state_bytes(gz_tokens, gz_files, hidden), 1)
        gz_source = f"measured on {gz_files:,} files"
    for s in shards:
        if hidden is not None:
            s.bytes_bf16 = state_bytes(s.tokens_todo, s.todo, hidden)
            s.bytes_gz = int(s.bytes_bf16 * gz_ratio)
    where = root if root.exists() else next((p for p in root.parents if p.exists()), Path("/"))
    free = (free_space or (lambda p: shutil.disk_usage(p).free))(where)
    rate, source = _earlier_rate(root) if root.is_dir() else (None, "")
    if rate is None and cfg.tokens_per_s > 0:
        rate, source = cfg.tokens_per_s, "extract.tokens_per_s"
    return Plan(shards=shards, mine=i, hidden_size=hidden, free_bytes=free, root=root, rate=rate,
                rate_source=source, gz_ratio=gz_ratio, gz_source=gz_source, compress=cfg.compress, notes=notes)


def format_plan(plan: Plan) -> list[str]:
    """The plan as lines: one per shard (this machine's marked), then free space and the verdict."""
    h = f"H={plan.hidden_size}" if plan.hidden_size else "H not read (nothing to do here)"
    lines = [f"extract plan for {plan.root} ({h}; bytes are bf16 states + ids + mask; gz ratio "
             f"{plan.gz_ratio:.2f}, {plan.gz_source}; rate "
             + (f"{fmt_count(plan.rate)} tok/s, {plan.rate_source})" if plan.rate
                else "unknown: set extract.tokens_per_s)")]
    lines.append(f"  {'shard':>9}  {'samples':>9}  {'done':>9}  {'to do':>9}  {'tokens':>8}  {'bf16':>9}  "
                 f"{'gz est.':>9}  {'time':>7}")
    for s in plan.shards:
        sized = plan.hidden_size is not None
        time_s = s.tokens_todo / plan.rate if plan.rate and s.todo else (0.0 if not s.todo else None)
        mark = "*" if s.index == plan.mine else " "
        lines.append(f"{mark} {f'{s.index}/{s.count}':>9}  {s.samples:>9,}  {s.done:>9,}  {s.todo:>9,}  "
                     f"{fmt_count(s.tokens_todo):>8}  {fmt_bytes(s.bytes_bf16) if sized else '?':>9}  "
                     f"{fmt_bytes(s.bytes_gz) if sized else '?':>9}  {compact_duration(time_s):>7}")
    this = plan.this
    need = this.bytes_gz if plan.compress else this.bytes_bf16
    if plan.nothing_to_do:
        lines.append(f"shard {this.index}/{this.count}: nothing to do ({this.done:,} of {this.samples:,} files "
                     f"already written); the model is not loaded")
    else:
        verdict = "enough" if need <= plan.free_bytes else "NOT ENOUGH"
        lines.append(f"shard {this.index}/{this.count} (*) writes ~{fmt_bytes(need)} "
                     f"({'gz' if plan.compress else 'bf16'}); {fmt_bytes(plan.free_bytes)} free there: {verdict}")
    return lines + plan.notes


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
