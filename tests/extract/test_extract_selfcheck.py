"""`draftgen extract --self-check` end to end on the CPU (hf backend), and its checks failing when they should.

The GPU default for the long sample is 16,384 tokens; here 128, so the suite stays fast (the length
is `--long-tokens`). The run uses the released SpecForge reader (unpacked, on PYTHONPATH).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch

from draftgen.core.extract.model_info import ModelDims, eagle3_layers, read_model_dims
from draftgen.core.extract.selfcheck import _samples
from draftgen.core.extract.selfcheck_rows import SelfCheckResult, check_states
from draftgen.core.extract.tiny_models import FAMILIES, families_for

CHECKS = ("backend starts", "mixed batch: shapes, dtypes, finite", "each sample alone == in the batch",
          "lm_head(hidden_state) vs HF logits", "aux slices are HF hidden_states[k+1]", "peak memory, long sample",
          "files read back through SpecForge's reader", "rerun skips every file")


@pytest.mark.slow
def test_self_check_passes_end_to_end_on_cpu(tmp_path: Path, specforge_tree: Path, capsys: pytest.CaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from draftgen.cli.main import main
    monkeypatch.syspath_prepend(str(specforge_tree))  # the released reader, as on a GPU box with the extra
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    try:
        code = main(["extract", "--self-check", "--long-tokens", "64"])
    finally:
        for name in [m for m in sys.modules if m == "specforge" or m.startswith("specforge.")]:
            del sys.modules[name]
    out = capsys.readouterr().out
    assert code == 0, out
    for family in FAMILIES[:2]:  # the hf backend's (transformers has no Kimi-K2.5 class)
        for check in CHECKS:
            line = next((x for x in out.splitlines() if f"[{family}] {check}" in x), None)
            assert line is not None and "PASS" in line, f"{family} / {check} missing or failed:\n{out}"
    assert "lengths [64, 63, 63, 17, 3]" in out and "hidden [T, 256], aux [T, 768]" in out
    assert "via SpecForge's list_feature_files, load_feature_file and normalize_offline_sample" in out
    assert "workers exit" in out and "0 child processes left" in out
    assert "PASSED" in out
    assert not list(tmp_path.glob("draftgen-selfcheck-*"))  # its scratch folder is gone


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=8192)).eval()
    path = tmp_path_factory.mktemp("selfcheck-tiny")
    model.save_pretrained(path)
    return path, model


def _outputs(model: torch.nn.Module, samples: list, layers: tuple[int, int, int], shift: int = 1
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    with torch.inference_mode():
        for ids, _ in samples:
            hs = model(torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states
            out.append((hs[-1][0],  # after the final norm (transformers 5)
                        torch.cat([hs[k + shift][0] for k in layers], dim=-1)))
    return out


def _rows(path: Path, model: torch.nn.Module, batch: list, alone: list, samples: list) -> dict[str, bool]:
    result = SelfCheckResult()
    dims = read_model_dims(str(path))
    check_states(result, "[t]", samples, batch, alone, dims, eagle3_layers(8), model, "cpu", torch.float32)
    return {r.check.removeprefix("[t] "): r.passed for r in result.rows}


def test_checks_fail_on_wrong_layers_wrong_states_and_padding_leaks(tiny: tuple[Path, torch.nn.Module]) -> None:
    path, model = tiny
    samples = _samples(40, seed=2)
    layers = eagle3_layers(8)
    right = _outputs(model, samples, layers)
    assert all(_rows(path, model, right, right, samples).values())
    # aux one layer early (SGLang's +1 rule got wrong): the layer check fails, nothing else.
    early = _outputs(model, samples, layers, shift=0)
    rows = _rows(path, model, early, early, samples)
    assert not rows["aux slices are HF hidden_states[k+1]"] and rows["lm_head(hidden_state) vs HF logits"]
    # hidden_state before the final norm instead of after it: the logits check fails.
    with torch.inference_mode():
        pre_norm = [(model(torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states[-2][0], aux)
                    for (ids, _), (_, aux) in zip(samples, right)]
    assert not _rows(path, model, pre_norm, pre_norm, samples)["lm_head(hidden_state) vs HF logits"]
    # A batch whose rows differ from the samples run alone (padding leaking in): that check fails.
    leaky = [(h + 0.5 * torch.randn_like(h), a) for h, a in right]
    assert not _rows(path, model, right, leaky, samples)["each sample alone == in the batch"]
    # A NaN anywhere: the shapes/finite check fails.
    nan = [(h.clone(), a) for h, a in right]
    nan[1][0][0, 0] = float("nan")
    assert not _rows(path, model, nan, nan, samples)["mixed batch: shapes, dtypes, finite"]


def test_specforge_checks_the_targets_family_only() -> None:
    # SGLang's parallel state is set up once per process: one tiny model, the target's family.
    kimi = ModelDims(61, 7168, "k", architectures=("KimiK25ForConditionalGeneration",))
    llama = ModelDims(32, 4096, "l", architectures=("LlamaForCausalLM",))
    deepseek = ModelDims(61, 7168, "d", architectures=("DeepseekV3ForCausalLM",))
    assert families_for("specforge", kimi) == families_for("specforge", None) == (FAMILIES[2],)  # Kimi's own class
    assert families_for("specforge", deepseek) == (FAMILIES[1],)
    assert families_for("specforge", llama) == (FAMILIES[0],)
    assert families_for("hf", kimi) == FAMILIES[:2]


def test_the_kimi_form_is_kimi_k25s_config_with_the_language_weights_under_language_model(tmp_path: Path) -> None:
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from draftgen.core.extract.tiny_models import KIMI_ARCH, TINY_VISION, VOCAB, kimi_form, tiny_configs
    text_cfg = tiny_configs(256)[FAMILIES[2]]
    assert (text_cfg.scoring_func, text_cfg.topk_method, text_cfg.n_group, text_cfg.first_k_dense_replace,
            text_cfg.n_shared_experts, text_cfg.kv_lora_rank) == ("sigmoid", "noaux_tc", 1, 1, 1, 512)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(text_cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    form = kimi_form(tmp_path / "hf", tmp_path / "kimi")
    config = json.loads((form / "config.json").read_text())
    assert config["architectures"] == [KIMI_ARCH] and config["model_type"] == "kimi_k25"
    assert config["text_config"]["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["vision_config"]["text_hidden_size"] == text_cfg.hidden_size
    assert {k: v for k, v in config["vision_config"].items() if k != "text_hidden_size"} == TINY_VISION
    assert config["media_placeholder_token_id"] == VOCAB - 1  # never drawn by the samples
    dims = read_model_dims(str(form))
    assert (dims.num_layers, dims.hidden_size) == (text_cfg.num_hidden_layers, text_cfg.hidden_size)
    assert dims.deepseek_family and "text_config" in dims.source
    weights = {}
    for part in form.glob("*.safetensors"):
        weights.update(load_file(str(part)))
    saved = {}  # transformers saves the checkpoint form SGLang reads (experts one by one: experts.E.gate_proj)
    for part in (tmp_path / "hf").glob("*.safetensors"):
        saved.update(load_file(str(part)))
    assert any(".mlp.experts.7.gate_proj.weight" in k for k in saved)
    assert {k.removeprefix("language_model.") for k in weights} == set(saved)  # as load_weights strips it
    assert all(k.startswith("language_model.") for k in weights)
    assert all(torch.equal(weights[f"language_model.{k}"], v) for k, v in saved.items())


def test_thresholds_are_chosen_by_dtype() -> None:
    from draftgen.core.extract.selfcheck_rows import thresholds
    f32, bf16 = thresholds(torch.float32), thresholds(torch.bfloat16)
    assert thresholds(torch.float16) == bf16 and thresholds(torch.float64) == f32
    assert (f32.cosine_min, f32.argmax_min, f32.aux_margin, f32.alone_cosine_min) == (0.99, 0.98, 2.0, 0.999)
    assert bf16.cosine_min < f32.cosine_min and bf16.argmax_min < f32.argmax_min
    assert 1 < bf16.aux_margin < f32.aux_margin and bf16.alone_cosine_min < f32.alone_cosine_min


def test_bf16_rounding_passes_at_bf16_thresholds_and_a_wrong_layer_still_fails(
        tiny: tuple[Path, torch.nn.Module]) -> None:
    path, model = tiny
    samples = _samples(40, seed=3)
    layers = eagle3_layers(8)
    dims = read_model_dims(str(path))

    def rows(batch: list, dtype: torch.dtype) -> dict[str, bool]:
        result = SelfCheckResult()
        check_states(result, "[t]", samples, batch, batch, dims, layers, model, "cpu", dtype)
        return {r.check.removeprefix("[t] "): r.passed for r in result.rows}

    right = [(h.to(torch.bfloat16), a.to(torch.bfloat16)) for h, a in _outputs(model, samples, layers)]
    assert all(rows(right, torch.bfloat16).values())
    early = [(h.to(torch.bfloat16), a.to(torch.bfloat16)) for h, a in _outputs(model, samples, layers, shift=0)]
    assert not rows(early, torch.bfloat16)["aux slices are HF hidden_states[k+1]"]
    model.float()  # check_states moved the reference to bf16


def test_the_memory_row_is_judged_on_a_gpu_against_the_plans_allowance() -> None:
    from draftgen.core.extract.selfcheck_rows import memory_verdict
    gib = 2**30
    # 1 GiB for 16,384 tokens at H=256 -> ~28 GiB for the same at H=7168.
    ok, detail = memory_verdict(gib, 16_384, 256, 7168, 16_384, "cuda", 40 * gib)
    assert ok and "~30.1 GB for 16,384 tokens at H=7168" in detail and "within the 42.9 GB" in detail
    bad, detail = memory_verdict(gib, 16_384, 256, 7168, 16_384, "cuda", 10 * gib)
    assert not bad and "MORE THAN the 10.7 GB the GPU plan leaves" in detail
    assert memory_verdict(gib, 16_384, 256, 7168, 16_384, "cuda", None)[0]        # no plan: shown, not judged
    cpu_ok, cpu_detail = memory_verdict(gib, 16_384, 256, 7168, 16_384, "cpu", 1)
    assert cpu_ok and "not judged on a CPU" in cpu_detail and "process memory (RSS)" in cpu_detail
