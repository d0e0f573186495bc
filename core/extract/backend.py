"""The one small interface every extraction backend implements, and the factory that picks one."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from draftgen.core.config import ExtractConfig
from draftgen.core.errors import ConfigError
from draftgen.core.extract.model_info import ModelDims


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


def make_backend(cfg: ExtractConfig, dims: ModelDims, layers: tuple[int, int, int], *,
                 log_dir: Path, config_path: object = "config") -> ExtractBackend:
    if cfg.backend == "hf":
        from draftgen.core.extract.hf_backend import HFBackend
        return HFBackend(cfg.model, layers, dtype=cfg.dtype, device=cfg.device,
                         trust_remote_code=cfg.trust_remote_code)
    if cfg.backend == "sglang":
        from draftgen.core.extract.sglang_backend import SglangBackend
        return SglangBackend(cfg.model, layers, dims=dims, tp_size=cfg.tp_size, dtype=cfg.dtype,
                             trust_remote_code=cfg.trust_remote_code, log_dir=log_dir)
    raise ConfigError(f"{config_path}: extract.backend must be \"hf\" or \"sglang\", not {cfg.backend!r}")
