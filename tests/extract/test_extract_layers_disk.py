"""Every drafter's layers, the disk budget and speculative decoding refused (issue 53, points 3, 4 and 7).

The tiny real Llama of test_extract (N = 8, H = 64) extracts a DFlash set and an explicit 5-layer list on
the CPU; each aux slice is compared with transformers' own `output_hidden_states`. `extract --plan` is
run on a model folder holding only config.json (no weights to load), and `extract.max_disk_gb` is run
twice through `draftgen extract`, the second run with a larger budget.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from draftgen.core.errors import ConfigError
from draftgen.core.extract import extract, layout
from draftgen.core.extract.disk import FILE_OVERHEAD_BYTES, state_bytes
from draftgen.core.extract.model_info import ModelDims, dflash_layers, resolve_aux_layers, trainer_layer_ids
from draftgen.core.units import fmt_bytes
from tests.extract import test_extract
from tests.extract.test_extract import HIDDEN, N_LAYERS, make_run, reference, token_arrays

model_dir = test_extract.model_dir
hf_model = test_extract.hf_model


def write_config(tmp_path: Path, run: Path, model: Path, extra: str = "") -> Path:
    path = tmp_path / "draftgen.toml"
    path.write_text(f'[output]\ndir = "{run}"\n[[datasets]]\nname = "B1"\nprompts = "p.jsonl"\n'
                    f'[extract]\nmodel = "{model}"\nbackend = "hf"\ndevice = "cpu"\ndtype = "float32"\n{extra}')
    return path


# Layer sets

@pytest.mark.parametrize("aux_layers, layers", [("dflash:5", (1, 2, 3, 4, 5)), ([0, 2, 3, 5, 6], (0, 2, 3, 5, 6))])
def test_a_dflash_set_and_a_five_layer_list_extract_and_the_handoff_names_them(
        tmp_path: Path, model_dir: Path, hf_model: torch.nn.Module, aux_layers: object,
        layers: tuple[int, ...]) -> None:
    config = make_run(tmp_path, model_dir, test_extract.make_samples(n=4), aux_layers=aux_layers)
    stats = extract(config)
    assert stats.written == 4 and stats.layers == layers
    root = config.run_dir / "hidden_states"
    for k, (ids, _mask) in enumerate(token_arrays(config)):
        data = layout.load_sample(layout.sample_path(root, k))
        aux = data["aux_hidden_state"]
        assert aux.dtype == torch.bfloat16 and tuple(aux.shape) == (1, len(ids), len(layers) * HIDDEN)
        _, states = reference(hf_model, ids)
        for slot, layer in enumerate(layers):  # each slice is HF's hidden_states[layer + 1], in that order
            got = aux[0, :, slot * HIDDEN:(slot + 1) * HIDDEN].float()
            assert torch.allclose(got, states[layer + 1].to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2)
    recorded = json.loads((root / "stats.json").read_text())
    assert recorded["layers"] == list(layers) and recorded["layer_set"] == str(aux_layers)
    assert recorded["trainer_layer_ids"] == {"eagle3": None, "dflash": list(layers)}
    script = (root / "train-command.sh").read_text()
    assert f"dflash_config.target_layer_ids = {list(layers)}" in script
    assert "take exactly three" in script
    spec = json.loads((root / "specforge.json").read_text())
    assert "aux_hidden_state_layer_ids" not in spec["model"]  # SpecForge's EAGLE-3 would refuse five


def test_named_sets_are_placed_from_n() -> None:
    kimi = ModelDims(61, 7168, "k", architectures=("KimiK25ForConditionalGeneration",))
    assert resolve_aux_layers("dflash:5", kimi) == (1, 15, 30, 44, 58)
    assert resolve_aux_layers("dspark:5", kimi) == (1, 15, 30, 44, 58)
    assert resolve_aux_layers("dflash:1", kimi) == (30,)
    assert resolve_aux_layers("peagle", kimi) == resolve_aux_layers("eagle3", kimi) == (1, 29, 57)
    assert trainer_layer_ids((1, 29, 57), kimi) == {"eagle3": [1, 29, 57], "dflash": [1, 29, 57]}
    assert trainer_layer_ids((2, 29, 57), kimi)["eagle3"] == [3, 30, 58]  # SGLang's DeepSeek rule
    tiny = ModelDims(N_LAYERS, HIDDEN, "tiny")
    with pytest.raises(ConfigError, match="strictly ascending"):  # 8 layers cannot hold 7 distinct ones in 1..5
        resolve_aux_layers("dflash:7", tiny)
    # A K past the room says the most there is, not a list of K layers (dflash:1000 printed 1,000 ids).
    with pytest.raises(ConfigError) as refused:
        resolve_aux_layers("dflash:1000", tiny)
    assert str(refused.value) == (
        "config: extract.aux_layers = 'dflash:1000' (SpecForge's DFlash placement for N=8) spreads 1,000 layers "
        "from 1 to N-3 = 5, which has room for 5: they would not be strictly ascending (a layer twice); ask for "
        "dflash:5 or fewer (tiny)")
    assert resolve_aux_layers("dflash:5", tiny) == (1, 2, 3, 4, 5)
    with pytest.raises(ConfigError, match="one of eagle3, peagle, dflash:K, dspark:K"):
        resolve_aux_layers("dflash:0", tiny)


def test_config_refuses_bad_layer_lists_at_load(tmp_path: Path, model_dir: Path) -> None:
    for bad, message in (([3, 1], "strictly ascending"), ([], "lists no layer id"), ("dflash", "dflash:K"),
                         ([1, -1], "strictly ascending")):
        with pytest.raises(ConfigError, match=message):
            make_run(tmp_path / str(len(message)), model_dir, [], aux_layers=bad)


# The disk budget

def test_plan_prints_the_sets_size_in_both_dtypes_before_anything_loads(tmp_path: Path, model_dir: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    from draftgen.cli.main import main
    bare = tmp_path / "bare-model"  # only config.json: a weight read would fail
    bare.mkdir()
    (bare / "config.json").write_text((model_dir / "config.json").read_text())
    samples = test_extract.make_samples(n=6)
    config = make_run(tmp_path, bare, samples, aux_layers="dflash:5")
    path = write_config(tmp_path, config.run_dir, bare, 'aux_layers = "dflash:5"\n')
    assert main(["extract", str(path), "--plan"]) == 0
    out = capsys.readouterr().out
    lengths = sorted(len(ids) for ids, _ in samples)
    tokens = sum(lengths)
    # (5 + 1)·H states a token: 2 bytes each in bf16; 1 byte and one float32 scale in fp8; + 16 of ids and mask.
    bf16 = tokens * (6 * HIDDEN * 2 + 16) + 6 * FILE_OVERHEAD_BYTES
    fp8 = tokens * (6 * HIDDEN + 4 + 16) + 6 * FILE_OVERHEAD_BYTES
    assert state_bytes(tokens, 6, HIDDEN, 5, "bf16") == bf16 and state_bytes(tokens, 6, HIDDEN, 5, "fp8") == fp8
    line = next(x for x in out.splitlines() if x.startswith("the whole set:"))
    assert f"6 samples, {tokens} tokens (median {lengths[2]:,}, largest {lengths[-1]:,} a sample)" in line
    assert "5 aux layers [1, 2, 3, 4, 5] + the last at H=64" in line
    assert f"bf16 (chosen) ~{fmt_bytes(bf16)}" in line and f"fp8 ~{fmt_bytes(fp8)}" in line
    assert f"largest ~{fmt_bytes(state_bytes(lengths[-1], 1, HIDDEN, 5, 'bf16'))}" in line
    assert "free on the output filesystem" in line
    assert not (config.run_dir / "hidden_states").exists()  # nothing written, nothing loaded


def test_a_disk_budget_stops_the_run_and_a_larger_one_finishes_the_rest_none_twice(
        tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    from draftgen.cli.main import main
    samples = test_extract.make_samples(n=8)
    config = make_run(tmp_path, model_dir, samples)
    per_sample = [state_bytes(len(ids), 1, HIDDEN, 3) for ids, _ in samples]
    budget = sum(per_sample[:5]) + per_sample[5] // 2  # five samples fit, the sixth does not
    path = write_config(tmp_path, config.run_dir, model_dir, f"max_disk_gb = {budget / 1e9!r}\n")
    assert main(["extract", str(path)]) == 0
    out = capsys.readouterr().out
    assert "disk budget (extract.max_disk_gb, this shard's share)" in out and "5 samples still to do fit" in out
    assert "stopped at the disk budget (extract.max_disk_gb = " in out
    assert f"3 samples (from sample 5, ~{fmt_bytes(state_bytes(sum(len(s[0]) for s in samples[5:]), 3, HIDDEN))}" \
           in out
    assert f"`draftgen extract {path}` again" in out
    root = config.run_dir / "hidden_states"
    files = sorted(root.rglob("*.ckpt"), key=lambda p: int(p.stem.split("_")[1]))
    assert [p.name for p in files] == [f"data_{k}.ckpt" for k in range(5)]  # merged order
    assert sum(p.stat().st_size for p in files) <= budget
    first = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in files}
    recorded = json.loads((root / "stats.json").read_text())
    # The 3 left for a later run are not "already there" (the summary said "5 files written, 3 already there").
    assert (recorded["budget_left"], recorded["written"], recorded["skipped_existing"]) == (3, 5, 0)
    assert "5 files written to" in out and "0 already there" in out

    # The same budget again counts the files' real bytes (below the estimates): what still fits, in merged
    # order, and never past the budget.
    assert main(["extract", str(path)]) == 0
    capsys.readouterr()
    done = sorted(int(p.stem.split("_")[1]) for p in root.rglob("*.ckpt"))
    assert done == list(range(len(done))) and 5 <= len(done) < 8
    used = sum(p.stat().st_size for p in root.rglob("*.ckpt"))
    assert used <= budget
    # A budget the files already fill: said, nothing loaded or written.
    path = write_config(tmp_path, config.run_dir, model_dir, f"max_disk_gb = {used / 1e9!r}\n")
    assert main(["extract", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"nothing extracted: extract.max_disk_gb = {used / 1e9:g} is spent" in out
    assert f"{8 - len(done)} samples" in out and len(list(root.rglob("*.ckpt"))) == len(done)

    path = write_config(tmp_path, config.run_dir, model_dir, "max_disk_gb = 1.0\n")
    assert main(["extract", str(path)]) == 0
    out = capsys.readouterr().out
    assert "stopped at the disk budget" not in out
    stats = json.loads((root / "stats.json").read_text())
    assert stats["written"] == 8 - len(done) and stats["skipped_existing"] == len(done) and stats["budget_left"] == 0
    assert sorted(p.name for p in root.rglob("*.ckpt")) == sorted(f"data_{k}.ckpt" for k in range(8))
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in root.rglob("*.ckpt")
            if p.name in first} == first  # none extracted twice
    for k, (ids, _mask) in enumerate(samples):
        assert layout.load_sample(layout.sample_path(root, k))["input_ids"].tolist() == np.asarray(ids).tolist()


def test_max_disk_gb_must_not_be_negative(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="extract.max_disk_gb must be >= 0"):
        make_run(tmp_path, model_dir, [], max_disk_gb=-1)


# Speculative decoding

@pytest.mark.parametrize("key", ["speculative_algorithm", "speculative_num_steps", "enable_multi_layer_eagle",
                                 "speculative-algorithm"])
def test_a_key_that_turns_speculative_decoding_on_is_refused_by_name(tmp_path: Path, model_dir: Path,
                                                                     key: str) -> None:
    with pytest.raises(ConfigError, match=rf"extract\.sglang\.{key} is refused: .*draft tokens.*sglang#26163"):
        make_run(tmp_path, model_dir, [], backend="specforge", sglang={key: "EAGLE3"})


def test_dflash_layers_is_a_pure_function_of_n_and_k() -> None:
    assert dflash_layers(61, 5) == (1, 15, 30, 44, 58)
    assert dflash_layers(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B's 36 layers, DFlash's usual 5


def test_the_gpu_plan_counts_the_layers_asked_for() -> None:
    from draftgen.core.extract.gpu_plan import make_gpu_plan
    from draftgen.core.extract.model_info import estimate_weights
    from tests.extract.test_extract_gpu_plan import KIMI, extract_cfg
    three = estimate_weights(KIMI, 8, aux_layers=3).activation_bytes_per_token
    five = estimate_weights(KIMI, 8, aux_layers=5).activation_bytes_per_token
    assert five - three == 2 * 2 * 7168 * 2  # two more bf16 layers a token, held twice (SGLang's and SpecForge's)
    plans = [make_gpu_plan(extract_cfg(aux_layers=aux).extract, KIMI, "kimi", 16384, 4, nvml=None, env={})
             for aux in ("eagle3", "dflash:5")]
    assert plans[1].activation_bytes - plans[0].activation_bytes == 16384 * (five - three)


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_other_aux_layers_over_files_of_a_layer_set_are_refused_not_mixed(tmp_path: Path, model_dir: Path,
                                                                          fmt: str) -> None:
    import dataclasses
    config = make_run(tmp_path, model_dir, test_extract.make_samples(n=4), format=fmt)
    assert extract(config).written == 4
    root = config.run_dir / "hidden_states"
    gone = next(p for p in sorted(root.rglob("*")) if p.name in ("data_3.ckpt", "hs_3.safetensors"))
    gone.unlink()
    kept = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.suffix in (".ckpt", ".safetensors")}
    other = dataclasses.replace(config, extract=dataclasses.replace(config.extract, aux_layers=[0, 2, 5]))
    # The three files of layers [1, 3, 4] were skipped as done and the fourth written with [0, 2, 5].
    with pytest.raises(ConfigError, match=r"gives layers \[0, 2, 5\], but the files in .* hold layers \[1, 3, 4\] "
                                          r"\(stats.json\): extracting would mix two layer sets"):
        extract(other)
    assert {p: p.stat().st_mtime_ns for p in kept} == kept and not gone.exists()
    assert extract(config).written == 1  # the same layers go on
