"""Read an online SpecForge config's samples with SpecForge's released code; run as a script with the
unpacked release on PYTHONPATH (pydantic is all its config schema needs; nothing here needs a GPU).

    python tests/specforge_prompts.py CONFIG_JSON [OVERRIDE ...]

What an online `specforge train --config CONFIG_JSON OVERRIDE ...` of SpecForge 0.2.0 does before its
first step, from its own modules: `load_config` (the strict typed schema, then the dotted overrides),
`specforge train --plan` through its CLI (the process plan, no worker started), `resolve_run` (the
algorithm) and `specforge.training.assembly._prepare_prompts`, the function its online producer calls
for its prompts: it passes the configured path, max_length, chat template and the algorithm's minimum
loss tokens and loss-mask filter to `specforge.data.prompt_builder.prepare_prompt_tasks`. A file whose
first record has input_ids and loss_mask is read verbatim; any other goes through
`build_eagle3_dataset` with the tokenizer given here, the bundled Kimi tokenizer of
tests/specforge_parse.py. Prints one JSON object last: the plan's exit code, the data paths and every
prompt's input_ids and loss_mask, in order.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


def main(path: str, overrides: list[str]) -> None:
    from specforge.application import resolve_run
    from specforge.cli import main as specforge_main
    from specforge.config import SGLANG_CAPTURE_CONTEXT_HEADROOM, load_config
    from specforge.training.assembly import _prepare_prompts
    from specforge_parse import KimiForSpecForge

    cfg = load_config(path, overrides)
    plan_out = io.StringIO()
    with contextlib.redirect_stdout(plan_out):
        rc = specforge_main(["train", "--config", path, "--plan", *overrides])
    resolved = resolve_run(cfg)
    prompts = _prepare_prompts(resolved.config, KimiForSpecForge(), algorithm=resolved.algorithm, draft_config=None)
    print(json.dumps({
        "mode": cfg.mode, "plan_rc": rc, "plan": plan_out.getvalue(), "strategy": cfg.training.strategy,
        "prompts_path": cfg.data.prompts_path, "train_data_path": cfg.data.train_data_path,
        "max_length": cfg.data.max_length, "target_model_path": cfg.model.target_model_path,
        "capture_headroom": SGLANG_CAPTURE_CONTEXT_HEADROOM,
        "prompts": [{"input_ids": list(p["payload"]["input_ids"]), "loss_mask": list(p["payload"]["loss_mask"])}
                    for p in prompts],
    }))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
