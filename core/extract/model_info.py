"""What extraction needs to know about the target model before loading it: N, H and the aux layers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        return dims_from_config_dict(cfg, str(path))
    from transformers import AutoConfig
    try:
        auto = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises OSError, ValueError or hub errors here
        raise DraftgenError(f"extract.model {model!r}: cannot load its config: {e}") from None
    return dims_from_config_dict(auto.to_dict(), model)


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default low/mid/high layers as 0-based layer outputs (SpecForge and SGLang use the same)."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def resolve_aux_layers(aux_layers: str | list[int], dims: ModelDims,
                       config_path: Path | str = "config") -> tuple[int, int, int]:
    """The three aux layers as 0-based layer outputs: layer k's output is HF `hidden_states[k + 1]`.

    The same convention for every backend. They must be strictly ascending: SGLang concatenates
    the captured layers in model order whatever order it is given, so a list in another order
    would silently label the slices wrong.
    """
    layers: tuple[int, ...]
    if aux_layers == "eagle3":
        layers = eagle3_layers(dims.num_layers)
        where = f"the EAGLE-3 default for N={dims.num_layers}"
    else:
        layers = tuple(int(k) for k in aux_layers)
        where = "extract.aux_layers"
    if len(layers) != 3:
        raise ConfigError(f"{config_path}: extract.aux_layers must list exactly 3 layer ids, not {list(layers)}")
    # The last layer's output is `hidden_state` already (after the norm); SGLang cannot capture it as aux.
    bad = [k for k in layers if not 0 <= k < dims.num_layers - 1]
    if bad:
        raise ConfigError(f"{config_path}: {where} gives layers {list(layers)}, but {bad} is outside "
                          f"0..{dims.num_layers - 2} (the model has N={dims.num_layers} layers, {dims.source})")
    if list(layers) != sorted(set(layers)):
        raise ConfigError(f"{config_path}: {where} gives layers {list(layers)}; they must be strictly ascending "
                          f"(SGLang concatenates captured layers in model order), e.g. {sorted(set(layers))}")
    return layers[0], layers[1], layers[2]


def sglang_capture_ids(layers: tuple[int, int, int], dims: ModelDims, config_path: Path | str = "config") -> list[int]:
    """The ids to hand SGLang's `set_eagle3_layers_to_capture` (through SpecForge) so it captures `layers`.

    SGLang 0.5.14 records the *input* of each listed layer. Llama-style models add 1 to every id,
    so layer-output ids go in unchanged. DeepSeek-family models (Kimi-K2.5 included) add 1 only
    when the first id is 1 and otherwise take the ids as layer inputs: then the ids must go in
    already shifted, and a first layer of 0 (the output of layer 0) cannot be asked for at all.
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
