"""Reconstruction benchmark: tokens/s of `reconstruct()` against raw tiktoken `encode_ordinary`.

Both run in the same process on the same texts (the prompt, reasoning and content of generated
answers of ~5,000 tokens, a mix of English reasoning, Python, Chinese and Markdown maths), with the
real Kimi-K2 vocabulary. Per core: one process, raw and reconstruct alternating batch by batch,
best of --repeat, in CPU seconds. All cores: a process pool of --workers (default: every core) on the same batches,
each worker with its tokenizer loaded once; and `draftgen tokens` end to end (read responses.jsonl,
the same warm pool, write the token store) on a run directory made of the same answers. The
reference for the pool rows is raw `encode_ordinary` in the same pool.
Target: reconstruction ≥ 0.75× raw per core, all cores used.

    python benchmarks/bench_reconstruct.py [--answers 400] [--workers N] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from draftgen.core.config_load import config_from_dict
from draftgen.core.tokens.reconstruct import Answer, answer_fields, reconstruct_record
from draftgen.core.tokens.template import load_template
from draftgen.core.tokens.tokenizer import bundled_kimi, bundled_kimi_path
from draftgen.core.tokens.workers import (
    WorkerSpec,
    _batches,
    _init_worker,
    ping,
    reconstruct_batch,
    reconstruct_dataset,
    worker_pool,
)

PASSAGES = {
    "reasoning": [
        "Let me think about this carefully. We need the number of ways to choose {a} items from {b}, "
        "which is C({b}, {a}) = {b}! / ({a}! ({b}-{a})!). ",
        "Wait, that is not right: the constraint says x + y <= {a}, so for each x in [0, {a}] there are "
        "{a} - x + 1 values of y. Summing gives ({a}+1)({a}+2)/2 = {c}. ",
        "Hmm, let me double-check with a small case. If n = {a}, the recursion f(n) = f(n-1) + 2f(n-2) "
        "gives f({a}) = {c}, which matches the closed form (2^(n+1) + (-1)^n) / 3. ",
        "The user asks for an efficient solution, so an O(n log n) sort followed by a two-pointer scan "
        "should work; the edge cases are an empty list and duplicates like [{a}, {a}, {b}]. ",
        "Actually, I should consider whether the function is called with negative inputs; the spec says "
        "values lie in [-{b}, {b}], so the modulo must be normalised: ((x % {a}) + {a}) % {a}. ",
    ],
    "code": [
        "def solve(nums: list[int], k: int = {a}) -> int:\n    \"\"\"Return the count of pairs summing to k.\"\"\"\n"
        "    seen: dict[int, int] = {{}}\n    total = 0\n    for x in nums:\n        total += seen.get(k - x, 0)\n"
        "        seen[x] = seen.get(x, 0) + 1\n    return total\n\n",
        "```python\nimport numpy as np\n\narr = np.arange({b}).reshape(-1, {a})\nprint(arr.sum(axis=1)[:5])  "
        "# row sums\n```\n\n",
        "for (int i = 0; i < {b}; ++i) {{\n    if (grid[i][j] == '#') continue;\n    dp[i][j] = std::min(dp[i-1][j], "
        "dp[i][j-1]) + cost[i][j];\n}}\n",
    ],
    "chinese": [
        "首先，我们需要理解题目的要求：给定一个长度为 {b} 的数组，求其中和为 {a} 的子数组个数。",
        "这个问题可以用前缀和加哈希表的方法在线性时间内解决，时间复杂度为 O(n)，空间复杂度也是 O(n)。",
        "因此，答案是 {c}。我们再验证一下边界情况：当数组为空时，结果应当为零。",
    ],
    "math": [
        "**Step {a}.** We have $\\int_0^{{{a}}} x^2 \\, dx = \\frac{{{a}^3}}{{3}}$, and therefore "
        "$\\sum_{{k=1}}^{{{b}}} k^2 = \\frac{{{b}({b}+1)(2\\cdot{b}+1)}}{{6}} = {c}$.\n\n",
        "| n | f(n) | ratio |\n|---|------|-------|\n| {a} | {c} | {b}.{a} |\n\n",
    ],
}


def passage(rng: random.Random, kind: str) -> str:
    a, b = rng.randint(2, 99), rng.randint(100, 9999)
    return rng.choice(PASSAGES[kind]).format(a=a, b=b, c=a * b + rng.randint(0, 999))


def text_of(rng: random.Random, chars: int, mix: dict[str, float]) -> str:
    kinds, weights = list(mix), list(mix.values())
    parts, n = [], 0
    while n < chars:
        p = passage(rng, rng.choices(kinds, weights)[0])
        parts.append(p)
        n += len(p)
    return "".join(parts)


def make_answers(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Response lines shaped like the reference run's: ~5,000-token answers, reasoning included."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = text_of(rng, rng.randint(300, 1500), {"reasoning": 1, "code": 1, "chinese": 0.3})
        reasoning = text_of(rng, rng.randint(8000, 16000), {"reasoning": 4, "math": 1, "chinese": 0.5, "code": 1})
        content = text_of(rng, rng.randint(3000, 7000), {"code": 2, "math": 1, "reasoning": 1})
        messages = [{"role": "user", "content": prompt}]
        if i % 5 == 0:
            messages.insert(0, {"role": "system", "content": "You are a careful assistant."})
        out.append({"id": f"b{i}", "messages": messages, "reasoning": reasoning, "content": content,
                    "finish_reason": "stop", "truncated": False, "usage": {"completion_tokens": 0}})
    return out


def raw_batch(records: list[Answer]) -> int:
    """Reference: tiktoken encode_ordinary over the same texts (answer_fields), tokens counted (in a worker too)."""
    encode = bundled_kimi().encoding.encode_ordinary
    n = 0
    for _, messages, reasoning, content in (rec[:4] for rec in records):
        for m in messages:
            n += len(encode(m["content"]))
        n += len(encode(reasoning)) + len(encode(content))
    return n


def recon_batch(records: list[Answer]) -> int:
    return sum(length for _, length, _ in reconstruct_batch(records)[2])


def paired(fns: dict[str, Any], repeat: int, clock: Any = time.perf_counter) -> dict[str, float]:
    """Best time of each function over `repeat` rounds, the functions alternating within a round so a
    busy machine slows them alike."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            t = clock()
            fn()
            best[name] = min(best[name], clock() - t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--answers", type=int, default=400)
    parser.add_argument("--workers", type=int, default=0, help="pool size (0: every core)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    workers = args.workers or cores

    tok = bundled_kimi()
    template = load_template("kimi-k2.5", tok)
    answers = make_answers(args.answers)
    # Billed counts as the model would report them, so the checks run their normal (passing) path.
    for rec in answers:
        rec["usage"]["completion_tokens"] = reconstruct_record(tok, template, rec).span_tokens
    spec = WorkerSpec(str(bundled_kimi_path()), False, "kimi-k2.5")
    _init_worker(spec)
    fields = [answer_fields(rec) for rec in answers]  # what a worker is sent
    batches = list(_batches(fields))
    raw_tokens = raw_batch(fields)
    recon_tokens = sum(recon_batch(b) for b in batches)

    # One core: per batch, raw and reconstruct alternate; the sums of per-batch bests (CPU time of this
    # process, so other load on the machine does not count) are compared.
    per_batch = [paired({"raw": partial(raw_batch, b), "recon": partial(recon_batch, b)}, args.repeat,
                        time.process_time) for b in batches]
    raw_1 = raw_tokens / sum(t["raw"] for t in per_batch)
    recon_1 = recon_tokens / sum(t["recon"] for t in per_batch)
    rows: list[tuple[str, float, float]] = [
        ("raw tiktoken encode_ordinary, 1 core", raw_1, 1.0),
        ("reconstruct() (render, encode, mask, checks), 1 core", recon_1, recon_1 / raw_1),
    ]

    tmp = Path(tempfile.mkdtemp(prefix="bench-reconstruct-"))
    try:
        config = config_from_dict({"tokenizer": {"path": str(bundled_kimi_path())}, "output": {"dir": "run"},
                                   "engine": {"workers": workers},
                                   "datasets": [{"name": "B", "prompts": "B.jsonl"}]}, tmp / "bench.toml")
        folder = tmp / "run" / "B"
        folder.mkdir(parents=True)
        (folder / "responses.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in answers))

        t = time.perf_counter()
        pool = worker_pool(config, workers)
        list(pool.map(ping, range(workers * 4)))  # every worker started, tokenizer loaded
        startup = time.perf_counter() - t
        with pool:
            def end_to_end() -> None:
                shutil.rmtree(folder / "tokens", ignore_errors=True)
                report = reconstruct_dataset(config, "B", workers=workers, pool=pool)
                assert report.checked == len(answers) and report.valid == len(answers), report.format()

            best = paired({"raw": lambda: sum(pool.map(raw_batch, batches)),
                           "recon": lambda: sum(pool.map(recon_batch, batches)),
                           "e2e": end_to_end}, args.repeat)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    raw_n = raw_tokens / best["raw"]
    rows += [
        (f"raw encode_ordinary, {workers} processes", raw_n, 1.0),
        (f"reconstruct batches, {workers} processes", recon_tokens / best["recon"],
         recon_tokens / best["recon"] / raw_n),
        (f"draftgen tokens end to end (read, {workers} processes, write)", recon_tokens / best["e2e"],
         recon_tokens / best["e2e"] / raw_n),
    ]

    print(f"\nreconstruction with the Kimi-K2 vocabulary: {len(answers):,} answers, {recon_tokens:,} tokens "
          f"({recon_tokens // len(answers):,} per answer), {cores} cores, best of {args.repeat} (alternating; "
          f"1-core rows per CPU second, pool rows per wall second)\n")
    header = ("what", "tokens/s", "× raw encode_ordinary (same processes)")
    width = max(len(r[0]) for r in rows)
    print(f"{header[0]:<{width}} | {header[1]:>12} | {header[2]}")
    print(f"{'-' * width} | {'-' * 12} | {'-' * len(header[2])}")
    for what, rate, ratio in rows:
        print(f"{what:<{width}} | {rate:>12,.0f} | {ratio:.2f}")
    print(f"\nworker start (once per `draftgen tokens` or run): {startup:.2f} s for {workers} processes. "
          f"Target: reconstruct ≥ 0.75× raw encode_ordinary per core, all cores used.")


if __name__ == "__main__":
    main()
