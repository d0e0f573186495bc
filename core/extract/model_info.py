"""What extraction needs to know about the target model before loading it: N, H and the aux layers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftgen.core.errors import ConfigError, DraftgenError


@dataclass(frozen=True)
class ModelDims:
    num_layers: int   # N: decoder layers of the language model
    hidden_size: int  # H
    source: str       # where they were read, for messages


def _dims_from(cfg: dict[str, Any]) -> tuple[int, int] | None:
    n, h = cfg.get("num_hidden_layers"), cfg.get("hidden_size")
    if isinstance(n, int) and isinstance(h, int):
        return n, h
    return None


def dims_from_config_dict(cfg: dict[str, Any], source: str) -> ModelDims:
    """N and H from a model config; a multimodal model (Kimi-K2.5) keeps them under `text_config`."""
    # The text model is what EAGLE-3 drafts for, so its numbers win when both levels have them.
    for where, table in (("text_config", cfg.get("text_config")), ("top level", cfg)):
        if isinstance(table, dict):
            found = _dims_from(table)
            if found:
                return ModelDims(num_layers=found[0], hidden_size=found[1], source=f"{source} ({where})")
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


def resolve_aux_layers(aux_layers: str | list[int], dims: ModelDims, config_path: Path | str = "config") -> tuple[int, int, int]:
    if aux_layers == "eagle3":
        layers = eagle3_layers(dims.num_layers)
        where = f"the EAGLE-3 default for N={dims.num_layers}"
    else:
        layers = tuple(int(k) for k in aux_layers)  # type: ignore[assignment]
        where = "extract.aux_layers"
    if len(layers) != 3:
        raise ConfigError(f"{config_path}: extract.aux_layers must list exactly 3 layer ids, not {list(layers)}")
    # The last layer's output is `hidden_state` already (after the norm); SGLang cannot capture it as aux.
    bad = [k for k in layers if not 0 <= k < dims.num_layers - 1]
    if bad:
        raise ConfigError(f"{config_path}: {where} gives layers {list(layers)}, but {bad} is outside "
                          f"0..{dims.num_layers - 2} (the model has N={dims.num_layers} layers, {dims.source})")
    return layers  # type: ignore[return-value]
