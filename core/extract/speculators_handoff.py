"""The training hand-off for vLLM's speculators (extract.format = "speculators"), beside SpecForge's.

`draftgen train-command CONFIG` and the end of an extraction write, in hidden_states/:

    speculators-train.yaml   the config `speculators train --config` reads (its stage-shaped YAML, `train:`)
    train-speculators.sh     the command, with the figures as comments
    speculators-data/        merged/tokens as the Arrow dataset speculators' trainer loads (`load_from_disk`)

What the pinned speculators 0.9.0 and hs-connectors 0.9.0 take, read from their released code
(speculators/train/config/schema.py and resolution.py, speculators/train/data.py, hs_connectors/transfer.py;
checked by tests/extract/test_speculators_format.py, which resolves our file with speculators' own
`TrainConfig.resolve` and reads the data with its own ArrowDataset):
- the entry point `speculators train --config FILE` (the wheel's console script; `torchrun -m
  speculators.train` for several GPUs); the YAML nests keys in the schema's groups under `train:`;
  unknown keys are only warned about, so the contract test checks every key is the schema's;
- `data.data_path` is an Arrow dataset saved with `datasets`' save_to_disk, columns `input_ids`,
  `loss_mask` (int64) and `seq_len`, in torch format, as speculators' prepare_data saves it; the file of
  row i is `hs_{i}.safetensors` (ArrowDataset maps its index to the file index one to one);
- `data.hidden_states_backend` "fp8" (FP8Transfer, dequantizes) or "file" (FileTransfer), and the folder in
  `backend.hidden_states_path`, which both backends take in the release (PR #1028's head had a
  `--fp8-hidden-states-path` of its own: the release dropped it, and speculators ignores an unknown key);
- `draft.target_layer_ids`: the aux layers in vLLM's numbering, without the last (pre-norm) slot, which
  the trainer takes as `hidden_states[:, -1]`;
- `data.total_seq_len` is the length samples are packed to; a sample longer than it is cut: here at least
  the longest merged sample (and speculators' default of 8,192);
- `generation.on_missing` = "warn": a row without a file (skipped as NaN or longer than the context) is
  left out with a warning; the default "generate" would ask a vLLM server on localhost for it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from draftgen.core.config import Config
from draftgen.core.errors import DraftgenError
from draftgen.core.files import write_atomic
from draftgen.core.quoting import one_line, sh_path
from draftgen.core.tokens.store import TokenReader

SPECULATORS_VERSION = "0.9.0"     # tests/pinned.py SPECULATORS_PINS (checked by the contract test)
CONFIG_FILE = "speculators-train.yaml"
SCRIPT_FILE = "train-speculators.sh"
DATA_DIR = "speculators-data"
DATA_MARK = "draftgen-merge.json"  # which merge speculators-data/ was written from
DEFAULT_TOTAL_SEQ_LEN = 8192      # DataArgs.total_seq_len's default


def layer_ids(config: Config) -> list[int]:
    """The file slots in vLLM's numbering: stats.json's, else from the config and the model's config.json."""
    stats = config.run_dir / "hidden_states" / "stats.json"
    try:
        ids = json.loads(stats.read_text(encoding="utf-8")).get("target_layer_ids")
        if isinstance(ids, list) and len(ids) >= 2 and all(isinstance(x, int) for x in ids):
            return [int(x) for x in ids]
    except (OSError, ValueError, AttributeError):
        pass
    from draftgen.core.extract.model_info import read_model_dims, resolve_aux_layers
    from draftgen.core.extract.speculators_layout import vllm_layer_ids
    dims = read_model_dims(config.extract.model, trust_remote_code=config.extract.trust_remote_code)
    return vllm_layer_ids(resolve_aux_layers(config.extract.aux_layers, dims, config.path), dims.num_layers)


def train_config(config: Config, *, max_length: int, ids: list[int]) -> dict[str, Any]:
    """speculators' stage-shaped TrainConfig for this run's data (every key one of its schema's)."""
    run, hidden = config.run_dir, (config.run_dir / "hidden_states").resolve()
    fp8 = config.extract.dtype == "fp8"
    verifier: dict[str, Any] = {"verifier_name_or_path": config.extract.model}
    if config.extract.trust_remote_code:
        verifier["trust_remote_code"] = True
    return {"train": {
        "speculator_type": "eagle3",
        "verifier": verifier,
        "draft": {"target_layer_ids": ids[:-1]},
        "data": {"data_path": str(hidden / DATA_DIR), "hidden_states_backend": "fp8" if fp8 else "file",
                 "total_seq_len": max(max_length, DEFAULT_TOTAL_SEQ_LEN)},
        "backend": {"hidden_states_path": str(hidden)},
        "generation": {"on_missing": "warn"},
        "trainer": {"save_path": str((run / "draft-speculators").resolve())},
    }}


def write_dataset(config: Config, merge_id: str) -> tuple[Path, str]:
    """merged/tokens as speculators' Arrow dataset under hidden_states/speculators-data/, written again only
    when merged/ is another merge than the one it was written from; (its folder, what was done)."""
    data = config.run_dir / "hidden_states" / DATA_DIR
    mark = data / DATA_MARK
    try:
        if merge_id and json.loads(mark.read_text(encoding="utf-8")).get("merge_id") == merge_id:
            return data, "already written for this merge"
    except (OSError, ValueError, AttributeError):
        pass
    try:
        from datasets import Dataset
        from datasets.utils.logging import disable_progress_bar
    except ImportError:
        raise DraftgenError("speculators' trainer reads the rows as an Arrow dataset, written with the `datasets` "
                            "library, which is not installed here: pip install 'datasets>=2.19' (speculators "
                            "installs it too) and run `draftgen train-command` again") from None
    disable_progress_bar()  # its bars would scribble over the TUI, which runs extraction in-process
    reader = TokenReader(config.run_dir / "merged" / "tokens")
    ids, masks, lengths = [], [], []
    for _id, row, mask in reader:
        ids.append(row.astype("int64"))
        masks.append(mask.astype("int64"))
        lengths.append(len(row))
    ds = Dataset.from_dict({"input_ids": ids, "loss_mask": masks, "seq_len": lengths})
    ds.set_format(type="torch")  # as speculators' preprocessing saves it: ArrowDataset compares torch tensors
    tmp = data.with_name(f".{DATA_DIR}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    ds.save_to_disk(str(tmp))
    write_atomic(tmp / DATA_MARK, json.dumps({"merge_id": merge_id, "rows": len(ids)}).encode())
    if config.extract.group_readable:  # as the samples are (extract.group_readable)
        from draftgen.core.files import GROUP_DIR_MODE, GROUP_FILE_MODE
        tmp.chmod(GROUP_DIR_MODE)
        for part in tmp.iterdir():
            part.chmod(GROUP_FILE_MODE)
    shutil.rmtree(data, ignore_errors=True)
    tmp.rename(data)
    return data, f"{len(ids):,} rows written"


def command(path: Path) -> str:
    return f"speculators train --config {sh_path(path)}"


def describe(spec: dict[str, Any], path: Path, data_note: str, ids: list[int]) -> list[str]:
    """What the speculators config says, one line each (printed by train-command, the script's comments)."""
    t = spec["train"]
    return [f"speculators {SPECULATORS_VERSION} (vLLM's trainer) on the same hidden states: {path}",
            f"  data: {t['data']['data_path']} (merged/tokens as its Arrow dataset: {data_note}); hidden states "
            f"by its {t['data']['hidden_states_backend']!r} backend from {next(iter(t['backend'].values()))}",
            f"  target_layer_ids (vLLM's numbering): {ids[:-1]}, then {ids[-1]} in each file's last slot (the last "
            f"layer's output before the final norm)",
            f"  total_seq_len = {t['data']['total_seq_len']:,} (samples are packed to it; at least the longest)",
            f"  {command(path)}   (several GPUs: torchrun --nproc_per_node=G -m speculators.train "
            f"--config {sh_path(path)})"] + ([] if len(ids) == 4 else [
            f"  NOTE: speculator_type = eagle3 reads 3 aux layers; these files hold {len(ids) - 1}: set the drafter "
            f"that takes them (speculators' dflash, dspark...) in the config before training (its layer ids were "
            f"checked here for EAGLE-3 only)"])


def written_files(config: Config) -> list[Path]:
    """The hand-off's files as written: its config, its script and every file of its Arrow dataset (for the
    record in hidden_states/provenance.json)."""
    hidden = config.run_dir / "hidden_states"
    data = hidden / DATA_DIR
    found = sorted(p for p in data.rglob("*") if p.is_file()) if data.is_dir() else []
    return [hidden / CONFIG_FILE, hidden / SCRIPT_FILE, *found]


def write(config: Config, *, max_length: int) -> list[str]:
    """Write the config, the script and the dataset; the lines that describe them."""
    from draftgen.core.tokens import identity
    fp = identity.read_fingerprint(config.run_dir / "merged" / identity.FINGERPRINT_FILE)
    merge_id = fp.merge_id if fp is not None else ""
    hidden = (config.run_dir / "hidden_states").resolve()
    ids = layer_ids(config)
    spec = train_config(config, max_length=max_length, ids=ids)
    path = hidden / CONFIG_FILE
    hidden.mkdir(parents=True, exist_ok=True)
    _data, note = write_dataset(config, merge_id)
    # JSON is YAML: speculators' yaml.safe_load reads it, and every name stays one escaped string.
    write_atomic(path, (json.dumps(spec, indent=2) + "\n").encode())
    lines = describe(spec, path, note, ids)
    script = hidden / SCRIPT_FILE
    body = ("#!/bin/sh\n" + "".join(f"# {one_line(line)}\n" for line in lines)
            + f"exec {command(path)} \"$@\"\n")
    write_atomic(script, body.encode())
    script.chmod(script.stat().st_mode | 0o100)
    return lines
