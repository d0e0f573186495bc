"""The on-disk format of `hidden_states/`: SpecForge's offline EAGLE-3 training files.

    hidden_states/
      rows_0-2000/data_0.ckpt ... data_1999.ckpt
      rows_2000-4000/data_2000.ckpt ...
      stats.json                    (stats.shard-I-of-N.json for a `--shard I/N` run)

`i` in `data_{i}.ckpt` is the sample's index in `merged/tokens/index.jsonl`; its folder is
`rows_{k*2000}-{(k+1)*2000}` with `k = i // 2000`. With `extract.compress` the file is
`data_{i}.ckpt.gz`, the same bytes gzip-compressed. Each file is one `torch.save` of a dict
with exactly these keys:

    input_ids         int64     [T]         the sample's token ids
    loss_mask         int64     [T]         0/1, as merged
    hidden_state      bfloat16  [1, T, H]   last layer after the final norm (the lm_head input)
    aux_hidden_state  bfloat16  [1, T, 3H]  three layer outputs concatenated on the last dim

Checked against SpecForge's reader (specforge/data/preprocessing.py, `list_local_files` and
`OfflineEagle3Dataset`, and scripts/prepare_hidden_states.py, which writes the same layout):
- it walks the folder and keeps files ending in `.ckpt` or `.ckpt.gz`, sorted by path, so the
  folder names only group files; our temporary files end in neither and are never picked up;
- `.gz` files are read with `torch.load(io.BytesIO(gzip.open(p).read()))`, others with
  `torch.load(p, mmap=True)` (needs torch.save's default zip format, which we use);
- it squeezes dim 0 of `hidden_state`/`aux_hidden_state` and slices `[:max_len]` on the token
  dim, and indexes `input_ids[:max_len][None, :]`, so the ids and mask are 1-D;
- prepare_hidden_states.py uses `rows_{g}-{g+2000}` folders (file_group_size 2000), names files
  `data_{global_index}.ckpt`, stores `hidden_state`/`aux_hidden_state` as `[1, T, ...]`
  (`.unsqueeze(0)`) and skips a sample with NaN rather than writing it.

Files are written to a temporary name in the same folder and renamed, so a file that exists
is whole; a restart skips it. Tensors are copied before saving because `torch.save` stores a
view's whole storage: a slice of a padded batch would carry the padding (and the other samples)
to disk.
"""

from __future__ import annotations

import gzip
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftgen.core.files import write_atomic

ROWS_PER_DIR = 2000
SUFFIX, GZ_SUFFIX = ".ckpt", ".ckpt.gz"
KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
# Level 1: bf16 activations compress little, and level 6 would make gzip the bottleneck.
GZ_LEVEL = 1


def rows_dir(root: Path, index: int) -> Path:
    start = (index // ROWS_PER_DIR) * ROWS_PER_DIR
    return Path(root) / f"rows_{start}-{start + ROWS_PER_DIR}"


def sample_path(root: Path, index: int, *, compress: bool = False) -> Path:
    return rows_dir(root, index) / f"data_{index}{GZ_SUFFIX if compress else SUFFIX}"


def existing_sample(root: Path, index: int) -> Path | None:
    """The file already written for `index`, in either form (switching `compress` must not write it twice)."""
    for compress in (False, True):
        path = sample_path(root, index, compress=compress)
        if path.exists():
            return path
    return None


@dataclass(frozen=True)
class SampleTensors:
    """One sample's outputs, unpadded: hidden [T, H] and aux [T, 3H]."""
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: torch.Tensor
    aux: torch.Tensor

    def is_finite(self) -> bool:
        return bool(torch.isfinite(self.hidden).all()) and bool(torch.isfinite(self.aux).all())


def sample_dict(sample: SampleTensors) -> dict[str, torch.Tensor]:
    """The dict SpecForge loads, with fresh storage of exactly the right size."""
    return {
        "input_ids": sample.input_ids.to(torch.int64).reshape(-1).clone(),
        "loss_mask": sample.loss_mask.to(torch.int64).reshape(-1).clone(),
        "hidden_state": sample.hidden.to(torch.bfloat16).unsqueeze(0).clone(),
        "aux_hidden_state": sample.aux.to(torch.bfloat16).unsqueeze(0).clone(),
    }


def write_sample(root: Path, index: int, sample: SampleTensors, *, compress: bool) -> int:
    """Write one file atomically (temporary name, then rename); return its size in bytes."""
    path = sample_path(root, index, compress=compress)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(sample_dict(sample), buf)
    data = buf.getvalue()
    if compress:
        data = gzip.compress(data, compresslevel=GZ_LEVEL)
    # fsync: without it a power cut after the rename can leave an empty file that looks done.
    write_atomic(path, data, fsync=True)
    return len(data)


def load_sample(path: Path) -> dict[str, Any]:
    """Read a file the way SpecForge's OfflineEagle3Dataset._open_file does."""
    path = Path(path)
    if path.name.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            return torch.load(io.BytesIO(f.read()), weights_only=False)
    return torch.load(path, weights_only=False, mmap=True)
