"""The read-back check: every hidden-state file read back by its trainer's own rules, against merged/.

`draftgen check CONFIG [--shard I/N]` reads every file (read only) and lists the bad ones with why;
`draftgen extract CONFIG --validate` runs the same check first, removes the bad files of its shard
and extracts those samples again (and the missing ones; nothing else).

A format is a `Format`: the files its trainer would read under hidden_states/, each with the merged
row it claims, and a function that checks one file against its row (`check_file(path, ids, mask,
expected)`: None when good, else why, in words). SpecForge's offline `.ckpt` layout
(layout.py), by the rules of its reader (specforge/data/preprocessing.py and the 0.2.0
`OfflineManifestReader`/`normalize_offline_sample`, tests/specforge_read.py):

- every file under the folder ending in `.ckpt` or `.ckpt.gz` is a sample to it: one whose name is
  not `data_<i>` with `i` a row of merged/tokens, or a second file for the same row, is bad (it would
  be trained on as a sample of its own);
- the file loads (`torch.load`, through gzip for `.gz`): a truncated or corrupt file does not;
- it is a dict with `input_ids` and `loss_mask` int64 [T], `hidden_state` [1, T, H] and
  `aux_hidden_state` [1, T, k*H], both of the stored dtype (bfloat16), T >= 1: H and k are the
  configured model's hidden size and number of aux layers (from its config.json; stats.json's when
  the model is not on this machine);
- every value of both states is finite;
- `input_ids` and `loss_mask` equal merged/tokens entry `i`, token for token.

and speculators' `hs_{i}.safetensors` (speculators_layout.py) by speculators 0.9.0 / hs-connectors 0.9.0's
reader (`check_speculators_file`): loads, `token_ids` int64 [T] equal to the row's ids, `hidden_states`
[T, k+1, H] of the stored dtype, finite as dequantized, FP8's scales [T, 1, 1].

`Expected.scale_key` is the hook for FP8 files: when a format stores FP8, the file must also hold its
scales under that key, [T, ...] float32, finite and positive.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from draftgen.core.errors import DraftgenError
from draftgen.core.tokens import identity
from draftgen.core.tokens.store import INDEX_FILE, TokenReader

THREADS = 4            # files read at once (torch.load and the finite check release the GIL)
PRINT_INTERVAL_S = 5.0


@dataclass(frozen=True)
class Expected:
    """What every file must hold beside its row's ids and mask."""
    hidden_size: int
    layers: int                     # aux layers stacked in the file (3 for EAGLE-3)
    dtype: str = "bfloat16"         # the states' stored dtype, as torch names it
    scale_key: str | None = None    # FP8: the key of the per-token scales, which must be present
    # speculators: the slots' layers in vLLM's numbering, which each file's metadata must name (None: unchecked)
    layer_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Bad:
    """One file a trainer would read wrongly: `index` its merged row (-1: none of this merge's rows)."""
    index: int
    path: Path
    why: str


FileCheck = Callable[[Path, np.ndarray, np.ndarray, Expected], "str | None"]


@dataclass(frozen=True)
class Format:
    """How one trainer's files are found (`files(root)`: (row index or -1, path), every file it reads) and
    how one is checked against its merged row."""
    name: str
    files: Callable[[Path], list[tuple[int, Path]]]
    check_file: FileCheck


@dataclass
class CheckResult:
    checked: int = 0                                   # files read back (one per row)
    good: int = 0                                      # of those, read right
    bad: list[Bad] = field(default_factory=list)      # in path order: those read wrong, and files no row or a
                                                       # second file of a row
    missing: list[int] = field(default_factory=list)  # rows of the scope with no file
    bytes_read: int = 0


# ---------------------------------------------------------------------------------------------
# SpecForge's offline layout


def specforge_files(root: Path) -> list[tuple[int, Path]]:
    """Every file SpecForge's reader takes under `root` (it walks and keeps `.ckpt`/`.ckpt.gz`), sorted by path
    as it sorts them, each with the row its name gives (`data_<i>.ckpt`), -1 for any other name."""
    out = []
    for folder, _dirs, names in os.walk(root):
        for name in names:
            if not name.endswith(identity.SAMPLE_SUFFIXES):
                continue
            stem = name.removesuffix(".gz").removesuffix(".ckpt")
            digits = stem.removeprefix("data_")
            index = int(digits) if stem.startswith("data_") and digits.isdigit() else -1
            out.append((index, Path(folder) / name))
    return sorted(out, key=lambda x: str(x[1]))


def _first_difference(got: np.ndarray, want: np.ndarray) -> int:
    return int(np.nonzero(got != want)[0][0])


def check_specforge_file(path: Path, ids: np.ndarray, mask: np.ndarray, expected: Expected) -> str | None:
    """None when SpecForge reads `path` as merged row (`ids`, `mask`) with the expected states; else why."""
    import torch

    from draftgen.core.extract import layout
    try:
        data = layout.load_sample(path)
    except Exception as e:  # noqa: BLE001 - whatever torch.load or gzip raise, the file is unreadable
        return f"unreadable (truncated or corrupt): {type(e).__name__}: {e}"
    if not isinstance(data, dict):
        return f"holds a {type(data).__name__}, not a dict of tensors"
    missing = [k for k in layout.KEYS if not isinstance(data.get(k), torch.Tensor)]
    if missing:
        return f"no tensor {', '.join(missing)} (SpecForge reads {', '.join(layout.KEYS)})"
    input_ids, loss_mask = data["input_ids"], data["loss_mask"]
    hidden, aux = data["hidden_state"], data["aux_hidden_state"]
    t = int(input_ids.shape[0]) if input_ids.dim() == 1 else -1
    h, k = expected.hidden_size, expected.layers
    want = {"input_ids": (torch.int64, (t,)), "loss_mask": (torch.int64, (t,)),
            "hidden_state": (getattr(torch, expected.dtype), (1, t, h)),
            "aux_hidden_state": (getattr(torch, expected.dtype), (1, t, k * h))}
    if t < 1:
        return f"input_ids has shape {tuple(input_ids.shape)}, not [T] with T >= 1"
    if aux.dim() == 3 and aux.shape[-1] != k * h and aux.shape[-1] % h == 0:
        return f"aux_hidden_state holds {aux.shape[-1] // h} layers of H={h}, not {k} (the configured aux layers)"
    for key, (dtype, shape) in want.items():
        tensor = data[key]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            return (f"{key} is {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}, expected "
                    f"{str(dtype).removeprefix('torch.')} {list(shape)}")
    if not layout.SampleTensors(input_ids, loss_mask, hidden[0], aux[0]).is_finite():
        return "NaN or Inf in its hidden states"
    if expected.scale_key is not None:
        why = _check_scales(data.get(expected.scale_key), expected.scale_key, t)
        if why:
            return why
    if len(ids) != t:
        return f"holds {t:,} tokens, but merged/tokens row has {len(ids):,} (another sample's states)"
    got_ids, got_mask = input_ids.numpy(), loss_mask.numpy()
    if not np.array_equal(got_ids, ids):
        at = _first_difference(got_ids, ids)
        return (f"input_ids differ from merged/tokens from token {at:,} on ({int(got_ids[at])} where merged has "
                f"{int(ids[at])}): another sample's states")
    if not np.array_equal(got_mask, mask.astype(np.int64)):
        return f"loss_mask differs from merged/tokens at token {_first_difference(got_mask, mask):,}"
    return None


def _check_scales(scales: Any, key: str, t: int) -> str | None:
    """The FP8 hook: per-token scales present, [T, ...] float32, finite and positive."""
    import torch
    if not isinstance(scales, torch.Tensor):
        return f"no {key} (FP8 states need their per-token scales)"
    if scales.dtype != torch.float32 or scales.dim() < 1 or int(scales.shape[0]) != t:
        dtype = str(scales.dtype).removeprefix("torch.")
        return f"{key} is {dtype} {list(scales.shape)}, expected float32 [T={t}, ...]"
    if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
        return f"{key} holds a scale that is not finite and positive"
    return None


SPECFORGE = Format("specforge", specforge_files, check_specforge_file)


# ---------------------------------------------------------------------------------------------
# speculators' hs_{i}.safetensors (speculators_layout.py)


def speculators_files(root: Path) -> list[tuple[int, Path]]:
    """Every `hs_*.safetensors` directly in `root` (speculators reads one folder: its
    get_existing_hidden_state_indices counts each as a sample written, its trainer loads `hs_{i}` by the
    dataset's row i), each with the row its name gives, -1 for a name no row's file has (`hs_x`, `hs_007`)."""
    from draftgen.core.extract import speculators_layout as sl
    out = []
    for path in root.iterdir():
        name = path.name
        if not (name.startswith(sl.PREFIX) and name.endswith(sl.SUFFIX)) or not path.is_file():
            continue
        digits = name.removeprefix(sl.PREFIX).removesuffix(sl.SUFFIX)
        index = int(digits) if digits.isdigit() and digits.isascii() and str(int(digits)) == digits else -1
        out.append((index, path))
    return sorted(out, key=lambda x: str(x[1]))


def check_speculators_file(path: Path, ids: np.ndarray, mask: np.ndarray, expected: Expected) -> str | None:
    """None when speculators reads `path` as merged row `ids` with the expected states; else why.

    Its rules (speculators 0.9.0, hs-connectors 0.9.0; speculators_layout.py): the file loads with
    safetensors' load_file; `token_ids` int64 [T] equal to the row's ids (check_hidden_states; the loss
    mask is the dataset's, not the file's); `hidden_states` [T, k+1, H] of the stored dtype (ArrowDataset
    cuts the k aux slots and the last); finite values as the trainer gets them (for FP8, dequantized as
    FP8Transfer does: fp8 to bfloat16 times the scale in bfloat16); FP8's `hidden_states_scales` float32
    [T, 1, 1], finite and positive."""
    import torch

    from draftgen.core.extract import speculators_layout as sl
    try:
        data = sl.load_sample(path)
    except Exception as e:  # noqa: BLE001 - whatever safetensors raises, the file is unreadable
        return f"unreadable (truncated or corrupt): {type(e).__name__}: {e}"
    keys = ["token_ids", "hidden_states"] + ([expected.scale_key] if expected.scale_key else [])
    missing = [k for k in keys if k not in data]
    if missing:
        why = " (FP8 states need their per-token scales)" if missing == [expected.scale_key] else ""
        return f"no {', '.join(missing)}{why} (speculators reads {', '.join(keys)})"
    token_ids, hidden = data["token_ids"], data["hidden_states"]
    t = int(token_ids.shape[0]) if token_ids.dim() == 1 else -1
    if t < 1 or token_ids.dtype != torch.int64:
        return (f"token_ids is {str(token_ids.dtype).removeprefix('torch.')} {list(token_ids.shape)}, "
                f"not int64 [T] with T >= 1")
    h, slots = expected.hidden_size, expected.layers + 1
    if hidden.dim() == 3 and hidden.shape[1] != slots:
        return (f"hidden_states holds {hidden.shape[1]} layer slots, not {slots} (the {expected.layers} configured "
                f"aux layers, then the last layer)")
    dtype = getattr(torch, expected.dtype)
    if hidden.dtype != dtype or tuple(hidden.shape) != (t, slots, h):
        return (f"hidden_states is {str(hidden.dtype).removeprefix('torch.')} {list(hidden.shape)}, expected "
                f"{expected.dtype} {[t, slots, h]}")
    other_layers = _other_layers(path, expected)
    if other_layers:
        return other_layers
    scales = None
    if expected.scale_key is not None:
        scales = data[expected.scale_key]
        wrong = _check_scales(scales, expected.scale_key, t)
        if wrong:
            return wrong
        if tuple(scales.shape) != (t, 1, 1):
            return f"{expected.scale_key} is float32 {list(scales.shape)}, expected float32 {[t, 1, 1]}"
    for s in range(slots):  # one [T, H] slot at a time: no float copy of the whole file
        x = hidden[:, s]
        if scales is not None:
            x = x.to(torch.bfloat16) * scales[:, 0].to(torch.bfloat16)
        lo, hi = torch.aminmax(x.reshape(-1))
        if not bool(torch.isfinite(torch.stack((lo, hi)).float()).all()):
            return f"NaN or Inf in its hidden states (slot {s}{', dequantized' if scales is not None else ''})"
    if len(ids) != t:
        return f"holds {t:,} tokens, but merged/tokens row has {len(ids):,} (another sample's states)"
    got = token_ids.numpy()
    if not np.array_equal(got, ids):
        at = _first_difference(got, ids)
        return (f"token_ids differ from merged/tokens from token {at:,} on ({int(got[at])} where merged has "
                f"{int(ids[at])}): another sample's states")
    return None


def _other_layers(path: Path, expected: Expected) -> str | None:
    """Why a speculators file holds other layers than the configured ones (its metadata's target_layer_ids)."""
    named = _target_layer_ids(path) if expected.layer_ids is not None else None
    if named is None or expected.layer_ids is None or named == list(expected.layer_ids):
        return None
    return (f"holds layers {named} (vLLM's numbering, its metadata), not the configured {list(expected.layer_ids)}: "
            f"extracted with another extract.aux_layers")


def _target_layer_ids(path: Path) -> list[int] | None:
    """The `target_layer_ids` draftgen writes in a speculators file's header; None when it names none (a file
    another tool wrote) or cannot be parsed."""
    import json

    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            text = (f.metadata() or {}).get("target_layer_ids")
        ids = json.loads(text) if text is not None else None
    except (OSError, ValueError, TypeError):
        return None
    return [int(k) for k in ids] if isinstance(ids, list) and all(isinstance(k, int) for k in ids) else None


SPECULATORS = Format("speculators", speculators_files, check_speculators_file)
FORMATS = {SPECFORGE.name: SPECFORGE, SPECULATORS.name: SPECULATORS}


def format_name(cfg: Any) -> str:
    """The format `[extract]` writes (`format`, "specforge" when unset)."""
    return str(getattr(cfg, "format", "specforge") or "specforge")


def stored_dtype(cfg: Any) -> str:
    """The dtype the states are stored in, as torch names it: float8_e4m3fn for `dtype = "fp8"`, else bfloat16
    (`[extract] dtype` float32 or bfloat16 is the forward's; the files hold bfloat16 either way)."""
    return "float8_e4m3fn" if getattr(cfg, "dtype", "") == "fp8" else "bfloat16"


def expected_of(cfg: Any, hidden_size: int, layers: int, layer_ids: list[int] | None = None) -> Expected:
    """What each file of `[extract]`'s format and dtype holds for H and `layers` aux layers: its stored dtype, for
    FP8 the key of its scales, and for speculators `layer_ids` (its slots in vLLM's numbering), named in each file."""
    from draftgen.core.extract.speculators_layout import SCALES_KEY
    dtype = stored_dtype(cfg)
    fp8 = dtype == "float8_e4m3fn"
    ids = tuple(layer_ids) if layer_ids is not None and format_name(cfg) == "speculators" else None
    return Expected(hidden_size=hidden_size, layers=layers, dtype=dtype, scale_key=SCALES_KEY if fp8 else None,
                    layer_ids=ids)


def format_of(cfg: Any) -> Format:
    """The read-back rules of the format `[extract]` writes."""
    name = format_name(cfg)
    if name not in FORMATS:
        raise DraftgenError(f"extract.format {name!r}: the read-back check knows {', '.join(FORMATS)}")
    return FORMATS[name]


# ---------------------------------------------------------------------------------------------
# A folder


def _in_scope(index: int, shard: tuple[int, int]) -> bool:
    return index >= 0 and index % shard[1] == shard[0]


def check_folder(root: Path, reader: TokenReader, expected: Expected, *, fmt: Format = SPECFORGE,
                 shard: tuple[int, int] = (0, 1), threads: int = THREADS,
                 progress: Callable[[int, int, int], None] | None = None) -> CheckResult:
    """Read back every file of `shard` under `root` (and every file no row owns, in shard 0); reads only.

    `progress(done, total, bytes_read)` is called after each file."""
    result = CheckResult()
    rows = len(reader)
    files = fmt.files(root) if root.is_dir() else []
    seen: dict[int, Path] = {}
    todo: list[tuple[int, Path]] = []
    for index, path in files:
        if index < 0 or index >= rows:
            if shard[0] == 0:
                result.bad.append(Bad(-1, path, f"not a sample of merged/tokens (rows 0 to {rows - 1:,}): "
                                                f"{fmt.name}'s reader takes every such file as a sample of its own"))
            continue
        if not _in_scope(index, shard):
            continue
        if index in seen:
            result.bad.append(Bad(index, path, f"a second file for sample {index:,} beside {seen[index].name}: "
                                               f"it would be trained on twice"))
            continue
        seen[index] = path
        todo.append((index, path))
    result.missing = [k for k in range(shard[0], rows, shard[1]) if k not in seen]

    def one(item: tuple[int, Path]) -> tuple[int, Path, str | None, int]:
        index, path = item
        ids, mask = reader.arrays(reader.entries[index])
        why = fmt.check_file(path, ids, mask, expected)
        try:
            size = path.stat().st_size
        except OSError:
            size = 0
        return index, path, why, size

    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="draftgen-check") as pool:
        for index, path, why, size in pool.map(one, todo):
            result.checked += 1
            result.bytes_read += size
            if why is None:
                result.good += 1
            else:
                result.bad.append(Bad(index, path, why))
            if progress is not None:
                progress(result.checked, len(todo), result.bytes_read)
    result.bad.sort(key=lambda b: str(b.path))
    return result


def expected_for(config: Any, root: Path) -> Expected:
    """H and the number of aux layers the configured extraction writes: from the model's config.json (its
    weights are never read), else from stats.json where the model is not on this machine."""
    from draftgen.core.extract.model_info import dims_from_config_dict, read_model_config, resolve_aux_layers
    cfg = config.extract
    try:
        model_cfg, source = read_model_config(cfg.model, trust_remote_code=cfg.trust_remote_code)
        from draftgen.core.extract.speculators_layout import vllm_layer_ids
        dims = dims_from_config_dict(model_cfg, source)
        layers = resolve_aux_layers(cfg.aux_layers, dims, config.path)
        return expected_of(cfg, dims.hidden_size, len(layers), vllm_layer_ids(layers, dims.num_layers))
    except DraftgenError as e:
        reason = str(e)
    import orjson
    for stats in sorted(root.glob("stats*.json")):
        try:
            obj = orjson.loads(stats.read_bytes())
            if int(obj.get("hidden_size") or 0) > 0 and obj.get("layers"):
                ids = obj.get("target_layer_ids")
                return expected_of(cfg, int(obj["hidden_size"]), len(obj["layers"]),
                                   [int(k) for k in ids] if isinstance(ids, list) else None)
        except (OSError, orjson.JSONDecodeError, TypeError, ValueError):
            continue
    raise DraftgenError(f"cannot tell what the hidden-state files should hold: the model's config cannot be read "
                        f"({reason}) and {root} has no stats.json naming H and the layers")


def remove_bad(result: CheckResult) -> tuple[list[Bad], list[Bad]]:
    """Delete the bad files of this merge's rows (extraction then writes them again); files no row owns are
    left for the user. Returns (removed, left)."""
    removed, left = [], []
    for bad in result.bad:
        if bad.index < 0:
            left.append(bad)
            continue
        try:
            bad.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            from draftgen.core.files import disk_error
            raise disk_error(bad.path, e) from e
        removed.append(bad)
    return removed, left


def describe(bad: Bad, root: Path, reader: TokenReader) -> str:
    """One line for a bad file: its path under hidden_states/, its row and id, why (controls escaped)."""
    from draftgen.core.safe_text import visible
    try:
        where = str(bad.path.relative_to(root))
    except ValueError:
        where = str(bad.path)
    row = (f"sample {bad.index:,}, id {reader.entries[bad.index].id}"
           if 0 <= bad.index < len(reader) else "no sample")
    return visible(f"{where} ({row}): {bad.why}", one_line=True)


# ---------------------------------------------------------------------------------------------
# The command


def check_command(config: Any, shard: tuple[int, int] = (0, 1), *, out: TextIO | None = None) -> int:
    """`draftgen check CONFIG [--shard I/N]`: 0 when every file reads back right, 1 when some do not (listed)."""
    from draftgen.core.extract import claim
    from draftgen.core.quoting import sh_path
    from draftgen.core.safe_text import visible
    from draftgen.core.units import fmt_bytes
    stream = out or sys.stdout
    parsed = shard
    run = Path(config.run_dir)
    tokens = run / "merged" / "tokens"
    if not (tokens / INDEX_FILE).exists():
        raise DraftgenError(f"{tokens / INDEX_FILE}: not found; run `draftgen merge {sh_path(config.path)}` first")
    root = run / "hidden_states"
    if not root.is_dir():
        raise DraftgenError(f"{root}: not found; `draftgen extract {sh_path(config.path)}` writes it")
    reader = TokenReader(tokens)
    standing = claim.standing(root, run / "merged", reader)
    if not standing.usable:
        raise claim.refusal(standing, root, config.path)
    fmt = format_of(config.extract)
    from draftgen.core.extract.speculators_layout import refuse_other_format
    refuse_other_format(fmt.name, root, config.path)  # else the other format's files pass as "without a file"
    expected = expected_for(config, root)
    print(f"checking {visible(str(root))} against {standing.current.describe()}, shard {parsed[0]}/{parsed[1]}: "
          f"{fmt.name} files, H={expected.hidden_size}, {expected.layers} aux layers, {expected.dtype}",
          file=stream, flush=True)
    last = [time.monotonic()]

    def show(done: int, total: int, nbytes: int) -> None:
        now = time.monotonic()
        if now - last[0] >= PRINT_INTERVAL_S:
            last[0] = now
            print(f"  checked {done:,} / {total:,} files ({fmt_bytes(nbytes)})", file=stream, flush=True)

    result = check_folder(root, reader, expected, fmt=fmt, shard=parsed, progress=show)
    print(f"checked {result.checked:,} files ({fmt_bytes(result.bytes_read)}): {result.good:,} good, "
          f"{len(result.bad):,} bad, {len(result.missing):,} samples without a file (not extracted yet, or "
          f"skipped: stats.json says why)", file=stream, flush=True)
    for bad in result.bad:
        print(f"  bad: {describe(bad, root, reader)}", file=stream, flush=True)
    if not result.bad:
        return 0
    shard_arg = f" --shard {parsed[0]}/{parsed[1]}" if parsed != (0, 1) else ""
    ours = sum(1 for b in result.bad if b.index >= 0)
    if ours:
        files = f"{ours:,} bad file{'s' if ours != 1 else ''}"
        print(f"`draftgen extract {sh_path(config.path)} --validate{shard_arg}` checks again, removes the "
              f"{files} of this merge's samples and extracts those samples again (nothing else)",
              file=stream, flush=True)
    if ours < len(result.bad):
        print(f"{len(result.bad) - ours:,} files are no sample of this merge: move them out of {visible(str(root))} "
              f"(the trainer would read them)", file=stream, flush=True)
    return 1

