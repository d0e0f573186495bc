"""Open a dataset where the user keeps it, through the `datasets` library (the `prompts` extra).

A source is written `[NAME=]WHERE[:SPLIT]`, WHERE being:
- a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` (`load_from_disk`);
- a `.parquet`, `.arrow`, `.json`, `.jsonl` (optionally `.gz`) or `.csv` file (`load_dataset` with
  the matching packaged builder and `data_files`);
- any other folder of data files, e.g. a cloned Hub repository (`load_dataset(folder)` infers it);
- a Hub id (`org/name`) found in the local Hugging Face cache: the snapshot folder comes from
  `huggingface_hub.snapshot_download(..., repo_type="dataset", local_files_only=True)` and is opened
  like a folder. Nothing is downloaded unless the user passes `--download`; without it,
  HF_HUB_OFFLINE and HF_DATASETS_OFFLINE are set before `datasets` is imported, so the library
  itself never reaches the network either (`stay_offline`, called by the command before anything
  is imported).

`datasets` is imported here and only here, lazily, with a message naming the extra when it is missing.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftgen.core.errors import DraftgenError

_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json", ".csv": "csv"}
_BATCH = 1024


class SourceError(DraftgenError):
    """A dataset that cannot be found or opened."""


def stay_offline() -> None:
    """Tell the Hugging Face libraries not to reach the network: the variables they read when imported,
    and their constants when they are imported already (e.g. by a tokenizer lookup in the cache)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    for module, name in (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE")):
        if module in sys.modules and hasattr(sys.modules[module], name):
            setattr(sys.modules[module], name, True)


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise SourceError("`draftgen prompts` needs the `datasets` library: pip install 'draftgen[prompts]' "
                          "(from a clone: pip install -e '.[prompts]')") from None
    datasets.disable_progress_bars()
    return datasets


@dataclass(frozen=True)
class SourceSpec:
    name: str        # the dataset name (and id prefix); derived from WHERE unless given
    where: str
    split: str | None


def _slug(text: str) -> str:
    text = re.sub(r"(\.(jsonl|json|parquet|arrow|csv))?(\.gz)?$", "", text)
    return re.sub(r"[^A-Za-z0-9_-]+", "_", text).strip("_") or "prompts"


def parse_source(text: str) -> SourceSpec:
    """`[NAME=]WHERE[:SPLIT]` → SourceSpec. A `:` is a split only when what precedes it is no file."""
    name, sep, where = text.partition("=")
    if not sep or "/" in name or not name:
        name, where = "", text
    split = None
    head, colon, tail = where.rpartition(":")
    if colon and tail and "/" not in tail and not Path(where).expanduser().exists():
        where, split = head, tail
    if not where:
        raise SourceError(f"source {text!r}: expected [NAME=]PATH_OR_HUB_ID[:SPLIT]")
    if not name:
        name = _slug(Path(where.rstrip("/")).name)
    if _slug(name) != name:
        raise SourceError(f"source {text!r}: the name {name!r} may only use letters, digits, _ and -")
    return SourceSpec(name, where, split)


class Source:
    """One opened split of a dataset: its columns, its length, and its rows by index."""

    def __init__(self, spec: SourceSpec, table: Any, split: str, origin: str) -> None:
        self.spec, self.table, self.split, self.origin = spec, table, split, origin

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def columns(self) -> list[str]:
        return list(self.table.column_names)

    def __len__(self) -> int:
        return len(self.table)

    def rows(self, indices: Sequence[int]) -> Iterator[tuple[int, Mapping[str, Any]]]:
        """(index, row) for each index, in the order given, read a batch at a time."""
        for start in range(0, len(indices), _BATCH):
            chunk = list(indices[start:start + _BATCH])
            batch = self.table[chunk]  # a list of ints gives a dict of columns
            cols = list(batch)
            for k, index in enumerate(chunk):
                yield index, {c: batch[c][k] for c in cols}


def _pick_split(dd: Any, split: str | None, where: str) -> tuple[Any, str]:
    names = list(dd.keys())
    if split is None:
        if "train" in names:
            split = "train"
        elif len(names) == 1:
            split = names[0]
        else:
            raise SourceError(f"{where}: several splits ({', '.join(names)}); choose one with {where}:SPLIT")
    if split not in names:
        raise SourceError(f"{where}: no split {split!r} (splits: {', '.join(names)})")
    return dd[split], split


def _hub_snapshot(repo_id: str, download: bool) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise SourceError(f"{repo_id}: not a local path, and huggingface_hub is not installed to look in "
                          f"the Hugging Face cache") from None
    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", local_files_only=not download))
    except Exception as e:  # not cached, bad id, no network: the hub library's many error types
        if download:
            raise SourceError(f"{repo_id}: could not download the dataset ({type(e).__name__}: {e})") from None
        raise SourceError(f"{repo_id}: not a local file or folder, and not in the local Hugging Face cache "
                          f"(draftgen does not download unless you pass --download)") from None


def open_source(spec: SourceSpec, *, download: bool = False, subset: str | None = None) -> Source:
    """Open `spec` (see the module docstring); SourceError with the place and the reason otherwise."""
    path = Path(spec.where).expanduser()
    looks_like_hub = not path.exists() and not spec.where.startswith((".", "/", "~")) and spec.where.count("/") == 1
    if not path.exists() and not looks_like_hub:
        raise SourceError(f"{spec.where}: no such file or folder")
    ds = _datasets()
    try:
        if looks_like_hub:
            folder = _hub_snapshot(spec.where, download)
            return _open_folder(ds, spec, folder, subset, origin=f"{spec.where} (cache: {folder})")
        if path.is_dir():
            return _open_folder(ds, spec, path, subset, origin=str(path))
        suffixes = [s for s in path.suffixes if s != ".gz"]
        builder = _BUILDERS.get(suffixes[-1] if suffixes else "")
        if builder is None:
            raise SourceError(f"{path}: unknown file type (known: {', '.join(sorted(_BUILDERS))}, optionally .gz)")
        table = ds.load_dataset(builder, data_files=str(path), split=spec.split or "train")
        return Source(spec, table, spec.split or "train", str(path))
    except SourceError:
        raise
    except (FileNotFoundError, ValueError, OSError) as e:
        raise SourceError(f"{spec.where}: cannot open the dataset ({type(e).__name__}: {e})") from None
    except Exception as e:  # pyarrow and datasets raise their own types for a corrupt or unreadable file
        raise SourceError(f"{spec.where}: cannot read the dataset ({type(e).__name__}: {e})") from None


def _open_folder(ds: Any, spec: SourceSpec, folder: Path, subset: str | None, origin: str) -> Source:
    if (folder / "state.json").exists() or (folder / "dataset_dict.json").exists():
        loaded = ds.load_from_disk(str(folder))  # written by save_to_disk
    else:
        loaded = ds.load_dataset(str(folder), subset)
    if isinstance(loaded, ds.Dataset):
        return Source(spec, loaded, spec.split or "train", origin)
    table, split = _pick_split(loaded, spec.split, spec.where)
    return Source(spec, table, split, origin)
