"""The extraction self-check's rows (selfcheck.py): the checklist (`SelfCheckResult`) and the checks that judge
what a backend gave against transformers' own model and SpecForge's reader: shapes, dtypes and finite
states, each sample alone equal to itself in the batch, lm_head(hidden_state) against the reference
logits and each aux slice against its layer (`check_states`, by the dtype's `THRESHOLDS`), the files read
back (`check_files`), and the peak memory of the long sample (`Peak`, judged by `memory_verdict`)."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from draftgen.core.config import Config
from draftgen.core.extract import layout
from draftgen.core.extract.model_info import ModelDims
from draftgen.core.units import fmt_bytes


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


def check_states(result: SelfCheckResult, label: str, samples: list[tuple[np.ndarray, np.ndarray]],
                 batch_out: list[tuple[torch.Tensor, torch.Tensor]],
                 alone_out: list[tuple[torch.Tensor, torch.Tensor]], dims: ModelDims, layers: tuple[int, ...],
                 ref: Any, device: str, dtype: torch.dtype) -> None:
    """The rows of the backend's states: the mixed batch's shapes, dtypes and finite values, each sample alone
    against itself in the batch, lm_head(hidden_state) against `ref`'s logits, each aux slice against its layer."""
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


def check_files(result: SelfCheckResult, label: str, config: Config, samples: list[tuple[np.ndarray, np.ndarray]],
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


def _cos_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


class Peak:
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
