"""Merge benchmark: 100,000 generated answers of a few thousand tokens → merged/ (target ≤ 20 s).

Generates a run directory (8 datasets, responses.jsonl + tokens/ with a few percent of answers to
drop: truncated, invalid, duplicate prompt, not reconstructed, failed), merges it in a fresh
subprocess and reports wall time and that process's peak RSS. Then it does the same with text twice
as long (same token counts) to show memory does not grow with the text. The reference measured in
the same run is the I/O floor: copying the same input files (shutil.copyfile: sendfile, a real
copy of the bytes, never a reflink), then fsyncing the copies as the merge fsyncs its output. Copy
and merge alternate, --repeats times, so load on the shared machine falls on both; the ratio is
taken per pair. Drop-caches is not available here: inputs are in the page cache for both. Data are
written under --dir (default: the system temp folder) and deleted afterwards.

    python benchmarks/bench_merge.py [--samples 100000] [--tokens 2000] [--text-kb 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson

DATASETS = ("B1_code", "B2_reasoning", "B3_math", "B4_mixturethoughts", "B5_chat", "B6_science", "B7_multi",
            "B8_sweagent")
VOCAB_SIZE = 163_840


def word_pool(rng: np.random.Generator, size: int) -> str:
    """`size` characters of word-like text (words of 2-9 letters, spaces, some newlines)."""
    letters = np.frombuffer(b"etaoinshrdlucmfwypvbgkqjxz", dtype=np.uint8)
    words = ["".join(chr(c) for c in rng.choice(letters, int(rng.integers(2, 10)))) for _ in range(4000)]
    picks = rng.integers(0, len(words), size // 5)
    seps = np.where(rng.random(len(picks)) < 0.03, "\n", " ")
    text = "".join(w + s for w, s in zip((words[i] for i in picks), seps))
    return (text * (size // len(text) + 1))[:size]


def generate(run: Path, samples: int, tokens: int, text_bytes: int, seed: int = 0) -> dict[str, int]:
    """Write the datasets; returns counts of what was generated."""
    from draftgen.core.tokens.store import TokenWriter

    rng = np.random.default_rng(seed)
    pool = word_pool(rng, 8 << 20)
    per_ds = samples // len(DATASETS)
    generated = {"answers": 0, "tokens": 0}
    earlier_prompts: list[list[dict[str, str]]] = []
    for d, name in enumerate(DATASETS):
        folder = run / name
        folder.mkdir(parents=True)
        n = per_ds if d < len(DATASETS) - 1 else samples - per_ds * (len(DATASETS) - 1)
        lengths = rng.integers(tokens // 2, tokens * 3 // 2 + 1, n)
        all_ids = rng.integers(0, VOCAB_SIZE, int(lengths.sum()), dtype=np.uint32)
        text_len = (text_bytes * rng.uniform(0.5, 1.5, n)).astype(np.int64)
        offsets = rng.integers(0, len(pool) - 2 * text_bytes - 400, (n, 3))
        fate = rng.random(n)  # < .02 truncated, < .03 invalid, < .04 duplicate prompt, < .045 no tokens
        with open(folder / "responses.jsonl", "wb", buffering=1 << 20) as out, TokenWriter(folder / "tokens") as tw:
            pos = 0
            for i in range(n):
                sid = f"{name}-{i}"
                if fate[i] < 0.04 and fate[i] >= 0.03 and earlier_prompts:
                    messages = earlier_prompts[int(rng.integers(0, len(earlier_prompts)))]
                else:
                    o = offsets[i, 0]
                    messages = [{"role": "user", "content": f"{sid}: {pool[o:o + 300]}"}]
                    if i % 10 == 0:
                        messages.insert(0, {"role": "system", "content": "You are a careful assistant."})
                    if i % 97 == 0:
                        earlier_prompts.append(messages)
                r_len = int(text_len[i] * 0.7)
                c_len = int(text_len[i]) - r_len
                truncated = bool(fate[i] < 0.02)
                out.write(orjson.dumps({
                    "id": sid, "messages": messages,
                    "reasoning": pool[offsets[i, 1]:offsets[i, 1] + r_len],
                    "content": pool[offsets[i, 2]:offsets[i, 2] + c_len],
                    "tool_calls": None, "finish_reason": "length" if truncated else "stop",
                    "native_finish_reason": "stop", "provider": "Together", "model": "moonshotai/kimi-k2.5",
                    "generation_id": f"gen-{d}-{i}",
                    "usage": {"prompt_tokens": 120, "completion_tokens": int(lengths[i]) - 120,
                              "reasoning_tokens": int(lengths[i]) // 2, "cost": 0.0021},
                    "latency_s": 41.5, "attempts": 1, "truncated": truncated, "empty_content": False,
                    "ts": 1_700_000_000.0 + i,
                }) + b"\n")
                length = int(lengths[i])
                if not 0.04 <= fate[i] < 0.045:
                    valid = not 0.02 <= fate[i] < 0.03
                    mask = np.zeros(length, dtype=np.uint8)
                    mask[120:] = 1
                    tw.append(sid, all_ids[pos:pos + length], mask, {
                        "answer_start": 120, "answer_end": length, "valid": valid,
                        "failed_checks": [] if valid else ["count"], "span_tokens": length - 120,
                        "billed_tokens": length - 120, "count_diff": 0, "truncated": truncated,
                        "source": "reconstructed"})
                pos += length
                generated["tokens"] += length
        with open(folder / "failures.jsonl", "wb") as out:
            for i in range(n // 200):
                out.write(orjson.dumps({"id": f"{name}-failed-{i}", "messages": [], "error_kind": "400",
                                        "status": 400, "message": "bad request", "attempts": 1}) + b"\n")
        generated["answers"] += n
    return generated


def write_config(root: Path) -> Path:
    lines = ['[output]', 'dir = "run"', '[merge]', 'seed = 42']
    for name in DATASETS:
        lines += ["[[datasets]]", f'name = "{name}"', f'prompts = "{name}.jsonl"']
    path = root / "draftgen.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def peak_rss_mb() -> float:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and exec,
    so a child would report the (bigger) parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(config_path: str, baseline: bool) -> None:
    """Runs in the measured subprocess: one merge (or, for the baseline, only the imports)."""
    from draftgen.core.config_load import load_config
    from draftgen.core.live.snapshot import StageProgress
    from draftgen.core.merge.merge import merge

    config = load_config(config_path)
    started = time.perf_counter()
    marks: dict[str, float] = {}

    def phase(p: StageProgress) -> None:  # when pass 1 ends ("read") and pass 2 ends ("finishing")
        marks.setdefault(p.message, time.perf_counter() - started)

    result: dict[str, float] = {"samples": 0, "tokens": 0, "dropped": 0}
    if not baseline:
        stats = merge(config, phase)
        result = {"samples": stats.samples, "tokens": stats.tokens, "dropped": sum(stats.dropped.values())}
    result["seconds"] = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["cpu_s"] = usage.ru_utime + usage.ru_stime
    result["scan_s"] = marks.get("read", 0.0)
    result["write_s"] = marks.get("finishing", 0.0) - result["scan_s"]
    result["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(result))


def measure(config: Path, baseline: bool = False) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--worker", str(config)] + (["--baseline"] if baseline else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def io_floor(run: Path, scratch: Path) -> tuple[float, float]:
    """Seconds to copy every dataset file once, then to fsync the copies: what any merge of these
    bytes must at least spend."""
    started = time.perf_counter()
    copies = []
    for src in run.glob("*/**/*"):
        if src.is_file() and "merged" not in src.parts:
            dst = scratch / src.relative_to(run)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            copies.append(dst)
    copied = time.perf_counter()
    for dst in copies:
        fd = os.open(dst, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    synced = time.perf_counter()
    shutil.rmtree(scratch)
    os.sync()  # the removal's writeback must not land in the merge's time
    return copied - started, synced - copied


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--tokens", type=int, default=2000, help="mean tokens per sample")
    parser.add_argument("--text-kb", type=float, default=8.0, help="mean reasoning+content KB per answer")
    parser.add_argument("--repeats", type=int, default=3, help="copy/merge pairs per text size")
    parser.add_argument("--dir", type=Path, default=None, help="where to generate (deleted afterwards)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.baseline)
        return

    rows = []
    for scale in (1, 2):
        root = Path(tempfile.mkdtemp(prefix="bench-merge-", dir=args.dir))
        try:
            started = time.perf_counter()
            generate(root / "run", args.samples, args.tokens, int(args.text_kb * 1024 * scale))
            generated_s = time.perf_counter() - started
            config = write_config(root)
            input_gb = tree_bytes(root / "run") / 1e9
            os.sync()  # the generator's writeback must not land in the first copy's time
            base = measure(config, baseline=True)
            for _ in range(args.repeats):
                copy_s, fsync_s = io_floor(root / "run", root / "copy")
                result = measure(config)
                output_gb = tree_bytes(root / "run" / "merged") / 1e9
                rows.append((f"{args.text_kb * scale:.0f} KB", input_gb, output_gb, generated_s, copy_s, fsync_s,
                             result, base))
                os.sync()
        finally:
            shutil.rmtree(root, ignore_errors=True)

    print(f"\nmerge of {args.samples:,} answers, {len(DATASETS)} datasets, ~{args.tokens:,} tokens each "
          f"(inputs in the page cache; target ≤ 20 s, memory independent of text size; load average "
          f"{os.getloadavg()[0]:.1f}).\n"
          f"Reference, alternating with the merges: copying the same input files once (shutil.copyfile, "
          f"page cache), then fsyncing the copies.\n")
    header = ("text/answer", "inputs GB", "merged GB", "kept", "dropped", "copy s", "copy+fsync s",
              "merge s", "merge CPU s", "pass 1 s", "pass 2 s", "fsync+switch s", "merge / copy+fsync",
              "passes / copy", "peak RSS MB", "RSS over imports MB")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("-" * (len(h) + 2) for h in header) + "|")
    for text, in_gb, out_gb, _gen_s, copy_s, fsync_s, r, base in rows:
        passes = r["scan_s"] + r["write_s"]
        print("| " + " | ".join((text, f"{in_gb:.2f}", f"{out_gb:.2f}", f"{r['samples']:,}", f"{r['dropped']:,}",
                                 f"{copy_s:.1f}", f"{copy_s + fsync_s:.1f}", f"{r['seconds']:.1f}",
                                 f"{r['cpu_s'] - base['cpu_s']:.1f}",
                                 f"{r['scan_s']:.1f}", f"{r['write_s']:.1f}", f"{r['seconds'] - passes:.1f}",
                                 f"{r['seconds'] / (copy_s + fsync_s):.2f}x", f"{passes / copy_s:.2f}x",
                                 f"{r['peak_rss_mb']:.0f}", f"{r['peak_rss_mb'] - base['peak_rss_mb']:.0f}")) + " |")


if __name__ == "__main__":
    main()
