"""Online training reads draftgen's ids: the online hand-off (hidden_states/specforge-online.json, written
by `draftgen train-command`) given to SpecForge's released code, as `specforge train` would read it.

SpecForge 0.2.0 is downloaded once per pytest cache (tests/pinned.py) and run in a subprocess
(tests/specforge_prompts.py): its own `load_config` with the cluster's keys given on the command line as
the printout says, its `--plan`, and the prompts its online producer trains on, from its own
`_prepare_prompts` → `prepare_prompt_tasks`. Every one of them must be merged/tokens' entry at the same
index, ids and loss mask. Re-rendering merged/train.jsonl instead (what docs/training.md once said an
online run reads) gives other ids: SpecForge's kimi template adds a default system prompt to a row without
one, Kimi-K2.5's own template drops the answer's reasoning, and SpecForge shuffles the rows it renders.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from tests.extract import test_extract
from tests.pinned import run_with_specforge

model_dir = test_extract.model_dir  # the tiny Llama fixture (the hand-off reads its layer count)


def site_overrides(tmp_path: Path) -> list[str]:
    """A value for each key the printout says the cluster must give (no traffic: `--plan` starts nothing)."""
    from draftgen.core.extract.handoff import ONLINE_SITE_KEYS
    values = {"deployment.disaggregated.server_urls": '["http://127.0.0.1:30000"]',
              "deployment.disaggregated.mooncake_master_server_addr": "127.0.0.1:50051",
              "deployment.disaggregated.mooncake_metadata_server": "http://127.0.0.1:8080/metadata",
              "model.vocab_mapping_path": str(tmp_path / "vocab-mapping.pt")}
    return [f"{key}={values[key]}" for key, _, _ in ONLINE_SITE_KEYS]


def read_online(config: Any, specforge_tree: Path, tmp_path: Path, *more: str) -> tuple[dict, list]:
    """`draftgen train-command`, then SpecForge's reading of the online config it wrote; (its answer,
    merged/tokens as [(ids, mask)])."""
    from draftgen.core.extract.handoff import ONLINE_CONFIG_FILE, train_command
    from draftgen.core.tokens.store import TokenReader
    out = io.StringIO()
    assert train_command(config, out=out) == 0
    online = config.run_dir / "hidden_states" / ONLINE_CONFIG_FILE
    assert "# online training instead" in out.getvalue() and str(online.resolve()) in out.getvalue()
    got = run_with_specforge("specforge_prompts.py", online, specforge_tree, "SpecForge refused",
                             *site_overrides(tmp_path), *more)
    ours = [(ids.tolist(), mask.tolist()) for _, ids, mask in TokenReader(config.run_dir / "merged" / "tokens")]
    return got, ours


def equal_samples(got: dict, ours: list) -> int:
    return sum(p["input_ids"] == ids and p["loss_mask"] == mask
               for p, (ids, mask) in zip(got["prompts"], ours, strict=False))


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`draftgen demo --headless`'s run (simulator, smoke, generation, merge, extraction): its config."""
    import asyncio

    from draftgen.core.config_load import load_config
    from draftgen.tui.demo import run_demo
    root = tmp_path_factory.mktemp("demo")
    out = io.StringIO()
    assert asyncio.run(run_demo(root, headless=True, out=out, latency_scale=0.02)) == 0, out.getvalue()[-3000:]
    return load_config(root / "draftgen.toml")


@pytest.mark.slow
def test_specforge_trains_online_on_every_demo_sample_as_merged(demo_run: Any, specforge_tree: Path,
                                                                tmp_path: Path) -> None:
    from draftgen.core.extract.handoff import SGLANG_CAPTURE_HEADROOM
    got, ours = read_online(demo_run, specforge_tree, tmp_path)
    merged = demo_run.run_dir / "merged"
    assert got["plan_rc"] == 0 and got["mode"] == "online" and got["strategy"] == "eagle3"
    assert got["prompts_path"] == str((merged / "train-tokens.jsonl").resolve()) and got["train_data_path"] == ""
    assert got["max_length"] == max(len(ids) for ids, _ in ours)  # nothing cut
    assert got["capture_headroom"] == SGLANG_CAPTURE_HEADROOM  # the context the printout asks of the servers
    assert len(ours) > 200 and any(n > 1 for n in (sum(m) for _, m in ours))
    assert len(got["prompts"]) == len(ours)
    assert equal_samples(got, ours) == len(ours)
    # `data.train_data_path` reads the same file the same way (SpecForge sniffs its first record).
    same, _ = read_online(demo_run, specforge_tree, tmp_path, "data.prompts_path=",
                          f"data.train_data_path={merged / 'train-tokens.jsonl'}")
    assert same["prompts"] == got["prompts"]


@pytest.mark.slow
def test_a_per_conversation_merge_is_read_online_with_every_turn_in_its_mask(tmp_path: Path, specforge_tree: Path,
                                                                           model_dir: Path) -> None:
    """A per-conversation sample's mask has its earlier answers added by the merge (they are not in the
    dataset's token store): SpecForge reads that mask, not the stored one."""
    from draftgen.core.merge.merge import merge
    from tests.multiturn import multi_turn_run
    config, _ = multi_turn_run(tmp_path, merge={"multi_turn": "per_conversation"},
                               tables={"extract": {"model": str(model_dir)}})
    merge(config)
    got, ours = read_online(config, specforge_tree, tmp_path)
    assert len(ours) == 4 and equal_samples(got, ours) == len(got["prompts"]) == 4
    spans = [sum(1 for a, b in zip([0, *m], m, strict=False) if b > a) for _, m in ours]
    assert max(spans) == 3
