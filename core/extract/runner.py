"""`extract()`: the target model over `merged/tokens/`, written as SpecForge offline files (see layout.py).

Synchronous on purpose: the model forward is the whole cost, and the caller (the TUI's engine, or
`draftgen extract`) runs it in a thread and reads its progress through the `progress` callback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftgen.core.config import Config
from draftgen.core.errors import ConfigError, DiskError, DraftgenError
from draftgen.core.extract import claim, layout
from draftgen.core.extract import speculators_layout as speculators
from draftgen.core.extract.backend import ExtractBackend, make_backend
from draftgen.core.extract.disk import (
    FILE_OVERHEAD_BYTES,
    IDS_MASK_BYTES_PER_TOKEN,
    disk_budget,
    state_bytes,
    stored_dtype,
    token_bytes,
)
from draftgen.core.extract.model_info import (
    ModelDims,
    dims_from_config_dict,
    read_model_config,
    resolve_aux_layers,
    trainer_layer_ids,
)
from draftgen.core.extract.plan import context_limit, plan_batches, recorded_too_long
from draftgen.core.extract.writer import Item, PooledWriter, Written
from draftgen.core.files import GROUP_FILE_MODE, TMP_MARK, disk_error, write_json_atomic
from draftgen.core.live.progress import Throttle
from draftgen.core.live.snapshot import StageProgress, StageState
from draftgen.core.merge.swap import merge_lock
from draftgen.core.quoting import sh_path
from draftgen.core.rundir import EventLog, RunDir
from draftgen.core.tokens.store import INDEX_FILE, TokenEntry, TokenReader
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


def bytes_needed(tokens: int, files: int, hidden_size: int, layers: int = 3, dtype: str = "bf16") -> int:
    """(layers + 1)·H states a token in `dtype`, plus the ids, the mask and each file's container (disk.state_bytes)."""
    return state_bytes(tokens, files, hidden_size, layers, dtype)


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


def _shard_indices(count: int, shard: tuple[int, int]) -> range:
    i, n = shard
    return range(i, count, n)


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


def stats_path(root: Path, shard: tuple[int, int]) -> Path:
    # Machines running different shards share the folder; each keeps its own stats.
    return root / ("stats.json" if shard == (0, 1) else f"stats.shard-{shard[0]}-of-{shard[1]}.json")


class _Reporter:
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


def _batches_of_arrays(reader: TokenReader,
                       batches: list[list[int]]) -> Iterator[tuple[list[int], list[Any], list[Any]]]:
    for batch in batches:
        ids, masks = [], []
        for index in batch:
            i, m = reader.arrays(reader.entries[index])
            ids.append(i)
            masks.append(m)
        yield batch, ids, masks


@dataclass
class _Plan:
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


def _make_plan(root: Path, reader: TokenReader, shard: tuple[int, int], dims: ModelDims, limit: int,
               cfg: Any, max_samples: int | None, on_other_merge: str = claim.REFUSE, *,
               model: tuple[dict[str, Any], str] | None = None, gpu_plan: bool = False,
               config_path: object = "config", layers: int = 3, validate: Any = None) -> _Plan:
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
    indices = _shard_indices(len(reader), shard)
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
    return _Plan(todo=todo, note=note, batches=batches, skipped_existing=there,
                 tokens_todo=tokens_todo, max_forward_tokens=widest, max_samples=most, mem_fraction=fraction,
                 too_long=[{"index": k, "id": entries[k].id, "tokens": entries[k].length} for k in too_long],
                 context=context, budget_left=left,
                 budget_left_bytes=bytes_needed(sum(entries[k].length for k in left), len(left), dims.hidden_size,
                                                layers, dtype),
                 redone=redone)


def _expected(cfg: Any, dims: ModelDims, layers: tuple[int, ...]) -> Any:
    """What --validate reads every file back against: this model's H, the layers extracted, the stored dtype
    (and FP8's scales)."""
    from draftgen.core.extract.readback import expected_of
    return expected_of(cfg, dims.hidden_size, len(layers), speculators.vllm_layer_ids(layers, dims.num_layers))


def _remove_bad(root: Path, reader: TokenReader, shard: tuple[int, int], expected: Any, cfg: Any,
                ) -> list[dict[str, Any]]:
    """--validate (rank 0, before the plan): the shard's files read back by the trainer's rules (readback.py);
    the bad ones of this merge's samples are deleted, so the plan extracts them again."""
    from draftgen.core.extract import readback
    result = readback.check_folder(root, reader, expected, fmt=readback.format_of(cfg), shard=shard)
    removed, _left = readback.remove_bad(result)  # files no sample owns: `draftgen check` lists them
    return [{"index": b.index, "path": str(b.path), "why": b.why} for b in removed]


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


def _already_done(config: Config, rundir: RunDir, reader: TokenReader, shard: tuple[int, int],
                  progress: Callable[[StageProgress], None] | None, on_other_merge: str) -> ExtractStats | None:
    """The stats of a shard whose every sample is already written for this merge, or was skipped by an earlier
    run as longer than the same context (no model loaded, no process group), else None; hidden states of
    another merge are refused here unless `on_other_merge` says what to do."""
    standing = claim.standing(rundir.hidden_states, rundir.merged, reader)  # read only: every rank sees the same
    if not standing.usable and on_other_merge == claim.REFUSE:
        raise claim.refusal(standing, rundir.hidden_states, config.path)
    indices = _shard_indices(len(reader), shard)
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
    done = (_already_done(config, rundir, reader, shard, progress, on_other_merge)
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
        plan: _Plan = group.share(lambda: _make_plan(
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


def _log_plan(events: EventLog, plan: _Plan, stats: ExtractStats, shard: tuple[int, int],
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
                reader: TokenReader, root: Path, plan: _Plan, backend: ExtractBackend,
                progress: Callable[[StageProgress], None] | None, stop: threading.Event | None,
                rundir: RunDir, disk_watch: Any = None, *, started_at: float | None = None,
                model: tuple[dict[str, Any], str] | None = None) -> ExtractStats:
    cfg = config.extract
    entries: list[TokenEntry] = reader.entries
    indices = _shard_indices(len(reader), shard)
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
    reporter = _Reporter(progress, stats, backend.description, plan.tokens_todo)
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
                _account(done, stats, events, quant)
            reporter.emit()
        for done in pool.drain():
            _account(done, stats, events, quant)
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


def budget_line(config: Config, stats: ExtractStats) -> str:
    """What extract.max_disk_gb left undone, and how to go on."""
    return (f"stopped at the disk budget (extract.max_disk_gb = {stats.max_disk_gb:g}): {stats.budget_left:,} samples "
            f"(from sample {stats.budget_left_from}, ~{fmt_bytes(stats.budget_left_bytes)} more) are left; raise "
            f"extract.max_disk_gb by at least {stats.budget_left_bytes / 1e9:.3g} (or free space) and run "
            f"`draftgen extract {sh_path(config.path)}` again: the files written are kept and skipped")


def layer_set_text(aux_layers: str | list[int]) -> str:
    return aux_layers if isinstance(aux_layers, str) else str(list(aux_layers))


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


def _checked(index: int, sample_id: str, input_ids: torch.Tensor, loss_mask: torch.Tensor, hidden: torch.Tensor,
             aux: torch.Tensor, dims: ModelDims, source: str, layers: int = 3) -> Item:
    """One sample's outputs for the writer, once their shapes are right (aux: `layers` layers side by side)."""
    length = int(input_ids.shape[0])
    h = dims.hidden_size
    if tuple(hidden.shape) != (length, h) or tuple(aux.shape) != (length, layers * h):
        raise DraftgenError(f"{source}: sample {index} gave hidden {tuple(hidden.shape)} and aux "
                            f"{tuple(aux.shape)}, expected ({length}, {h}) and ({length}, {layers * h})")
    return Item(index, sample_id, layout.SampleTensors(input_ids, loss_mask, hidden, aux))


def _account(done: Written, stats: ExtractStats, events: EventLog,
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
