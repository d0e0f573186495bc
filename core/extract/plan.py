"""What an extraction will do, before any weights load.

`make_plan()` reads only `merged/tokens/index.jsonl`, the files already in `hidden_states/`, the
model's config.json (only when something is left to do: it gives H, the context length and, for
the specforge backend, the GPU plan: gpu_plan.py) and earlier stats files (the measured rate).
`draftgen extract CONFIG --plan` prints it and exits; `extract` prints it first and exits without
loading the model when nothing is left to do. What the files take on disk, the disk budget and the
free-space watch while a run writes: disk.py.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftgen.core.config import Config
from draftgen.core.errors import DraftgenError
from draftgen.core.extract.disk import disk_budget, state_bytes, stored_dtype, token_bytes
from draftgen.core.extract.gpu_plan import GpuPlan, format_gpu_plan, make_gpu_plan
from draftgen.core.units import compact_duration, fmt_bytes, fmt_count

# gzip level 1 on bf16 activations, when no .gz file of this run is on disk to measure: a guess.
ASSUMED_GZ_RATIO = 0.85
# compress = true: the plan times gzip (level 1, as the writer) on this many bytes of bf16
# activation-like data, one thread, on the machine that will write (bench_extract.py --gzip: the same
# on a whole Kimi-size sample, 1 and several threads).
GZ_PROBE_BYTES = 4 << 20


def plan_batches(items: Sequence[tuple[int, int]], batch_tokens: int, max_samples: int | None = None,
                 ) -> list[list[int]]:
    """Group (index, length) items of similar length into batches of at most `batch_tokens` padded tokens.

    Longest first: a batch that does not fit in memory fails in the first minute, not hours in.
    A sample longer than `batch_tokens` gets a batch of its own.
    """
    ordered = sorted(items, key=lambda item: (-item[1], item[0]))
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for index, length in ordered:
        too_many = max_samples is not None and len(current) >= max_samples
        if current and (too_many or (len(current) + 1) * width > batch_tokens):
            batches.append(current)
            current = []
        if not current:
            width = length  # the first of a batch is its longest
        current.append(index)
    if current:
        batches.append(current)
    return batches


@dataclass
class ShardPlan:
    index: int
    count: int
    samples: int = 0
    done: int = 0           # files already on disk
    todo: int = 0
    tokens_todo: int = 0
    too_long: int = 0       # skipped as longer than the context by an earlier run at this context: settled
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
    gpu: GpuPlan | None = None     # the specforge backend's, when this shard has work
    context: int | None = None     # the model's context length (None: not read, or the config does not say)
    too_long: int = 0              # samples of this shard longer than `context`: skipped, counted
    layers: tuple[int, ...] = ()   # the aux layers asked for (empty when the model config was not read)
    dtype: str = "bf16"            # what the files store (STATE_DTYPES)
    set_tokens: int = 0            # the whole merged set, every shard
    set_files: int = 0
    median_tokens: int = 0         # of a sample of the set
    largest_tokens: int = 0
    max_disk_bytes: int = 0        # extract.max_disk_gb for this shard (0: no budget)
    budget_used: int = 0           # bytes this shard's files take already
    budget_fits: int = 0           # samples still to do that fit the budget
    budget_fits_bytes: int = 0
    budget_left: int = 0           # samples still to do past it: left for a later run
    budget_left_bytes: int = 0

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


def recorded_too_long(root: Path, merge_id: str, model: str) -> dict[int, set[int]]:
    """Each sample an earlier run skipped as longer than the context, with the contexts it was skipped at:
    from every stats*.json of `root` written for merge `merge_id` and extract.model `model`.

    Such a sample is settled while the context is one of those (a merge with another id, another model or
    another context makes it eligible again): it never gets a file, yet nothing is left to do for it."""
    out: dict[int, set[int]] = {}
    if not merge_id or not root.is_dir():
        return out
    for path in root.glob("stats*.json"):
        try:
            stats = json.loads(path.read_text(encoding="utf-8"))
            if stats.get("merge_id") != merge_id or stats.get("model") != model:
                continue
            context = stats.get("context")
            if not isinstance(context, int) or isinstance(context, bool):
                continue
            for item in stats.get("too_long") or []:
                out.setdefault(int(item["index"]), set()).add(context)
        except (OSError, ValueError, AttributeError, TypeError, KeyError):
            continue
    return out


def context_limit(cfg: Any, model_cfg: dict[str, Any]) -> int | None:
    """The longest sample the forward may take: [extract.sglang] context_length (specforge), else the model's
    max_position_embeddings."""
    from draftgen.core.extract.model_info import context_length
    override = cfg.sglang.get("context_length") if cfg.backend == "specforge" else None
    if isinstance(override, int) and not isinstance(override, bool) and override > 0:
        return override
    return context_length(model_cfg)


def make_plan(config: Config, shard: tuple[int, int], *, free_space: Callable[[Path], int] | None = None,
              nvml: Any = None, env: Mapping[str, str] | None = None) -> Plan:
    """The plan of every shard of `shard`'s N; the model config is read (and, for the specforge backend, the
    cards' memory) only if this shard has work."""
    from draftgen.core.extract.model_info import dims_from_config_dict, read_model_config, resolve_aux_layers
    from draftgen.core.extract.speculators_layout import existing_file, refuse_other_format
    from draftgen.core.rundir import RunDir
    from draftgen.core.tokens.store import INDEX_FILE, TokenReader
    cfg = config.extract
    rundir = RunDir(config.run_dir)
    tokens_dir = rundir.merged / "tokens"
    if not (tokens_dir / INDEX_FILE).exists():
        raise DraftgenError(f"{tokens_dir / INDEX_FILE}: not found; run `draftgen merge` first")
    reader = TokenReader(tokens_dir)
    root = rundir.hidden_states
    refuse_other_format(cfg.format, root, config.path)  # as extract would: no plan of files it would not count
    i, n = shard
    shards = [ShardPlan(j, n) for j in range(n)]
    gz_bytes = gz_tokens = gz_files = 0
    todo_lengths: list[list[int]] = [[] for _ in range(n)]
    missing: list[int] = []   # this shard's
    for k, entry in enumerate(reader.entries):
        s = shards[k % n]
        s.samples += 1
        path = existing_file(cfg.format, root, k)  # in the configured format (speculators: hs_{k})
        if path is None:
            s.todo += 1
            s.tokens_todo += entry.length
            todo_lengths[k % n].append(entry.length)
            if k % n == i:
                missing.append(k)
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
    gpu = None
    context = None
    too_long = 0
    layers: tuple[int, ...] = ()
    dtype = stored_dtype(cfg)
    budget: tuple[list[int], list[int], int] | None = None
    if shards[i].todo:
        model_cfg, source = read_model_config(cfg.model, trust_remote_code=cfg.trust_remote_code)
        dims = dims_from_config_dict(model_cfg, source)
        hidden = dims.hidden_size
        layers = resolve_aux_layers(cfg.aux_layers, dims, config.path)
        context = context_limit(cfg, model_cfg)
        lengths = todo_lengths[i]
        if context is not None:
            too_long = sum(1 for n in lengths if n > context)
            lengths = [n for n in lengths if n <= context]
            if too_long:
                notes.append(f"{too_long:,} samples are longer than the model's context ({context:,} tokens, "
                             f"{source} or extract.sglang.context_length): they are skipped and counted, not written")
            _settle_too_long(shards[i], missing, reader, root, context, cfg.model)
        if cfg.max_disk_gb > 0:
            budget = _budget(cfg, reader, root, shard, missing, context, dims.hidden_size, len(layers), dtype)
            lengths = [reader.entries[k].length for k in budget[0]]
        if cfg.backend == "specforge" and lengths:
            batches = plan_batches(list(enumerate(lengths)), cfg.batch_tokens)
            widest = max(len(b) * max(lengths[k] for k in b) for b in batches)
            gpu = make_gpu_plan(cfg, model_cfg, source, widest, max(len(b) for b in batches), nvml=nvml, env=env,
                                config_path=config.path)
    gz_ratio, gz_source = _size_shards(shards, hidden, len(layers), (gz_bytes, gz_tokens, gz_files))
    where = root if root.exists() else next((p for p in root.parents if p.exists()), Path("/"))
    free = (free_space or (lambda p: shutil.disk_usage(p).free))(where)
    rate, rate_source = _earlier_rate(root) if root.is_dir() else (None, "")
    if rate is None and cfg.tokens_per_s > 0:
        rate, rate_source = cfg.tokens_per_s, "extract.tokens_per_s"
    plan = Plan(shards=shards, mine=i, hidden_size=hidden, free_bytes=free, root=root, rate=rate,
                rate_source=rate_source, gz_ratio=gz_ratio, gz_source=gz_source, compress=cfg.compress, notes=notes,
                gpu=gpu, context=context, too_long=too_long, layers=layers, dtype=dtype)
    _set_sizes(plan, reader, budget, int(cfg.max_disk_gb * 1e9 / n))
    return plan


def _size_shards(shards: list[ShardPlan], hidden: int | None, layers: int,
                 gz: tuple[int, int, int]) -> tuple[float, str]:
    """Each shard's bytes to write (bf16, and gzipped at the ratio the .gz files on disk show, else assumed);
    the ratio and where it came from."""
    gz_bytes, gz_tokens, gz_files = gz
    gz_ratio, gz_source = ASSUMED_GZ_RATIO, "assumed"
    if hidden is None:
        return gz_ratio, gz_source
    if gz_files:
        gz_ratio = gz_bytes / max(state_bytes(gz_tokens, gz_files, hidden, layers), 1)
        gz_source = f"measured on {gz_files:,} files"
    for s in shards:
        s.bytes_bf16 = state_bytes(s.tokens_todo, s.todo, hidden, layers)
        s.bytes_gz = int(s.bytes_bf16 * gz_ratio)
    return gz_ratio, gz_source


def _budget(cfg: Any, reader: Any, root: Path, shard: tuple[int, int], missing: list[int], context: int | None,
            hidden: int, layers: int, dtype: str) -> tuple[list[int], list[int], int]:
    """disk_budget() for this shard's missing samples that fit the context: its share of extract.max_disk_gb."""
    i, n = shard
    every = [e.length for e in reader.entries]
    fitting = [k for k in missing if context is None or every[k] <= context]
    return disk_budget(root, range(i, len(every), n), every, fitting, int(cfg.max_disk_gb * 1e9 / n),
                       lambda t: state_bytes(t, 1, hidden, layers, dtype), fmt=cfg.format)


def _set_sizes(plan: Plan, reader: Any, budget: tuple[list[int], list[int], int] | None, share: int) -> None:
    """The whole set's tokens, median and largest sample, and the budget's figures, into `plan`."""
    every_length = sorted(e.length for e in reader.entries)
    if every_length:
        plan.set_tokens, plan.set_files = sum(every_length), len(every_length)
        plan.median_tokens, plan.largest_tokens = every_length[(len(every_length) - 1) // 2], every_length[-1]
    if budget is None or plan.hidden_size is None:
        return
    fits, left, used = budget
    h, k = plan.hidden_size, len(plan.layers)
    plan.max_disk_bytes, plan.budget_used = share, used
    plan.budget_fits, plan.budget_left = len(fits), len(left)
    plan.budget_fits_bytes = state_bytes(sum(reader.entries[x].length for x in fits), len(fits), h, k, plan.dtype)
    plan.budget_left_bytes = state_bytes(sum(reader.entries[x].length for x in left), len(left), h, k, plan.dtype)


def _settle_too_long(shard: ShardPlan, missing: list[int], reader: Any, root: Path, context: int,
                     model: str) -> None:
    """Take out of `shard`'s work the samples an earlier run of this merge skipped at this same context."""
    from draftgen.core.tokens import identity
    current = identity.merged_fingerprint(root.parent / "merged")
    if not current.same_merge(identity.read_fingerprint(root / identity.HIDDEN_MERGE_FILE)):
        return  # not this merge's folder (yet): every missing sample is work
    recorded = recorded_too_long(root, current.merge_id, model)
    for k in missing:
        if context in recorded.get(k, ()):
            shard.todo -= 1
            shard.tokens_todo -= reader.entries[k].length
            shard.too_long += 1


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
    lines += format_set_size(plan)
    this = plan.this
    need = this.bytes_gz if plan.compress else this.bytes_bf16
    if plan.dtype != "bf16" and plan.hidden_size is not None and not plan.compress:  # what the files will store
        need = state_bytes(this.tokens_todo, this.todo, plan.hidden_size, len(plan.layers), plan.dtype)
    if plan.max_disk_bytes:
        need = int(plan.budget_fits_bytes * (plan.gz_ratio if plan.compress else 1))
    if plan.nothing_to_do:
        skipped = (f", {this.too_long:,} skipped as longer than the context of {plan.context:,} tokens"
                   if this.too_long and plan.context else "")
        lines.append(f"shard {this.index}/{this.count}: nothing to do ({this.done:,} of {this.samples:,} files "
                     f"already written{skipped}); the model is not loaded")
    else:
        verdict = "enough" if need <= plan.free_bytes else "NOT ENOUGH"
        lines.append(f"shard {this.index}/{this.count} (*) writes ~{fmt_bytes(need)} "
                     f"({'gz' if plan.compress else plan.dtype}); {fmt_bytes(plan.free_bytes)} free there: {verdict}")
    if plan.gpu is not None:
        lines += format_gpu_plan(plan.gpu)
    return lines + plan.notes + compress_warning(plan)


def format_set_size(plan: Plan) -> list[str]:
    """The whole merged set's bytes in both stored dtypes (the chosen one marked), per sample median and largest,
    and the disk budget's verdict; nothing when H was not read (nothing to do here)."""
    if plan.hidden_size is None or not plan.set_files:
        return []
    h, k = plan.hidden_size, len(plan.layers)
    sizes = []
    for dtype in ("bf16", "fp8"):
        total = state_bytes(plan.set_tokens, plan.set_files, h, k, dtype)
        median = state_bytes(plan.median_tokens, 1, h, k, dtype)
        largest = state_bytes(plan.largest_tokens, 1, h, k, dtype)
        mark = " (chosen)" if dtype == plan.dtype else ""
        sizes.append(f"{dtype}{mark} ~{fmt_bytes(total)} (a sample: median ~{fmt_bytes(median)}, largest "
                     f"~{fmt_bytes(largest)})")
    lines = [f"the whole set: {plan.set_files:,} samples, {fmt_count(plan.set_tokens)} tokens (median "
             f"{plan.median_tokens:,}, largest {plan.largest_tokens:,} a sample), {k} aux layers "
             f"{list(plan.layers)} + the last at H={h}, {token_bytes(h, k, plan.dtype):,} B a token: "
             + "; ".join(sizes) + f"; {fmt_bytes(plan.free_bytes)} free on the output filesystem"]
    if plan.max_disk_bytes:
        left = (f"; {plan.budget_left:,} samples (~{fmt_bytes(plan.budget_left_bytes)}) are left for a later run "
                f"with a larger extract.max_disk_gb" if plan.budget_left else "; every sample still to do fits")
        lines.append(f"disk budget (extract.max_disk_gb, this shard's share): {fmt_bytes(plan.max_disk_bytes)}; "
                     f"{fmt_bytes(plan.budget_used)} already written; {plan.budget_fits:,} samples still to do fit "
                     f"(~{fmt_bytes(plan.budget_fits_bytes)}, {plan.dtype}){left}")
    return lines


def gzip_rate(nbytes: int = GZ_PROBE_BYTES) -> float:
    """Bytes/s gzip level 1 (the writer's) reaches on one thread here, on bf16 activation-like data."""
    import gzip

    import numpy as np
    # bf16 of N(0, 1): the top half of each float32 (little-endian), as the writer stores hidden states.
    floats = np.random.default_rng(0).standard_normal(nbytes // 2, dtype=np.float32)
    data = floats.view(np.uint16)[1::2].tobytes()
    start = time.perf_counter()
    gzip.compress(data, compresslevel=1, mtime=0)
    return len(data) / max(time.perf_counter() - start, 1e-9)


def compress_warning(plan: Plan, threads: int | None = None, rate_per_thread: float | None = None) -> list[str]:
    """With `compress`: the rate gzip reaches in the writer's threads; a warning when the plan's rate needs more."""
    if not plan.compress or plan.hidden_size is None or plan.nothing_to_do:
        return []
    if threads is None:
        import os
        threads = max(4, min(8, os.cpu_count() or 4))  # writer.THREADS, without importing torch
    per_token = token_bytes(plan.hidden_size, len(plan.layers) or 3, plan.dtype)
    reach = (rate_per_thread or gzip_rate()) * threads  # zlib lets go of the GIL: the threads add up
    line = (f"compress = true: gzip (level 1, {threads} writer threads, timed here) reaches ~{fmt_bytes(reach)}/s, "
            f"~{fmt_count(reach / per_token)} tok/s at H={plan.hidden_size}")
    if plan.rate is None:
        return [f"{line}; the extraction's own rate is unknown (set extract.tokens_per_s to compare)"]
    need = plan.rate * per_token
    if need <= reach:
        return [f"{line}; enough for {fmt_count(plan.rate)} tok/s ({fmt_bytes(need)}/s)"]
    return [f"warning: {line}, but {fmt_count(plan.rate)} tok/s ({plan.rate_source}) writes {fmt_bytes(need)}/s: "
            f"the writer, not the GPUs, would set the pace (~{reach / need:.0%} of it). Set compress = false "
            f"(the files are ~{1 / max(plan.gz_ratio, 1e-9):.2f}x larger) unless disk space is the limit"]
