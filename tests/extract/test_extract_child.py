"""Extraction in a child process (the specforge backend outside torchrun): SGLang allows one capture per
process, so the TUI's second `x` must not run in the first one's process. Here on the CPU: the child
runs the real runner on a tiny model, twice, with progress, stop and errors carried back."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from draftgen.core.config import Config
from draftgen.core.config_load import config_from_dict
from draftgen.core.errors import ConfigError, DraftgenError
from draftgen.core.extract import layout, runner
from draftgen.core.extract.child import extract_in_child, needs_child
from draftgen.core.live.snapshot import StageProgress
from draftgen.core.tokens.store import TokenWriter

VOCAB = 300


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=2,
                                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
                                 pad_token_id=0)).eval().save_pretrained(path)
    return path


def make_run(tmp_path: Path, model: Path, n: int = 4, **extract_table: object) -> Config:
    rng = np.random.default_rng(2)
    with TokenWriter(tmp_path / "run" / "merged" / "tokens") as writer:
        for k in range(n):
            writer.append(f"s{k}", rng.integers(1, VOCAB, size=6 + k), np.ones(6 + k, dtype=np.uint8))
    table = {"model": str(model), "backend": "hf", "device": "cpu", "dtype": "float32", **extract_table}
    raw = {"output": {"dir": str(tmp_path / "run")}, "datasets": [{"name": "B1", "prompts": "p.jsonl"}],
           "extract": table}
    return config_from_dict(raw, tmp_path / "draftgen.toml")


def test_only_the_specforge_backend_outside_torchrun_goes_to_a_child() -> None:
    assert needs_child("specforge", None, None, env={})
    assert not needs_child("specforge", None, None, env={"WORLD_SIZE": "8"})  # a torchrun rank runs once
    assert not needs_child("specforge", object(), None, env={})               # a backend already loaded
    assert not needs_child("hf", None, None, env={})


def test_two_extractions_in_one_process_each_run_in_their_own_child(tmp_path: Path, model_dir: Path) -> None:
    for name in ("first", "second"):
        seen: list[StageProgress] = []
        config = make_run(tmp_path / name, model_dir)
        stats = extract_in_child(config, progress=seen.append, target=runner.extract)
        assert stats.written == 4 and not stats.stopped
        assert seen and seen[-1].state == "done" and seen[-1].done == 4
        root = config.run_dir / "hidden_states"
        assert all(layout.existing_sample(root, k) is not None for k in range(4))


def test_stop_reaches_the_child_and_its_errors_come_back_as_themselves(tmp_path: Path, model_dir: Path) -> None:
    stop = threading.Event()
    stop.set()
    stats = extract_in_child(make_run(tmp_path / "stopped", model_dir), stop=stop, target=runner.extract)
    assert stats.stopped and stats.written == 0
    bad = make_run(tmp_path / "bad", model_dir, aux_layers=[1, 3, 99])  # the child reads N = 8: out of range
    with pytest.raises(ConfigError, match=r"outside 0\.\.6"):
        extract_in_child(bad, target=runner.extract)
    # A DraftgenError class of another module than core/errors.py comes back as itself too.
    from draftgen.core.extract.child import _raise
    from draftgen.core.extract.claim import HiddenStatesOfAnotherMerge
    with pytest.raises(HiddenStatesOfAnotherMerge, match="another merge"):
        _raise(f"{HiddenStatesOfAnotherMerge.__module__}:{HiddenStatesOfAnotherMerge.__qualname__}", "another merge")
    with pytest.raises(DraftgenError) as plain:
        _raise("os:OSError", "not ours")  # never a class from outside draftgen
    assert type(plain.value) is DraftgenError


def test_the_specforge_backend_runs_in_a_child_every_time(tmp_path: Path, model_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Here SpecForge (or a GPU) is missing, so the child stops with that error, the same each time; in one
    process the second would have met SGLang's state from the first."""
    from draftgen.core.extract import runner
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def in_this_process(*_a: object) -> None:
        raise AssertionError("the specforge backend was set up in the test's own process")
    monkeypatch.setattr(runner, "make_group", in_this_process)  # a spawned child never sees this
    config = make_run(tmp_path, model_dir, backend="specforge", min_shm_gb=0)
    messages = []
    for _ in range(2):
        with pytest.raises(DraftgenError) as caught:
            runner.extract(config)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
    assert "SpecForge and SGLang" in messages[0] or "CUDA" in messages[0]
