"""Extraction tokens/s against the forward-pass FLOP limit of the device, measured side by side.

    python benchmarks/bench_extract.py                 # CPU, a ~30M-parameter random Llama
    python benchmarks/bench_extract.py --peak-tflops 1.2 --samples 64

A forward pass costs about 2·P FLOPs per token (P = the decoder's matmul parameters; extraction
skips lm_head, and the embedding is a lookup), plus 2·T·d per layer for causal attention. So
`achieved FLOP/s = FLOPs per token x tokens/s`, and the table compares it with
- the device's peak: on CPU an estimate (cores x clock x FLOPs per cycle from the CPU flags) or
  --peak-tflops; on a GPU the H200's bf16 dense peak, 989 TFLOP/s;
- a bare torch matmul of the model's shapes, measured in the same run: what this device really
  sustains, the practical ceiling for the forward pass.
Rows: the hf backend's forward alone, and the whole `extract()` (forward + checks + bf16 files).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftgen.core.config import config_from_dict  # noqa: E402
from draftgen.core.extract import extract  # noqa: E402
from draftgen.core.extract.hf_backend import HFBackend  # noqa: E402
from draftgen.core.extract.model_info import eagle3_layers  # noqa: E402
from draftgen.core.tokens.store import TokenWriter  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0


def cpu_peak_tflops() -> tuple[float, str]:
    """cores x GHz x fp32 FLOPs/cycle (2 FMA units: AVX-512 64, AVX2 32); a rough upper bound."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = set(re.findall(r"^flags\s*:\s*(.*)$", text, re.M)[0].split()) if "flags" in text else set()
    per_cycle = 64 if "avx512f" in flags else 32 if {"avx2", "fma"} <= flags else 8
    ghz = None
    name = re.search(r"model name\s*:.*@\s*([\d.]+)GHz", text)
    if name:
        ghz = float(name.group(1))
    else:
        mhz = re.search(r"cpu MHz\s*:\s*([\d.]+)", text)
        ghz = float(mhz.group(1)) / 1000 if mhz else 2.0
    cores = torch.get_num_threads()
    return cores * ghz * per_cycle / 1000, f"{cores} cores x {ghz:.2f} GHz x {per_cycle} FLOP/cycle (fp32)"


def build_model(folder: Path, hidden: int, layers: int, vocab: int) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                      vocab_size=vocab, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    # Matmul parameters the extraction forward runs: decoder layers only (no embedding lookup, no lm_head).
    return sum(p.numel() for name, p in model.model.layers.named_parameters() if p.dim() == 2)


def matmul_tflops(hidden: int, dtype: torch.dtype, device: str, seconds: float = 1.5) -> float:
    """Sustained FLOP/s of [4096, h] x [h, 3h], the MLP shape that dominates the forward."""
    a = torch.randn(4096, hidden, dtype=dtype, device=device)
    b = torch.randn(hidden, 3 * hidden, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        n += 1
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * 4096 * hidden * 3 * hidden * n / (time.perf_counter() - start) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's peak; estimated if omitted")
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.peak_tflops is not None:
        peak, peak_how = args.peak_tflops, "given"
    elif device == "cuda":
        peak, peak_how = H200_BF16_DENSE_TFLOPS, "H200 bf16 dense"
    else:
        peak, peak_how = cpu_peak_tflops()
    rng = np.random.default_rng(0)
    lengths = rng.integers(args.min_len, args.max_len + 1, size=args.samples)
    tokens = int(lengths.sum())

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        params = build_model(tmp_path / "model", args.hidden, args.layers, args.vocab)
        mean_len = float((lengths.astype(np.float64) ** 2).sum() / tokens)  # token-weighted context length
        flops_per_token = 2 * params + 2 * mean_len * args.hidden * args.layers
        samples = [rng.integers(0, args.vocab, size=int(n)) for n in lengths]
        print(f"device {device}; model: {args.layers} layers, H={args.hidden}, {params / 1e6:.1f}M matmul params; "
              f"{args.samples} samples, {tokens:,} tokens; {flops_per_token / 1e6:.1f} MFLOP/token; "
              f"torch threads {torch.get_num_threads()}")
        print(f"peak {peak:.3f} TFLOP/s ({peak_how})\n")
        rows = []
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            before = matmul_tflops(args.hidden, dtype, device)
            backend = HFBackend(str(tmp_path / "model"), eagle3_layers(args.layers), dtype=dtype_name, device=device)
            backend.run([samples[0][:64]])  # warm-up
            from draftgen.core.extract.runner import plan_batches
            batches = plan_batches([(k, len(s)) for k, s in enumerate(samples)], args.batch_tokens)
            start = time.perf_counter()
            for batch in batches:
                backend.run([samples[k] for k in batch])
            elapsed = time.perf_counter() - start
            # The reference is taken before and after: on a shared machine the load drifts during a run.
            ref = (before + matmul_tflops(args.hidden, dtype, device)) / 2
            rows.append(("bare matmul [4096,h]x[h,3h]", dtype_name, None, None, ref, ref, peak))
            tps = tokens / elapsed
            rows.append(("hf backend forward", dtype_name, tps, elapsed, tps * flops_per_token / 1e12, ref, peak))

            run = tmp_path / f"run-{dtype_name}"
            with TokenWriter(run / "merged" / "tokens") as writer:
                for k, s in enumerate(samples):
                    writer.append(f"s{k}", s, np.ones(len(s), dtype=np.uint8))
            config = config_from_dict({
                "output": {"dir": str(run)}, "datasets": [{"name": "B", "prompts": "p.jsonl"}],
                "extract": {"model": str(tmp_path / "model"), "backend": "hf", "device": device, "dtype": dtype_name,
                            "batch_tokens": args.batch_tokens}}, tmp_path / "bench.toml")
            stats = extract(config, backend=backend)
            e2e = stats.tokens_written / stats.elapsed_s
            rows.append(("extract() incl. bf16 files", dtype_name, e2e, stats.elapsed_s,
                         e2e * flops_per_token / 1e12, ref, peak))
            backend.close()

    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs at the end of the run")
    print(f"{'what':30} {'dtype':9} {'tok/s':>9} {'s':>7} {'TFLOP/s':>9} {'% matmul':>9} {'% peak':>7}")
    for what, dtype_name, tps, secs, tflops, ref, pk in rows:
        print(f"{what:30} {dtype_name:9} {'' if tps is None else f'{tps:,.0f}':>9} "
              f"{'' if secs is None else f'{secs:.2f}':>7} {tflops:9.4f} {100 * tflops / ref:8.1f}% "
              f"{100 * tflops / pk:6.1f}%")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
