"""Read a draftgen run with SpecForge's released code; run as a script with the unpacked release on PYTHONPATH.

    python tests/specforge_read.py RUN_DIR

What an offline EAGLE-3 training run of SpecForge 0.2.0 does with `hidden_states/`, from its own
modules (pure python + torch; nothing here needs a GPU, SGLang or `datasets`):
`OfflineManifestReader` (validate_files=True: every file's keys and tensors inspected up front),
`LocalFeatureStore` + `FeatureDataLoader` (the training loader, file:// refs) with the EAGLE-3
normaliser `build_offline_normalizer` as its per-sample transform. And with `merged/train.jsonl`:
`safe_conversations_generator`, the reader `scripts/prepare_hidden_states.py` feeds its dataset
from. (SpecForge's stricter `scripts/conversation_validation.py` is not in the released wheel or
sdist, so it cannot be run from a release; the same rules are checked here in its terms by the
caller.) Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(run_dir: str) -> None:
    import torch
    from specforge.algorithms.eagle3.data import build_offline_normalizer
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader
    from specforge.utils import safe_conversations_generator

    run = Path(run_dir)
    refs = OfflineManifestReader(str(run / "hidden_states"), validate_files=True, max_len=1 << 20).read()
    loader = FeatureDataLoader(LocalFeatureStore(), refs=refs, batch_size=1, drop_last=False,
                               per_sample_transform=build_offline_normalizer(1 << 20), strategy="eagle3")
    samples = []
    for ref, batch in zip(refs, loader, strict=True):
        t = batch.tensors if hasattr(batch, "tensors") else batch
        t = {k: v for k, v in dict(t).items() if isinstance(v, torch.Tensor)}
        samples.append({
            "path": ref.feature_store_uri.removeprefix("file://"),
            "num_tokens": ref.num_tokens,
            "specs": {k: [list(s.shape), str(s.dtype)] for k, s in ref.feature_specs.items()},
            "shapes": {k: list(v.shape) for k, v in t.items()},
            "dtypes": {k: str(v.dtype) for k, v in t.items()},
            "input_ids": t["input_ids"].reshape(-1).tolist(),
            "loss_mask": t["loss_mask"].reshape(-1).tolist(),
        })
    rows = list(safe_conversations_generator(str(run / "merged" / "train.jsonl")))
    print(json.dumps({"samples": samples, "conversations": [r["conversations"] for r in rows],
                      "row_keys": sorted({k for r in rows for k in r})}))


if __name__ == "__main__":
    main(sys.argv[1])
