"""`draftgen extract CONFIG [--shard I/N|auto] [--plan]`: extraction with plain progress lines, for nohup and CI,
served to `draftgen attach RUN_DIR` (the extract stage and the GPU panel) from rank 0."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from draftgen.core.config import Config
from draftgen.core.errors import DraftgenError
from draftgen.core.live.events import Level
from draftgen.core.live.progress import every
from draftgen.core.live.snapshot import StageProgress
from draftgen.core.live.stage_payloads import ExtractDone
from draftgen.core.quoting import sh_path
from draftgen.core.safe_text import visible
from draftgen.core.units import compact_duration, fmt_bytes, fmt_count

PRINT_INTERVAL_S = 5.0


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise DraftgenError(f"--shard auto: {name}={env[name]!r} is not an integer") from None


def shard_from_env(env: Mapping[str, str]) -> tuple[tuple[int, int], str]:
    """This machine's (i, N) and where it came from: a Slurm job array, a multi-node Slurm job, or a
    multi-node torchrun.

    Slurm array: i = (SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN) / SLURM_ARRAY_TASK_STEP, N =
    SLURM_ARRAY_TASK_COUNT. Slurm job over several nodes (one task per node): i = SLURM_NODEID, N =
    SLURM_NNODES. torchrun (its elastic agent sets them): i = GROUP_RANK, N = GROUP_WORLD_SIZE, when
    more than one node joined (a --standalone torchrun is node 0 of 1 and says nothing of the others).
    """
    if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
        task, count = _env_int(env, "SLURM_ARRAY_TASK_ID"), _env_int(env, "SLURM_ARRAY_TASK_COUNT")
        low = _env_int(env, "SLURM_ARRAY_TASK_MIN") if "SLURM_ARRAY_TASK_MIN" in env else 0
        step = _env_int(env, "SLURM_ARRAY_TASK_STEP") if "SLURM_ARRAY_TASK_STEP" in env else 1
        i = (task - low) // max(step, 1)
        if count < 1 or not 0 <= i < count or (task - low) % max(step, 1):
            raise DraftgenError(f"--shard auto: the Slurm array gives task {task} (min {low}, step {step}) of "
                                f"{count}, which is not one of 0..{count - 1}; pass --shard I/N instead")
        return (i, count), f"Slurm array task {task} of {count} (SLURM_ARRAY_TASK_ID/COUNT/MIN)"
    if "SLURM_NODEID" in env and "SLURM_NNODES" in env and _env_int(env, "SLURM_NNODES") > 1:
        i, count = _env_int(env, "SLURM_NODEID"), _env_int(env, "SLURM_NNODES")
        if not 0 <= i < count:
            raise DraftgenError(f"--shard auto: Slurm gives SLURM_NODEID={i} of SLURM_NNODES={count}")
        return (i, count), f"Slurm node {i} of {count} (SLURM_NODEID/SLURM_NNODES)"
    if "GROUP_RANK" in env and "GROUP_WORLD_SIZE" in env and _env_int(env, "GROUP_WORLD_SIZE") > 1:
        i, count = _env_int(env, "GROUP_RANK"), _env_int(env, "GROUP_WORLD_SIZE")
        if count < 1 or not 0 <= i < count:
            raise DraftgenError(f"--shard auto: torchrun gives GROUP_RANK={i} of GROUP_WORLD_SIZE={count}")
        return (i, count), f"torchrun node {i} of {count} (GROUP_RANK/GROUP_WORLD_SIZE)"
    raise DraftgenError(
        "--shard auto: found no launcher to ask: neither a Slurm job array (SLURM_ARRAY_TASK_ID and "
        "SLURM_ARRAY_TASK_COUNT, from sbatch --array), nor a Slurm job over several nodes (SLURM_NODEID and "
        "SLURM_NNODES > 1), nor a multi-node torchrun (GROUP_RANK and GROUP_WORLD_SIZE > 1) set this process's "
        "environment (a --standalone torchrun knows no other machines); pass --shard I/N (e.g. 0/2 on the first "
        "of two machines)")


def parse_shard(text: str, env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """`"i/N"` -> (i, N) with 0 <= i < N; `"auto"` -> the launcher's (see shard_from_env)."""
    if text == "auto":
        return shard_from_env(os.environ if env is None else env)[0]
    try:
        i_text, n_text = text.split("/")
        i, n = int(i_text), int(n_text)
    except ValueError:
        raise DraftgenError(f"--shard {text!r}: expected I/N, e.g. 0/4 for the first of four machines") from None
    if n < 1 or not 0 <= i < n:
        raise DraftgenError(f"--shard {text!r}: I must be between 0 and N-1 (got I={i}, N={n})")
    return i, n


def progress_line(p: StageProgress) -> str:
    detail = dict(p.detail)
    return (f"extract {p.done:,}/{p.total:,} samples  {detail.get('tokens', '')} tok  "
            f"{fmt_count(p.rate)} {p.rate_unit}  written {detail.get('written', '')}  NaN {detail.get('NaN', '0')}  "
            f"ETA {compact_duration(p.eta_s)}")


def plan_command(config: Config, shard: str | None, *, out: TextIO | None = None, nvml: Any = None) -> int:
    """`draftgen extract CONFIG --plan`: print what the extraction would do and exit; no model is loaded.

    1 when the GPU plan says the job cannot fit (the lines say why, with the numbers)."""
    from draftgen.core.extract.plan import format_plan, make_plan
    stream = out or sys.stdout
    parsed = parse_shard(shard) if shard else (0, 1)
    plan = make_plan(config, parsed, nvml=nvml)
    for line in format_plan(plan):
        print(line, file=stream, flush=True)
    return 1 if plan.gpu is not None and plan.gpu.refusal else 0


def extract_command(config: Config, shard: str | None, *, out: TextIO | None = None, nvml: Any = None,
                    disk_watch: Any = None, on_other_merge: str = "refuse", validate: bool = False) -> int:
    """Print the plan, run extraction, print a progress line every few seconds and a summary; 0 when it finished.

    Nothing left to do: says so and returns 0 without importing torch or reading the model.
    hidden_states/ of another merge than merged/ (core/extract/claim.py): refused before anything is
    planned, unless `on_other_merge` is "start_over" (`--start-over`) or "set_aside" (`--set-aside`).
    `validate` (`--validate`): every file is read back first (core/extract/readback.py) and the bad ones
    are extracted again, even when no file is missing.
    DraftgenError (bad config, no merged tokens, not enough disk, backend missing) propagates to
    the CLI boundary, which prints it without a traceback.
    """
    from draftgen.core.extract.disk import DiskWatch
    from draftgen.core.extract.plan import format_plan, make_plan
    stream = out or sys.stdout
    parsed = parse_shard(shard) if shard else (0, 1)
    from draftgen.core.extract import claim
    rank0 = int(os.environ.get("RANK", "0")) == 0
    plan = make_plan(config, parsed, nvml=nvml)
    hidden = config.run_dir / "hidden_states"
    # Read only, the same on every rank: each rank decides alike; rank 0 acts once all have joined.
    standing = claim.standing(hidden, config.run_dir / "merged")
    if not standing.usable and on_other_merge == claim.REFUSE:
        raise claim.refusal(standing, hidden, config.path)
    if rank0:
        for line in format_plan(plan):
            print(line, file=stream, flush=True)
        print(_standing_line(standing, hidden, on_other_merge), file=stream, flush=True)
    if not validate and (_nothing_left(config, plan, standing, rank0)
                         or _budget_spent(config, plan, standing, rank0, stream)):
        return 0
    if plan.gpu is not None and plan.gpu.refusal:  # before any weight loads
        raise DraftgenError(plan.gpu.refusal)
    if disk_watch is None:
        disk_watch = DiskWatch(margin_bytes=int(config.extract.min_free_gb * 2**30),
                               say=lambda m: print(m, file=stream, flush=True))
    extract = _runner_extract()
    publisher = None
    if rank0 and config.run_dir.is_dir():  # `draftgen attach RUN_DIR` shows the stage and the GPU panel
        from draftgen.core.extract.publish import ExtractPublisher
        publisher = ExtractPublisher(config, nvml=nvml)

    printer = every(PRINT_INTERVAL_S, lambda p: print(progress_line(p), file=stream, flush=True))

    def show(p: StageProgress) -> None:
        if publisher is not None:
            publisher.progress(p)
        printer(p)

    with publisher if publisher is not None else contextlib.nullcontext():
        if publisher is not None and not publisher.serving:
            print(f"warning: not serving attach: {publisher.error}", file=stream, flush=True)
        try:
            stats = extract(config, shard=parsed, progress=show, disk_watch=disk_watch,
                            on_other_merge=on_other_merge, validate=validate)
        except BaseException as e:
            if publisher is not None:
                publisher.finish(ExtractDone(outcome="failed", cause=str(e), at=Level.ERROR))
            raise
        if publisher is not None:
            publisher.finish(ExtractDone(outcome="stopped" if stats.stopped else "done", written=stats.written,
                                         existing=stats.skipped_existing, nan=stats.nan_samples, short=True,
                                         at=Level.INFO))
    if not rank0:
        return 0  # under torchrun rank 0 planned, wrote and reports; the others only ran forwards
    _print_summary(config, stats, parsed, stream)
    return 0

def _standing_line(standing: Any, hidden: Any, on_other_merge: str) -> str:
    """What the plan says of hidden_states/: whose merge they are, or what happens to another merge's."""
    from draftgen.core.extract import claim
    if standing.usable:
        return f"hidden states belong to {standing.current.describe()}"
    what = ("deleted (--start-over)" if on_other_merge == claim.START_OVER else
            f"moved to {claim.identity.aside_path(hidden, standing.stored)}/ (--set-aside)")
    why = "; ".join(standing.differences())
    return (f"hidden_states/ holds {standing.files:,} files of another merge ({why}): they are {what}"
            f" and every sample of {standing.current.describe()} is extracted (the plan "
            f"above counted them as done)")


def _nothing_left(config: Config, plan: Any, standing: Any, rank0: bool) -> bool:
    """Every sample is written, for this merge: nothing to load (an older folder checked file by file is
    recorded as this merge's on the way)."""
    from draftgen.core.extract import claim
    if not (plan.nothing_to_do and standing.usable):
        return False
    if standing.state == claim.ADOPTED and rank0:
        claim.settle(config.run_dir / "hidden_states", config.run_dir / "merged", claim.REFUSE, config.path)
    return True


def _budget_spent(config: Config, plan: Any, standing: Any, rank0: bool, stream: TextIO) -> bool:
    """extract.max_disk_gb holds no more sample of those left: says so (rank 0); nothing is loaded."""
    if not (plan.max_disk_bytes and not plan.budget_fits and plan.budget_left and standing.usable):
        return False
    if rank0:
        print(f"extract: nothing extracted: extract.max_disk_gb = {config.extract.max_disk_gb:g} is spent "
              f"({fmt_bytes(plan.budget_used)} written); {plan.budget_left:,} samples (~"
              f"{fmt_bytes(plan.budget_left_bytes)}) are left: raise extract.max_disk_gb and run "
              f"`draftgen extract {sh_path(config.path)}` again", file=stream, flush=True)
    return True


def _runner_extract() -> Any:
    """runner.extract, or a DraftgenError saying how to install torch when it is missing."""
    try:
        from draftgen.core.extract.runner import extract
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        raise DraftgenError("draftgen extract needs PyTorch, which is not installed: "
                            "pip install 'draftgen[extract]' (or torch itself, see README)") from None
    return extract


def _print_summary(config: Config, stats: Any, parsed: tuple[int, int], stream: TextIO) -> None:
    """Rank 0's closing lines: what was written, the hand-off, the draft config, what was skipped."""
    where = config.run_dir / "hidden_states"
    print(f"extract {'stopped' if stats.stopped else 'done'}: {stats.written:,} files written to {visible(str(where))} "
          f"({fmt_count(stats.tokens_written)} tokens, {fmt_bytes(stats.bytes_written)}, "
          f"{stats.tokens_per_s:,.0f} tok/s), {stats.skipped_existing:,} already there, "
          f"{stats.nan_samples:,} with NaN not written; model {stats.model} (N={stats.num_layers}, "
          f"H={stats.hidden_size}), aux layers {list(stats.layers)} ({stats.layer_set}), {stats.backend}, "
          f"shard {parsed[0]}/{parsed[1]}", file=stream, flush=True)
    if stats.claim_note:
        print(stats.claim_note, file=stream, flush=True)
    for bad in stats.redone:
        print(visible(f"--validate: {bad['path']} (sample {bad['index']}) was bad, extracted again: {bad['why']}",
                      one_line=True), file=stream, flush=True)
    if (where / "train-command.sh").exists() and stats.format != "speculators":  # speculators: its own script below
        print(f"training: {visible(str(where / 'train-command.sh'))} (SpecForge's command and config, "
              f"data.max_length = the longest sample; `draftgen train-command {sh_path(config.path)}` explains it)",
              file=stream, flush=True)
    _print_speculators(stats, where, stream)
    eagle = stats.trainer_layer_ids.get("eagle3")
    if eagle is not None:
        print(f"draft config: eagle_config.eagle_aux_hidden_state_layer_ids = {eagle} "
              f"(SGLang's numbering of layers {list(stats.layers)}; also in stats.json)", file=stream, flush=True)
    if stats.layers and len(stats.layers) != 3:
        print(f"draft config: dflash_config.target_layer_ids = {stats.trainer_layer_ids.get('dflash')} (DFlash's and "
              f"DSpark's numbering; {len(stats.layers)} layers: not an EAGLE-3 set, see docs/extraction.md)",
              file=stream, flush=True)
    if stats.budget_left:
        from draftgen.core.extract.stats import budget_line
        print(f"extract: {budget_line(config, stats)}", file=stream, flush=True)
    if stats.too_long_samples:
        shown = ", ".join(f"{x['index']} ({x['tokens']:,} tokens)" for x in stats.too_long[:10])
        more = f" and {stats.too_long_samples - 10} more" if stats.too_long_samples > 10 else ""
        print(f"warning: samples longer than the model's context (skipped, not written): {shown}{more}; "
              f"see stats.json", file=stream, flush=True)
    if stats.nan_samples:
        shown = ", ".join(str(x["index"]) for x in stats.nan[:10])
        more = f" and {stats.nan_samples - 10} more" if stats.nan_samples > 10 else ""
        print(f"warning: samples with NaN/Inf (not written): {shown}{more}; see stats.json", file=stream, flush=True)



def _print_speculators(stats: Any, where: Any, stream: TextIO) -> None:
    """format = "speculators": its layer ids, its command, and the FP8 error measured on the files written."""
    if getattr(stats, "format", "specforge") != "speculators":
        return
    from draftgen.core.extract import speculators_layout
    from draftgen.core.extract.speculators_handoff import SCRIPT_FILE
    print(f"speculators: files hs_{{i}}.safetensors, {stats.dtype}, layers {stats.target_layer_ids} in vLLM's "
          f"numbering (the last: before the final norm; also in stats.json and each file's metadata)",
          file=stream, flush=True)
    if (where / SCRIPT_FILE).exists():
        print(f"training with speculators: {visible(str(where / SCRIPT_FILE))}", file=stream, flush=True)
    if stats.fp8_error is not None:
        print(speculators_layout.describe(stats.fp8_error) + " (per slot in stats.json)", file=stream, flush=True)


def self_check_command(config: Config | None, *, long_tokens: int, out: TextIO | None = None) -> int:
    """`draftgen extract [CONFIG] --self-check`: the checklist on tiny models; 0 when every check passed.

    With a config, its [extract] backend and settings are checked (its model only sizes the memory
    extrapolation); without one, the hf backend on this machine (float32 on a CPU).
    """
    import dataclasses
    from pathlib import Path

    from draftgen.core.config_tables import ExtractConfig
    if long_tokens < 8:
        raise DraftgenError(f"--long-tokens {long_tokens}: must be at least 8")
    try:
        import torch
    except ModuleNotFoundError:
        raise DraftgenError("draftgen extract --self-check needs PyTorch: pip install 'draftgen[extract]'") from None
    from draftgen.core.extract.selfcheck import print_result, run_self_check
    if config is None:
        base = ExtractConfig(dtype="bfloat16" if torch.cuda.is_available() else "float32")
        path = Path("selfcheck.toml")
    else:
        base, path = config.extract, config.path
    if base.backend == "hf" and (base.device == "cpu" or not torch.cuda.is_available()):
        # On a CPU the reference is float32 too: nearly flat random logits compared across bf16
        # rounding would test the rounding, not the extraction.
        base = dataclasses.replace(base, dtype="float32")
    result = run_self_check(base, long_tokens=long_tokens, config_path=path, config=config)
    if result.rows:  # only rank 0 of a torchrun job has rows to print
        print_result(result, out)
    return 0 if result.passed or not result.rows else 1
