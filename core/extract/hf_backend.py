"""The `hf` backend: transformers' AutoModelForCausalLM, for small models and CPUs.

The decoder (the model without its lm_head) is run, not the whole causal LM: its
`last_hidden_state` is the final-norm output that feeds lm_head, and skipping lm_head saves a
[B, T, vocab] logits tensor. Verified on transformers 5.24 with a tiny Llama (tests/extract/test_extract.py
checks it on every run): `lm_head(last_hidden_state)` equals the causal LM's logits exactly, and
`hidden_states[-1]` of `output_hidden_states=True` is that same post-norm tensor. The aux layers
are taken with forward hooks on the decoder layers, so only the K asked for ([B, T, H] each) are kept
instead of all N+1; a hooked layer's output is HF's `hidden_states[k + 1]`. With `prenorm_last`
(extract.format = "speculators") the returned `hidden` is instead the last decoder layer's own output,
taken by a hook on it: the same tensor before the final norm (speculators' trainer applies the norm).

Batches are right-padded and carry an attention mask. With right padding a real token never
attends to a pad (pads come after it) and its position ids are unchanged, so the rows kept for
each sample match a one-by-one run; the padding rows are sliced off before anything is returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from draftgen.core.errors import DraftgenError
from draftgen.core.extract.padding import right_pad

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _decoder_layers(decoder: Any) -> Any:
    for name in ("layers", "h"):
        layers = getattr(decoder, name, None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise DraftgenError(f"hf backend: cannot find the decoder layers of {type(decoder).__name__} "
                        f"(expected .layers or .h); use the sglang backend for this model")


def _dtype_kwarg() -> str:
    import transformers
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in 4.56


class HFBackend:
    def __init__(self, model: str, layers: tuple[int, ...], *, dtype: str = "bfloat16",
                 device: str = "auto", trust_remote_code: bool = False, prenorm_last: bool = False) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        # Its tqdm bars would scribble over the TUI, which runs extraction in-process.
        hf_logging.disable_progress_bar()
        self.device = resolve_device(device)
        self.dtype = _DTYPES[dtype]
        self.layers = layers
        try:
            lm = AutoModelForCausalLM.from_pretrained(model, trust_remote_code=trust_remote_code,
                                                      **{_dtype_kwarg(): self.dtype})
        except (OSError, ValueError) as e:
            raise DraftgenError(f"extract.model {model!r}: cannot load it with transformers: {e}") from None
        self.model = lm.to(self.device).eval()
        self.decoder = self.model.get_decoder()
        decoder_layers = _decoder_layers(self.decoder)
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = [decoder_layers[k].register_forward_hook(self._capture_hook(k)) for k in layers]
        self._last: int | None = None
        if prenorm_last:
            self._last = len(decoder_layers) - 1
            self._hooks.append(decoder_layers[self._last].register_forward_hook(self._capture_hook(self._last)))
        self.description = f"hf {self.device} {dtype}"
        self.max_batch_tokens: int | None = None
        self.max_batch_samples: int | None = None

    def _capture_hook(self, k: int) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            # Decoder layers return a tensor in transformers 5 and a tuple before.
            self._captured[k] = output[0] if isinstance(output, tuple) else output
        return hook

    def run(self, batch: Sequence[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        input_ids, attention_mask, lengths = right_pad(batch)
        self._captured.clear()
        with torch.inference_mode():
            out = self.decoder(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                               use_cache=False)
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
            if self._last is not None:
                hidden = self._captured[self._last]  # before the final norm
            aux = torch.cat([self._captured[k] for k in self.layers], dim=-1)
            self._captured.clear()
            return [(hidden[row, :n].cpu(), aux[row, :n].cpu()) for row, n in enumerate(lengths)]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
