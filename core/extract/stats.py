"""One extraction run's counts: `ExtractStats` (what `hidden_states/stats.json` holds, one file per shard),
how they grow as the writer finishes each file (`account`), the progress the views read from them
(`ExtractReporter`), and the line that says what extract.max_disk_gb left undone (`budget_line`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftgen.core.config import Config
from draftgen.core.extract import speculators_layout as speculators
from draftgen.core.extract.writer import Written
from draftgen.core.live.progress import Throttle
from draftgen.core.live.snapshot import StageProgress, StageState
from draftgen.core.quoting import sh_path
from draftgen.core.rundir import EventLog
from draftgen.core.units import fmt_bytes, fmt_count


@dataclass
class ExtractStats:
    """What `hidden_states/stats.json` holds for one run (one shard)."""
    model: str
    backend: str
    num_layers: int
    hidden_size: int
    layers: tuple[int, ...]
    shard: tuple[int, int]
    compress: bool
    samples: int = 0              # in this shard
    tokens: int = 0               # in this shard
    skipped_existing: int = 0     # already on disk when the run started
    written: int = 0
    tokens_written: int = 0
    bytes_written: int = 0
    nan_samples: int = 0          # outputs held NaN or Inf: reported, not written
    nan: list[dict[str, Any]] = field(default_factory=list)  # {"index", "id"} of each
    too_long_samples: int = 0     # longer than the model's context: skipped before the forward, not written
    too_long: list[dict[str, Any]] = field(default_factory=list)  # {"index", "id", "tokens"} of each
    context: int | None = None    # the context they were skipped at: settled while it is unchanged (plan.py)
    stopped: bool = False
    elapsed_s: float = 0.0
    tokens_per_s: float = 0.0
    # The draft config's eagle_config.eagle_aux_hidden_state_layer_ids: SGLang's numbering of `layers`.
    draft_layer_ids: list[int] | None = None
    # extract.aux_layers as configured ("eagle3", "dflash:5" or the list), and `layers` in each trainer's
    # numbering (model_info.trainer_layer_ids)
    layer_set: str = ""
    trainer_layer_ids: dict[str, list[int] | None] = field(default_factory=dict)
    nothing_to_do: bool = False   # every file of the shard was there: no model was loaded
    merge_id: str = ""            # the merge these hidden states belong to (hidden_states/merge.json)
    claim_note: str = ""          # what was done to hidden states of another merge (start over, set aside)
    # extract.max_disk_gb: the samples still to do that did not fit it (left for a later run) and their estimate
    max_disk_gb: float = 0.0
    budget_left: int = 0
    budget_left_bytes: int = 0
    budget_left_from: int | None = None  # the first of them, in merged order
    redone: list[dict[str, Any]] = field(default_factory=list)  # --validate: {"index", "path", "why"} removed, redone
    format: str = "specforge"     # extract.format: the files' layout
    dtype: str = "bfloat16"       # the files' hidden-state dtype: bfloat16 or fp8
    # format = "speculators": the file slots' layers in vLLM's numbering (the aux layers, then N: pre-norm last).
    target_layer_ids: list[int] | None = None
    # dtype = "fp8": per slot, the worst and median over the files of each file's worst-token cosine and relative
    # error, measured as written (speculators_layout.QuantError).
    fp8_error: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def stats_path(root: Path, shard: tuple[int, int]) -> Path:
    # Machines running different shards share the folder; each keeps its own stats.
    return root / ("stats.json" if shard == (0, 1) else f"stats.shard-{shard[0]}-of-{shard[1]}.json")


def layer_set_text(aux_layers: str | list[int]) -> str:
    return aux_layers if isinstance(aux_layers, str) else str(list(aux_layers))


def budget_line(config: Config, stats: ExtractStats) -> str:
    """What extract.max_disk_gb left undone, and how to go on."""
    return (f"stopped at the disk budget (extract.max_disk_gb = {stats.max_disk_gb:g}): {stats.budget_left:,} samples "
            f"(from sample {stats.budget_left_from}, ~{fmt_bytes(stats.budget_left_bytes)} more) are left; raise "
            f"extract.max_disk_gb by at least {stats.budget_left_bytes / 1e9:.3g} (or free space) and run "
            f"`draftgen extract {sh_path(config.path)}` again: the files written are kept and skipped")


class ExtractReporter:
    """Builds StageProgress from the running counts, at most every PROGRESS_INTERVAL_S."""

    def __init__(self, progress: Callable[[StageProgress], None] | None, stats: ExtractStats,
                 backend_desc: str, tokens_todo: int) -> None:
        self.progress = progress
        self.stats = stats
        self.backend_desc = backend_desc
        self.tokens_todo = tokens_todo
        self.started = time.monotonic()
        self._throttle = Throttle()

    def emit(self, state: StageState = StageState.RUNNING, message: str = "", force: bool = False) -> None:
        if self.progress is None or not self._throttle.due(force):
            return
        now = time.monotonic()
        s = self.stats
        elapsed = max(now - self.started, 1e-9)
        rate = s.tokens_written / elapsed
        done_tokens = s.tokens_written
        remaining = max(self.tokens_todo - done_tokens, 0)
        eta = (remaining / rate if rate > 0 and state == StageState.RUNNING
               else (0.0 if state == StageState.DONE else None))
        self.progress(StageProgress(
            name="extract", state=state, done=s.skipped_existing + s.written + s.nan_samples + s.too_long_samples,
            total=s.samples,
            rate=rate, rate_unit="tok/s", eta_s=eta, message=message,
            detail=(
                ("tokens", f"{fmt_count(done_tokens)} / {fmt_count(self.tokens_todo)}"),
                ("written", fmt_bytes(s.bytes_written)),
                ("files", f"{s.written:,}"),
                ("skipped", f"{s.skipped_existing:,} done before"),
                ("NaN", f"{s.nan_samples:,}"),
                ("backend", self.backend_desc),
                ("layers", ", ".join(str(k) for k in s.layers)),
                ("shard", f"{s.shard[0]}/{s.shard[1]}"),
            ),
        ))


def account(done: Written, stats: ExtractStats, events: EventLog,
            quant: speculators.QuantError | None = None) -> None:
    """Count one sample the writer finished: written (its FP8 error into `quant`), or NaN/Inf (reported, not
    written)."""
    if not done.finite:
        stats.nan_samples += 1
        stats.nan.append({"index": done.index, "id": done.sample_id})
        events.write("warn", f"extract: sample {done.index} (id {done.sample_id}) has NaN/Inf in its hidden states; "
                             f"not written")
        return
    stats.bytes_written += done.nbytes
    if quant is not None and done.quant is not None:
        quant.add(done.quant)
    stats.written += 1
    stats.tokens_written += done.tokens
