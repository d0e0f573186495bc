"""The GPU plan before any weights load: weights per GPU from a model's config and quantisation, the
cards' memory from NVML (a fake one: the only thing mocked), SGLang's mem_fraction_static chosen or
checked, a refusal with the numbers; and each sample's length checked against the model's context."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from draftgen.core.config import Config
from draftgen.core.config_load import config_from_dict
from draftgen.core.errors import DraftgenError
from draftgen.core.extract.gpu_plan import CONTEXT_BYTES, DEFAULT_FRACTION, make_gpu_plan
from draftgen.core.extract.model_info import context_length, estimate_weights
from draftgen.core.extract.plan import compress_warning, format_plan, make_plan
from draftgen.core.tokens.store import TokenWriter

GIB = 2**30
RTX_PRO_6000 = ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 97_887 * 2**20)   # nvidia-smi: 97887MiB
H200 = ("NVIDIA H200", 143_771 * 2**20)                                              # nvidia-smi: 143771MiB

# Kimi-K2.5's config.json (moonshotai/Kimi-K2.5), its numbers as public code that pins them repeats: a
# KimiK25ForConditionalGeneration whose text_config is Kimi-K2's DeepseekV3 language model and holds the
# quantization_config (SGLang's KimiK25Config propagates it from there), INT4 (compressed-tensors, group 32,
# symmetric) on the routed experts only: attention, shared experts, the dense layer 0 MLP, lm_head and the
# vision tower stay bf16.
KIMI_TEXT = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 163840,
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
KIMI_QUANT = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 32,
                                              "strategy": "group", "dynamic": False}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*vision_tower.*", "re:.*mm_projector.*"],
}
KIMI = {
    "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
    "text_config": dict(KIMI_TEXT, quantization_config=KIMI_QUANT, routed_scaling_factor=2.827, n_group=1,
                        topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True),
    "vision_config": {"vt_hidden_size": 1152, "vt_intermediate_size": 4304, "vt_num_hidden_layers": 27,
                      "merge_kernel_size": [2, 2], "text_hidden_size": 7168},
}


class FakeCards:
    """The slice of pynvml the plan reads: `cards` of (name, total bytes, used bytes)."""

    def __init__(self, card: tuple[str, int], count: int = 8, used: dict[int, int] | None = None) -> None:
        used = used or {}
        self.cards = [dict(name=card[0], total=card[1], used=used.get(k, 600 * 2**20), uuid=f"GPU-{k:08x}-aaaa")
                      for k in range(count)]

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> dict:
        return self.cards[i]

    def nvmlDeviceGetName(self, h: dict) -> str:
        return h["name"]

    def nvmlDeviceGetUUID(self, h: dict) -> str:
        return h["uuid"]

    def nvmlDeviceGetMemoryInfo(self, h: dict) -> SimpleNamespace:
        return SimpleNamespace(total=h["total"], used=h["used"], free=h["total"] - h["used"])


def extract_cfg(tp: int = 8, fraction: float = 0.0, batch_tokens: int = 16384, **more: object) -> Config:
    raw = {"output": {"dir": "run"}, "datasets": [{"name": "B1", "prompts": "p.jsonl"}],
           "extract": {"model": "", "backend": "specforge", "tp_size": tp, "mem_fraction_static": fraction,
                       "batch_tokens": batch_tokens, **more}}
    return config_from_dict(raw, Path("/nonexistent/draftgen.toml"))


def plan_for(card: tuple[str, int], *, tp: int = 8, fraction: float = 0.0, tokens: int = 16384, samples: int = 2,
             env: dict[str, str] | None = None, nvml: object = None) -> object:
    cfg = extract_cfg(tp, fraction).extract
    return make_gpu_plan(cfg, KIMI, "Kimi-K2.5/config.json", tokens, samples,
                         nvml=nvml or FakeCards(card), env=env if env is not None else {})


def test_kimi_int4_weights_per_gpu_at_tp8_come_from_the_config() -> None:
    est = estimate_weights(KIMI, 8)
    parts = {p.name: p for p in est.parts}
    assert parts["routed experts"].bytes_per_param == 4 / 8 + 2 / 32      # int4 + a bf16 scale per 32
    assert parts["routed experts"].params == 60 * 384 * 3 * 7168 * 2048    # layers 1..60 are MoE
    for bf16 in ("attention", "attention (replicated)", "shared experts", "dense MLP", "lm_head", "embeddings",
                 "vision tower + projector", "MoE router"):
        assert parts[bf16].bytes_per_param == 2, bf16
    assert not parts["vision tower + projector"].sharded and not parts["attention (replicated)"].sharded
    total_params = sum(p.params for p in est.parts)
    assert 1.02e12 < total_params < 1.04e12                                # "1T parameters"
    assert 76e9 < est.per_gpu_bytes < 78e9                                 # ~75 GB per GPU (the figure)
    assert est.kv_bytes_per_token == 61 * (512 + 64) * 2                   # MLA latent, every rank
    assert est.quantization == "compressed-tensors int4 group 32"
    # The quantisation at the top level instead (as vLLM mirrors it) reads the same.
    top = dict(KIMI, quantization_config=KIMI_QUANT, text_config=KIMI_TEXT)
    assert estimate_weights(top, 8).per_gpu_bytes == est.per_gpu_bytes
    # The same model unquantised: every weight bf16, ~2 TB over 8 GPUs.
    plain = estimate_weights(dict(KIMI, text_config=KIMI_TEXT), 8)
    assert plain.per_gpu_bytes > 3.3 * est.per_gpu_bytes


def test_plan_refuses_kimi_at_tp8_on_96gb_cards_at_fraction_0_8_with_the_numbers() -> None:
    plan = plan_for(RTX_PRO_6000, fraction=0.8)
    assert plan.refusal is not None
    msg = plan.refusal
    assert "extract.mem_fraction_static = 0.8 is too small" in msg
    assert "GPU 0, NVIDIA RTX PRO 6000 Blackwell Server Edition: 95.6 GiB" in msg
    assert "weights ~74.7 GiB per GPU at TP 8" in msg and "compressed-tensors int4 group 32" in msg
    assert "SGLang would stop after loading the weights" in msg
    low, high = plan.fits_range
    assert 0.8 < low < high < 0.95 and f"Between {low:.2f} and {high:.2f} fits" in msg
    # What the plan checked, in numbers: the share 0.8 gives is less than weights + the KV pool.
    assert 0.8 * plan.usable_bytes < plan.weights_bytes + plan.kv_bytes


def test_plan_chooses_a_fraction_that_fits_kimi_on_96gb_cards() -> None:
    plan = plan_for(RTX_PRO_6000)
    assert plan.refusal is None
    low, high = plan.fits_range
    assert low <= plan.fraction <= high and plan.fraction > DEFAULT_FRACTION
    assert plan.fraction * plan.usable_bytes >= plan.weights_bytes + plan.kv_bytes
    assert (1 - plan.fraction) * plan.usable_bytes >= plan.activation_bytes
    assert plan.usable_bytes == RTX_PRO_6000[1] - 600 * 2**20 - CONTEXT_BYTES
    lines = "\n".join(format_plan_lines(plan))
    assert f"mem_fraction_static = {plan.fraction:.2f} (chosen by the plan" in lines
    assert "routed experts 66.4 GiB" in lines and "vision tower + projector 0.9 GiB (on every GPU)" in lines


def test_plan_on_141gb_h200s_leaves_fraction_0_8_alone_and_chooses_less_when_unset() -> None:
    configured = plan_for(H200, fraction=0.8)
    assert configured.refusal is None and configured.fraction == 0.8
    assert configured.fraction_source == "extract.mem_fraction_static"            # a config value wins
    chosen = plan_for(H200)
    assert chosen.refusal is None and 0.5 < chosen.fraction < 0.6                 # the rest goes to activations
    assert chosen.fits_range[1] == 0.95


def test_plan_refuses_what_cannot_fit_at_any_fraction_and_says_what_to_change() -> None:
    plan = plan_for(RTX_PRO_6000, tp=4, nvml=FakeCards(RTX_PRO_6000, count=4))
    assert plan.refusal and "the model does not fit" in plan.refusal
    assert "Even one token does not fit: use more GPUs (extract.tp_size) or bigger cards" in plan.refusal
    assert "weights ~146.4 GiB per GPU at TP 4" in plan.refusal
    # A batch too big for what the weights leave: the plan says which batch_tokens would fit.
    big = plan_for(RTX_PRO_6000, tokens=400_000, samples=1)
    assert big.refusal and "Lower extract.batch_tokens to about" in big.refusal


def test_a_configured_fraction_that_starves_the_activations_is_refused() -> None:
    plan = plan_for(H200, fraction=0.98 - 0.01, tokens=131_072, samples=1)
    assert plan.refusal and "is too large" in plan.refusal and "131,072 tokens" in plan.refusal


def test_plan_reads_the_cards_cuda_visible_devices_names_and_the_fullest_one() -> None:
    busy = FakeCards(RTX_PRO_6000, count=10, used={9: 20 * GIB})
    env = {"CUDA_VISIBLE_DEVICES": "2,3,4,5,6,7,8,9"}
    plan = plan_for(RTX_PRO_6000, env=env, nvml=busy)
    assert [c.physical for c in plan.cards] == [2, 3, 4, 5, 6, 7, 8, 9]
    assert plan.tightest.index == 7 and plan.tightest.physical == 9
    assert plan.refusal and "GPU 7 (NVML 9)" in plan.refusal and "75.6 GiB free" in plan.refusal
    # Fewer cards visible than tp_size: said, and no fraction is guessed from them.
    few = plan_for(RTX_PRO_6000, env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert few.cards == [] and "2 GPU(s) visible here" in few.card_note and few.fraction == DEFAULT_FRACTION


def test_without_nvml_the_plan_says_what_each_gpu_needs() -> None:
    class NoNvml:
        def nvmlInit(self) -> None:
            raise OSError("NVML Shared Library Not Found")

    plan = plan_for(RTX_PRO_6000, nvml=NoNvml())
    assert plan.refusal is None and plan.cards == [] and plan.fraction == DEFAULT_FRACTION
    lines = "\n".join(format_plan_lines(plan))
    assert "cards: not read (NVML not available (NVML Shared Library Not Found)); each GPU needs about" in lines


def format_plan_lines(plan: object) -> list[str]:
    from draftgen.core.extract.gpu_plan import format_gpu_plan
    return format_gpu_plan(plan)  # type: ignore[arg-type]


# --plan and extract, end to end on a Kimi-shaped folder (config.json only: no weight is ever read)

def kimi_run(tmp_path: Path, lengths: list[int], **extract_table: object) -> Config:
    model = tmp_path / "Kimi-K2.5"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(KIMI))
    rng = np.random.default_rng(0)
    with TokenWriter(tmp_path / "run" / "merged" / "tokens") as writer:
        for k, n in enumerate(lengths):
            writer.append(f"s{k}", rng.integers(1, 1000, size=n), np.ones(n, dtype=np.uint8))
    table = {"model": str(model), "backend": "specforge", "tp_size": 8, **extract_table}
    raw = {"output": {"dir": str(tmp_path / "run")}, "datasets": [{"name": "B1", "prompts": "p.jsonl"}],
           "extract": table}
    return config_from_dict(raw, tmp_path / "draftgen.toml")


def test_plan_command_shows_the_refusal_and_exits_1(tmp_path: Path) -> None:
    from draftgen.core.extract.command import plan_command
    config = kimi_run(tmp_path, [16_000, 300, 200], mem_fraction_static=0.8)
    out = io.StringIO()
    assert plan_command(config, None, out=out, nvml=FakeCards(RTX_PRO_6000)) == 1
    text = out.getvalue()
    assert "GPU plan (specforge, TP 8): per GPU weights ~74.7 GiB" in text
    assert "GPU plan: DOES NOT FIT:" in text and "is too small" in text
    out = io.StringIO()
    assert plan_command(kimi_run(tmp_path / "h200", [16_000, 300]), None, out=out, nvml=FakeCards(H200)) == 0
    assert "GPU plan: mem_fraction_static = 0." in out.getvalue()


def test_extract_refuses_before_any_weight_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from draftgen.core.extract import gpu, runner
    from draftgen.core.extract.specforge_backend import LocalGroup
    config = kimi_run(tmp_path, [16_000, 300], mem_fraction_static=0.8, min_shm_gb=0)
    fake = FakeCards(RTX_PRO_6000)
    real = gpu.card_memory
    monkeypatch.setattr(gpu, "card_memory", lambda nvml=None, env=None: real(fake, {}))
    monkeypatch.setattr(runner, "make_group", lambda cfg, path: LocalGroup())
    monkeypatch.setenv("WORLD_SIZE", "8")  # as rank 0 of the torchrun job (no child process; its group a stand-in)

    def no_load(*_a: object, **_k: object) -> None:
        raise AssertionError("a backend was made although the plan refuses the job")
    monkeypatch.setattr(runner, "make_backend", no_load)
    with pytest.raises(DraftgenError, match="mem_fraction_static = 0.8 is too small"):
        runner.extract(config)
    # Unset: the plan's fraction reaches the backend.
    seen: dict[str, float] = {}

    def capture(*_a: object, mem_fraction_static: float = 0.0, **_k: object) -> None:
        seen["f"] = mem_fraction_static
        raise DraftgenError("stop here")
    monkeypatch.setattr(runner, "make_backend", capture)
    with pytest.raises(DraftgenError, match="stop here"):
        runner.extract(kimi_run(tmp_path / "auto", [16_000, 300], min_shm_gb=0))
    assert 0.8 < seen["f"] < 0.95


# The context length

def test_context_length_is_the_text_models(tmp_path: Path) -> None:
    assert context_length(KIMI) == 262144
    assert context_length({"hidden_size": 8, "num_hidden_layers": 2}) is None


def test_plan_counts_samples_longer_than_the_context(tmp_path: Path) -> None:
    text = dict(KIMI_TEXT, max_position_embeddings=1000)
    config = kimi_run(tmp_path, [1500, 999, 1000, 20], mem_fraction_static=0.0)
    (Path(config.extract.model) / "config.json").write_text(json.dumps(dict(KIMI, text_config=text)))
    plan = make_plan(config, (0, 1), nvml=FakeCards(H200))
    assert plan.context == 1000 and plan.too_long == 1
    assert any("1 samples are longer than the model's context (1,000 tokens" in n for n in plan.notes)
    assert plan.gpu is not None and plan.gpu.max_forward_tokens <= 3 * 1000


def test_compress_warns_with_the_rate_it_will_reach(tmp_path: Path) -> None:
    config = kimi_run(tmp_path, [1000, 500], compress=True, tokens_per_s=40_000)
    plan = make_plan(config, (0, 1), nvml=FakeCards(H200))
    lines = compress_warning(plan, threads=8, rate_per_thread=30e6)  # 240 MB/s: the figure
    assert len(lines) == 1
    assert lines[0].startswith("warning: compress = true: gzip (level 1, 8 writer threads, timed here) reaches "
                               "~240.0 MB/s")
    assert "40.0k tok/s (extract.tokens_per_s)" in lines[0]
    assert "the writer, not the GPUs, would set the pace" in lines[0]
    slow = make_plan(kimi_run(tmp_path / "slow", [10], compress=True, tokens_per_s=100), (0, 1), nvml=FakeCards(H200))
    said = compress_warning(slow, threads=8, rate_per_thread=30e6)
    assert said[0].startswith("compress = true") and "enough for 100 tok/s" in said[0]
    assert compress_warning(make_plan(kimi_run(tmp_path / "plain", [10]), (0, 1), nvml=FakeCards(H200))) == []
    assert any("compress = true" in line for line in format_plan(plan))


def _tiny_run_with_a_long_sample(tmp_path: Path, context: int = 64) -> Config:
    """A tiny Llama (context `context`) and a merge of three samples, the second (65 tokens) longer than 64."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = tmp_path / "tiny"
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=2,
                                 num_key_value_heads=2, vocab_size=200, max_position_embeddings=context,
                                 pad_token_id=0)).eval().save_pretrained(model)
    rng = np.random.default_rng(1)
    run = tmp_path / "run"
    with TokenWriter(run / "merged" / "tokens") as writer:
        for k, n in enumerate([30, 65, 64]):
            writer.append(f"s{k}", rng.integers(1, 200, size=n), np.ones(n, dtype=np.uint8))
    raw = {"output": {"dir": str(run)}, "datasets": [{"name": "B1", "prompts": "p.jsonl"}],
           "extract": {"model": str(model), "backend": "hf", "device": "cpu", "dtype": "float32"}}
    return config_from_dict(raw, tmp_path / "draftgen.toml")


def test_extract_skips_and_counts_a_sample_longer_than_the_context(tmp_path: Path) -> None:
    from draftgen.core.extract import layout
    from draftgen.core.extract.runner import extract
    config = _tiny_run_with_a_long_sample(tmp_path)
    run = config.run_dir
    stats = extract(config)
    assert stats.written == 2 and stats.too_long_samples == 1
    assert stats.too_long == [{"index": 1, "id": "s1", "tokens": 65}]
    root = run / "hidden_states"
    assert layout.existing_sample(root, 1) is None and layout.existing_sample(root, 2) is not None
    assert "sample 1 (id s1) has 65 tokens, more than the model's context of 64" in (run / "events.log").read_text()
    again = extract(config)  # nothing left that fits: no model loaded, the skip counted again
    assert again.written == 0 and again.too_long_samples == 1 and again.backend.startswith("none")


def test_a_sample_skipped_as_too_long_is_settled_while_the_context_is_unchanged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from draftgen.core.extract import layout, runner
    from draftgen.core.extract.handoff import make_handoff
    config = _tiny_run_with_a_long_sample(tmp_path)
    root = config.run_dir / "hidden_states"
    first = runner.extract(config)
    assert first.written == 2 and first.too_long_samples == 1 and first.context == 64
    assert json.loads((root / "stats.json").read_text())["context"] == 64
    handoff = (root / "train-command.sh").read_text()
    assert ("1 of 3 samples are longer than the model's context (64 tokens) and were skipped, not extracted"
            in handoff)
    assert "extract.sglang.context_length" in handoff and "finishes the" not in handoff

    def no_group(*_a: object, **_k: object) -> None:
        raise AssertionError("a settled shard built a process group")
    monkeypatch.setattr(runner, "make_group", no_group)
    again = runner.extract(config)  # the same context: nothing to do, no group, no model, no child
    assert again.nothing_to_do and again.written == 0 and again.skipped_existing == 2
    assert again.too_long_samples == 1 and again.too_long == [{"index": 1, "id": "s1", "tokens": 65}]
    plan = make_plan(config, (0, 1))
    assert plan.nothing_to_do and plan.this.too_long == 1
    assert any("nothing to do (2 of 3 files already written, 1 skipped as longer than the context of 64 tokens)"
               in line for line in format_plan(plan))
    from draftgen.core.extract import command
    monkeypatch.setattr(command, "_runner_extract", no_group)  # `draftgen extract` ends at its plan
    out = io.StringIO()
    assert command.extract_command(config, None, out=out) == 0
    assert "1 skipped as longer than the context of 64 tokens); the model is not loaded" in out.getvalue()
    # A larger context: the sample is work again, and the run writes it.
    model_json = Path(config.extract.model) / "config.json"
    model_json.write_text(json.dumps(dict(json.loads(model_json.read_text()), max_position_embeddings=128)))
    assert not make_plan(config, (0, 1)).nothing_to_do
    monkeypatch.undo()
    raised = runner.extract(config)
    assert raised.written == 1 and raised.too_long_samples == 0 and layout.existing_sample(root, 1) is not None
    assert not [n for n in make_handoff(config).notes if "longer than" in n or "finishes" in n]
