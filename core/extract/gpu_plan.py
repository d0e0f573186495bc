"""The GPU plan (specforge backend; docs/extraction.md): what each GPU of the job must hold and SGLang's
`mem_fraction_static` from it.

The weights per GPU estimated from the model's config and quantisation (model_info.estimate_weights),
SGLang's KV pool for the largest planned forward, that forward's activations, and each visible card's
free memory from NVML (gpu.card_memory). SGLang 0.5.14 (model_runner_kv_cache_mixin._profile_available_bytes)
gives the KV pool `free_before_load * f - weights` and leaves `free_before_load * (1 - f)` to everything
else, f being `mem_fraction_static`: the plan picks the smallest f (plus a little) whose share holds the
weights and the pool, keeps the rest for the activations, and refuses, with the numbers, a job that
cannot fit or a configured f that would fail after the weights load. The extraction plan (plan.py) shows
it; the runner makes it before SGLang starts and hands it the fraction.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The GPU plan's margins (estimates; docs/extraction.md):
DEFAULT_FRACTION = 0.8           # SGLang's share when no card can be read here (and none is configured)
CONTEXT_BYTES = 3 * 2**29        # the CUDA context and NCCL's buffers, taken before SGLang measures free memory
LOADER_MARGIN = 0.04             # on the weights: quantisation side tensors, request pools, allocator rounding
RUNTIME_BYTES = 2 * 2**30        # outside the static share: cuBLAS/attention workspaces, fragmentation
FRACTION_HEADROOM = 0.02         # above the smallest share that holds weights + KV pool
FRACTION_MAX = 0.95


# The KV page size SGLang 0.5.14 forces for an attention backend (server_args.py
# `_handle_attention_backend_compatibility` and friends); others keep `page_size` (default 1). With
# no backend named SGLang picks one per GPU and model, so the margin assumes the largest it forces.
FORCED_PAGE_SIZES = {"flashmla": 64, "cutlass_mla": 128, "trtllm_mla": 64, "trtllm_mha": 64,
                     "tokenspeed_mla": 64, "cutedsl_mla": 64, "fa4": 128, "intel_xpu": 128}
LARGEST_PAGE = max(FORCED_PAGE_SIZES.values())


def kv_page_size(attention_backend: str, extra: dict[str, Any] | None = None) -> int:
    """The page size the KV pool is rounded to: the backend's forced one, else an explicit
    [extract.sglang] page_size, else 1 for a named backend and the largest forced one when SGLang chooses."""
    if attention_backend in FORCED_PAGE_SIZES:
        return FORCED_PAGE_SIZES[attention_backend]
    explicit = (extra or {}).get("page_size")
    if isinstance(explicit, int) and not isinstance(explicit, bool) and explicit > 0:
        return max(explicit, LARGEST_PAGE) if not attention_backend else explicit
    return 1 if attention_backend else LARGEST_PAGE


def kv_pool_tokens(max_forward_tokens: int, max_samples: int, page: int) -> int:
    """SGLang's `max_total_tokens` for the largest forward: its tokens, a page per sample (each sample is
    rounded up to whole pages), and a little slack."""
    return max_forward_tokens + page * max(1, max_samples) + 1024


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


@dataclass
class GpuPlan:
    """What each GPU of the job must hold, what the cards have, and SGLang's `mem_fraction_static` from it."""
    weights: Any                   # model_info.WeightEstimate
    weights_bytes: int             # per GPU, the estimate plus LOADER_MARGIN
    kv_tokens: int                 # SGLang's max_total_tokens for the largest forward
    kv_bytes: int
    activation_bytes: int          # the largest forward's working set and captured states, plus RUNTIME_BYTES
    max_forward_tokens: int
    cards: list[Any]               # gpu.Card: the tp_size cards the job runs on (empty: none could be read)
    card_note: str                 # why there are none, or ""
    configured: float              # extract.mem_fraction_static; 0: the plan chooses
    fraction: float = DEFAULT_FRACTION
    fraction_source: str = ""
    fits_range: tuple[float, float] | None = None  # the fractions that fit, on the tightest card
    refusal: str | None = None     # why the job cannot run, with the numbers (a DraftgenError's message)

    @property
    def tightest(self) -> Any:
        return min(self.cards, key=lambda c: c.free_bytes) if self.cards else None

    @property
    def usable_bytes(self) -> int:
        """What SGLang will see free before it loads, on the tightest card."""
        card = self.tightest
        return max(card.free_bytes - CONTEXT_BYTES, 0) if card else 0


def make_gpu_plan(cfg: Any, model_cfg: dict[str, Any], source: str, max_forward_tokens: int, max_samples: int, *,
                  nvml: Any = None, env: Mapping[str, str] | None = None, config_path: object = "config") -> GpuPlan:
    """The GPU plan for the specforge backend at `cfg.tp_size`; see the module docstring."""
    from draftgen.core.extract.gpu import card_memory
    from draftgen.core.extract.model_info import dims_from_config_dict, estimate_weights, resolve_aux_layers
    aux = len(resolve_aux_layers(cfg.aux_layers, dims_from_config_dict(model_cfg, source), str(config_path)))
    weights = estimate_weights(model_cfg, cfg.tp_size, cfg.compute_dtype, source, aux_layers=aux)
    w = int(weights.per_gpu_bytes * (1 + LOADER_MARGIN))
    kv_tokens = kv_pool_tokens(max_forward_tokens, max_samples, kv_page_size(cfg.attention_backend, cfg.sglang))
    kv = kv_tokens * weights.kv_bytes_per_token
    act = max_forward_tokens * weights.activation_bytes_per_token + RUNTIME_BYTES
    cards, note = card_memory(nvml, env)
    if cards and len(cards) < cfg.tp_size:
        note = (f"{len(cards)} GPU(s) visible here (CUDA_VISIBLE_DEVICES) but extract.tp_size = {cfg.tp_size}")
    plan = GpuPlan(weights, w, kv_tokens, kv, act, max_forward_tokens, cards[:cfg.tp_size], note,
                   cfg.mem_fraction_static)
    if not plan.cards or len(cards) < cfg.tp_size:
        plan.cards = [] if len(cards) < cfg.tp_size else plan.cards
        plan.fraction = cfg.mem_fraction_static or DEFAULT_FRACTION
        plan.fraction_source = ("extract.mem_fraction_static" if cfg.mem_fraction_static
                                else f"SGLang's usual {DEFAULT_FRACTION}: no card to read ({note})")
        return plan
    usable = plan.usable_bytes
    card = plan.tightest
    low = (w + kv) / usable if usable else 2.0
    high = 1 - act / usable if usable else -1.0
    where = (f"GPU {card.index}" + (f" (NVML {card.physical})" if card.physical != card.index else "")
             + f", {card.name}: {_gib(card.total_bytes)}, {_gib(card.free_bytes)} free")
    need = (f"weights ~{_gib(w)} per GPU at TP {cfg.tp_size} ({weights.quantization}; {_gib(weights.per_gpu_bytes)} "
            f"estimated from {source} + {LOADER_MARGIN:.0%}), KV pool {_gib(kv)} ({kv_tokens:,} tokens), "
            f"activations {_gib(act)} (the largest forward, {max_forward_tokens:,} tokens)")
    if low > min(high, FRACTION_MAX):
        fit = _fitting_tokens(plan, usable)
        plan.refusal = (
            f"{config_path}: the model does not fit: {where}; {_gib(usable)} usable after the CUDA context, but "
            f"it needs {need} = {_gib(w + kv + act)}"
            + (f". Lower extract.batch_tokens to about {fit:,} (the largest sample alone must fit too)"
               if fit > 0 else ". Even one token does not fit: use more GPUs (extract.tp_size) or bigger cards"))
        return plan
    plan.fits_range = (_ceil(low), _floor(min(high, FRACTION_MAX)))
    if cfg.mem_fraction_static:
        plan.fraction, plan.fraction_source = cfg.mem_fraction_static, "extract.mem_fraction_static"
        f = cfg.mem_fraction_static
        if f < low:
            plan.refusal = (
                f"{config_path}: extract.mem_fraction_static = {f:g} is too small: {where}; SGLang's static share "
                f"would be {_gib(f * usable)} of {_gib(usable)} usable, but {need.split(', activations')[0]} need "
                f"{_gib(w + kv)}: SGLang would stop after loading the weights (no room for the KV cache). Between "
                f"{plan.fits_range[0]:.2f} and {plan.fits_range[1]:.2f} fits; or remove the key and the plan chooses")
        elif f > high:
            plan.refusal = (
                f"{config_path}: extract.mem_fraction_static = {f:g} is too large: {where}; it leaves "
                f"{_gib((1 - f) * usable)} outside SGLang's static share, but the activations of the largest forward "
                f"need {_gib(act)} ({max_forward_tokens:,} tokens). Between {plan.fits_range[0]:.2f} and "
                f"{plan.fits_range[1]:.2f} fits; or remove the key and the plan chooses")
        return plan
    plan.fraction = min(_ceil(low + FRACTION_HEADROOM), plan.fits_range[1])
    plan.fraction_source = f"chosen by the plan (fits from {plan.fits_range[0]:.2f} to {plan.fits_range[1]:.2f})"
    return plan


def _ceil(x: float) -> float:
    import math
    return math.ceil(round(x * 100, 6)) / 100


def _floor(x: float) -> float:
    import math
    return math.floor(round(x * 100, 6)) / 100


def _fitting_tokens(plan: GpuPlan, usable: int) -> int:
    """About how many tokens one forward may have so that weights, KV pool and activations fit `usable`."""
    per_token = plan.weights.kv_bytes_per_token + plan.weights.activation_bytes_per_token
    slack_tokens = plan.kv_tokens - plan.max_forward_tokens
    spare = usable - plan.weights_bytes - RUNTIME_BYTES - slack_tokens * plan.weights.kv_bytes_per_token
    return max(int(spare // per_token) // 1024 * 1024, 0) if per_token else 0


def format_gpu_plan(plan: GpuPlan) -> list[str]:
    """The GPU plan as lines: what each GPU holds, the cards, the fraction (or the refusal)."""
    w = plan.weights
    lines = [f"GPU plan (specforge, TP {w.tp_size}): per GPU weights ~{_gib(plan.weights_bytes)} ({w.quantization}; "
             f"{_gib(w.per_gpu_bytes)} from the config + {LOADER_MARGIN:.0%}), KV pool {_gib(plan.kv_bytes)} "
             f"({plan.kv_tokens:,} tokens x {w.kv_bytes_per_token:,} B), activations {_gib(plan.activation_bytes)} "
             f"(largest forward {plan.max_forward_tokens:,} tokens)"]
    biggest = sorted(w.parts, key=lambda p: -p.per_gpu(w.tp_size))[:4]
    lines.append("  largest parts per GPU: " + ", ".join(
        f"{p.name} {_gib(p.per_gpu(w.tp_size))}" + ("" if p.sharded else " (on every GPU)") for p in biggest))
    if plan.cards:
        for c in plan.cards:
            mark = "*" if c is plan.tightest else " "
            lines.append(f"{mark} GPU {c.index}" + (f" (NVML {c.physical})" if c.physical != c.index else "")
                         + f"  {c.name}  {_gib(c.total_bytes)} total, {_gib(c.free_bytes)} free")
    else:
        need = plan.weights_bytes + plan.kv_bytes + plan.activation_bytes + CONTEXT_BYTES
        lines.append(f"  cards: not read ({plan.card_note}); each GPU needs about {_gib(need)} free")
    if plan.refusal:
        lines.append(f"GPU plan: DOES NOT FIT: {plan.refusal}")
    else:
        share = plan.fraction * plan.usable_bytes if plan.cards else None
        rest = (f": static share {_gib(share)} (weights + KV), {_gib(plan.usable_bytes - share)} left for "
                f"{_gib(plan.activation_bytes)} of activations on the fullest card") if share is not None else ""
        lines.append(f"GPU plan: mem_fraction_static = {plan.fraction:.2f} ({plan.fraction_source}){rest}")
    return lines
