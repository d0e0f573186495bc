"""The one small interface every extraction backend implements, and the factory that picks one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from draftgen.core.config import ExtractConfig
from draftgen.core.errors import ConfigError
from draftgen.core.extract.model_info import ModelDims

PAD_ID = 0  # any valid id: padded positions are masked or cut off


def right_pad(batch: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """[B, W] int64 ids right-padded with PAD_ID, the [B, W] 0/1 attention mask, and each row's length.

    Right padding leaves every real token's position and (causal) context unchanged, so each
    sample's rows match a run of it alone once the padding rows are cut off.
    """
    lengths = [len(ids) for ids in batch]
    input_ids = torch.full((len(batch), max(lengths)), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(batch):
        input_ids[row, : len(ids)] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
        attention_mask[row, : len(ids)] = 1
    return input_ids, attention_mask, lengths


class ExtractBackend(Protocol):
    """Runs the target model over a batch of token sequences (prefill only).

    `run` gets unpadded int64 id arrays and returns, per sample and in the same order,
    `(hidden [T, H], aux [T, 3H])` on the CPU with exactly that sample's T rows: `hidden` is the
    last layer after the final norm, `aux` the configured layer outputs concatenated. Any float
    dtype; the writer stores bf16.
    """

    description: str  # e.g. "hf cpu float32", shown in progress and stats
    # Limits the batcher must respect beyond extract.batch_tokens (None: no limit of its own).
    max_batch_tokens: int | None
    max_batch_samples: int | None

    def run(self, batch: Sequence[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor]]: ...

    def close(self) -> None: ...


def make_backend(cfg: ExtractConfig, dims: ModelDims, layers: tuple[int, int, int], *, group: object = None,
                 max_forward_tokens: int = 0, max_samples: int = 0, config_path: object = "config",
                 mem_fraction_static: float = 0.0) -> ExtractBackend:
    """The backend `cfg` names; for "specforge", `group` is the TorchrunGroup, the two maxima size SGLang's pools and
    `mem_fraction_static` is the GPU plan's (0: extract.mem_fraction_static, or plan.DEFAULT_FRACTION when unset)."""
    if cfg.backend == "hf":
        from draftgen.core.extract.hf_backend import HFBackend
        return HFBackend(cfg.model, layers, dtype=cfg.dtype, device=cfg.device,
                         trust_remote_code=cfg.trust_remote_code)
    if cfg.backend == "specforge":
        from draftgen.core.extract.model_info import sglang_capture_ids
        from draftgen.core.extract.plan import DEFAULT_FRACTION
        from draftgen.core.extract.specforge_backend import SpecForgeBackend
        return SpecForgeBackend(cfg.model, sglang_capture_ids(layers, dims, str(config_path)), group=group,  # type: ignore[arg-type]
                                dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code,
                                max_forward_tokens=max_forward_tokens, max_samples=max_samples,
                                mem_fraction_static=mem_fraction_static or cfg.mem_fraction_static or DEFAULT_FRACTION,
                                attention_backend=cfg.attention_backend,
                                sglang_args=cfg.sglang, config_path=config_path)
    raise ConfigError(f"{config_path}: extract.backend must be \"hf\" or \"specforge\", not {cfg.backend!r}")
