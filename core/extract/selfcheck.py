"""`draftgen extract --self-check`: extraction's smoke test, for the GPU box before hours of 8-GPU time.

On tiny random models of the target's families, built here (a Llama with head_dim 128, a
DeepseekV3-style MoE with MLA like Kimi-K2.5's language model, and, for the specforge backend,
Kimi-K2.5's own form: the class SGLang 0.5.14 registers for it, `KimiK25ForConditionalGeneration`
(sglang/srt/models/kimi_k25.py, configured by its `KimiK25Config`: `text_config` a DeepseekV3
config, `vision_config` the MoonViT tower), with Kimi's router settings, its language weights under
`language_model.` and a vision tower SGLang builds beside them), through the configured backend
and the real runner, it checks (the hf backend: Llama and DeepseekV3, transformers having no Kimi
class; specforge: the configured model's family only, since SGLang sets up its model-parallel state
once per process):

1. the backend starts;
2. a mixed batch with one long sample (`--long-tokens`, 16,384 by default) gives the right
   shapes and dtypes, all finite;
3. each sample run alone equals the same sample inside the batch (padding leaks nowhere);
4. `lm_head(hidden_state)` agrees with transformers' own logits (the Kimi form: its DeepseekV3
   language model with the same weights), by thresholds chosen by dtype (`THRESHOLDS`): float32
   mean cosine >= 0.99, argmax >= 98 %; bfloat16 looser, since SGLang's fused kernels and
   transformers' eager ones round differently on nearly flat random logits;
5. aux slice j matches HF `hidden_states[k_j + 1]` clearly better (float32: 2x, bfloat16: 1.5x
   closer) than `[k_j]` or `[k_j + 2]`: the layer convention, SGLang's +1 rule included;
6. the files the runner writes read back through SpecForge's own loader and EAGLE-3 normaliser
   (draftgen's copy of them, said so, where specforge is not installed) and equal the states;
7. peak memory during the long sample (on a GPU `torch.cuda.max_memory_allocated`, on a CPU the
   process's RSS) and /dev/shm, extrapolated to the configured model's H and batch_tokens; on a GPU
   with a configured run it must fit what the GPU plan leaves outside SGLang's static share
   (`memory_verdict`), elsewhere it is shown, not judged;
8. a rerun skips every file, and the backend leaves no process or process group behind.

Before them, the prerequisites this machine shows: the NVIDIA driver and CUDA (the pinned set is
CUDA 13: driver R580 or newer), glibc (SGLang 0.5.14's wheels need 2.34+), /dev/shm, and free disk
for the whole configured extraction.

Under torchrun every rank runs the same forwards; rank 0 makes the scratch folder and the tiny
models in it (shared with the other ranks by path: the ranks of one job share a machine), compares
and prints.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import platform
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from draftgen.core.config import Config, ExtractConfig, config_from_dict
from draftgen.core.extract import layout
from draftgen.core.extract.backend import make_backend
from draftgen.core.extract.model_info import ModelDims, read_model_dims, resolve_aux_layers
from draftgen.core.units import fmt_bytes

DEFAULT_LONG_TOKENS = 16_384
SHORT_LENGTHS = (300, 64, 17, 3)  # the rest of the mixed batch, cut to below the long sample
VOCAB = 8192
N_LAYERS = 8


@dataclass(frozen=True)
class Thresholds:
    cosine_min: float        # mean cosine of lm_head(hidden_state) to the reference logits
    argmax_min: float        # share of tokens whose argmax agrees
    aux_margin: float        # the right layer must be this many times closer than its neighbours
    alone_cosine_min: float  # per-row cosine of sample-alone vs sample-in-batch (kernels differ a little by shape)


# Chosen by dtype: float32 (CPU, the hf backend) is tight; bfloat16 (8 bits of mantissa, fused GPU kernels
# against transformers' eager ones, on nearly flat random logits) leaves room for rounding, not for a wrong
# layer (a neighbour layer is off by far more than 1.5x) or a leak (a padding leak drops the cosine well below).
THRESHOLDS = {
    torch.float32: Thresholds(cosine_min=0.99, argmax_min=0.98, aux_margin=2.0, alone_cosine_min=0.999),
    torch.bfloat16: Thresholds(cosine_min=0.98, argmax_min=0.90, aux_margin=1.5, alone_cosine_min=0.995),
}


def thresholds(dtype: torch.dtype) -> Thresholds:
    """The tolerances for states of `dtype` (float16 as bfloat16; anything wider as float32)."""
    return THRESHOLDS[torch.float32 if dtype in (torch.float32, torch.float64) else torch.bfloat16]

KIMI_HIDDEN = 7168    # extrapolation target when no model is configured
MIN_DRIVER = 580      # CUDA 13 (torch 2.11.0's default wheels, the gpu extra's) needs driver R580+
MIN_GLIBC = (2, 34)   # sglang 0.5.14 ships manylinux_2_34 wheels only


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


@dataclass
class Row:
    check: str
    passed: bool
    detail: str


@dataclass
class SelfCheckResult:
    rows: list[Row] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    def add(self, check: str, passed: bool, detail: str) -> None:
        self.rows.append(Row(check, bool(passed), detail))


def _samples(long_tokens: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    lengths = [long_tokens] + [min(n, max(long_tokens - 1, 1)) for n in SHORT_LENGTHS]
    out = []
    for n in lengths:
        ids = rng.integers(3, VOCAB - 1, size=n).astype(np.int64)  # never pad/bos/eos or Kimi's media placeholder
        mask = (rng.random(n) < 0.5).astype(np.uint8)
        out.append((ids, mask))
    return out


def _cos_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


class _Peak:
    """Samples process RSS and /dev/shm use in a thread while a block runs; on CUDA, the allocator's peak."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.mem = 0
        self.shm = 0

    @contextmanager
    def watch(self) -> Iterator[None]:
        import psutil
        proc = psutil.Process()
        shm = Path("/dev/shm")

        def shm_used() -> int:
            try:
                return shutil.disk_usage(shm).used
            except OSError:
                return 0

        base_rss, base_shm = proc.memory_info().rss, shm_used()
        peak = {"rss": base_rss, "shm": base_shm}
        done = threading.Event()

        def poll() -> None:
            while not done.wait(0.02):
                peak["rss"] = max(peak["rss"], proc.memory_info().rss)
                peak["shm"] = max(peak["shm"], shm_used())

        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base_cuda = torch.cuda.memory_allocated()
        thread = threading.Thread(target=poll, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            peak["rss"] = max(peak["rss"], proc.memory_info().rss)
            peak["shm"] = max(peak["shm"], shm_used())
            if self.device == "cuda":
                torch.cuda.synchronize()
                self.mem = torch.cuda.max_memory_allocated() - base_cuda
            else:
                self.mem = peak["rss"] - base_rss
            self.shm = peak["shm"] - base_shm


def _make_run(root: Path, name: str, model_dir: Path, samples: list[tuple[np.ndarray, np.ndarray]],
              base: ExtractConfig, config_path: Path) -> Config:
    from draftgen.core.tokens.store import TokenWriter
    run = root / f"run-{name.split()[0]}"
    with TokenWriter(run / "merged" / "tokens") as writer:
        for k, (ids, mask) in enumerate(samples):
            writer.append(f"selfcheck-{k}", ids, mask)
    table = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    table.update(model=str(model_dir), aux_layers="eagle3",
                 batch_tokens=sum(len(ids) for ids, _ in samples) * len(samples))
    raw = {"output": {"dir": str(run)}, "datasets": [{"name": "selfcheck", "prompts": "p.jsonl"}], "extract": table}
    return config_from_dict(raw, config_path)


def _specforge_reader() -> tuple[Callable[[Path], list[dict[str, torch.Tensor]]], str]:
    """SpecForge's offline reader + EAGLE-3 normaliser when installed; else draftgen's copy (named as such)."""
    try:
        from specforge.algorithms.eagle3.data import normalize_offline_sample
        from specforge.runtime.data_plane.feature_store import load_feature_file
        from specforge.runtime.data_plane.offline_reader import list_feature_files
    except ImportError:
        def read_copy(root: Path) -> list[dict[str, torch.Tensor]]:
            out = []
            for path in sorted(p for p in root.rglob("*") if p.name.endswith((".ckpt", ".ckpt.gz"))):
                raw = layout.load_sample(path)
                out.append({"path": str(path), "hidden_state": raw["aux_hidden_state"], "target": raw["hidden_state"],
                            "input_ids": raw["input_ids"][None], "loss_mask": raw["loss_mask"][None]})
            return out
        return read_copy, "draftgen's copy of SpecForge's reader (specforge not installed)"

    def read(root: Path) -> list[dict[str, torch.Tensor]]:
        out = []
        for path in list_feature_files(str(root)):
            sample = normalize_offline_sample(load_feature_file(path), max_len=1 << 30)
            sample["path"] = path
            out.append(sample)
        return out
    return read, "SpecForge's list_feature_files, load_feature_file and normalize_offline_sample"


def memory_verdict(peak_bytes: int, tokens: int, hidden: int, target_hidden: int, forward_tokens: int, device: str,
                   allowance: int | None) -> tuple[bool, str]:
    """The memory row: the long sample's peak, scaled by H and to the largest forward; judged only on a GPU with
    `allowance` (what the GPU plan leaves outside SGLang's static share, less its runtime margin)."""
    per_token = peak_bytes / max(tokens, 1)
    estimate = per_token * target_hidden / max(hidden, 1) * forward_tokens
    what = "GPU memory (torch.cuda.max_memory_allocated above the weights)" if device == "cuda" else \
        "process memory (RSS)"
    detail = (f"{what}: {fmt_bytes(peak_bytes)} for {tokens:,} tokens at H={hidden}; ~{fmt_bytes(estimate)} for "
              f"{forward_tokens:,} tokens at H={target_hidden} (scaled by H)")
    if device != "cuda":
        return True, detail + "; not judged on a CPU"
    if allowance is None:
        return True, detail + "; not judged (no GPU plan: no configured run, or no card read)"
    passed = estimate <= allowance
    return passed, detail + f"; {'within' if passed else 'MORE THAN'} the {fmt_bytes(allowance)} the GPU plan leaves"


def activation_allowance(config: Config | None) -> int | None:
    """What the configured run's GPU plan leaves the forward outside SGLang's static share; None without one."""
    if config is None or config.extract.backend != "specforge":
        return None
    from draftgen.core.errors import DraftgenError
    from draftgen.core.extract.gpu_plan import RUNTIME_BYTES
    from draftgen.core.extract.plan import make_plan
    try:
        gpu = make_plan(config, (0, 1)).gpu
    except DraftgenError:
        return None
    if gpu is None or not gpu.cards or gpu.refusal:
        return None
    return int((1 - gpu.fraction) * gpu.usable_bytes) - RUNTIME_BYTES


def _check_model(result: SelfCheckResult, name: str, hf_config: Any, work: Path, base: ExtractConfig,
                 config_path: Path, long_tokens: int, target_hidden: int, group: Any,
                 allowance: int | None = None) -> None:
    from transformers import AutoModelForCausalLM

    from draftgen.core.extract.runner import extract
    label = f"[{name}]"
    model_dir = work / name.split()[0]
    ref = None
    if group.writer:
        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(hf_config).eval()
        ref.save_pretrained(model_dir)
    if name == FAMILIES[2]:  # the backend loads Kimi's own form; the reference stays transformers' DeepseekV3
        hf_dir = model_dir
        model_dir = work / "kimi-k2.5-form"
        if group.writer:
            kimi_form(hf_dir, model_dir)
    group.share(lambda: None)  # every rank waits for the weights on disk
    samples = _samples(long_tokens, seed=1)
    # One rank writes the run's tokens; the others get its config (a folder they all see).
    config = group.share(lambda: _make_run(work, name, model_dir, samples, base, config_path))
    cfg = config.extract
    dims = read_model_dims(str(model_dir))
    layers = resolve_aux_layers("eagle3", dims)
    ids_list = [ids for ids, _ in samples]

    started = time.monotonic()
    backend = make_backend(cfg, dims, layers, group=group, max_forward_tokens=len(samples) * long_tokens,
                           max_samples=len(samples), config_path=config_path)
    if group.writer:  # one checklist, rank 0's
        result.add(f"{label} backend starts", True, f"{backend.description} in {time.monotonic() - started:.1f}s")
    device = "cuda" if torch.cuda.is_available() and cfg.device != "cpu" else "cpu"
    try:
        peak = _Peak(device)
        with peak.watch():  # first, so that on a CPU the process has not grown for something else already
            alone_out = [backend.run([ids_list[0]])]
        batch_out = backend.run(ids_list)
        alone_out += [backend.run([ids]) for ids in ids_list[1:]]
        if group.writer:
            _compare(result, label, samples, batch_out, [o[0] for o in alone_out], dims, layers, ref, device,
                     batch_out[0][0].dtype)
            ref = None
            passed, detail = memory_verdict(peak.mem, long_tokens, dims.hidden_size, target_hidden,
                                            max(base.batch_tokens, long_tokens), device, allowance)
            result.add(f"{label} peak memory, long sample", passed,
                       f"{detail}; /dev/shm grew {fmt_bytes(max(peak.shm, 0))}")
        stats = extract(config, backend=backend, group=group)
        if group.writer:
            _check_files(result, label, config, samples, batch_out, stats)
        again = extract(config, backend=backend, group=group)
        if group.writer:
            result.add(f"{label} rerun skips every file", again.written == 0 and again.skipped_existing == len(samples),
                       f"{again.skipped_existing}/{len(samples)} skipped, {again.written} written")
    finally:
        backend.close()


def _compare(result: SelfCheckResult, label: str, samples: list[tuple[np.ndarray, np.ndarray]],
             batch_out: list[tuple[torch.Tensor, torch.Tensor]], alone_out: list[tuple[torch.Tensor, torch.Tensor]],
             dims: ModelDims, layers: tuple[int, ...], ref: Any, device: str, dtype: torch.dtype) -> None:
    h = dims.hidden_size
    limit = thresholds(dtype)
    shapes_ok = all(tuple(hid.shape) == (len(ids), h) and tuple(aux.shape) == (len(ids), 3 * h)
                    and hid.is_floating_point() and aux.is_floating_point()
                    and bool(torch.isfinite(hid).all()) and bool(torch.isfinite(aux).all())
                    for (ids, _), (hid, aux) in zip(samples, batch_out, strict=True))
    lengths = [len(ids) for ids, _ in samples]
    result.add(f"{label} mixed batch: shapes, dtypes, finite", shapes_ok,
               f"lengths {lengths}; hidden [T, {h}], aux [T, {3 * h}], {batch_out[0][0].dtype}")
    worst = min(float(torch.minimum(_cos_rows(a[0], b[0]).min(), _cos_rows(a[1], b[1]).min()))
                for a, b in zip(alone_out, batch_out, strict=True))
    result.add(f"{label} each sample alone == in the batch", worst >= limit.alone_cosine_min,
               f"lowest per-token cosine {worst:.6f} (>= {limit.alone_cosine_min}, {dtype})")

    # The reference runs in the backend's dtype: a random model's logits are nearly flat, and
    # comparing bf16 kernels against float32 would test rounding, not the extraction.
    ref = ref.to(device=device, dtype=dtype)
    cosines, agree, total = [], 0, 0
    aux_ok, aux_detail = True, []
    with torch.inference_mode():
        for (ids, _), (hid, aux) in zip(samples, batch_out, strict=True):
            out = ref(torch.from_numpy(ids)[None].to(device), output_hidden_states=True)
            logits = out.logits[0].float()
            mine = ref.lm_head(hid.to(device=device, dtype=dtype)).float()
            cosines.append(_cos_rows(mine, logits))
            agree += int((mine.argmax(-1) == logits.argmax(-1)).sum())
            total += len(ids)
            hs = out.hidden_states
            for j, k in enumerate(layers):
                part = aux[:, j * h:(j + 1) * h].to(device)
                right = _rel(part, hs[k + 1][0])
                wrong = min(_rel(part, hs[k][0]), _rel(part, hs[k + 2][0]))
                if not right * limit.aux_margin <= wrong:
                    aux_ok = False
                if len(ids) == lengths[0]:
                    aux_detail.append(f"layer {k}: {right:.1e} vs {wrong:.1e}")
    cos = torch.cat(cosines)
    share = agree / max(total, 1)
    result.add(f"{label} lm_head(hidden_state) vs HF logits",
               float(cos.mean()) >= limit.cosine_min and share >= limit.argmax_min,
               f"mean cosine {float(cos.mean()):.5f} (min {float(cos.min()):.5f}), argmax agrees on "
               f"{share:.2%} of {total:,} tokens (>= {limit.cosine_min}, {limit.argmax_min:.0%} for {dtype})")
    result.add(f"{label} aux slices are HF hidden_states[k+1]", aux_ok,
               f"rel. error to [k+1] vs nearest of [k], [k+2] (>= {limit.aux_margin}x), long sample: "
               f"{'; '.join(aux_detail)}")


def _check_files(result: SelfCheckResult, label: str, config: Config, samples: list[tuple[np.ndarray, np.ndarray]],
                 batch_out: list[tuple[torch.Tensor, torch.Tensor]], stats: Any) -> None:
    """The runner's files, read back through SpecForge's reader, equal the states of the same batch."""
    read, how = _specforge_reader()
    root = config.run_dir / "hidden_states"
    got = read(root)
    by_index = {int(Path(s["path"]).name.split("_")[1].split(".")[0]): s for s in got}
    ok = stats.written == len(samples) and sorted(by_index) == list(range(len(samples)))
    worst = 1.0
    for k, ((ids, mask), (hid, aux)) in enumerate(zip(samples, batch_out, strict=True)):
        hid, aux = hid.cpu(), aux.cpu()  # the specforge backend leaves them on the GPU; the files are read on the CPU
        s = by_index.get(k)
        if s is None:
            ok = False
            continue
        expect_mask = torch.from_numpy(mask.astype(np.int64))
        ok &= torch.equal(s["input_ids"].reshape(-1), torch.from_numpy(ids))
        ok &= torch.equal(s["loss_mask"].reshape(-1)[:-1], expect_mask[:-1])  # the normaliser zeroes the last one
        ok &= s["target"].dtype == torch.bfloat16 and s["hidden_state"].dtype == torch.bfloat16
        ok &= (tuple(s["target"].shape[-2:]) == tuple(hid.shape)
               and tuple(s["hidden_state"].shape[-2:]) == tuple(aux.shape))
        if ok:
            # The runner made its own forward of the same batch; on a GPU kernels may round differently.
            worst = min(worst, float(_cos_rows(s["target"].reshape(hid.shape), hid).min()),
                        float(_cos_rows(s["hidden_state"].reshape(aux.shape), aux).min()))
    ok &= worst >= thresholds(batch_out[0][0].dtype).alone_cosine_min
    result.add(f"{label} files read back through SpecForge's reader", ok,
               f"{len(got)} files via {how}; {stats.written} written, {stats.tokens_written:,} tokens; lowest "
               f"per-token cosine to the states {worst:.6f}")


def families_for(backend: str, target: ModelDims | None) -> tuple[str, ...]:
    """hf: Llama and DeepseekV3 (transformers has no Kimi-K2.5 class). specforge: SGLang sets up its
    model-parallel state once per process, so one family, the target's: Kimi-K2.5's own form for a
    Kimi-K2.5 target and when no model is configured, DeepseekV3 for another DeepSeek-family one."""
    if backend != "specforge":
        return FAMILIES[:2]
    if target is None or KIMI_ARCH in target.architectures or "kimi_k25" in target.model_types:
        return (FAMILIES[2],)
    return (FAMILIES[1] if target.deepseek_family else FAMILIES[0],)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split("."):
        digits = "".join(c for c in p if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def gpu_prerequisites(nvml: Any = None) -> tuple[str | None, str | None, int]:
    """(driver version, CUDA version the driver supports, GPU count) from NVML; (None, None, 0) without one."""
    try:
        if nvml is None:
            nvml = importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception:  # no nvidia-ml-py, no driver, no device
        return None, None, 0
    try:
        driver = nvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        cuda = int(nvml.nvmlSystemGetCudaDriverVersion())
        return driver, f"{cuda // 1000}.{cuda % 1000 // 10}", int(nvml.nvmlDeviceGetCount())
    except Exception:
        return None, None, 0
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def glibc_version() -> str | None:
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION") or ""  # "glibc 2.35"
    except (ValueError, OSError, AttributeError):
        text = ""
    if text.startswith("glibc "):
        return text.split()[1]
    lib, version = platform.libc_ver()
    return version if lib == "glibc" and version else None


def add_prerequisites(result: SelfCheckResult, base: ExtractConfig, config: Config | None, nvml: Any = None) -> None:
    """Rows for what this machine shows before anything runs; for `hf` they inform, for `specforge` they must hold."""
    needs_gpu = base.backend == "specforge"
    driver, cuda, gpus = gpu_prerequisites(nvml)
    torch_cuda = torch.version.cuda or "none (CPU build)"
    if driver is None:
        result.add("NVIDIA driver and CUDA", not needs_gpu,
                   f"no GPU (NVML finds no driver or device); torch {torch.__version__} built for CUDA {torch_cuda}"
                   + ("; the specforge backend needs CUDA GPUs" if needs_gpu else ""))
    else:
        major = _version(driver)[:1] or (0,)
        ok = major[0] >= MIN_DRIVER or not needs_gpu
        result.add("NVIDIA driver and CUDA", ok,
                   f"driver {driver} (CUDA {cuda}), {gpus} GPU(s); torch built for CUDA {torch_cuda}; the gpu extra's "
                   f"torch needs CUDA 13: driver R{MIN_DRIVER}+")
    libc = glibc_version()
    libc_ok = libc is not None and _version(libc)[:2] >= MIN_GLIBC
    result.add("glibc", libc_ok or not needs_gpu,
               f"glibc {libc or 'not found (musl?)'}; sglang 0.5.14 ships wheels for glibc "
               f"{'.'.join(map(str, MIN_GLIBC))}+ only")
    try:
        shm = shutil.disk_usage("/dev/shm")
        shm_text = f"{fmt_bytes(shm.free)} free of {fmt_bytes(shm.total)}"
        shm_ok = shm.free >= base.min_shm_gb * 2**30
    except OSError as e:
        shm_text, shm_ok = f"cannot read /dev/shm: {e.strerror}", base.min_shm_gb <= 0
    result.add("/dev/shm", shm_ok or not needs_gpu,
               f"{shm_text}; extract.min_shm_gb = {base.min_shm_gb:g} (NCCL; Docker: --shm-size=32g or --ipc=host)")
    if config is None:
        return
    from draftgen.core.errors import DraftgenError
    from draftgen.core.extract.plan import make_plan
    try:
        plan = make_plan(config, (0, 1))
    except DraftgenError as e:
        result.add("free disk for the whole extraction", True, f"no plan yet: {e}")
        return
    need = sum(s.bytes_gz if plan.compress else s.bytes_bf16 for s in plan.shards)
    result.add("free disk for the whole extraction", need <= plan.free_bytes,
               f"{fmt_bytes(need)} for {plan.this.todo:,} samples ({plan.this.tokens_todo:,} tokens) still to do "
               f"({'gz estimate' if plan.compress else 'bf16'}); {fmt_bytes(plan.free_bytes)} free in {plan.root}")


def run_self_check(base: ExtractConfig, *, long_tokens: int = DEFAULT_LONG_TOKENS, target_hidden: int | None = None,
                   config_path: Path = Path("selfcheck.toml"), work_dir: Path | None = None,
                   families: tuple[str, ...] | None = None, config: Config | None = None,
                   nvml: Any = None) -> SelfCheckResult:
    """Run the checklist with `base`'s backend settings (its model only sizes the extrapolation).

    `config`, when given, is the configured run: the prerequisite rows check free disk for it.
    """
    from draftgen.core.extract.runner import make_group
    result = SelfCheckResult()
    started = time.monotonic()
    target: ModelDims | None = None
    if base.model:
        try:
            target = read_model_dims(base.model, trust_remote_code=base.trust_remote_code)
        except Exception:  # the extrapolation is a courtesy; the checks do not need the big model
            target = None
    if target_hidden is None:
        target_hidden = target.hidden_size if target else KIMI_HIDDEN
    if families is None:
        families = families_for(base.backend, target)
    import psutil
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    group = make_group(base, config_path)
    allowance = None
    if group.writer:
        add_prerequisites(result, base, config, nvml)
        allowance = activation_allowance(config) if torch.cuda.is_available() else None
    tmp = None
    try:
        work = work_dir
        if work is None:
            # Rank 0 makes it and tells the others: a folder per rank would leave them without the models.
            tmp = group.share(lambda: tempfile.mkdtemp(prefix="draftgen-selfcheck-"))
            work = Path(tmp)
        for name, hf_config in tiny_configs(max(2 * long_tokens, 4096), base.tp_size).items():
            if families is not None and name not in families:
                continue
            _check_model(result, name, hf_config, work, base, config_path, long_tokens, target_hidden, group,
                         allowance)
        group.share(lambda: None)  # nobody reads the scratch folder any more
    finally:
        group.close()
        if tmp is not None and group.writer:
            shutil.rmtree(tmp, ignore_errors=True)
    if group.writer:
        children = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
        result.add("workers exit", not children,
                   f"{base.backend}: process group closed, {len(children)} child processes left"
                   + (f" ({', '.join(str(c.pid) for c in children)})" if children else ""))
    result.elapsed_s = time.monotonic() - started
    return result


def print_result(result: SelfCheckResult, out: TextIO | None = None) -> None:
    from rich.console import Console

    from draftgen.core.checklist import checklist_table
    console = Console(file=out, width=160) if out is not None else Console()
    console.print(checklist_table("draftgen extract --self-check",
                                  ((r.check, r.passed, r.detail) for r in result.rows)))
    failed = sum(not r.passed for r in result.rows)
    console.print(("[green]PASSED[/]" if result.passed else f"[bold red]FAILED[/] ({failed} checks)")
                  + f" in {result.elapsed_s:.1f}s")
