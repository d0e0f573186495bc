"""Hidden-state extraction with a real (tiny, random-weight) Llama built from a config in the test.

The files are read back the way SpecForge's offline trainer reads them (`_specforge_read` below
mirrors specforge/data/preprocessing.py), and compared with what transformers itself computes.
Over 400 lines: the reader, the tiny model and every extraction mode share those fixtures.
"""

from __future__ import annotations

import io
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from draftgen.core.config import Config
from draftgen.core.config_load import config_from_dict
from draftgen.core.errors import ConfigError, DiskError, DraftgenError
from draftgen.core.extract import disk, extract, extract_command, layout, parse_shard, run_plan
from draftgen.core.extract.hf_backend import HFBackend
from draftgen.core.extract.model_info import (
    ModelDims,
    dims_from_config_dict,
    eagle3_layers,
    read_model_dims,
    resolve_aux_layers,
)
from draftgen.core.extract.plan import plan_batches
from draftgen.core.live.snapshot import StageProgress
from draftgen.core.tokens.store import TokenWriter

N_LAYERS, HIDDEN, VOCAB = 8, 64, 1000
NAN_TOKEN = VOCAB - 1  # its embedding row is NaN: a sample holding it gives NaN states
N_SAMPLES = 14


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=N_LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[NAN_TOKEN] = float("nan")
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from draftgen.core.extract.hf_backend import _dtype_kwarg  # `torch_dtype` before transformers 4.56
    return AutoModelForCausalLM.from_pretrained(model_dir, **{_dtype_kwarg(): torch.float32}).eval()


def make_samples(seed: int = 1, n: int = N_SAMPLES) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        length = int(rng.integers(3, 48))
        ids = rng.integers(1, NAN_TOKEN, size=length)  # never the NaN token, never the pad id 0
        mask = (rng.random(length) < 0.6).astype(np.uint8)
        samples.append((ids, mask))
    return samples


def make_run(tmp_path: Path, model_dir: Path, samples: list[tuple[np.ndarray, np.ndarray]] | None = None,
             **extract_table: object) -> Config:
    run = tmp_path / "run"
    with TokenWriter(run / "merged" / "tokens") as writer:
        for k, (ids, mask) in enumerate(samples if samples is not None else make_samples()):
            writer.append(f"s{k}", ids, mask)
    table = {"model": str(model_dir), "backend": "hf", "device": "cpu", "dtype": "float32", **extract_table}
    raw = {"output": {"dir": str(run)}, "datasets": [{"name": "B1", "prompts": "p.jsonl"}], "extract": table}
    return config_from_dict(raw, tmp_path / "draftgen.toml")


def token_arrays(config: Config) -> list[tuple[np.ndarray, np.ndarray]]:
    from draftgen.core.tokens.store import TokenReader
    return [(ids, mask) for _, ids, mask in TokenReader(config.run_dir / "merged" / "tokens")]


def _specforge_files(root: Path) -> list[str]:
    # specforge/data/preprocessing.py list_local_files: walk, keep .ckpt / .ckpt.gz, sort.
    paths = [os.path.join(r, f) for r, _, files in os.walk(root) for f in files]
    return sorted(p for p in paths if p.endswith((".ckpt", ".ckpt.gz")))


def _specforge_read(path: str, max_len: int = 2048) -> dict[str, torch.Tensor]:
    # OfflineEagle3Dataset._open_file + process_data, as SpecForge does them.
    data = layout.load_sample(Path(path))
    hidden_state = data["aux_hidden_state"].squeeze(0)[:max_len][None, :]
    target = data["hidden_state"].squeeze(0)[:max_len][None, :]
    input_ids = data["input_ids"][:max_len][None, :]
    loss_mask = data["loss_mask"][:max_len][None, :].clone()
    loss_mask[0, -1] = 0
    return {"attention_mask": torch.ones_like(loss_mask), "loss_mask": loss_mask, "target": target,
            "hidden_state": hidden_state, "input_ids": input_ids}


def reference(hf_model: torch.nn.Module, ids: np.ndarray) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """transformers' own logits and output_hidden_states for one unpadded sample."""
    with torch.no_grad():
        out = hf_model(torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True)
    return out.logits[0], tuple(h[0] for h in out.hidden_states)


# ---------------------------------------------------------------------------------------------
# The files


def test_files_have_exactly_the_specforge_keys_shapes_and_dtypes(tmp_path: Path, model_dir: Path) -> None:
    config = make_run(tmp_path, model_dir)
    stats = extract(config)
    root = config.run_dir / "hidden_states"
    arrays = token_arrays(config)
    assert stats.written == N_SAMPLES and stats.nan_samples == 0 and stats.skipped_existing == 0
    files = _specforge_files(root)
    assert sorted(files) == sorted(str(root / "rows_0-2000" / f"data_{i}.ckpt") for i in range(N_SAMPLES))
    for i, (ids, mask) in enumerate(arrays):
        t = len(ids)
        data = torch.load(root / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)
        assert list(data) == ["input_ids", "loss_mask", "hidden_state", "aux_hidden_state"]
        assert (data["input_ids"].dtype, tuple(data["input_ids"].shape)) == (torch.int64, (t,))
        assert (data["loss_mask"].dtype, tuple(data["loss_mask"].shape)) == (torch.int64, (t,))
        assert (data["hidden_state"].dtype, tuple(data["hidden_state"].shape)) == (torch.bfloat16, (1, t, HIDDEN))
        assert (data["aux_hidden_state"].dtype, tuple(data["aux_hidden_state"].shape)) == (torch.bfloat16,
                                                                                           (1, t, 3 * HIDDEN))
        assert data["input_ids"].tolist() == ids.tolist()
        assert data["loss_mask"].tolist() == mask.tolist()
        for tensor in data.values():  # no padding rows hiding in a larger storage either
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    # And SpecForge's reader gets what it expects out of every file.
    for path in files:
        item = _specforge_read(path)
        t = item["input_ids"].shape[1]
        assert item["hidden_state"].shape == (1, t, 3 * HIDDEN) and item["target"].shape == (1, t, HIDDEN)
    stats_json = json.loads((root / "stats.json").read_text())
    assert stats_json["samples"] == N_SAMPLES and stats_json["num_layers"] == N_LAYERS
    assert stats_json["hidden_size"] == HIDDEN and stats_json["layers"] == list(eagle3_layers(N_LAYERS))
    assert stats_json["tokens"] == sum(len(ids) for ids, _ in arrays) and stats_json["nan_samples"] == 0
    assert not any(p.name.startswith(".") for p in (root / "rows_0-2000").iterdir())


def test_bf16_run_stores_only_each_samples_rows(tmp_path: Path, model_dir: Path) -> None:
    # In bf16 the backend's slices are views of the padded batch: saving one must not save the batch.
    samples = make_samples(seed=7, n=6)
    config = make_run(tmp_path, model_dir, samples, dtype="bfloat16", batch_tokens=10_000)
    extract(config)
    for i, (ids, _) in enumerate(samples):
        path = layout.sample_path(config.run_dir / "hidden_states", i)
        data = torch.load(path, weights_only=True)
        assert data["hidden_state"].shape == (1, len(ids), HIDDEN)
        for tensor in data.values():
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        assert path.stat().st_size < len(ids) * (4 * HIDDEN * 2 + 16) + 4096


def test_rows_folders_group_2000_files(tmp_path: Path) -> None:
    assert layout.sample_path(tmp_path, 0) == tmp_path / "rows_0-2000" / "data_0.ckpt"
    assert layout.sample_path(tmp_path, 1999) == tmp_path / "rows_0-2000" / "data_1999.ckpt"
    assert layout.sample_path(tmp_path, 2000) == tmp_path / "rows_2000-4000" / "data_2000.ckpt"
    assert layout.sample_path(tmp_path, 4321, compress=True) == tmp_path / "rows_4000-6000" / "data_4321.ckpt.gz"


def test_compressed_files_read_back_the_same(tmp_path: Path, model_dir: Path) -> None:
    samples = make_samples(n=4)
    plain = make_run(tmp_path / "a", model_dir, samples)
    packed = make_run(tmp_path / "b", model_dir, samples, compress=True)
    extract(plain)
    extract(packed)
    for i in range(4):
        a = _specforge_read(str(layout.sample_path(plain.run_dir / "hidden_states", i)))
        b = _specforge_read(str(layout.sample_path(packed.run_dir / "hidden_states", i, compress=True)))
        for key in a:
            assert torch.equal(a[key], b[key]), key
    # Switching compression on a restart does not write a second copy of a sample.
    again = extract(make_run(tmp_path / "a", model_dir, [], compress=True))
    assert again.written == 0 and again.skipped_existing == 4
    assert not list((plain.run_dir / "hidden_states").rglob("*.gz"))


# ---------------------------------------------------------------------------------------------
# The values


def test_hidden_state_is_the_lm_head_input(tmp_path: Path, model_dir: Path, hf_model: torch.nn.Module) -> None:
    samples = make_samples(n=4)
    backend = HFBackend(str(model_dir), eagle3_layers(N_LAYERS), dtype="float32", device="cpu")
    outputs = backend.run([ids for ids, _ in samples])
    config = make_run(tmp_path, model_dir, samples)
    extract(config)
    for i, ((ids, _), (hidden, _aux)) in enumerate(zip(samples, outputs)):
        logits, hidden_states = reference(hf_model, ids)
        with torch.no_grad():
            torch.testing.assert_close(hf_model.lm_head(hidden), logits, atol=1e-5, rtol=1e-5)
            # transformers 5: output_hidden_states[-1] is the final-norm output too.
            torch.testing.assert_close(hidden, hidden_states[-1], atol=1e-5, rtol=1e-5)
            stored = torch.load(layout.sample_path(config.run_dir / "hidden_states", i), weights_only=True)
            from_file = hf_model.lm_head(stored["hidden_state"][0].float())
        torch.testing.assert_close(from_file, logits, atol=2e-2, rtol=2e-2)  # bf16 storage


@pytest.mark.parametrize("aux_layers", ["eagle3", [0, 3, 6]])
def test_aux_slices_are_the_hf_layer_outputs(tmp_path: Path, model_dir: Path, hf_model: torch.nn.Module,
                                             aux_layers: str | list[int]) -> None:
    layers = eagle3_layers(N_LAYERS) if aux_layers == "eagle3" else tuple(aux_layers)
    assert layers == ((1, 3, 4) if aux_layers == "eagle3" else (0, 3, 6))
    samples = make_samples(seed=2, n=4)
    config = make_run(tmp_path, model_dir, samples, aux_layers=aux_layers)
    stats = extract(config)
    assert stats.layers == layers
    backend = HFBackend(str(model_dir), layers, dtype="float32", device="cpu")
    outputs = backend.run([ids for ids, _ in samples])
    for i, ((ids, _), (_hidden, aux)) in enumerate(zip(samples, outputs)):
        _, hidden_states = reference(hf_model, ids)
        stored = torch.load(layout.sample_path(config.run_dir / "hidden_states", i), weights_only=True)
        for j, k in enumerate(layers):
            expected = hidden_states[k + 1]
            torch.testing.assert_close(aux[:, j * HIDDEN:(j + 1) * HIDDEN], expected, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(stored["aux_hidden_state"][0, :, j * HIDDEN:(j + 1) * HIDDEN].float(),
                                       expected.to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)


@pytest.mark.slow
def test_batching_mixed_lengths_equals_one_by_one(tmp_path: Path, model_dir: Path) -> None:
    samples = make_samples(seed=3, n=8)
    lengths = [len(ids) for ids, _ in samples]
    assert len(set(lengths)) > 1
    backend = HFBackend(str(model_dir), eagle3_layers(N_LAYERS), dtype="float32", device="cpu")
    together = backend.run([ids for ids, _ in samples])
    for (ids, _), (hidden, aux) in zip(samples, together):
        alone_hidden, alone_aux = backend.run([ids])[0]
        assert hidden.shape == (len(ids), HIDDEN) and aux.shape == (len(ids), 3 * HIDDEN)
        torch.testing.assert_close(hidden, alone_hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(aux, alone_aux, atol=1e-5, rtol=1e-5)
    # Through extract(): one big batch and one sample per batch give the same files.
    batched = make_run(tmp_path / "batched", model_dir, samples, batch_tokens=10_000)
    single = make_run(tmp_path / "single", model_dir, samples, batch_tokens=1)
    extract(batched)
    extract(single)
    for i in range(len(samples)):
        a = torch.load(layout.sample_path(batched.run_dir / "hidden_states", i), weights_only=True)
        b = torch.load(layout.sample_path(single.run_dir / "hidden_states", i), weights_only=True)
        for key in layout.KEYS:
            assert a[key].shape == b[key].shape
            torch.testing.assert_close(a[key].float(), b[key].float(), atol=1e-2, rtol=1e-2)


def test_plan_batches_respects_the_token_limit() -> None:
    rng = np.random.default_rng(4)
    items = [(k, int(rng.integers(1, 300))) for k in range(200)] + [(200, 5000)]
    batches = plan_batches(items, batch_tokens=1024, max_samples=16)
    length = dict(items)
    assert sorted(k for b in batches for k in b) == list(range(201))
    assert [200] in batches  # longer than the limit: alone
    for batch in batches:
        assert len(batch) <= 16
        if len(batch) > 1:
            assert len(batch) * max(length[k] for k in batch) <= 1024


# ---------------------------------------------------------------------------------------------
# Restart, shards, NaN, disk


def test_restart_skips_files_already_written(tmp_path: Path, model_dir: Path) -> None:
    config = make_run(tmp_path, model_dir)
    extract(config)
    root = config.run_dir / "hidden_states"
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*.ckpt")}
    redo = layout.sample_path(root, 5)
    redo.unlink()
    stale = root / "rows_0-2000" / ".data_7.ckpt.tmp-4242"  # left by a killed run
    stale.write_bytes(b"half a file")
    stats = extract(config)
    assert (stats.written, stats.skipped_existing) == (1, N_SAMPLES - 1)
    assert redo.exists() and not stale.exists()
    for path, mtime in before.items():
        if path != redo:
            assert path.stat().st_mtime_ns == mtime, path


def test_shards_cover_every_sample_exactly_once(tmp_path: Path, model_dir: Path) -> None:
    config = make_run(tmp_path, model_dir)
    root = config.run_dir / "hidden_states"
    seen: set[int] = set()
    total = 0
    for i in range(3):
        stats = extract(config, shard=(i, 3))
        now = {int(p.name.split("_")[1].split(".")[0]) for p in root.rglob("*.ckpt")}
        mine = now - seen
        assert mine == {k for k in range(N_SAMPLES) if k % 3 == i}
        assert stats.written == len(mine) and stats.samples == len(mine)
        assert json.loads((root / f"stats.shard-{i}-of-3.json").read_text())["written"] == len(mine)
        seen |= now
        total += stats.written
    assert seen == set(range(N_SAMPLES)) and total == N_SAMPLES


def test_nan_sample_is_reported_not_written(tmp_path: Path, model_dir: Path) -> None:
    samples = make_samples(seed=5, n=6)
    ids, mask = samples[2]
    ids = ids.copy()
    ids[len(ids) // 2] = NAN_TOKEN
    samples[2] = (ids, mask)
    config = make_run(tmp_path, model_dir, samples, batch_tokens=10_000)  # the NaN sample shares a batch
    stats = extract(config)
    root = config.run_dir / "hidden_states"
    assert stats.nan_samples == 1 and stats.nan == [{"index": 2, "id": "s2"}]
    assert stats.written == 5
    assert not layout.sample_path(root, 2).exists()
    for i in (0, 1, 3, 4, 5):
        data = torch.load(layout.sample_path(root, i), weights_only=True)
        assert torch.isfinite(data["hidden_state"].float()).all()
    assert json.loads((root / "stats.json").read_text())["nan"] == [{"index": 2, "id": "s2"}]
    assert "sample 2 (id s2) has NaN" in (config.run_dir / "events.log").read_text()


def test_disk_check_refuses_when_space_is_short(tmp_path: Path, model_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    config = make_run(tmp_path, model_dir)
    tokens = sum(len(ids) for ids, _ in token_arrays(config))
    need = disk.bytes_needed(tokens, N_SAMPLES, HIDDEN)
    assert need >= tokens * (3 * HIDDEN + HIDDEN) * 2
    usage = type("Usage", (), {"total": 10**9, "used": 10**9 - 5000, "free": 5000})
    monkeypatch.setattr(run_plan.shutil, "disk_usage", lambda path: usage)
    with pytest.raises(DiskError) as err:
        extract(config)
    assert f"{need:,} bytes" in str(err.value) and "5,000 bytes" in str(err.value)
    assert not list((config.run_dir / "hidden_states").rglob("*.ckpt"))


def test_no_merged_tokens_is_a_clear_error(tmp_path: Path, model_dir: Path) -> None:
    raw = {"output": {"dir": str(tmp_path / "run")}, "datasets": [{"name": "B1", "prompts": "p.jsonl"}],
           "extract": {"model": str(model_dir)}}
    with pytest.raises(DraftgenError, match="draftgen merge"):
        extract(config_from_dict(raw, tmp_path / "draftgen.toml"))


# ---------------------------------------------------------------------------------------------
# Model config: N and H, and the aux layers


def test_nested_text_config_gives_n_and_h(tmp_path: Path) -> None:
    kimi = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": {"model_type": "kimi_k2", "num_hidden_layers": 61, "hidden_size": 7168,
                            "vocab_size": 163840},
            "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27}}
    (tmp_path / "config.json").write_text(json.dumps(kimi))
    dims = read_model_dims(str(tmp_path))
    assert (dims.num_layers, dims.hidden_size) == (61, 7168)
    assert resolve_aux_layers("eagle3", dims) == (1, 29, 57)  # Kimi-K2.5's EAGLE-3 layers (docs/files.md)


def test_top_level_config_and_missing_numbers() -> None:
    dims = dims_from_config_dict({"num_hidden_layers": 32, "hidden_size": 4096}, "llama/config.json")
    assert (dims.num_layers, dims.hidden_size) == (32, 4096)
    assert eagle3_layers(32) == (1, 15, 28)
    with pytest.raises(DraftgenError, match="text_config"):
        dims_from_config_dict({"vision_config": {"hidden_size": 3}}, "x/config.json")


def test_explicit_layers_out_of_range_are_refused() -> None:
    dims = ModelDims(num_layers=8, hidden_size=64, source="tiny")
    assert resolve_aux_layers([0, 3, 6], dims) == (0, 3, 6)
    with pytest.raises(ConfigError, match="outside 0..6"):
        resolve_aux_layers([0, 3, 7], dims)  # the last layer's output is hidden_state already
    assert resolve_aux_layers([1, 2], dims) == (1, 2)  # any number of layers (issue 53)
    with pytest.raises(ConfigError, match="lists no layer"):
        resolve_aux_layers([], dims)


def test_aux_layers_must_ascend() -> None:
    # SGLang concatenates captured layers in model order: [5, 2, 3] would label every slice wrong.
    dims = ModelDims(num_layers=8, hidden_size=64, source="tiny")
    for bad in ([5, 2, 3], [2, 2, 3], [1, 4, 3]):
        with pytest.raises(ConfigError, match=r"strictly ascending.*e\.g\. \["):
            resolve_aux_layers(bad, dims)


def test_sglang_capture_ids_follow_the_deepseek_plus_one_rule() -> None:
    from draftgen.core.extract.model_info import sglang_capture_ids
    llama = ModelDims(num_layers=61, hidden_size=64, source="t", architectures=("LlamaForCausalLM",))
    kimi = dims_from_config_dict({"architectures": ["KimiK25ForConditionalGeneration"],
                                  "text_config": {"model_type": "deepseek_v3", "num_hidden_layers": 61,
                                                  "hidden_size": 7168}}, "kimi")
    assert kimi.deepseek_family and not llama.deepseek_family
    # Llama adds 1 to every id; DeepSeek adds 1 when the first id is 1 (Kimi's default [1, 29, 57]).
    assert sglang_capture_ids((2, 29, 57), llama) == [2, 29, 57]
    assert sglang_capture_ids((1, 29, 57), kimi) == [1, 29, 57]
    assert sglang_capture_ids((2, 29, 57), kimi) == [3, 30, 58]  # taken as layer inputs: shift them ourselves
    with pytest.raises(ConfigError, match="starts at layer 0, which SGLang cannot capture for a DeepSeek-family"):
        sglang_capture_ids((0, 29, 57), kimi)
    assert sglang_capture_ids((0, 29, 57), llama) == [0, 29, 57]


# ---------------------------------------------------------------------------------------------
# Progress and the command


def test_progress_reports_samples_tokens_and_done(tmp_path: Path, model_dir: Path) -> None:
    config = make_run(tmp_path, model_dir, batch_tokens=64)
    seen: list[StageProgress] = []
    extract(config, progress=seen.append)
    assert seen and all(p.name == "extract" and p.rate_unit == "tok/s" for p in seen)
    last = seen[-1]
    assert last.state == "done" and last.done == last.total == N_SAMPLES and last.eta_s == 0.0
    labels = [label for label, _ in last.detail]
    assert {"tokens", "written", "NaN", "backend", "layers"} <= set(labels)
    assert dict(last.detail)["NaN"] == "0"


def test_stop_event_ends_after_the_current_batch(tmp_path: Path, model_dir: Path) -> None:
    config = make_run(tmp_path, model_dir, batch_tokens=1)
    stop = threading.Event()
    stop.set()
    stats = extract(config, stop=stop)
    assert stats.stopped and stats.written == 0


def test_extract_command_prints_progress_and_summary(tmp_path: Path, model_dir: Path) -> None:
    config = make_run(tmp_path, model_dir)
    out = io.StringIO()
    assert extract_command(config, "1/2", out=out) == 0
    text = out.getvalue()
    assert "extract 0/7 samples" in text  # the first progress line
    assert "extract done: 7 files written" in text and "shard 1/2" in text


def test_parse_shard() -> None:
    assert parse_shard("2/5") == (2, 5)
    for bad in ("5/5", "-1/2", "a/b", "3", "0/0"):
        with pytest.raises(DraftgenError, match="--shard"):
            parse_shard(bad)


# ---------------------------------------------------------------------------------------------
# The specforge backend's setup (its forwards need a GPU: the self-check runs them there)


def test_specforge_backend_missing_is_a_clear_error(tmp_path: Path, model_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = make_run(tmp_path, model_dir, backend="specforge", dtype="bfloat16")
    with pytest.raises(DraftgenError, match=r"needs SpecForge and SGLang .*pip install -e '\.\[gpu\]'"):
        extract(config)
    assert "WORLD_SIZE" not in os.environ  # nothing of torchrun's environment was faked before failing


def test_specforge_tp_size_must_match_torchrun(tmp_path: Path, model_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = make_run(tmp_path, model_dir, backend="specforge", tp_size=8)
    with pytest.raises(ConfigError, match="torchrun --nproc_per_node 8 --no-python draftgen extract"):
        extract(config)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="tp_size = 8 but torchrun started 4 processes"):
        extract(config)


def test_removed_sglang_backend_names_its_replacement(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ConfigError, match='extract.backend = "sglang" was replaced by "specforge"'):
        make_run(tmp_path, model_dir, backend="sglang")
    with pytest.raises(ConfigError, match="mem_fraction_static must be between 0 and 1"):
        make_run(tmp_path, model_dir, mem_fraction_static=1.5)


def test_shm_check_names_the_fix(tmp_path: Path) -> None:
    from draftgen.core.extract.specforge_backend import check_shm
    assert check_shm(0.0, tmp_path) > 0
    with pytest.raises(DraftgenError, match=r"needs at least 1e\+06 GiB there \(extract.min_shm_gb\).*--shm-size"):
        check_shm(1e6, tmp_path)


def test_server_args_size_the_pools_for_the_largest_forward() -> None:
    from draftgen.core.extract.specforge_backend import server_args
    args = server_args(max_forward_tokens=20_000, max_samples=3, mem_fraction_static=0.8, attention_backend="")
    assert args["max_total_tokens"] >= 20_000 and args["max_running_requests"] == 3
    assert args["mem_fraction_static"] == 0.8 and "attention_backend" not in args
    assert server_args(max_forward_tokens=1, max_samples=1, mem_fraction_static=0.5,
                       attention_backend="fa3")["attention_backend"] == "fa3"


def test_the_kv_margin_follows_the_attention_backends_page_size() -> None:
    # Each sample's tokens are rounded up to whole KV pages: a page-128 backend needs a page a sample.
    from draftgen.core.extract.gpu_plan import LARGEST_PAGE, kv_page_size
    from draftgen.core.extract.specforge_backend import server_args

    def total(backend: str, **extra: int) -> int:
        return server_args(max_forward_tokens=10_000, max_samples=8, mem_fraction_static=0.8,
                           attention_backend=backend, extra=extra or None)["max_total_tokens"]

    assert kv_page_size("cutlass_mla") == 128 and kv_page_size("flashmla") == 64 and kv_page_size("fa3") == 1
    assert kv_page_size("") == LARGEST_PAGE == 128      # SGLang picks the backend: assume the largest page
    assert kv_page_size("fa3", {"page_size": 16}) == 16 and kv_page_size("", {"page_size": 16}) == 128
    assert total("cutlass_mla") == 10_000 + 128 * 8 + 1024
    assert total("fa3") == 10_000 + 8 + 1024
    assert total("fa3", page_size=32) == 10_000 + 32 * 8 + 1024


def test_specforge_plan_is_made_before_the_model_loads(tmp_path: Path, model_dir: Path) -> None:
    # Rank 0's plan sizes SGLang's pools: the widest forward and the most samples of any batch.
    config = make_run(tmp_path, model_dir, batch_tokens=64)
    root = config.run_dir / "hidden_states"
    from draftgen.core.tokens.store import TokenReader
    reader = TokenReader(config.run_dir / "merged" / "tokens")
    dims = read_model_dims(str(model_dir))
    plan = run_plan.make_run_plan(root, reader, (0, 1), dims, 64, config.extract, None)
    lengths = [e.length for e in reader.entries]
    assert sorted(k for b in plan.batches for k in b) == list(range(len(lengths)))
    assert plan.max_forward_tokens == max(len(b) * max(lengths[k] for k in b) for b in plan.batches)
    assert plan.max_forward_tokens <= max(64, max(lengths))
    assert plan.max_samples == max(len(b) for b in plan.batches)


async def test_extract_is_served_to_attach_with_the_gpu_panel(tmp_path: Path, model_dir: Path) -> None:
    # What `draftgen attach RUN_DIR` sees from another pane while `draftgen extract` runs (rank 0).
    import asyncio

    from draftgen.core.extract.publish import ExtractPublisher
    from draftgen.core.live.attach_viewer import AttachClient
    from draftgen.core.live.snapshot import RunSnapshot
    from tests.extract.test_gpu import FakeNvml

    config = make_run(tmp_path, model_dir)
    seen: list[RunSnapshot] = []

    async def watch() -> None:
        async for item in AttachClient(config.run_dir, retry_s=0.05):
            if isinstance(item, RunSnapshot):
                seen.append(item)
                stage = item.stage("extract")
                if stage is not None and stage.done == 3 and item.gpus:
                    return

    with ExtractPublisher(config, interval_s=0.05, nvml=FakeNvml()) as pub:
        assert pub.serving, pub.error
        pub.progress(StageProgress("extract", state="running", done=3, total=7))
        await asyncio.wait_for(watch(), timeout=30)
    last = seen[-1]
    assert last.stage("extract").total == 7 and [g.name for g in last.gpus] == ["NVIDIA H200", "NVIDIA H200"]
    assert last.model == str(model_dir)
    # The command serves it too, and leaves no socket behind.
    out = io.StringIO()
    assert extract_command(config, None, out=out) == 0
    assert "not serving attach" not in out.getvalue()
    from draftgen.core.rundir import RunDir
    assert not RunDir(config.run_dir).socket.exists()
