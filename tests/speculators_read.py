"""Read a run's hidden_states/hs_{i}.safetensors with speculators' released reader (run in a subprocess).

    python tests/speculators_read.py RUN OUT [fp8|file]

with the unpacked speculators and hs-connectors wheels on PYTHONPATH (tests/pinned.py). For every row
i of RUN/merged/tokens: the file is loaded by the backend's own transfer (hs_connectors FP8Transfer for
"fp8", FileTransfer for "file": `get_cached(i)`, which dequantizes FP8), checked by
speculators.data_generation.offline.check_hidden_states against the row's ids, and cut by
speculators.train.data.ArrowDataset's own slicing (`_get_raw_data`, over an Arrow dataset of the
rows as speculators' prepare_data saves it). The dequantized [T, k+1, H] tensors go to OUT/hs_{i}.pt;
the last line printed is JSON: the files read, their keys and dtypes as stored, and the slices' shapes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def main() -> None:
    run, out, backend = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "fp8"
    from datasets import Dataset
    from hs_connectors import FileTransfer, FP8Transfer
    from safetensors import safe_open
    from speculators.data_generation.offline import check_hidden_states, get_existing_hidden_state_indices
    from speculators.train.data import ArrowDataset

    from draftgen.core.tokens.store import TokenReader

    hidden = run / "hidden_states"
    rows = [(ids.astype("int64").tolist(), mask.astype("int64").tolist())
            for _, ids, mask in TokenReader(run / "merged" / "tokens")]
    transfer = FP8Transfer(hidden) if backend == "fp8" else FileTransfer(hidden)
    data = out / "arrow"
    ds = Dataset.from_dict({"input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows],
                            "seq_len": [len(r[0]) for r in rows]})
    ds.set_format(type="torch")  # as speculators' preprocessing saves it
    ds.save_to_disk(str(data))
    arrow = ArrowDataset(max_len=4096, datapath=data, transfer=transfer, on_missing="raise")
    files = []
    for i, (ids, _mask) in enumerate(rows):
        with safe_open(str(hidden / f"hs_{i}.safetensors"), framework="pt") as f:
            stored = {k: str(f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118
            meta = f.metadata()
        loaded = transfer.get_cached(i)
        assert loaded is not None, f"hs_{i}.safetensors: FileTransfer found nothing"
        check_hidden_states(loaded, ids)
        raw = arrow._get_raw_data(i)
        assert isinstance(raw, dict), f"hs_{i}.safetensors: ArrowDataset gave {raw!r}"
        torch.save(loaded["hidden_states"].float(), out / f"hs_{i}.pt")
        files.append({"index": i, "stored": stored, "metadata": meta,
                      "dequantized": [str(loaded["hidden_states"].dtype), list(loaded["hidden_states"].shape)],
                      "aux": list(raw["hidden_states"].shape), "last": list(raw["verifier_last_hidden_states"].shape),
                      "ids_equal": bool(torch.equal(raw["input_ids"], torch.tensor(ids)))})
    print(json.dumps({"files": files, "existing": get_existing_hidden_state_indices(hidden)}))


if __name__ == "__main__":
    main()
