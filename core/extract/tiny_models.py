"""The tiny random models the extraction self-check runs (selfcheck.py): the target's families, small but
with shapes GPU kernels accept (a Llama with head_dim 128, a DeepseekV3-style MoE with MLA like
Kimi-K2.5's language model, and that model with Kimi's router settings), Kimi-K2.5's own form as
SGLang 0.5.14 loads it (`kimi_form`), and which families a backend checks (`families_for`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftgen.core.extract.model_info import ModelDims

VOCAB = 8192
N_LAYERS = 8
FAMILIES = ("llama (head_dim 128)", "deepseek-v3 MoE + MLA", "kimi-k2.5 (KimiK25ForConditionalGeneration)")
KIMI_ARCH = "KimiK25ForConditionalGeneration"
# A MoonViT tower as small as SGLang builds one: its KimiK25VisionConfig reads the plain names, the
# projector the vt_ ones (the released config.json carries both).
TINY_VISION = {"patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "init_pos_emb_time": 4,
               "pos_emb_type": "divided_fixed", "num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 128,
               "intermediate_size": 256, "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1,
               "vt_hidden_size": 128, "vt_intermediate_size": 256, "merge_kernel_size": [2, 2],
               "video_attn_type": "spatial_temporal", "merge_type": "sd2_tpool", "mm_projector_type": "patchmerger",
               "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5}


def tiny_configs(max_positions: int, tp_size: int = 1) -> dict[str, Any]:
    """The two families, small but with shapes GPU kernels accept: head_dim 128, MLA ranks 512 + 64.

    Heads (and so H = 128 x heads) grow with the TP degree so every rank holds whole heads: H = 256
    on one device, 1024 under TP 8.
    """
    from transformers import DeepseekV3Config, LlamaConfig
    heads = max(2, tp_size)
    hidden = 128 * heads
    common = dict(vocab_size=VOCAB, num_hidden_layers=N_LAYERS, max_position_embeddings=max_positions,
                  hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads,
                  num_key_value_heads=heads, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    mla = dict(moe_intermediate_size=64 * heads, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
               first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=384, qk_rope_head_dim=64, qk_nope_head_dim=128,
               v_head_dim=128)
    return {
        FAMILIES[0]: LlamaConfig(head_dim=128, **common),
        FAMILIES[1]: DeepseekV3Config(n_group=2, topk_group=1, **mla, **common),
        # Kimi-K2's router (its text_config): one group, sigmoid scores with the noaux_tc bias, scaled.
        FAMILIES[2]: DeepseekV3Config(n_group=1, topk_group=1, scoring_func="sigmoid", topk_method="noaux_tc",
                                      norm_topk_prob=True, routed_scaling_factor=2.827, **mla, **common),
    }


def kimi_form(hf_dir: Path, out: Path) -> Path:
    """The tiny DeepseekV3 model at `hf_dir` in Kimi-K2.5's own form, as SGLang 0.5.14 loads it: config.json a
    KimiK25Config (`text_config` the DeepseekV3 one, `vision_config` TINY_VISION) and the weights renamed under
    `language_model.` (KimiK25ForConditionalGeneration.load_weights strips that prefix and hands the rest to its
    DeepseekV3ForCausalLM); the vision tower has no weights in the file: SGLang builds it beside the language
    model (memory, as Kimi's), and a text-only forward never runs it."""
    import json

    from safetensors.torch import load_file, save_file
    text = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [KIMI_ARCH], "model_type": "kimi_k25", "text_config": text,
              "vision_config": dict(TINY_VISION, text_hidden_size=text["hidden_size"]),
              "media_placeholder_token_id": VOCAB - 1, "pad_token_id": 0, "torch_dtype": text.get("torch_dtype")}
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for k, part in enumerate(sorted(hf_dir.glob("*.safetensors"))):
        renamed = {f"language_model.{name}": t.contiguous() for name, t in load_file(str(part)).items()}
        save_file(renamed, str(out / f"model-{k:05d}.safetensors"), metadata={"format": "pt"})
    return out


def families_for(backend: str, target: ModelDims | None) -> tuple[str, ...]:
    """hf: Llama and DeepseekV3 (transformers has no Kimi-K2.5 class). specforge: SGLang sets up its
    model-parallel state once per process, so one family, the target's: Kimi-K2.5's own form for a
    Kimi-K2.5 target and when no model is configured, DeepseekV3 for another DeepSeek-family one."""
    if backend != "specforge":
        return FAMILIES[:2]
    if target is None or KIMI_ARCH in target.architectures or "kimi_k25" in target.model_types:
        return (FAMILIES[2],)
    return (FAMILIES[1] if target.deepseek_family else FAMILIES[0],)
