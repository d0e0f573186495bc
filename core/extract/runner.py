"""`extract()`: the target model over `merged/tokens/`, written as SpecForge offline files (see layout.py).

Synchronous on purpose: the model forward is the whole cost, and the caller (the TUI's engine, or
`draftgen extract`) runs it in a thread and reads its progress through the `progress` callback.
What rank 0 settles before any model loads is run_plan.py; the run's counts and progress, stats.py;
what the files take on disk and the free-space watch, disk.py.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from draftgen.core.config import Config
from draftgen.core.errors import ConfigError, DraftgenError
from draftgen.core.extract import claim, layout
from draftgen.core.extract import speculators_layout as speculators
from draftgen.core.extract.backend import ExtractBackend, make_backend
from draftgen.core.extract.disk import bytes_needed, stored_dtype
from draftgen.core.extract.model_info import (
    ModelDims,
    dims_from_config_dict,
    read_model_config,
    resolve_aux_layers,
    trainer_layer_ids,
)
from draftgen.core.extract.run_plan import RunPlan, already_done, make_run_plan, shard_indices
from draftgen.core.extract.stats import ExtractReporter, ExtractStats, account, budget_line, layer_set_text, stats_path
from draftgen.core.extract.writer import Item, PooledWriter
from draftgen.core.files import GROUP_FILE_MODE, TMP_MARK, write_json_atomic
from draftgen.core.live.snapshot import StageProgress, StageState
from draftgen.core.merge.swap import merge_lock
from draftgen.core.quoting import sh_path
from draftgen.core.rundir import EventLog, RunDir
from draftgen.core.tokens.store import INDEX_FILE, TokenEntry, TokenReader
from draftgen.core.units import fmt_bytes


def _batches_of_arrays(reader: TokenReader,
                       batches: list[list[int]]) -> Iterator[tuple[list[int], list[Any], list[Any]]]:
    for batch in batches:
        ids, masks = [], []
        for index in batch:
            i, m = reader.arrays(reader.entries[index])
            ids.append(i)
            masks.append(m)
        yield batch, ids, masks


def _expected(cfg: Any, dims: ModelDims, layers: tuple[int, ...]) -> Any:
    """What --validate reads every file back against: this model's H, the layers extracted, the stored dtype
    (and FP8's scales)."""
    from draftgen.core.extract.readback import expected_of
    return expected_of(cfg, dims.hidden_size, len(layers), speculators.vllm_layer_ids(layers, dims.num_layers))


class _Idle:
    """The backend of a run with nothing to run (every missing sample is too long): no model is loaded."""
    description = "none (no sample left fits the context or the disk budget)"
    max_batch_tokens: int | None = None
    max_batch_samples: int | None = None

    def run(self, batch: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return []

    def close(self) -> None:
        pass


def make_group(cfg: Any, config_path: object = "config") -> Any:
    """Where this process stands: alone (hf), or one rank of a torchrun job (specforge)."""
    from draftgen.core.extract.specforge_backend import LocalGroup, TorchrunGroup
    if cfg.backend == "specforge":
        return TorchrunGroup(cfg.tp_size, config_path)
    return LocalGroup()


def extract(config: Config, *, shard: tuple[int, int] = (0, 1),
            progress: Callable[[StageProgress], None] | None = None,
            backend: ExtractBackend | None = None, stop: threading.Event | None = None,
            group: Any = None, disk_watch: Any = None, on_other_merge: str = claim.REFUSE,
            in_child: bool = False, validate: bool = False) -> ExtractStats:
    """Write `hidden_states/` for every sample of `shard` not already there; return the run's stats.

    Hidden states of another merge than merged/ (claim.py) are never added to: refused (a
    claim.HiddenStatesOfAnotherMerge naming what differs) unless `on_other_merge` is claim.START_OVER
    or claim.SET_ASIDE.

    The specforge backend outside torchrun runs in a child process (child.py: SGLang's parallel state
    allows one capture per process); `disk_watch` then is the child's own (its pauses come as progress).

    `backend` replaces the one `config.extract` describes (a test's, or a model already loaded);
    `stop`, when set, ends the run after the batch in progress (everything written stays valid).
    `validate` (`extract --validate`): every file of the shard is first read back by the trainer's rules
    (readback.py); the bad ones are deleted and extracted again with the missing ones, nothing else.
    Under torchrun (specforge backend) every rank calls this: rank 0 plans, checks and writes,
    and all ranks run the same forwards; `group` is that job (made here when None).

    merged/ is not replaced while this reads it: the run directory's merge lock is held from before
    merged/tokens is opened to the end (by the job's rank 0, or by the parent of an extraction child),
    so a `draftgen merge` meanwhile refuses, naming the lock, and hidden states can never be written
    from one merge while recorded as another's.
    """
    with _merged_held(Path(config.run_dir), in_child):
        return _extract(config, shard=shard, progress=progress, backend=backend, stop=stop, group=group,
                        disk_watch=disk_watch, on_other_merge=on_other_merge, in_child=in_child, validate=validate)


@contextlib.contextmanager
def _merged_held(root: Path, in_child: bool) -> Iterator[None]:
    """The merge lock, held by one process of the job (not a torchrun rank but 0, not the child of a parent
    that holds it)."""
    if in_child or int(os.environ.get("RANK", "0")) != 0 or not root.is_dir():
        yield
        return
    with merge_lock(root):
        yield


def _extract(config: Config, *, shard: tuple[int, int], progress: Callable[[StageProgress], None] | None,
             backend: ExtractBackend | None, stop: threading.Event | None, group: Any, disk_watch: Any,
             on_other_merge: str, in_child: bool, validate: bool = False) -> ExtractStats:
    """extract(), the merge lock held."""
    started_at = time.time()
    cfg = config.extract
    if not cfg.model:
        raise ConfigError(f"{config.path}: extract.model is not set (a local model folder or an HF id)")
    i, n = shard
    if n < 1 or not 0 <= i < n:
        raise DraftgenError(f"shard {i}/{n}: I must be between 0 and N-1")
    if cfg.batch_tokens < 1:
        raise ConfigError(f"{config.path}: extract.batch_tokens must be > 0, not {cfg.batch_tokens}")
    rundir = RunDir(config.run_dir)
    tokens_dir = rundir.merged / "tokens"
    if not (tokens_dir / INDEX_FILE).exists():
        raise DraftgenError(f"{tokens_dir / INDEX_FILE}: not found; run `draftgen merge` first")
    reader = TokenReader(tokens_dir)
    # --validate reads every file back first: every rank goes on to the plan, where rank 0 does it.
    done = (already_done(config, rundir, reader, shard, progress, on_other_merge)
            if backend is None and not validate else None)
    if done is not None:
        return done
    from draftgen.core.extract.child import extract_in_child, needs_child
    if not in_child and needs_child(cfg.backend, backend, group):
        stats: ExtractStats = extract_in_child(config, shard=shard, progress=progress, stop=stop,
                                               on_other_merge=on_other_merge, target=extract, validate=validate)
        return stats
    model_cfg, source = read_model_config(cfg.model, trust_remote_code=cfg.trust_remote_code)
    dims = dims_from_config_dict(model_cfg, source)
    layers = resolve_aux_layers(cfg.aux_layers, dims, config.path)
    if cfg.backend == "specforge" and backend is None:
        from draftgen.core.extract.model_info import sglang_capture_ids
        sglang_capture_ids(layers, dims, config.path)  # refuse what SGLang cannot capture before anything loads
        from draftgen.core.extract.specforge_backend import check_sglang_table
        check_sglang_table(cfg.sglang, config.path)
    root = rundir.hidden_states
    owned_group = group is None
    if group is None:
        from draftgen.core.extract.specforge_backend import LocalGroup
        group = make_group(cfg, config.path) if backend is None else LocalGroup()
    owned = backend is None
    try:
        limit = min(cfg.batch_tokens, (backend.max_batch_tokens if backend else None) or cfg.batch_tokens)
        plan: RunPlan = group.share(lambda: make_run_plan(
            root, reader, shard, dims, limit, cfg, backend.max_batch_samples if backend else None, on_other_merge,
            model=(model_cfg, source), gpu_plan=backend is None, config_path=config.path, layers=len(layers),
            validate=_expected(cfg, dims, layers) if validate else None))
        if backend is None and not plan.todo:  # every sample left is longer than the context: nothing to load
            backend = _Idle()
        if backend is None:
            backend = make_backend(cfg, dims, layers, group=group, max_forward_tokens=plan.max_forward_tokens,
                                   max_samples=plan.max_samples, config_path=config.path,
                                   mem_fraction_static=plan.mem_fraction)
        if group.writer:
            return _run_writer(config, shard, dims, layers, reader, root, plan, backend, progress, stop, rundir,
                               disk_watch, started_at=started_at, model=(model_cfg, source))
        for _batch, ids, _masks in _batches_of_arrays(reader, plan.batches):
            backend.run(ids)
        return ExtractStats(model=cfg.model, backend=backend.description, num_layers=dims.num_layers,
                            hidden_size=dims.hidden_size, layers=layers, shard=shard, compress=cfg.compress)
    finally:
        if owned and backend is not None:
            backend.close()
        if owned_group:
            group.close()


def _log_plan(events: EventLog, plan: RunPlan, stats: ExtractStats, shard: tuple[int, int],
              layers: tuple[int, ...], dims: ModelDims) -> None:
    """events.log's lines for what the plan found before any sample is written."""
    i, n = shard
    if plan.note:
        events.write("warn", f"extract: {plan.note}")
    for bad in plan.redone:
        events.write("warn", f"extract: --validate: {bad['path']} (sample {bad['index']}) removed, extracted again: "
                             f"{bad['why']}")
    events.write("info", f"extract: {len(plan.todo):,} samples ({plan.tokens_todo:,} tokens) to do in shard {i}/{n}, "
                         f"{stats.skipped_existing:,} already written; layers {list(layers)}, H={dims.hidden_size}")
    for skip in plan.too_long:
        events.write("warn", f"extract: sample {skip['index']} (id {skip['id']}) has {skip['tokens']:,} tokens, more "
                             f"than the model's context of {plan.context:,} (max_position_embeddings, or "
                             f"extract.sglang.context_length): skipped, not written")


def _run_writer(config: Config, shard: tuple[int, int], dims: ModelDims, layers: tuple[int, ...],
                reader: TokenReader, root: Path, plan: RunPlan, backend: ExtractBackend,
                progress: Callable[[StageProgress], None] | None, stop: threading.Event | None,
                rundir: RunDir, disk_watch: Any = None, *, started_at: float | None = None,
                model: tuple[dict[str, Any], str] | None = None) -> ExtractStats:
    cfg = config.extract
    entries: list[TokenEntry] = reader.entries
    indices = shard_indices(len(reader), shard)
    stats = ExtractStats(model=cfg.model, backend=backend.description, num_layers=dims.num_layers,
                         hidden_size=dims.hidden_size, layers=layers, shard=shard, compress=cfg.compress,
                         samples=len(indices), tokens=sum(entries[k].length for k in indices),
                         skipped_existing=plan.skipped_existing, draft_layer_ids=_draft_layer_ids(layers, dims),
                         layer_set=layer_set_text(cfg.aux_layers), trainer_layer_ids=trainer_layer_ids(layers, dims),
                         merge_id=_merge_id(root), claim_note=plan.note,
                         too_long_samples=len(plan.too_long), too_long=plan.too_long, context=plan.context,
                         max_disk_gb=cfg.max_disk_gb, budget_left=len(plan.budget_left),
                         budget_left_bytes=plan.budget_left_bytes,
                         budget_left_from=plan.budget_left[0] if plan.budget_left else None,
                         redone=plan.redone, format=cfg.format, dtype="fp8" if cfg.dtype == "fp8" else "bfloat16")
    write, quant = _file_writer(cfg, layers, dims, stats)
    if disk_watch is None:
        from draftgen.core.extract.disk import DiskWatch
        disk_watch = DiskWatch(margin_bytes=int(cfg.min_free_gb * 2**30))
    events = EventLog(rundir.events_log)
    _log_plan(events, plan, stats, shard, layers, dims)
    reporter = ExtractReporter(progress, stats, backend.description, plan.tokens_todo)
    started = reporter.started

    def warn(message: str) -> None:
        events.write("warn", message)
        reporter.emit(message=message, force=True)

    pool = PooledWriter(root, compress=cfg.compress, group_readable=cfg.group_readable, write=write)
    try:
        reporter.emit(force=True)
        for batch, ids, masks in _batches_of_arrays(reader, plan.batches):
            if stop is not None and stop.is_set():
                stats.stopped = True
                break
            need = bytes_needed(sum(len(x) for x in ids), len(ids), dims.hidden_size, len(layers), stored_dtype(cfg))
            if not disk_watch.wait_for(root, need, stop, log=warn):
                stats.stopped = True
                break
            outputs = backend.run(ids)
            items = [_checked(index, entries[index].id, torch.from_numpy(sample_ids), torch.from_numpy(mask),
                              hidden, aux, dims, backend.description, len(layers))
                     for index, sample_ids, mask, (hidden, aux) in zip(batch, ids, masks, outputs, strict=True)]
            del outputs  # the writer holds the batch now: its memory goes when its files are written
            pool.submit(items)  # the next forward overlaps these files; blocks while the writer is behind
            del items
            for done in pool.completed():
                account(done, stats, events, quant)
            reporter.emit()
        for done in pool.drain():
            account(done, stats, events, quant)
            reporter.emit()
    except BaseException as e:
        pool.close()  # files being written finish whole or are removed; the rest are redone on restart
        if reporter is not None:
            reporter.emit(StageState.FAILED, message=str(e) or type(e).__name__, force=True)
        events.write("error", f"extract: stopped by an error: {e}")
        events.close()
        raise
    finally:
        pool.close()
        elapsed = time.monotonic() - started
        stats.elapsed_s = round(elapsed, 3)
        stats.tokens_per_s = round(stats.tokens_written / elapsed, 1) if elapsed > 0 else 0.0
        stats.fp8_error = quant.to_dict() if quant is not None else None
    write_json_atomic(stats_path(root, shard), stats.to_dict())
    _leave_provenance(config, root, stats, model, time.time() if started_at is None else started_at, events)
    _leave_handoff(config, events)
    if cfg.group_readable:
        _open_to_group(root)
    summary = (f"{stats.written:,} written ({fmt_bytes(stats.bytes_written)}), {stats.nan_samples:,} NaN, "
               f"{stats.skipped_existing:,} already there"
               + (f", {len(stats.redone):,} bad files redone (--validate)" if stats.redone else "")
               + (f", {stats.too_long_samples:,} longer than the context (skipped)" if stats.too_long_samples else "")
               + (f"; {speculators.describe(stats.fp8_error)}" if stats.fp8_error is not None else ""))
    if stats.budget_left:
        summary += "; " + budget_line(config, stats)
    events.write("info", f"extract: {'stopped' if stats.stopped else 'done'}: {summary}")
    events.close()
    if reporter is not None:
        reporter.emit(StageState.STOPPED if stats.stopped else StageState.DONE, force=True,
                      message=("stopped: " if stats.stopped else "") + summary)
    return stats


def _file_writer(cfg: Any, layers: tuple[int, ...], dims: ModelDims, stats: ExtractStats,
                 ) -> tuple[Any, speculators.QuantError | None]:
    """The writer's file format (None: SpecForge's) and, for FP8, the error gathered from every file written;
    speculators' layer ids go into `stats`."""
    if cfg.format != "speculators":
        return None, None
    ids = speculators.vllm_layer_ids(layers, dims.num_layers)
    stats.target_layer_ids = ids
    fp8 = cfg.dtype == "fp8"

    def write(root: Path, index: int, sample: layout.SampleTensors) -> tuple[int, Any]:
        return speculators.write_sample(root, index, sample, fp8=fp8, layer_ids=ids,
                                        group_readable=cfg.group_readable)
    return write, speculators.QuantError(ids) if fp8 else None


def _open_to_group(root: Path) -> None:
    """The files beside the samples (stats, merge.json, the training hand-off) readable by the group too,
    as the samples are (extract.group_readable); the hand-off script stays executable."""
    for path in root.iterdir():
        if path.is_file() and TMP_MARK not in path.name:
            mode = path.stat().st_mode & 0o777
            os.chmod(path, mode | (GROUP_FILE_MODE & 0o070) | (0o010 if mode & 0o100 else 0))


def _leave_provenance(config: Config, root: Path, stats: ExtractStats, model: tuple[dict[str, Any], str] | None,
                      started_at: float, events: EventLog) -> None:
    """hidden_states/provenance.json's record of this run (core/provenance.py); a failure is said, never fatal."""
    from draftgen.core import provenance
    from draftgen.core.extract.readback import format_name, stored_dtype
    cfg = config.extract
    i, n = stats.shard
    try:
        rec = provenance.record(
            config, started_at,
            inputs={"merge_id": stats.merge_id, "samples_sha256": _samples_sha256(root)},
            model={"path": cfg.model, **provenance.model_config_digest(model)},
            backend=stats.backend, layers=list(stats.layers), draft_layer_ids=stats.draft_layer_ids,
            dtype=cfg.dtype, stored_dtype=stored_dtype(cfg), format=format_name(cfg), compress=cfg.compress,
            shard=[i, n], written=stats.written, skipped_existing=stats.skipped_existing, stopped=stats.stopped,
            redone=[b["index"] for b in stats.redone])
        provenance.add(root, "extract" if (i, n) == (0, 1) else f"extract shard {i}/{n}", rec)
    except (DraftgenError, OSError, ValueError, TypeError) as e:
        events.write("warn", f"extract: {root / provenance.PROVENANCE_FILE} was not written: {e}")


def _samples_sha256(root: Path) -> str:
    from draftgen.core.tokens import identity
    fp = identity.read_fingerprint(root / identity.HIDDEN_MERGE_FILE)
    return fp.samples_sha256 if fp is not None else ""


def _leave_handoff(config: Config, events: EventLog) -> None:
    """hidden_states/specforge.json, specforge-online.json and train-command.sh (handoff.py); a failure is
    said, never fatal."""
    from draftgen.core.extract.handoff import make_handoff, write_handoff, write_online, write_provenance
    started_at = time.time()
    try:
        h = make_handoff(config)
        written = [*write_handoff(h), write_online(h)]
        if config.extract.format == "speculators":
            from draftgen.core.extract import speculators_handoff
            speculators_handoff.write(config, max_length=h.max_length)
            written += speculators_handoff.written_files(config)
        write_provenance(config, h, started_at, written)
    except (DraftgenError, OSError, ValueError) as e:
        events.write("warn", f"extract: the training hand-off (`draftgen train-command {sh_path(config.path)}`) was "
                             f"not written: {e}")


def _draft_layer_ids(layers: tuple[int, ...], dims: ModelDims) -> list[int] | None:
    """The ids SGLang serves an EAGLE-3 draft with; None where SGLang cannot capture these layers."""
    from draftgen.core.extract.model_info import sglang_capture_ids
    try:
        return sglang_capture_ids(layers, dims)
    except ConfigError:
        return None


def _merge_id(root: Path) -> str:
    from draftgen.core.tokens import identity
    fp = identity.read_fingerprint(root / identity.HIDDEN_MERGE_FILE)
    return fp.merge_id if fp is not None else ""


def _checked(index: int, sample_id: str, input_ids: torch.Tensor, loss_mask: torch.Tensor, hidden: torch.Tensor,
             aux: torch.Tensor, dims: ModelDims, source: str, layers: int = 3) -> Item:
    """One sample's outputs for the writer, once their shapes are right (aux: `layers` layers side by side)."""
    length = int(input_ids.shape[0])
    h = dims.hidden_size
    if tuple(hidden.shape) != (length, h) or tuple(aux.shape) != (length, layers * h):
        raise DraftgenError(f"{source}: sample {index} gave hidden {tuple(hidden.shape)} and aux "
                            f"{tuple(aux.shape)}, expected ({length}, {h}) and ({length}, {layers * h})")
    return Item(index, sample_id, layout.SampleTensors(input_ids, loss_mask, hidden, aux))

