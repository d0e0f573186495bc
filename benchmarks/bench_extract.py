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

    python benchmarks/bench_extract.py --writer [--dir DIR]   # the hidden-state writer alone

`--writer` measures the file writer (core/extract/writer.py) against the disk: Kimi-size rows
(H 7168, aux 3x7168, 4,096-token samples, bf16; ids and mask int64) and 8B-size rows (H 4096),
written to DIR (default: a temporary folder under benchmarks/, the filesystem the run writes to),
each row against a plain sequential write + fsync of the same number of bytes in files of the same
size, one thread, the bytes already in memory (measured before, between and after the pooled runs).

- "pooled writer" (the `writer / raw write` line) is the writer as a GPU backend feeds it
  (DeviceHandOver): on a GPU `submit` reduces the finite flags on the device and DMA-copies the rows
  into pinned host memory, no host pass over the rows, so here the rows are in host memory and their
  flags are reduced before the clock starts. Timed: `submit` and everything the pool's threads do per
  file, the host's whole share on a GPU machine: torch.save (pickling, its CRC-32 of every record,
  the writes into the page cache), fsync, rename, until the last file is renamed.
- "pooled writer, CPU rows": CPU tensors (the hf backend on a CPU): the finite check (`aminmax`)
  then runs on the host, in the pool, and is timed too.
- "released serial path": isfinite, clone, torch.save into a BytesIO, write + fsync, one file after
  the other in the caller; "pooled writer, compress": 1,024-token samples through gzip, as from a GPU.

Files are deleted after each row, so the disk holds one row at a time (at most ~4 GB).

    python benchmarks/bench_extract.py --gzip          # gzip level 1 on a Kimi-size row, per thread

`--gzip` times the writer's compression (layout.GZ_LEVEL) of a Kimi-size sample (4,096 tokens, bf16,
H 7168) on 1 and on writer.THREADS threads against a plain copy of the same bytes: the rate
`compress = true` reaches (plan.GZ_BYTES_PER_S_PER_THREAD is this figure; docs/extraction.md).

    python benchmarks/bench_extract.py --handover      # GPU only: the D2H copy on its own stream

`--handover` runs batches of a stand-in forward (bf16 matmuls giving Kimi-size rows on the GPU) and
hands each to the writer's staging (writer._stage: finite flags, pinned copies) with the copies on
the compute stream and on the writer's own stream, against the forward alone, measured in the same
run: the share of GPU time the hand-over costs each way. Without a GPU it says so and measures nothing.
"""

from __future__ import annotations

import argparse
import gzip
import io
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftgen.core.config_load import config_from_dict  # noqa: E402
from draftgen.core.extract import (
    extract,  # noqa: E402
    layout,  # noqa: E402
    writer,  # noqa: E402
)
from draftgen.core.extract.hf_backend import HFBackend  # noqa: E402
from draftgen.core.extract.model_info import eagle3_layers  # noqa: E402
from draftgen.core.extract.writer import Item, PooledWriter  # noqa: E402
from draftgen.core.files import write_atomic  # noqa: E402
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


def synthetic_batch(hidden: int, tokens: int, count: int) -> list[layout.SampleTensors]:
    """`count` distinct samples of activation-like bf16 rows, each tensor owning its storage."""
    g = torch.Generator().manual_seed(hidden)
    out = []
    for _ in range(count):
        ids = torch.randint(0, 160_000, (tokens,), generator=g)
        mask = (torch.rand(tokens, generator=g) < 0.7).to(torch.int64)
        out.append(layout.SampleTensors(ids, mask, torch.randn(tokens, hidden, generator=g).to(torch.bfloat16),
                                        torch.randn(tokens, 3 * hidden, generator=g).to(torch.bfloat16)))
    return out


def raw_write(folder: Path, file_bytes: int, files: int) -> float:
    """Seconds for a plain sequential write + fsync of `files` files of `file_bytes` each."""
    data = memoryview(os.urandom(1 << 24) * (file_bytes // (1 << 24) + 1))[:file_bytes]
    start = time.perf_counter()
    for k in range(files):
        path = folder / f"raw_{k}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        view = data
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.close(fd)
    elapsed = time.perf_counter() - start
    for k in range(files):
        (folder / f"raw_{k}.bin").unlink()
    return elapsed


def serial_write(folder: Path, batch: list[layout.SampleTensors], files: int, compress: bool) -> tuple[float, int]:
    """The released path, one file after the other in the caller: isfinite, clones, BytesIO, write + fsync."""
    start, nbytes = time.perf_counter(), 0
    for k in range(files):
        s = batch[k % len(batch)]
        assert bool(torch.isfinite(s.hidden).all()) and bool(torch.isfinite(s.aux).all())
        buf = io.BytesIO()
        torch.save({"input_ids": s.input_ids.to(torch.int64).reshape(-1).clone(),
                    "loss_mask": s.loss_mask.to(torch.int64).reshape(-1).clone(),
                    "hidden_state": s.hidden.to(torch.bfloat16).unsqueeze(0).clone(),
                    "aux_hidden_state": s.aux.to(torch.bfloat16).unsqueeze(0).clone()}, buf)
        data = buf.getvalue()
        if compress:
            data = gzip.compress(data, compresslevel=layout.GZ_LEVEL)
        path = layout.sample_path(folder, k, compress=compress)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data, fsync=True)
        nbytes += len(data)
    return time.perf_counter() - start, nbytes


class DeviceHandOver(PooledWriter):
    """The pooled writer as a GPU backend feeds it (the specforge backend's rows stay on the GPU).

    There `submit` (writer._stage's CUDA branch) reduces one finite flag per sample on the device,
    fetches the small flag tensor and starts DMA copies of the rows into pinned host memory: no pass
    of the host's CPU over the rows. Here the rows are already in host memory, owning their storage as
    the pinned copies do, and their flags are reduced once before the clock starts (the device's
    work). What the pool's threads then do per file is production code, unchanged and timed."""

    def __init__(self, root: Path, *, compress: bool, flags: dict[int, bool]) -> None:
        super().__init__(root, compress=compress)
        self._flags = flags

    def _stage(self, items, stream=None):  # type: ignore[override]
        return [self._flags[id(item.sample)] for item in items], [item.sample for item in items], None


def device_flags(batch: list[layout.SampleTensors]) -> dict[int, bool]:
    """The flags a GPU would reduce for these rows, keyed by the sample object."""
    return {id(s): flag for s, flag in zip(batch, layout.finite_flags(batch).tolist(), strict=True)}


def pooled_write(folder: Path, batch: list[layout.SampleTensors], files: int, compress: bool,
                 on_device: bool = True) -> tuple[float, int]:
    """The pooled writer fed batch after batch, as the runner does; until the last file is renamed.

    `on_device`: rows handed over as from a GPU (DeviceHandOver); otherwise as CPU tensors, whose
    finite check then runs on the host, in the pool (the hf backend on a CPU)."""
    pool = (DeviceHandOver(folder, compress=compress, flags=device_flags(batch)) if on_device
            else PooledWriter(folder, compress=compress))
    start, nbytes, k = time.perf_counter(), 0, 0
    try:
        while k < files:
            items = [Item(k + j, f"s{k + j}", s) for j, s in enumerate(batch[: files - k])]
            pool.submit(items)
            k += len(items)
            nbytes += sum(done.nbytes for done in pool.completed())
        nbytes += sum(done.nbytes for done in pool.drain())
    finally:
        pool.close()
    return time.perf_counter() - start, nbytes


def writer_main(args: argparse.Namespace) -> None:
    base = Path(args.dir) if args.dir else Path(__file__).resolve().parent
    base.mkdir(parents=True, exist_ok=True)
    tokens, per_batch = 4096, 4  # extract.batch_tokens 16,384 = four 4,096-token samples per forward
    sizes = [("Kimi-K2.5", 7168), ("8B", 4096)]
    need = args.samples * tokens * (4 * 7168 * 2 + 16)
    free = shutil.disk_usage(base).free
    print(f"writing under {base}: {free / 1e9:.1f} GB free, at most {need / 1e9:.1f} GB held at once")
    if free < 2 * need:
        sys.exit(f"{base}: not enough free space for the benchmark ({free / 1e9:.1f} GB free, "
                 f"want {2 * need / 1e9:.1f})")
    rows = []
    with tempfile.TemporaryDirectory(dir=base, prefix="bench-writer-") as tmp:
        folder = Path(tmp)
        for name, hidden in sizes:
            start = time.perf_counter()
            batch = synthetic_batch(hidden, tokens, per_batch)
            print(f"  {name}: {per_batch} synthetic samples made in {time.perf_counter() - start:.1f} s", flush=True)
            n_new, n_slow = args.samples, max(per_batch, args.samples // 4)  # the slow rows write fewer files
            file_bytes = layout.write_sample(folder, 0, batch[0], compress=False)
            layout.sample_path(folder, 0).unlink()
            results = {}
            # Raw and pooled alternate, half the files each time: on a shared machine the load drifts.
            half = max(per_batch, n_new // 2)
            raw_secs = [raw_write(folder, file_bytes, half)]
            pooled_secs, pooled_bytes = 0.0, 0
            for _ in range(2):
                secs, nbytes = pooled_write(folder, batch, half, False)
                shutil.rmtree(folder / "rows_0-2000")
                pooled_secs, pooled_bytes = pooled_secs + secs, pooled_bytes + nbytes
                raw_secs.append(raw_write(folder, file_bytes, half))
            results["pooled writer"] = (2 * half, pooled_bytes, pooled_secs, tokens)
            print(f"  {name}: raw {[round(half * file_bytes / t / 1e9, 3) for t in raw_secs]} GB/s, pooled "
                  f"{pooled_bytes / pooled_secs / 1e9:.3f} GB/s", flush=True)
            # gzip runs at ~10-20 MB/s a core on bf16 activations: its row writes 1,024-token samples.
            short = [layout.SampleTensors(*(t[:1024].clone() for t in (s.input_ids, s.loss_mask, s.hidden, s.aux)))
                     for s in batch]
            for what, fn, rows_in, files, compress in (
                    ("pooled writer, CPU rows", lambda *a: pooled_write(*a, on_device=False), batch, half, False),
                    ("released serial path", serial_write, batch, n_slow, False),
                    ("pooled writer, compress", pooled_write, short, per_batch, True)):
                secs, nbytes = fn(folder, rows_in, files, compress)
                results[what] = (files, nbytes, secs, int(rows_in[0].input_ids.shape[0]))
                print(f"  {name}: {what}: {files} files, {nbytes / secs / 1e9:.3f} GB/s", flush=True)
                shutil.rmtree(folder / "rows_0-2000")
            raw_time = sum(raw_secs) * 2 * half / (len(raw_secs) * half)  # seconds for 2*half files
            raw_rate = 2 * half * file_bytes / raw_time
            rows.append((name, hidden, "plain sequential write + fsync", 2 * half, 2 * half * file_bytes,
                         raw_time, raw_rate, tokens))
            for what, (files, nbytes, secs, toks) in results.items():
                rows.append((name, hidden, what, files, nbytes, secs, raw_rate, toks))
            del batch, short
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs at the end; torch threads "
          f"{torch.get_num_threads()}; pool: {writer.THREADS} threads, {writer.DEPTH} batches of {per_batch} held")
    print(f"{'size':10} {'what':32} {'files':>5} {'GB':>6} {'s':>6} {'GB/s':>6} {'tok/s':>8} {'x raw':>6}")
    for name, hidden, what, files, nbytes, secs, raw_rate, toks in rows:
        rate = nbytes / secs
        print(f"{name + ' H' + str(hidden):10} {what:32} {files:5d} {nbytes / 1e9:6.2f} {secs:6.2f} "
              f"{rate / 1e9:6.3f} {files * toks / secs:8,.0f} {rate / raw_rate:6.2f}")
    for name, hidden, what, _files, nbytes, secs, raw_rate, _ in rows:
        if what == "pooled writer":
            print(f"{name} (H {hidden}) writer / raw write: {nbytes / secs / raw_rate:.2f}")


def gzip_main(args: argparse.Namespace) -> None:
    """gzip level 1 (the writer's) on a Kimi-size sample, 1 and writer.THREADS threads, against a plain copy."""
    import concurrent.futures
    rng = np.random.default_rng(0)
    tokens, hidden = 4096, 7168
    sample = layout.SampleTensors(torch.from_numpy(rng.integers(0, 160_000, tokens)),
                                  torch.ones(tokens, dtype=torch.long),
                                  torch.randn(tokens, hidden).to(torch.bfloat16),
                                  torch.randn(tokens, 3 * hidden).to(torch.bfloat16))
    buf = io.BytesIO()
    torch.save(layout.sample_dict(sample), buf)
    data = buf.getvalue()

    def one() -> int:
        return len(gzip.compress(data, compresslevel=layout.GZ_LEVEL, mtime=0))

    def copy() -> int:
        return len(bytes(bytearray(data)))

    print(f"one Kimi-size sample: {tokens:,} tokens x (H + 3H) bf16 = {len(data) / 1e6:.0f} MB; gzip level "
          f"{layout.GZ_LEVEL}\n")
    print(f"{'':<28}{'threads':>8}{'MB/s':>10}{'tok/s':>10}{'ratio':>8}")
    for name, fn in (("plain copy (reference)", copy), ("gzip", one)):
        for threads in (1, writer.THREADS):
            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                start = time.perf_counter()
                sizes = list(pool.map(lambda _k, f=fn: f(), range(threads * 2)))
                elapsed = time.perf_counter() - start
            rate = len(data) * len(sizes) / elapsed
            print(f"{name:<28}{threads:>8}{rate / 1e6:>10.0f}{rate * tokens / len(data):>10,.0f}"
                  f"{sizes[0] / len(data):>8.3f}")


def handover_main(args: argparse.Namespace) -> None:
    """The D2H hand-over on the compute stream vs the writer's own stream, against the forward alone (GPU only)."""
    if not torch.cuda.is_available():
        print("--handover needs a CUDA GPU (none here): the copy stream's overlap was not measured")
        return
    dev, hidden, rows, width, batches = torch.device("cuda"), 7168, 4, 2048, 12
    weight = torch.randn(hidden, hidden, device=dev, dtype=torch.bfloat16) / hidden ** 0.5

    def forward() -> torch.Tensor:
        x = torch.randn(rows * width, hidden, device=dev, dtype=torch.bfloat16)
        outs = []
        for _layer in range(16):  # a stand-in for the model: enough matmul time per batch to hide a copy
            x = torch.tanh(x @ weight)
            outs.append(x)
        return torch.cat([outs[-1], outs[1], outs[7], outs[12]], dim=-1).reshape(rows, width, 4 * hidden)

    def run(mode: str) -> float:
        pool = PooledWriter(Path(tempfile.gettempdir()), compress=False)
        pool.copy_on_own_stream = mode == "own stream"
        held: list[object] = []
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(batches):
            out = forward()
            if mode == "forward alone":
                continue
            items = [Item(r, f"s{r}", layout.SampleTensors(torch.zeros(width, dtype=torch.long),
                                                            torch.ones(width, dtype=torch.long),
                                                            out[r, :, :hidden], out[r, :, hidden:]))
                     for r in range(rows)]
            held.append(writer._stage(items, pool._stream_for(items)))
            if len(held) > 2:  # the writer's depth: the oldest batch's copies must have landed
                held.pop(0)[2].synchronize()  # type: ignore[index]
        torch.cuda.synchronize()
        pool.close()
        return time.perf_counter() - start

    run("own stream")  # warm-up: kernels, pinned-memory pool
    results = {mode: run(mode) for mode in ("forward alone", "compute stream", "own stream")}
    base = results["forward alone"]
    print(f"{batches} batches of {rows} x {width} tokens, rows [T, 4 x {hidden}] bf16 "
          f"({rows * width * 4 * hidden * 2 / 1e9:.2f} GB per batch) on {torch.cuda.get_device_name()}\n")
    for mode, elapsed in results.items():
        print(f"{mode:<16}{elapsed:>8.3f} s{'' if mode == 'forward alone' else f'  +{elapsed / base - 1:.1%}':>10}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--writer", action="store_true", help="measure the hidden-state writer against the disk")
    ap.add_argument("--gzip", action="store_true", help="gzip's rate on a Kimi-size sample (compress = true)")
    ap.add_argument("--handover", action="store_true", help="GPU: the D2H copy on its own stream vs the compute one")
    ap.add_argument("--dir", default=None, help="--writer: the folder to write in (default: under benchmarks/)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--samples", type=int, default=None, help="default 24; --writer: files per row, 16")
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's peak; estimated if omitted")
    args = ap.parse_args()
    if args.gzip:
        gzip_main(args)
        return
    if args.handover:
        handover_main(args)
        return
    if args.writer:
        args.samples = args.samples or 16
        writer_main(args)
        return
    args.samples = args.samples or 24

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
            from draftgen.core.extract.plan import plan_batches
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
