"""Resolve draftgen's speculators hand-off with speculators' released trainer config (run in a subprocess).

    python tests/speculators_train_config.py CONFIG.yaml

with the unpacked speculators and hs-connectors wheels on PYTHONPATH (tests/pinned.py). As `speculators train
--config CONFIG.yaml` does up to its data loaders (speculators/train/cli.py `main`): `TrainConfig.resolve`
(unrecognised keys are an error here, where speculators only warns), the backend's `from_train_args`, then
ArrowDataset over `data_path` with that transfer, every row read through `_get_raw_data`. The last line printed
is JSON: the resolved values draftgen sets, where each came from, and each row's slices.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings


def main() -> None:
    from hs_connectors import HiddenStatesBackend
    from speculators.train.config import TrainConfig
    from speculators.train.data import ArrowDataset

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = TrainConfig.resolve(["--config", sys.argv[1]])
    unknown = [str(w.message) for w in caught if "unrecognised keys" in str(w.message)]
    if unknown:  # speculators warns and ignores them: here they are an error
        sys.exit(f"speculators ignores keys of {sys.argv[1]}: {unknown}")
    args = argparse.Namespace(**cfg.flatten())
    transfer = HiddenStatesBackend.registry[args.hidden_states_backend].from_train_args(args, args.data_path)
    data = ArrowDataset(max_len=args.total_seq_len, datapath=args.data_path, transfer=transfer,
                        on_missing=args.on_missing)
    rows = []
    for i in range(len(data)):
        raw = data._get_raw_data(i)
        rows.append(None if not isinstance(raw, dict) else
                    {"aux": list(raw["hidden_states"].shape), "last": list(raw["verifier_last_hidden_states"].shape),
                     "dtype": str(raw["hidden_states"].dtype), "mask": raw["loss_mask"].tolist()})
    keys = ("speculator_type", "verifier_name_or_path", "target_layer_ids", "data_path", "hidden_states_backend",
            "total_seq_len", "on_missing", "save_path")
    print(json.dumps({"values": {k: getattr(args, k) for k in keys},
                      "provenance": {k: cfg.provenance.get(k) for k in keys},
                      "backend_args": dict(cfg.backend_args), "transfer": type(transfer).__name__, "rows": rows}))


if __name__ == "__main__":
    main()
