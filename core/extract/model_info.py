"""What extraction needs to know about the target model before loading it: N, H and the aux layers."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftgen.core.config_checks import parse_layer_set
from draftgen.core.errors import ConfigError, DraftgenError

# SGLang's DeepSeek-family models (DeepseekV2/V3ForCausalLM, and Kimi-K2.5, whose language model is a
# DeepseekV3ForCausalLM) add 1 to the capture ids only when the first id is 1 (see
# `sglang_capture_ids`); the contract test checks that rule in the pinned SGLang source.
DEEPSEEK_FAMILY_ARCHS = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "KimiK25ForConditionalGeneration",
})
DEEPSEEK_FAMILY_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25"})


@dataclass(frozen=True)
class ModelDims:
    num_layers: int   # N: decoder layers of the language model
    hidden_size: int  # H
    source: str       # where they were read, for messages
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()  # model_type at the top level and under text_config

    @property
    def deepseek_family(self) -> bool:
        return bool(DEEPSEEK_FAMILY_ARCHS.intersection(self.architectures)
                    or DEEPSEEK_FAMILY_TYPES.intersection(self.model_types))


def _dims_from(cfg: dict[str, Any]) -> tuple[int, int] | None:
    n, h = cfg.get("num_hidden_layers"), cfg.get("hidden_size")
    if isinstance(n, int) and isinstance(h, int):
        return n, h
    return None


def dims_from_config_dict(cfg: dict[str, Any], source: str) -> ModelDims:
    """N and H from a model config; a multimodal model (Kimi-K2.5) keeps them under `text_config`."""
    text = cfg.get("text_config")
    archs = tuple(a for a in cfg.get("architectures") or () if isinstance(a, str))
    types = tuple(t for t in (cfg.get("model_type"), text.get("model_type") if isinstance(text, dict) else None)
                  if isinstance(t, str))
    # The text model is what EAGLE-3 drafts for, so its numbers win when both levels have them.
    for where, table in (("text_config", text), ("top level", cfg)):
        if isinstance(table, dict):
            found = _dims_from(table)
            if found:
                return ModelDims(num_layers=found[0], hidden_size=found[1], source=f"{source} ({where})",
                                 architectures=archs, model_types=types)
    raise DraftgenError(f"{source}: no num_hidden_layers and hidden_size at the top level or under text_config")


def read_model_dims(model: str, *, trust_remote_code: bool = False) -> ModelDims:
    """From `config.json` of a local folder; from transformers' AutoConfig for a hub id."""
    cfg, source = read_model_config(model, trust_remote_code=trust_remote_code)
    return dims_from_config_dict(cfg, source)


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default low/mid/high layers as 0-based layer outputs (SpecForge and SGLang use the same)."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def dflash_layers(num_layers: int, count: int) -> tuple[int, ...]:
    """DFlash's `count` target layers for a model of `num_layers`, as SpecForge 0.2.0 places them
    (specforge/modeling/draft/dflash.py `build_target_layer_ids`: one layer is N // 2; more are spread
    evenly from 1 to N - 3, rounded half to even as Python's round()). 0-based layer outputs: DFlash's
    `extract_context_feature` reads HF `hidden_states[k + 1]` for layer k, as draftgen numbers them."""
    if count == 1:
        return (num_layers // 2,)
    start, end = 1, num_layers - 3
    return tuple(int(round(start + (i * (end - start)) / (count - 1))) for i in range(count))


def resolve_aux_layers(aux_layers: str | list[int], dims: ModelDims,
                       config_path: Path | str = "config") -> tuple[int, ...]:
    """The aux layers as 0-based layer outputs: layer k's output is HF `hidden_states[k + 1]`.

    Any number of them: a list, or a named set (config_checks.LAYER_SET_NAMES) placed from N. The same convention
    for every backend. They must be strictly ascending: SGLang concatenates the captured layers in
    model order whatever order it is given, so a list in another order would silently label the
    slices wrong.
    """
    layers: tuple[int, ...]
    if isinstance(aux_layers, str):
        try:
            name, count = parse_layer_set(aux_layers)
        except ValueError as e:
            raise ConfigError(f"{config_path}: {e}") from None
        if name in ("eagle3", "peagle"):
            layers = eagle3_layers(dims.num_layers)
            where = f"the {'EAGLE-3' if name == 'eagle3' else 'P-EAGLE'} default for N={dims.num_layers}"
        else:
            layers = dflash_layers(dims.num_layers, count)
            where = f"extract.aux_layers = {aux_layers!r} (SpecForge's DFlash placement for N={dims.num_layers})"
            room = max(dims.num_layers - 3, 1)  # layers 1 to N - 3: more than that many repeat one
            if count > room and len(set(layers)) < len(layers):
                raise ConfigError(f"{config_path}: {where} spreads {count:,} layers from 1 to N-3 = "
                                  f"{dims.num_layers - 3}, which has room for {room}: they would not be strictly "
                                  f"ascending (a layer twice); ask for {name}:{room} or fewer ({dims.source})")
    else:
        layers = tuple(int(k) for k in aux_layers)
        where = "extract.aux_layers"
    if not layers:
        raise ConfigError(f"{config_path}: extract.aux_layers lists no layer")
    # The last layer's output is `hidden_state` already (after the norm); SGLang cannot capture it as aux.
    bad = [k for k in layers if not 0 <= k < dims.num_layers - 1]
    if bad:
        raise ConfigError(f"{config_path}: {where} gives layers {list(layers)}, but {bad} is outside "
                          f"0..{dims.num_layers - 2} (the model has N={dims.num_layers} layers, {dims.source})")
    if list(layers) != sorted(set(layers)):
        raise ConfigError(f"{config_path}: {where} gives layers {list(layers)}; they must be strictly ascending "
                          f"(SGLang concatenates captured layers in model order), e.g. {sorted(set(layers))}")
    return layers


def sglang_capture_ids(layers: tuple[int, ...], dims: ModelDims, config_path: Path | str = "config") -> list[int]:
    """The ids to hand SGLang's `set_eagle3_layers_to_capture` (through SpecForge) so it captures `layers`.

    SGLang 0.5.14 records the *input* of each listed layer. Llama-style models add 1 to every id,
    so layer-output ids go in unchanged. DeepSeek-family models (Kimi-K2.5 included) add 1 only
    when the first id is 1 and otherwise take the ids as layer inputs: then the ids must go in
    already shifted, and a first layer of 0 (the output of layer 0) cannot be asked for at all.
    Any number of ids: the setter takes a list.
    """
    if not dims.deepseek_family or layers[0] == 1:
        return list(layers)
    if layers[0] == 0:
        raise ConfigError(
            f"{config_path}: extract.aux_layers {list(layers)} starts at layer 0, which SGLang cannot capture for a "
            f"DeepSeek-family model ({', '.join(dims.architectures or dims.model_types)}): it adds 1 to the ids only "
            f"when the first is 1, so the output of layer 0 is out of reach. Start at 1 or higher (the EAGLE-3 "
            f"default is {list(eagle3_layers(dims.num_layers))})")
    return [k + 1 for k in layers]


def trainer_layer_ids(layers: tuple[int, ...], dims: ModelDims) -> dict[str, list[int] | None]:
    """The extracted layers in each trainer's own numbering (stats.json's `trainer_layer_ids`, the hand-off):

    - "eagle3": an EAGLE-3 / P-EAGLE draft config's `eagle_config.eagle_aux_hidden_state_layer_ids` and
      SpecForge's `model.aux_hidden_state_layer_ids`: SGLang's capture ids (sglang_capture_ids); None where
      SGLang cannot capture these layers, or where they are not 3 (SpecForge 0.2.0 takes exactly three);
    - "dflash": a DFlash / DSpark draft config's `dflash_config.target_layer_ids`: 0-based layer outputs, as
      draftgen numbers them (SpecForge's `extract_context_feature` reads `hidden_states[k + 1]`; SGLang's
      `set_dflash_layers_to_capture` adds 1 for every model).
    """
    eagle: list[int] | None = None
    if len(layers) == 3:
        try:
            eagle = sglang_capture_ids(layers, dims)
        except ConfigError:
            eagle = None
    return {"eagle3": eagle, "dflash": list(layers)}


def read_model_config(model: str, *, trust_remote_code: bool = False) -> tuple[dict[str, Any], str]:
    """The model's whole config as a dict and where it was read (config.json of a folder, or AutoConfig)."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        path = folder / "config.json"
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DraftgenError(f"{path}: not found (extract.model must be a model folder with config.json)") from None
        except (OSError, ValueError) as e:
            raise DraftgenError(f"{path}: cannot read the model config: {e}") from None
        if not isinstance(cfg, dict):
            raise DraftgenError(f"{path}: not a JSON object")
        return cfg, str(path)
    from transformers import AutoConfig
    try:
        auto = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises OSError, ValueError or hub errors here
        raise DraftgenError(f"extract.model {model!r}: cannot load its config: {e}") from None
    return auto.to_dict(), model


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's table: `text_config` of a multimodal model (Kimi-K2.5), else the config itself."""
    text = cfg.get("text_config")
    return text if isinstance(text, dict) and _dims_from(text) else cfg


def context_length(cfg: dict[str, Any]) -> int | None:
    """The longest sequence the model takes (max_position_embeddings of the text model), None when unsaid."""
    for table in (text_config(cfg), cfg):
        value = table.get("max_position_embeddings")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


# --- Weights per GPU, from the architecture's dimensions and its quantisation ------------------------

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class WeightPart:
    """One kind of weight: its parameters in the whole model, bytes per parameter, split over TP or not."""
    name: str
    params: int
    bytes_per_param: float
    sharded: bool  # SGLang splits it over the tensor-parallel ranks; else every GPU holds all of it

    def per_gpu(self, tp_size: int) -> float:
        return self.params * self.bytes_per_param / (tp_size if self.sharded else 1)


@dataclass(frozen=True)
class WeightEstimate:
    parts: tuple[WeightPart, ...]
    tp_size: int
    quantization: str          # what the quantisation config says, in words
    kv_bytes_per_token: int    # SGLang's KV pool per token on each GPU
    activation_bytes_per_token: int  # the forward's working set and the captured states, per token on each GPU
    source: str

    @property
    def per_gpu_bytes(self) -> int:
        return int(sum(p.per_gpu(self.tp_size) for p in self.parts))


def _int(table: dict[str, Any], *keys: str, default: int = 0) -> int:
    for key in keys:
        value = table.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def _matches(name: str, pattern: str) -> bool:
    """compressed-tensors' rule: "re:<regex>" is re.match on the module name; else the name itself (or its tail)."""
    import re
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def quantized_bytes(cfg: dict[str, Any], dtype_bytes: int) -> tuple[Callable[[str], float], str]:
    """(bytes per parameter of the Linear module `name`, the scheme in words) from `quantization_config`.

    compressed-tensors: each config group's weights `num_bits`, plus one bf16 scale per `group_size`
    (strategy "group") and a zero point when not symmetric, for modules its `targets` name ("Linear":
    every linear layer) and its `ignore` list does not. fp8 (DeepSeek's): 1 byte, `modules_to_not_convert`
    excepted. Anything else, or none: the model's dtype.
    """
    q = cfg.get("quantization_config") or text_config(cfg).get("quantization_config")
    if not isinstance(q, dict):
        return (lambda _name: float(dtype_bytes)), "none"
    method = q.get("quant_method", "")
    if method == "compressed-tensors":
        ignore = [p for p in q.get("ignore") or () if isinstance(p, str)]
        groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
        schemes: list[tuple[list[str], float]] = []
        words = []
        for g in groups:
            w = g.get("weights") or {}
            bits = _int(w, "num_bits", default=8)
            per = bits / 8
            size = _int(w, "group_size")
            if w.get("strategy", "group") == "group" and size > 0:
                per += 2 / size + (0 if w.get("symmetric", True) else bits / 8 / size)
            schemes.append(([t for t in g.get("targets") or ["Linear"] if isinstance(t, str)], per))
            words.append(f"{w.get('type', 'int')}{bits}" + (f" group {size}" if size else ""))

        def ct(name: str) -> float:
            if any(_matches(name, p) for p in ignore):
                return float(dtype_bytes)
            for targets, per in schemes:
                if any(t == "Linear" or _matches(name, t) for t in targets):
                    return per
            return float(dtype_bytes)
        return ct, f"compressed-tensors {', '.join(words) or '?'}"
    if method == "fp8":
        keep = [p for p in q.get("modules_to_not_convert") or q.get("ignored_layers") or () if isinstance(p, str)]
        return (lambda name: float(dtype_bytes) if any(k in name for k in keep) else 1.0), "fp8"
    return (lambda _name: float(dtype_bytes)), f"{method or 'unknown'} (counted as {dtype_bytes} bytes per weight)"


def estimate_weights(cfg: dict[str, Any], tp_size: int, dtype: str = "bfloat16",
                     source: str = "config", *, aux_layers: int = 3) -> WeightEstimate:
    """Weights per GPU as SGLang lays out a DeepSeek-V3 / Kimi-K2.5 (MLA, MoE) or a Llama-style model at TP `tp_size`.

    Parameter counts come from the dimensions; norms and biases are left out (well under 0.1 %). Under
    TP, SGLang replicates MLA's down-projections (q_a_proj, kv_a_proj_with_mqa), the MoE router and
    the vision tower and projector; it splits everything else (embeddings and lm_head by vocabulary).
    """
    t = text_config(cfg)
    dbytes = DTYPE_BYTES.get(str(t.get("torch_dtype") or cfg.get("torch_dtype") or dtype), DTYPE_BYTES.get(dtype, 2))
    per_param, scheme = quantized_bytes(cfg, dbytes)
    prefix = "language_model." if t is not cfg else ""
    h, layers, vocab = _int(t, "hidden_size"), _int(t, "num_hidden_layers"), _int(t, "vocab_size")
    heads = _int(t, "num_attention_heads", default=1)
    parts: list[WeightPart] = []

    def add(name: str, module: str, params: int, sharded: bool) -> None:
        if params > 0:
            parts.append(WeightPart(name, params, per_param(prefix + module), sharded))

    parts.append(WeightPart("embeddings", vocab * h, float(dbytes), True))  # an Embedding, never a quantised Linear
    if not (t.get("tie_word_embeddings") and cfg.get("tie_word_embeddings", True)):
        add("lm_head", "lm_head", vocab * h, True)
    kv_lora = _int(t, "kv_lora_rank")
    if kv_lora:  # MLA
        rope, nope, v = _int(t, "qk_rope_head_dim"), _int(t, "qk_nope_head_dim"), _int(t, "v_head_dim")
        q_lora = _int(t, "q_lora_rank")
        attn = "model.layers.1.self_attn."
        add("attention (replicated)", attn + "kv_a_proj_with_mqa", layers * (h * (kv_lora + rope) + h * q_lora), False)
        q = q_lora * heads * (nope + rope) if q_lora else h * heads * (nope + rope)
        add("attention", attn + "o_proj", layers * (q + kv_lora * heads * (nope + v) + heads * v * h), True)
        kv_token = layers * (kv_lora + rope) * dbytes  # the latent, on every rank
        attn_token = heads * (nope + rope + v) * 2 * dbytes // max(tp_size, 1)
    else:
        kvh = _int(t, "num_key_value_heads", default=heads)
        hd = _int(t, "head_dim", default=h // max(heads, 1))
        add("attention", "model.layers.1.self_attn.o_proj", layers * (2 * h * heads * hd + 2 * h * kvh * hd), True)
        kv_token = layers * 2 * max(kvh // max(tp_size, 1), 1) * hd * dbytes
        attn_token = heads * hd * 3 * dbytes // max(tp_size, 1)
    experts = _int(t, "n_routed_experts", "num_experts", "num_local_experts")
    inter = _int(t, "intermediate_size")
    moe_inter = _int(t, "moe_intermediate_size", default=inter)
    first_dense, freq = _int(t, "first_k_dense_replace"), max(_int(t, "moe_layer_freq", default=1), 1)
    moe_layers = sum(1 for k in range(layers) if experts and k >= first_dense and k % freq == 0)
    add("dense MLP", "model.layers.0.mlp.down_proj", (layers - moe_layers) * 3 * h * inter, True)
    if moe_layers:
        add("routed experts", "model.layers.1.mlp.experts.0.down_proj", moe_layers * experts * 3 * h * moe_inter, True)
        add("shared experts", "model.layers.1.mlp.shared_experts.down_proj",
            moe_layers * _int(t, "n_shared_experts") * 3 * h * moe_inter, True)
        parts.append(WeightPart("MoE router", moe_layers * experts * h, float(dbytes), False))
    vision = cfg.get("vision_config")
    if isinstance(vision, dict) and t is not cfg:
        vh = _int(vision, "vt_hidden_size", "hidden_size")
        vi = _int(vision, "vt_intermediate_size", "intermediate_size", default=4 * vh)
        vl = _int(vision, "vt_num_hidden_layers", "num_hidden_layers")
        merge = vision.get("merge_kernel_size") or [2, 2]
        merged = vh * int(merge[0]) * int(merge[1]) if isinstance(merge, list) and len(merge) == 2 else 4 * vh
        add("vision tower + projector", "vision_tower.encoder.blocks.0.mlp.fc0",
            vl * (4 * vh * vh + 2 * vh * vi) + merged * merged + merged * h, False)
    topk = _int(t, "num_experts_per_tok", default=1)
    mlp_token = (topk * moe_inter if moe_layers else inter) * 3 * dbytes // max(tp_size, 1)
    # Kept for the whole forward: the captured states (`aux_layers`·H aux + H last), in SGLang's buffer and
    # in SpecForge's stacked output; working set of one layer: a few H-wide buffers, attention, MLP/MoE.
    activation_token = 2 * (aux_layers + 1) * h * dbytes + 8 * h * dbytes + attn_token + mlp_token
    return WeightEstimate(parts=tuple(parts), tp_size=tp_size, quantization=scheme, kv_bytes_per_token=kv_token,
                          activation_bytes_per_token=activation_token, source=source)
