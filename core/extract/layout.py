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

Files are written to a temporary name in the same folder, fsynced and renamed, so a file that
exists is whole; a restart skips it. `torch.save` streams straight into the temporary file (through
gzip with `compress`): no in-memory copy of the file. A tensor that is a view (a slice of a padded
batch) is copied first because `torch.save` stores a view's whole storage: it would carry the
padding (and the other samples) to disk; a tensor that owns exactly its storage goes as it is.
"""

from __future__ import annotations

import gzip
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftgen.core.files import FILE_MODE, GROUP_DIR_MODE, GROUP_FILE_MODE, disk_error, replacing

ROWS_PER_DIR = 2000
SUFFIX, GZ_SUFFIX = ".ckpt", ".ckpt.gz"
KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
# Level 1: bf16 activations compress little, and level 6 would make gzip the bottleneck.
GZ_LEVEL = 1
SMALL_WRITE = 1 << 16  # torch.save's headers come in small pieces: gathered into one write


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
        return bool(finite_flags([self])[0])


def finite_flags(samples: list[SampleTensors]) -> torch.Tensor:
    """One bool per sample (no NaN/Inf in hidden or aux), reduced where the tensors live and
    fetched as one small CPU tensor: one sync for a batch on a GPU, no full-size temporaries."""
    if not samples:
        return torch.zeros(0, dtype=torch.bool)
    # aminmax propagates NaN and shows ±Inf, so min and max are finite iff every element is.
    extremes = [torch.stack(torch.aminmax(t.reshape(-1))).float() if t.numel() else
                torch.zeros(2, device=t.device) for s in samples for t in (s.hidden, s.aux)]
    return torch.isfinite(torch.stack(extremes).reshape(len(samples), 4)).all(dim=1).cpu()


def _owned(tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """`tensor` as `dtype` and `shape`, copied only when it does not own exactly its storage."""
    t = tensor.to(dtype).reshape(shape)
    if (t.device.type == "cpu" and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()):
        return t
    return t.clone(memory_format=torch.contiguous_format) if t.device.type == "cpu" else t.cpu()


def sample_dict(sample: SampleTensors) -> dict[str, torch.Tensor]:
    """The dict SpecForge loads, each tensor with storage of exactly its size."""
    length = int(sample.input_ids.reshape(-1).shape[0])
    return {
        "input_ids": _owned(sample.input_ids, torch.int64, (length,)),
        "loss_mask": _owned(sample.loss_mask, torch.int64, (length,)),
        "hidden_state": _owned(sample.hidden, torch.bfloat16, (1, *sample.hidden.shape)),
        "aux_hidden_state": _owned(sample.aux, torch.bfloat16, (1, *sample.aux.shape)),
    }


class _FdSink:
    """torch.save's stream onto a file descriptor: large writes go straight from the tensor's
    memory (partial writes retried), small ones are gathered; `size` counts what was written."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = 0
        self._small = bytearray()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if n < SMALL_WRITE:
            self._small += view
            if len(self._small) >= SMALL_WRITE:
                self.flush()
        else:
            self.flush()
            self._write_all(view)
        self.size += n
        return n

    def flush(self) -> None:
        if self._small:
            self._write_all(memoryview(self._small))
            self._small = bytearray()

    def _write_all(self, view: memoryview) -> None:
        while view:
            view = view[os.write(self.fd, view):]


def make_dir(folder: Path, *, group_readable: bool = False) -> None:
    """`folder` (and its parents); with `group_readable` it is 0750 (the umask would leave 0700)."""
    folder.mkdir(parents=True, exist_ok=True)
    if group_readable and folder.stat().st_mode & 0o777 != GROUP_DIR_MODE:
        os.chmod(folder, GROUP_DIR_MODE)


def write_sample(root: Path, index: int, sample: SampleTensors, *, compress: bool, group_readable: bool = False) -> int:
    """Write one file atomically (temporary name, fsync, rename); return its size in bytes.

    `group_readable`: the file 0640 and its folder 0750 (extract.group_readable), else 0600/0700.
    Raises DiskError naming the file when it cannot be written; no temporary file is left then."""
    path = sample_path(root, index, compress=compress)
    try:
        make_dir(path.parent, group_readable=group_readable)
    except OSError as e:
        raise disk_error(path, e) from e
    # fsync: without it a power cut after the rename can leave an empty file that looks done.
    with replacing(path, fsync=True, mode=GROUP_FILE_MODE if group_readable else FILE_MODE) as f:
        sink = _FdSink(f.fileno())  # past the file object's buffer: large writes go straight from the tensors
        if compress:
            # No name or time in the header: the same sample gives the same bytes.
            with gzip.GzipFile(filename="", mode="wb", compresslevel=GZ_LEVEL, fileobj=sink, mtime=0) as gz:
                torch.save(sample_dict(sample), gz)
        else:
            torch.save(sample_dict(sample), sink)
        sink.flush()
    return sink.size


def load_sample(path: Path) -> dict[str, Any]:
    """Read a file the way SpecForge's OfflineEagle3Dataset._open_file does."""
    path = Path(path)
    if path.name.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            return torch.load(io.BytesIO(f.read()), weights_only=False)
    return torch.load(path, weights_only=False, mmap=True)
