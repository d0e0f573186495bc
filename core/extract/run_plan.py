"""Rank 0's plan of one extraction run, made before any model loads and shared with every rank of a torchrun
job (`make_run_plan`): hidden_states/ claimed for this merge (claim.py) or refused, the temporaries a killed
run of this shard left removed, files of another format or layer set refused, --validate's bad files
removed, then the shard's samples still to do, less those longer than the model's context and those past
extract.max_disk_gb (left for a later run), their batches, the free-space check, and, for the specforge
backend, the GPU plan's mem_fraction_static (gpu_plan.py).

Before it, `already_done`: a shard whose every file is there (or was skipped by an earlier run as longer
than this same context) is reported without loading the model or making a process group.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftgen.core.config import Config
from draftgen.core.errors import ConfigError, DiskError, DraftgenError
from draftgen.core.extract import claim, layout
from draftgen.core.extract import speculators_layout as speculators
from draftgen.core.extract.disk import (
    FILE_OVERHEAD_BYTES,
    IDS_MASK_BYTES_PER_TOKEN,
    bytes_needed,
    disk_budget,
    stored_dtype,
    token_bytes,
)
from draftgen.core.extract.model_info import ModelDims, read_model_config, resolve_aux_layers
from draftgen.core.extract.plan import context_limit, plan_batches, recorded_too_long
from draftgen.core.extract.stats import ExtractStats
from draftgen.core.files import TMP_MARK, disk_error
from draftgen.core.live.snapshot import StageProgress, StageState
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.store import TokenEntry, TokenReader
from draftgen.core.units import fmt_bytes


@dataclass
class RunPlan:
    """What rank 0 decides before any model loads, shared with every rank of a torchrun job."""
    todo: list[int]
    batches: list[list[int]]
    skipped_existing: int
    tokens_todo: int
    max_forward_tokens: int  # padded tokens of the largest planned batch
    max_samples: int
    note: str = ""           # what claim.settle did to hidden states of another merge
    mem_fraction: float = 0.0  # SGLang's mem_fraction_static from the GPU plan (0: the backend's default)
    too_long: list[dict[str, Any]] = field(default_factory=list)  # longer than the context: skipped
    context: int | None = None
    budget_left: list[int] = field(default_factory=list)  # past extract.max_disk_gb: left for a later run
    budget_left_bytes: int = 0
    redone: list[dict[str, Any]] = field(default_factory=list)    # --validate: bad files removed, to redo


def already_done(config: Config, rundir: RunDir, reader: TokenReader, shard: tuple[int, int],
                 progress: Callable[[StageProgress], None] | None, on_other_merge: str) -> ExtractStats | None:
    """The stats of a shard whose every sample is already written for this merge, or was skipped by an earlier
    run as longer than the same context (no model loaded, no process group), else None; hidden states of
    another merge are refused here unless `on_other_merge` says what to do."""
    standing = claim.standing(rundir.hidden_states, rundir.merged, reader)  # read only: every rank sees the same
    if not standing.usable and on_other_merge == claim.REFUSE:
        raise claim.refusal(standing, rundir.hidden_states, config.path)
    indices = shard_indices(len(reader), shard)
    if standing.state not in (claim.SAME, claim.ADOPTED):
        return None
    missing = [k for k in indices if _existing(config.extract, rundir.hidden_states, k) is None]
    context = _settled_context(config, rundir.hidden_states, standing, missing) if missing else None
    if missing and context is None:
        return None
    if standing.state == claim.ADOPTED:  # every file checked to be this merge's: recorded (same bytes on each rank)
        claim.settle(rundir.hidden_states, rundir.merged, claim.REFUSE, config.path, reader)
    too_long = [{"index": k, "id": reader.entries[k].id, "tokens": reader.entries[k].length} for k in missing]
    return _nothing_to_do(config, shard, len(indices), progress, standing, too_long, context)


def _settled_context(config: Config, root: Path, standing: claim.Standing, missing: list[int]) -> int | None:
    """The context when every missing sample was skipped as longer than it by an earlier run of this merge and
    model, at this same context (only the model's config.json is read, never its weights); else None."""
    recorded = recorded_too_long(root, standing.current.merge_id, config.extract.model)
    if any(k not in recorded for k in missing):
        return None
    cfg = config.extract
    try:
        model_cfg, _source = read_model_config(cfg.model, trust_remote_code=cfg.trust_remote_code)
    except DraftgenError:
        return None  # the run that follows says what is wrong with it
    context = context_limit(cfg, model_cfg)
    if context is None or any(context not in recorded[k] for k in missing):
        return None
    return context


def _nothing_to_do(config: Config, shard: tuple[int, int], samples: int,
                   progress: Callable[[StageProgress], None] | None, standing: claim.Standing,
                   too_long: list[dict[str, Any]], context: int | None) -> ExtractStats:
    """Every file of the shard exists, but for samples skipped as longer than this same context: report it
    without loading the model or making a process group."""
    cfg = config.extract
    there = samples - len(too_long)
    if progress is not None:
        skipped = (f", {len(too_long):,} skipped as longer than the context of {context:,} tokens"
                   if too_long and context else "")
        progress(StageProgress(name="extract", state=StageState.DONE, done=samples, total=samples,
                               rate_unit="tok/s", eta_s=0.0,
                               message=f"nothing to do: {there:,} files already there{skipped}"))
    return ExtractStats(model=cfg.model, backend="none (nothing to do)", num_layers=0, hidden_size=0,
                        layers=(), shard=shard, compress=cfg.compress, samples=samples,
                        skipped_existing=there, nothing_to_do=True, merge_id=standing.current.merge_id,
                        format=cfg.format,
                        too_long_samples=len(too_long), too_long=too_long, context=context)


def make_run_plan(root: Path, reader: TokenReader, shard: tuple[int, int], dims: ModelDims, limit: int,
                  cfg: Any, max_samples: int | None, on_other_merge: str = claim.REFUSE, *,
                  model: tuple[dict[str, Any], str] | None = None, gpu_plan: bool = False,
                  config_path: object = "config", layers: int = 3, validate: Any = None) -> RunPlan:
    # Rank 0, every rank joined: the folder is made this merge's (or refused) before a file is added.
    note = claim.settle(root, root.parent / "merged", on_other_merge, config_path, reader)
    try:
        layout.make_dir(root, group_readable=cfg.group_readable)
        if cfg.group_readable:  # the group must pass through the run folder to reach hidden_states/
            mode = root.parent.stat().st_mode & 0o777
            if mode & 0o050 != 0o050:
                os.chmod(root.parent, mode | 0o050)
    except OSError as e:
        raise disk_error(root, e) from e
    _remove_stale_tmp(root, shard)
    _refuse_other_format(cfg, root, config_path)
    _refuse_other_layers(root, resolve_aux_layers(cfg.aux_layers, dims, str(config_path)), config_path)
    redone = _remove_bad(root, reader, shard, validate, cfg) if validate is not None else []
    entries: list[TokenEntry] = reader.entries
    indices = shard_indices(len(reader), shard)
    todo = [k for k in indices if _existing(cfg, root, k) is None]
    context = context_limit(cfg, model[0]) if model is not None else None
    too_long = [k for k in todo if context is not None and entries[k].length > context]
    if too_long:  # the forward would fail on it (SGLang refuses it; a RoPE model past its length gives junk)
        skip = set(too_long)
        todo = [k for k in todo if k not in skip]
    dtype = stored_dtype(cfg)
    left: list[int] = []
    if cfg.max_disk_gb > 0:  # merged order, up to this shard's share of the budget; the rest waits for a later run
        todo, left, _used = disk_budget(root, indices, [e.length for e in entries], todo,
                                        int(cfg.max_disk_gb * 1e9 / shard[1]),
                                        lambda t: bytes_needed(t, 1, dims.hidden_size, layers, dtype),
                                        fmt=cfg.format)
    tokens_todo = sum(entries[k].length for k in todo)
    _check_disk(root, tokens_todo, len(todo), dims, layers, dtype)
    if cfg.backend == "specforge" and todo:
        from draftgen.core.extract.specforge_backend import check_shm
        check_shm(cfg.min_shm_gb)
    batches = plan_batches([(k, entries[k].length) for k in todo], limit, max_samples)
    widest = max((len(b) * max(entries[k].length for k in b) for b in batches), default=0)
    most = max((len(b) for b in batches), default=0)
    fraction = 0.0
    if gpu_plan and cfg.backend == "specforge" and todo and model is not None:
        from draftgen.core.extract.gpu_plan import make_gpu_plan
        gpu = make_gpu_plan(cfg, model[0], model[1], widest, most, config_path=config_path)
        if gpu.refusal:
            raise DraftgenError(gpu.refusal)
        fraction = gpu.fraction
    there = len(indices) - len(todo) - len(too_long) - len(left)  # files on disk: not those left for the budget
    return RunPlan(todo=todo, note=note, batches=batches, skipped_existing=there,
                 tokens_todo=tokens_todo, max_forward_tokens=widest, max_samples=most, mem_fraction=fraction,
                 too_long=[{"index": k, "id": entries[k].id, "tokens": entries[k].length} for k in too_long],
                 context=context, budget_left=left,
                 budget_left_bytes=bytes_needed(sum(entries[k].length for k in left), len(left), dims.hidden_size,
                                                layers, dtype),
                 redone=redone)


def shard_indices(count: int, shard: tuple[int, int]) -> range:
    i, n = shard
    return range(i, count, n)


def _existing(cfg: Any, root: Path, index: int) -> Path | None:
    """The file already written for `index` in the configured format."""
    return speculators.existing_file(cfg.format, root, index)


def _refuse_other_format(cfg: Any, root: Path, config_path: object) -> None:
    """One format per folder: files of the other trainer's layout would be neither redone nor read."""
    speculators.refuse_other_format(cfg.format, root, config_path)


def _refuse_other_layers(root: Path, layers: tuple[int, ...], config_path: object) -> None:
    """The files of one folder hold one layer set: where a run's stats (stats.json, a shard's) say its files hold
    other aux layers than `layers`, they would be skipped as already there and trained on as these (a SpecForge
    `.ckpt` names no layers; a speculators file's own are checked by `draftgen check`)."""
    import orjson

    from draftgen.core.tokens import identity
    if not root.is_dir():
        return
    for stats in sorted(root.glob("stats*.json")):
        try:
            obj = orjson.loads(stats.read_bytes())
            before = [int(k) for k in obj["layers"]] if isinstance(obj, dict) and obj.get("layers") else None
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
        if before is not None and before != list(layers) and identity.stored_samples(root):
            raise ConfigError(f"{config_path}: extract.aux_layers gives layers {list(layers)}, but the files in {root} "
                              f"hold layers {before} ({stats.name}): extracting would mix two layer sets, the files "
                              f"there skipped as already done. Move hidden_states/ aside (or set aux_layers back to "
                              f"{before}) before extracting these layers")


def _remove_stale_tmp(root: Path, shard: tuple[int, int]) -> None:
    """Delete temporary files a killed run of *this* shard left (other machines may be writing theirs)."""
    i, n = shard
    for folder in root.glob("rows_*"):
        for tmp in folder.glob(f".data_*{TMP_MARK}*"):
            digits = tmp.name.removeprefix(".data_").split(".", 1)[0]
            if digits.isdigit() and int(digits) % n == i:
                tmp.unlink(missing_ok=True)
    for tmp in speculators.stale_temporaries(root, shard):
        tmp.unlink(missing_ok=True)


def _check_disk(root: Path, tokens: int, files: int, dims: ModelDims, layers: int = 3, dtype: str = "bf16") -> None:
    need = bytes_needed(tokens, files, dims.hidden_size, layers, dtype)
    free = shutil.disk_usage(root).free
    if need > free:
        raise DiskError(
            f"{root}: extraction needs {fmt_bytes(need)} ({need:,} bytes: {tokens:,} tokens x "
            f"{token_bytes(dims.hidden_size, layers, dtype):,} bytes ({dtype} states of {layers} aux layers + the "
            f"last, ({layers}H+H) with H={dims.hidden_size}, and {IDS_MASK_BYTES_PER_TOKEN} of ids and mask) + "
            f"{FILE_OVERHEAD_BYTES:,} per file, for the {files:,} samples still to do) but only {fmt_bytes(free)} "
            f"({free:,} bytes) is free there")


def _remove_bad(root: Path, reader: TokenReader, shard: tuple[int, int], expected: Any, cfg: Any,
                ) -> list[dict[str, Any]]:
    """--validate (rank 0, before the plan): the shard's files read back by the trainer's rules (readback.py);
    the bad ones of this merge's samples are deleted, so the plan extracts them again."""
    from draftgen.core.extract import readback
    result = readback.check_folder(root, reader, expected, fmt=readback.format_of(cfg), shard=shard)
    removed, _left = readback.remove_bad(result)  # files no sample owns: `draftgen check` lists them
    return [{"index": b.index, "path": str(b.path), "why": b.why} for b in removed]
