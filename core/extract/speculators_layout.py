"""The on-disk format of `hidden_states/` for vLLM's speculators (extract.format = "speculators").

    hidden_states/
      hs_0.safetensors ... hs_{n-1}.safetensors
      stats.json

`i` in `hs_{i}.safetensors` is the sample's index in `merged/tokens/index.jsonl`, all in one folder.
Each file is one safetensors file with exactly these tensors:

    token_ids             int64                   [T]            the sample's token ids
    hidden_states         bfloat16 | float8_e4m3fn [T, k+1, H]   the k aux layers' outputs, then the last
                                                                 decoder layer's output before the final norm
    hidden_states_scales  float32                 [T, 1, 1]      dtype = "fp8" only: one scale per token

and in its header metadata `target_layer_ids` (the k+1 slots in vLLM's numbering, as JSON) with
`layer_numbering` = "vllm" and `producer` = "draftgen".

Checked against speculators' own reader at the releases tests/extract/test_speculators_release.py
pins (speculators 0.9.0, hs-connectors 0.9.0):
- hs_connectors.transfer.FileTransfer.get_cached(i) loads `hidden_states_path / f"hs_{i}.safetensors"`
  with safetensors' load_file; FP8Transfer (the "fp8" backend, PR #1028) does the same and, when
  `hidden_states_scales` is there, replaces `hidden_states` by `fp8.to(bf16) * scales.to(bf16)`;
- speculators.train.data.ArrowDataset takes `hidden_states[:, :-1].flatten(1)` as the aux input
  ([T, k*H]), `hidden_states[:, -1]` as `verifier_last_hidden_states` and compares `token_ids` with
  the dataset's `input_ids` row; its loss mask comes from the dataset, not the file;
- speculators.data_generation.offline.check_hidden_states wants `token_ids` equal to the row's ids,
  `hidden_states` with T rows and finite values;
- vLLM's layer id k is the input of decoder layer k (vLLM's llama `aux_hidden_state_layers` and
  speculators' scripts/launch_vllm.py, whose last id is num_hidden_layers): draftgen's layer-output
  k (HF `hidden_states[k + 1]`) is vLLM's k + 1, and the pre-norm last slot is N.

FP8 is hs_connectors.fp8_utils.quantize_tensor_to_fp8 exactly: per token, amax over the k+1 slots and
H, `scale = max(amax / 448, 1e-12)`, `fp8 = (x / scale).to(float8_e4m3fn)`. Each file's error is
measured as it is written, against the tensor quantized: per slot the worst token's cosine and the
slot's relative error ||dequantized - x|| / ||x|| (`QuantError`).

Files are written to a temporary name beginning with "." (speculators' reader and its
get_existing_hidden_state_indices never take it), fsynced and renamed: a file that exists is whole.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftgen.core.extract.layout import SampleTensors, make_dir
from draftgen.core.files import FILE_MODE, GROUP_FILE_MODE, TMP_MARK, disk_error, replacing

PREFIX, SUFFIX = "hs_", ".safetensors"
SCALES_KEY = "hidden_states_scales"
FP8_MAX = 448.0            # torch.finfo(torch.float8_e4m3fn).max
SCALE_FLOOR = 1e-12        # hs_connectors' clamp: an all-zero token keeps a usable scale


def sample_path(root: Path, index: int) -> Path:
    return Path(root) / f"{PREFIX}{index}{SUFFIX}"


def existing_sample(root: Path, index: int) -> Path | None:
    path = sample_path(root, index)
    return path if path.exists() else None


def existing_file(fmt: str, root: Path, index: int) -> Path | None:
    """The file already written for `index` in extract.format `fmt` (either SpecForge form, or hs_{index})."""
    if fmt == "speculators":
        return existing_sample(root, index)
    from draftgen.core.extract import layout
    return layout.existing_sample(root, index)


def refuse_other_format(fmt: str, root: Path, config_path: object) -> None:
    """One format per folder: ConfigError when `root` holds a sample file of the other trainer's layout, which
    extraction would neither skip nor redo and the read-back check would not read (extract, --plan, check)."""
    from draftgen.core.errors import ConfigError
    if not Path(root).is_dir():
        return
    if fmt == "speculators":
        other = next((p for p in Path(root).glob("rows_*/data_*") if p.name.endswith((".ckpt", ".ckpt.gz"))), None)
    else:
        other = next(Path(root).glob(f"{PREFIX}*{SUFFIX}"), None)
    if other is not None:
        raise ConfigError(f"{config_path}: extract.format = {fmt!r}, but {root} already holds files of the other "
                          f"format ({other.name}); move hidden_states/ aside (or set the format it was made with) "
                          f"before extracting in this one")


def vllm_layer_ids(layers: tuple[int, ...], num_layers: int) -> list[int]:
    """The k+1 slots in vLLM's numbering: each aux layer output k is vLLM's k + 1, the pre-norm last is N."""
    return [k + 1 for k in layers] + [num_layers]


def stacked(sample: SampleTensors) -> torch.Tensor:
    """[T, k+1, H]: the aux layers (aux is [T, k*H]) then the last layer's pre-norm output (hidden [T, H])."""
    t, h = sample.hidden.shape
    return torch.cat([sample.aux.reshape(t, -1, h), sample.hidden.reshape(t, 1, h)], dim=1)


def _slots(sample: SampleTensors) -> list[torch.Tensor]:
    """The k+1 slots as [T, H] views: the aux layers' slices, then the pre-norm last layer (no copy)."""
    t, h = sample.hidden.shape
    return [*sample.aux.reshape(t, -1, h).unbind(1), sample.hidden]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hs_connectors' quantize_tensor_to_fp8 of x [T, S, H]: float8_e4m3fn values and one float32 scale per token
    [T, 1, 1], bit for bit (tests/extract/test_speculators_format.py)."""
    values, scale, _errors = _quantize_slots(list(x.unbind(1)), measure=False)
    return values, scale


def _quantize_slots(slots: list[torch.Tensor], *, measure: bool,
                    ) -> tuple[torch.Tensor, torch.Tensor, tuple[tuple[float, float], ...]]:
    """quantize_tensor_to_fp8 over the slots stacked on dim 1, one slot at a time (float32 copies of one [T, H]
    slot at most, not of [T, k+1, H]: 0.6 GB for a 5,300-token Kimi sample, per writer thread), and with
    `measure` each slot's error as slot_errors gives it.

    The same values as hs_connectors': amax, abs and the float32 conversion are exact, so the amax taken in
    the slots' own dtype and the division done slot by slot give the same bits."""
    t, h = slots[0].shape
    amax = torch.stack([x.abs().amax(dim=-1) for x in slots], dim=1).amax(dim=1).float()
    scale = (amax / FP8_MAX).clamp(min=SCALE_FLOOR).reshape(t, 1, 1)
    values = torch.empty((t, len(slots), h), dtype=torch.float8_e4m3fn)
    errors = []
    for s, x in enumerate(slots):
        ref = x.float()
        values[:, s] = (ref / scale[:, 0]).to(torch.float8_e4m3fn)
        if measure:
            errors.append(slot_errors(ref, values[:, s], scale[:, 0]))
    return values, scale, tuple(errors)


def slot_errors(ref: torch.Tensor, fp8: torch.Tensor, scale: torch.Tensor) -> tuple[float, float]:
    """One slot's (worst token's cosine, ||dequantized - ref|| / ||ref||): ref [T, H] float32, fp8 [T, H] as stored,
    scale [T, 1].

    Dequantized as FP8Transfer does it (to bf16, times the scale in bf16). A token whose slot is all
    zeros and comes back all zeros counts as cosine 1; a slot of zeros, as relative error 0."""
    back = (fp8.to(torch.bfloat16) * scale.to(torch.bfloat16)).float()
    dot = (ref * back).sum(-1)
    norms = ref.norm(dim=-1) * back.norm(dim=-1)
    cos = torch.where(norms > 0, dot / norms.clamp(min=1e-30), (ref.abs().amax(-1) == back.abs().amax(-1)).float())
    worst = float(cos.min()) if cos.numel() else 1.0
    base = float(ref.norm())
    return worst, (float((back - ref).norm()) / base if base > 0 else 0.0)


SlotErrors = tuple[tuple[float, float], ...]  # per slot: (the worst token's cosine, the relative error)


def tensors(sample: SampleTensors, *, fp8: bool) -> tuple[dict[str, torch.Tensor], SlotErrors | None]:
    """The file's tensors, and with `fp8` each slot's (worst cosine, relative error) as stored."""
    length = int(sample.input_ids.reshape(-1).shape[0])
    out = {"token_ids": sample.input_ids.reshape(length).to(torch.int64).contiguous()}
    if not fp8:
        out["hidden_states"] = stacked(sample).to(torch.bfloat16).contiguous()
        return out, None
    values, scale, errors = _quantize_slots(_slots(sample), measure=True)
    out["hidden_states"] = values
    out[SCALES_KEY] = scale.contiguous()
    return out, errors


def write_sample(root: Path, index: int, sample: SampleTensors, *, fp8: bool, layer_ids: list[int],
                 group_readable: bool = False) -> tuple[int, tuple[tuple[float, float], ...] | None]:
    """Write `hs_{index}.safetensors` atomically (temporary name, fsync, rename): its size and FP8 error.

    Raises DiskError naming the file when it cannot be written; no temporary file is left then."""
    from safetensors.torch import save

    path = sample_path(root, index)
    try:
        make_dir(path.parent, group_readable=group_readable)
    except OSError as e:
        raise disk_error(path, e) from e
    out, error = tensors(sample, fp8=fp8)
    data = save(out, metadata={"producer": "draftgen", "layer_numbering": "vllm",
                               "target_layer_ids": json.dumps(layer_ids)})
    with replacing(path, fsync=True, mode=GROUP_FILE_MODE if group_readable else FILE_MODE) as f:
        f.write(data)
    return len(data), error


def load_sample(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors as stored (FP8 not undone), as safetensors' load_file gives them to FileTransfer."""
    from safetensors.torch import load_file
    return load_file(str(path))


def stale_temporaries(root: Path, shard: tuple[int, int]) -> list[Path]:
    """Temporary files a killed run of this shard left beside the samples."""
    i, n = shard
    found = []
    for tmp in Path(root).glob(f".{PREFIX}*{TMP_MARK}*"):
        digits = tmp.name.removeprefix(f".{PREFIX}").split(".", 1)[0]
        if digits.isdigit() and int(digits) % n == i:
            found.append(tmp)
    return found


@dataclass
class QuantError:
    """The FP8 error of every file this run wrote, per slot: worst and median over the files."""
    slots: list[int]                                      # vLLM's layer ids, one per slot
    files: list[tuple[tuple[float, float], ...]] = field(default_factory=list)

    def add(self, error: tuple[tuple[float, float], ...]) -> None:
        self.files.append(error)

    def to_dict(self) -> dict[str, Any]:
        if not self.files:
            return {"files": 0, "slots": self.slots}
        per_slot = list(zip(*self.files, strict=True))
        cos = [[c for c, _ in slot] for slot in per_slot]
        rel = [[r for _, r in slot] for slot in per_slot]
        return {"files": len(self.files), "slots": self.slots,
                "cosine_worst": [round(min(c), 6) for c in cos],
                "cosine_median": [round(statistics.median(c), 6) for c in cos],
                "rel_error_worst": [round(max(r), 6) for r in rel],
                "rel_error_median": [round(statistics.median(r), 6) for r in rel]}


def describe(error: dict[str, Any]) -> str:
    """One line for the summary: the worst slot's cosine and relative error, and their medians."""
    if not error.get("files"):
        return "fp8: no file written"
    cw, rw = error["cosine_worst"], error["rel_error_worst"]
    slot_c = min(range(len(cw)), key=cw.__getitem__)
    slot_r = max(range(len(rw)), key=rw.__getitem__)
    return (f"fp8 error over {error['files']:,} files: cosine worst {cw[slot_c]:.5f} (layer {error['slots'][slot_c]}), "
            f"median {min(error['cosine_median']):.5f}; relative error worst {rw[slot_r]:.2%} "
            f"(layer {error['slots'][slot_r]}), median {max(error['rel_error_median']):.2%}")
