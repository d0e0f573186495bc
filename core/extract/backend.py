"""The one small interface every extraction backend implements, and the factory that picks one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from draftgen.core.config_tables import ExtractConfig
from draftgen.core.errors import ConfigError
from draftgen.core.extract.model_info import ModelDims


class ExtractBackend(Protocol):
    """Runs the target model over a batch of token sequences (prefill only).

    `run` gets unpadded int64 id arrays and returns, per sample and in the same order,
    `(hidden [T, H], aux [T, K·H])` on the CPU with exactly that sample's T rows: `hidden` is the
    last layer after the final norm, `aux` the configured layer outputs concatenated. Any float
    dtype; the writer stores bf16.
    """

    description: str  # e.g. "hf cpu float32", shown in progress and stats
    # Limits the batcher must respect beyond extract.batch_tokens (None: no limit of its own).
    max_batch_tokens: int | None
    max_batch_samples: int | None

    def run(self, batch: Sequence[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor]]: ...

    def close(self) -> None: ...


def make_backend(cfg: ExtractConfig, dims: ModelDims, layers: tuple[int, ...], *, group: object = None,
                 max_forward_tokens: int = 0, max_samples: int = 0, config_path: object = "config",
                 mem_fraction_static: float = 0.0) -> ExtractBackend:
    """The backend `cfg` names; for "specforge", `group` is the TorchrunGroup, the two maxima size SGLang's pools and
    `mem_fraction_static` is the GPU plan's (0: extract.mem_fraction_static, or gpu_plan.DEFAULT_FRACTION when
    unset)."""
    if cfg.backend == "hf":
        from draftgen.core.extract.hf_backend import HFBackend
        return HFBackend(cfg.model, layers, dtype=cfg.compute_dtype, device=cfg.device,
                         prenorm_last=cfg.format == "speculators",
                         trust_remote_code=cfg.trust_remote_code)
    if cfg.backend == "specforge":
        from draftgen.core.extract.gpu_plan import DEFAULT_FRACTION
        from draftgen.core.extract.model_info import sglang_capture_ids
        from draftgen.core.extract.specforge_backend import SpecForgeBackend
        return SpecForgeBackend(cfg.model, sglang_capture_ids(layers, dims, str(config_path)), group=group,  # type: ignore[arg-type]
                                dtype=cfg.compute_dtype, trust_remote_code=cfg.trust_remote_code,
                                max_forward_tokens=max_forward_tokens, max_samples=max_samples,
                                mem_fraction_static=mem_fraction_static or cfg.mem_fraction_static or DEFAULT_FRACTION,
                                attention_backend=cfg.attention_backend,
                                sglang_args=cfg.sglang, config_path=config_path)
    raise ConfigError(f"{config_path}: extract.backend must be \"hf\" or \"specforge\", not {cfg.backend!r}")
