"""Batches of samples of different lengths as the rectangular tensors a forward pass takes (every
backend pads the same way; its own module, so a backend needs nothing of the factory that picks it)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

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
