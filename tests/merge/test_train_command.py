"""The training hand-off fits the data: data.max_length is at least the longest merged sample, and
the printout says what SpecForge's default (2,048) or a smaller --max-length would cut, counted in
samples, tokens and trained-on tokens (core/extract/handoff.py). SpecForge's acceptance of the
config: tests/extract/test_specforge_contract.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from draftgen.core.extract.handoff import Cut, make_handoff
from tests.extract import test_extract

model_dir = test_extract.model_dir  # the tiny Llama (8 layers)


def sample(n: int) -> tuple[np.ndarray, np.ndarray]:
    """`n` ids; the second half is the answer (loss_mask 1), as a chat sample's end is."""
    return np.arange(n, dtype=np.uint32) % 900, (np.arange(n) >= n // 2).astype(np.uint8)


def test_max_length_is_the_longest_sample_and_smaller_ones_are_counted(tmp_path: Path, model_dir: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from draftgen.cli.main import main
    config = test_extract.make_run(tmp_path, model_dir, [sample(n) for n in (3000, 5000, 100, 2048)])
    h = make_handoff(config)
    assert h.max_length == h.config["data"]["max_length"] == 5000 == h.longest
    assert h.chosen == Cut(5000, 0, 0, 0)
    # SpecForge's default: 3000 and 5000 are cut; every token past 2,048 is an answer token here.
    assert h.cuts[0] == Cut(2048, 2, 952 + 2952, 952 + 2500)
    assert [c.max_length for c in h.cuts] == [2048, 4096]
    assert h.config["model"]["aux_hidden_state_layer_ids"] == [1, 3, 4]  # eagle3 layers; a Llama: ids as they are
    assert any("no file yet" in n for n in h.notes)

    cfg = tmp_path / "draftgen.toml"
    cfg.write_text(f'[output]\ndir = "{config.run_dir}"\n[[datasets]]\nname = "B1"\nprompts = "p.jsonl"\n'
                   f'[extract]\nmodel = "{model_dir}"\n')
    assert main(["train-command", str(cfg), "--max-length", "4096"]) == 0
    out = capsys.readouterr().out
    assert "data.max_length = 4,096: cuts 1 of 4 samples: 904 tokens, 904 of them trained on" in out
    assert "max_length 2,048 (SpecForge's default) would cut 2 of 4 samples: 3,904 tokens, 3,452 of them" in out
    where = config.run_dir.resolve() / "hidden_states" / "specforge.json"
    assert out.rstrip().splitlines()[-1] == f"specforge train --config {where}"
    written = json.loads((config.run_dir / "hidden_states" / "specforge.json").read_text())
    assert written["data"]["max_length"] == 4096
    # The online variant beside it: the same model and length, the pre-tokenized samples instead of the
    # hidden states (SpecForge takes exactly one source), and what only the cluster knows left to the user.
    online = json.loads((config.run_dir / "hidden_states" / "specforge-online.json").read_text())
    assert online["model"] == written["model"] and online["data"]["max_length"] == 4096
    assert online["data"] == {**{k: v for k, v in written["data"].items() if k != "hidden_states_path"},
                              "prompts_path": str(config.run_dir.resolve() / "merged" / "train-tokens.jsonl")}
    assert online["deployment"]["mode"] == "disaggregated" and online["output_dir"] != written["output_dir"]
    assert "model.vocab_mapping_path: the draft's t2d/d2t vocabulary map" in out
    assert "the capture servers must serve at least 4,103 tokens of context" in out
    assert main(["train-command", str(cfg)]) == 0
    assert "data.max_length = 5,000: cuts nothing (at least the longest sample)" in capsys.readouterr().out
