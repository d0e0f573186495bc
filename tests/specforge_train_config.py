"""Parse draftgen's training hand-off with SpecForge's released code; run as a script with the unpacked
release on PYTHONPATH (pydantic is all its config schema needs; nothing here needs a GPU).

    python tests/specforge_train_config.py CONFIG_JSON

`load_config` (specforge/config/schema.py: the strict typed schema, unknown keys refused) and then
`specforge train --config CONFIG_JSON --plan` through SpecForge's own CLI parser (specforge/cli.py
`main`): it resolves the run (algorithm, feature mode, aux layer ids, topology) and prints the
process plan without starting a worker. Prints one JSON object last.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


def main(path: str) -> None:
    from specforge.algorithms.eagle3.providers import algorithm_providers
    from specforge.cli import main as specforge_main
    from specforge.config import load_config
    from specforge.config.schema import DataConfig

    cfg = load_config(path)
    plan_out = io.StringIO()
    with contextlib.redirect_stdout(plan_out):
        rc = specforge_main(["train", "--config", path, "--plan"])
    defaults = algorithm_providers().model.draft_config.target_defaults
    print(json.dumps({
        "mode": cfg.mode, "max_length": cfg.data.max_length, "hidden_states_path": cfg.data.hidden_states_path,
        "train_data_path": cfg.data.train_data_path, "target_model_path": cfg.model.target_model_path,
        "aux_hidden_state_layer_ids": cfg.model.aux_hidden_state_layer_ids, "strategy": cfg.training.strategy,
        "plan_rc": rc, "plan": plan_out.getvalue(),
        "default_max_length": DataConfig.model_fields["max_length"].default,
        "draft_vocab_size": defaults.draft_vocab_size,
    }))


if __name__ == "__main__":
    main(sys.argv[1])
