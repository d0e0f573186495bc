"""`draftgen prompts build`: real parquet, arrow, save_to_disk and JSONL files made here, read through
the `datasets` library, measured with the bundled Kimi tokenizer, written, and loaded back."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import pytest

datasets = pytest.importorskip("datasets")

from draftgen.cli.main import main  # noqa: E402
from draftgen.core import dedupe  # noqa: E402
from draftgen.core.config_load import load_config  # noqa: E402
from draftgen.core.generate.loop.prompt_files import read_prompts  # noqa: E402
from draftgen.core.generate.loop.prompts import Prompt  # noqa: E402
from draftgen.core.promptsets import presets  # noqa: E402
from draftgen.core.promptsets.build import BuildError, BuildOptions, build, prompt_tokens  # noqa: E402
from draftgen.core.promptsets.sources import SourceError, open_source, parse_source, stay_offline  # noqa: E402
from draftgen.core.promptsets.split import suggest_threshold  # noqa: E402
from draftgen.core.tokens.template import load_template  # noqa: E402
from draftgen.core.tokens.tokenizer import bundled_kimi, bundled_kimi_path  # noqa: E402


@pytest.fixture(autouse=True)
def _hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The datasets library's arrow cache goes to the test's folder, never the user's; the offline
    # switches the command sets are put back after each test.
    import huggingface_hub.constants as hub_constants
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets-cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", datasets.config.HF_HUB_OFFLINE)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", hub_constants.HF_HUB_OFFLINE)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")


def _sharegpt(i: int) -> dict:
    return {"conversations": [{"from": "system", "value": "Be brief."},
                              {"from": "human", "value": f"What is {i} squared?"},
                              {"from": "gpt", "value": f"{i * i} (the dataset's own answer)"},
                              {"from": "human", "value": "And cubed?"},
                              {"from": "gpt", "value": "another answer"}]}


def _openai(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Write a haiku about the number {i}."},
                         {"role": "assistant", "content": "old answer"}], "source": "x"}


def _alpaca(i: int) -> dict:
    return {"instruction": f"Translate sentence {i} to French.", "input": "" if i % 2 else f"The cat {i}.",
            "output": "Le chat."}


def make_parquet(tmp: Path, rows: list[dict], name: str = "chat.parquet") -> Path:
    path = tmp / name
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def make_arrow(tmp: Path, rows: list[dict], name: str = "msgs") -> Path:
    """A plain .arrow file (the stream format datasets writes), taken out of a save_to_disk folder."""
    folder = tmp / f"{name}-saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    (arrow,) = folder.glob("*.arrow")
    path = tmp / f"{name}.arrow"
    arrow.rename(path)
    return path


def make_saved(tmp: Path, rows: list[dict], name: str = "alpaca") -> Path:
    folder = tmp / name
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(folder))
    return folder


def make_jsonl(tmp: Path, rows: list[dict], name: str = "plain.jsonl") -> Path:
    path = tmp / name
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def _opts(tmp: Path, sources: list[str], **kw) -> BuildOptions:
    tok = bundled_kimi()
    kw.setdefault("out_dir", tmp / "prompts")
    return BuildOptions(sources=[parse_source(s) for s in sources], tokenizer=tok,
                        template=load_template("kimi-k2.5", tok), **kw)


def _read(path: Path) -> list[Prompt]:
    items = list(read_prompts(path))
    assert all(isinstance(p, Prompt) for p in items), items  # every written line is a usable prompt
    return items  # type: ignore[return-value]


def test_each_preset_keeps_only_the_prompt_side(tmp_path: Path) -> None:
    sources = [str(make_parquet(tmp_path, [_sharegpt(i) for i in range(6)])),
               str(make_arrow(tmp_path, [_openai(i) for i in range(5)])),
               str(make_saved(tmp_path, [_alpaca(i) for i in range(4)])),
               str(make_jsonl(tmp_path, [{"question": f"Why is the sky blue, take {i}?", "answer": "Rayleigh"}
                                         for i in range(3)]))]
    result = build(_opts(tmp_path, sources, split="off"))
    by_name = {d.name: _read(d.path) for d in result.datasets}
    assert {s.name: s.mapping for s in result.sources} == {
        "chat": "conversations(conversations)", "msgs": "conversations(messages)",
        "alpaca": "instruction(instruction, input=input)", "plain": "text(question)"}

    chat = by_name["chat"]
    assert len(chat) == 6
    # sharegpt: the system turn and the first human turn; every gpt turn (the dataset's answers) dropped
    assert chat[2].messages == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "What is 2 squared?"}]
    assert [p.messages for p in by_name["msgs"]][3] == [{"role": "user",
                                                         "content": "Write a haiku about the number 3."}]
    alpaca = {p.id: p.messages[0]["content"] for p in by_name["alpaca"]}
    assert alpaca["alpaca:train:0"] == "Translate sentence 0 to French.\n\nThe cat 0."
    assert alpaca["alpaca:train:1"] == "Translate sentence 1 to French."  # empty input: no blank line
    assert [p.messages for p in by_name["plain"]][0] == [{"role": "user", "content": "Why is the sky blue, take 0?"}]
    for prompts in by_name.values():
        assert all(m["role"] != "assistant" for p in prompts for m in p.messages)


def test_turns_last_keeps_history_up_to_the_last_user_turn(tmp_path: Path) -> None:
    src = str(make_parquet(tmp_path, [_sharegpt(i) for i in range(2)]))
    result = build(_opts(tmp_path, [src], split="off", turns="last"))
    messages = _read(result.datasets[0].path)[0].messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[-1]["content"] == "And cubed?"


def test_explicit_mapping(tmp_path: Path) -> None:
    rows = [{"q": f"Prove lemma {i}.", "ctx": f"Context {i}.", "persona": "You are a mathematician.",
             "solution": "QED"} for i in range(4)]
    src = str(make_jsonl(tmp_path, rows, "lemmas.jsonl"))
    mapping = presets.parse_mapping("prompt=q,input=ctx,system=persona")
    result = build(_opts(tmp_path, [src], split="off", mapping=mapping))
    first = _read(result.datasets[0].path)[0]
    assert first.id == "lemmas:train:0"
    assert first.messages == [{"role": "system", "content": "You are a mathematician."},
                              {"role": "user", "content": "Prove lemma 0.\n\nContext 0."}]
    with pytest.raises(presets.MappingError, match="no column 'nope'.*columns: q, ctx, persona, solution"):
        build(_opts(tmp_path, [src], split="off", mapping={"prompt": "nope"}, out_dir=tmp_path / "x"))
    with pytest.raises(presets.MappingError, match="unknown key 'answer'"):
        presets.parse_mapping("answer=solution")


def test_ids_are_stable_across_runs_and_sample_sizes(tmp_path: Path) -> None:
    src = str(make_parquet(tmp_path, [_sharegpt(i) for i in range(200)]))

    def ids(out: str, n: int, seed: int = 7) -> dict[str, list]:
        result = build(_opts(tmp_path, [src], split="off", n=n, seed=seed, out_dir=tmp_path / out))
        return {p.id: p.messages for p in _read(result.datasets[0].path)}

    first, again = ids("a", 50), ids("b", 50)
    assert first == again and len(first) == 50
    bigger = ids("c", 80)
    assert set(first) < set(bigger)  # a larger sample with the same seed extends the smaller one
    for pid, messages in first.items():  # an id always names the same row, whatever the sample
        row = int(pid.rsplit(":", 1)[1])
        assert messages[1]["content"] == f"What is {row} squared?"
    assert set(ids("d", 50, seed=8)) != set(first)  # the seed chooses the sample


def test_duplicates_within_and_across_sources_and_existing_files(tmp_path: Path) -> None:
    a = [{"prompt": "Explain recursion."}, {"prompt": "Explain recursion."},            # exact duplicate
         {"prompt": "  EXPLAIN   recursion. "},                                          # same normalised text
         {"prompt": "Ｅｘｐｌａｉｎ recursion."},                                           # full-width: NFKC
         {"prompt": "Explain iteration."}]
    b = [{"prompt": "explain ITERATION."}, {"prompt": "What is a monad?"}]
    existing = make_jsonl(tmp_path, [{"id": "old-1", "prompt": "What is a   monad?"}], "old.jsonl")
    sa, sb = make_jsonl(tmp_path, a, "a.jsonl"), make_jsonl(tmp_path, b, "b.jsonl")
    result = build(_opts(tmp_path, [str(sa), str(sb)], split="off", existing=[existing]))
    stats = {s.name: s for s in result.sources}
    assert stats["a"].kept == 2 and stats["b"].kept == 0
    assert stats["a"].dropped["duplicate_exact"] + stats["a"].dropped["duplicate_normalised"] == 3
    assert stats["b"].dropped["duplicate_normalised"] == 2  # one across sources, one against old.jsonl
    assert [d.name for d in result.datasets] == ["a"]
    kept = [p.messages for p in _read(result.datasets[0].path)]
    assert len({dedupe.prompt_key(m) for m in kept}) == 2


def test_the_normalised_key_keeps_roles_apart() -> None:
    user = [{"role": "user", "content": "Hello there"}]
    assert dedupe.prompt_key(user) == dedupe.prompt_key([{"role": "user", "content": " hello\n\tTHERE "}])
    assert dedupe.prompt_key(user) != dedupe.prompt_key([{"role": "system", "content": "Hello there"},
                                                          {"role": "user", "content": ""}])
    assert dedupe.prompt_key(user) != dedupe.prompt_key([{"role": "user", "content": "Hello, there"}])
    assert dedupe.exact_key(user) != dedupe.exact_key([{"role": "user", "content": "hello there"}])


def test_suggested_threshold_separates_two_groups() -> None:
    short = [40 + i % 30 for i in range(300)]
    long = [3000 + 50 * (i % 40) for i in range(60)]
    cut = suggest_threshold(short + long)
    assert cut is not None and max(short) < cut <= min(long)
    assert cut == 450  # Otsu on log2: midway between 69 and 3,000 is 455, rounded down to 2 digits
    assert suggest_threshold([100] * 10) is None
    assert suggest_threshold([]) is None


def test_split_writes_two_classes_and_a_config_the_loader_reads(tmp_path: Path) -> None:
    rows = [{"prompt": f"Short question {i}?"} for i in range(30)]
    rows += [{"prompt": f"Long document {i}: " + " ".join(f"sentence {k} of the text." for k in range(150))}
             for i in range(10)]
    src = make_jsonl(tmp_path, rows, "mix.jsonl")
    config = tmp_path / "job.toml"
    rc = main(["prompts", "build", f"{src}", "--out", str(tmp_path / "prompts"), "--config", str(config),
               "--tokenizer", str(bundled_kimi_path()), "--price-in", "0.6", "--price-out", "2.5"])
    assert rc == 0
    cfg = load_config(config)
    by_name = {d.name: d for d in cfg.datasets}
    assert set(by_name) == {"mix_short", "mix_long"}
    assert (by_name["mix_short"].concurrency, by_name["mix_short"].max_tokens) == (2000, 10240)
    assert (by_name["mix_long"].concurrency, by_name["mix_long"].max_tokens) == (500, 16384)
    short, long = _read(by_name["mix_short"].prompts), _read(by_name["mix_long"].prompts)
    assert (len(short), len(long)) == (30, 10)
    tok = bundled_kimi()
    template = load_template("kimi-k2.5", tok)
    text = config.read_text()
    threshold = int(text.split("split at ")[1].split(" prompt tokens")[0].replace(",", ""))
    assert max(prompt_tokens(tok, template, p.messages) for p in short) < threshold
    assert min(prompt_tokens(tok, template, p.messages) for p in long) >= threshold
    # The cost in the comment: prompt tokens at $0.6/M plus 30 answers of 10,240/2 tokens at $2.5/M.
    short_tokens = sum(prompt_tokens(tok, template, p.messages) for p in short)
    expected = short_tokens * 0.6e-6 + 30 * 5120 * 2.5e-6
    assert f"# 30 prompts (short) from mix, {short_tokens:,} prompt tokens; estimated ${expected:,.2f}" in text
    assert Path(cfg.tokenizer.path).resolve() == bundled_kimi_path().resolve()
    assert 'prompts = "prompts/mix_short.jsonl"' in text  # under the config's folder: relative
    assert cfg.budget.max_usd is not None and cfg.budget.max_usd > expected

    # A second build adds to the same config, deduplicated against what it already lists.
    more = make_jsonl(tmp_path, [{"prompt": "short question 3?"}, {"prompt": "A new one."}], "more.jsonl")
    assert main(["prompts", "build", str(more), "--out", str(tmp_path / "prompts"), "--config", str(config),
                 "--split", "off"]) == 0
    cfg2 = load_config(config)
    assert [d.name for d in cfg2.datasets] == ["mix_short", "mix_long", "more"]
    assert [p.messages[0]["content"] for p in _read(cfg2.datasets[2].prompts)] == ["A new one."]
    assert text in config.read_text()  # appended: nothing already in the file changed


def test_a_name_already_in_the_config_is_refused_before_any_work(tmp_path: Path, capsys) -> None:
    src = make_jsonl(tmp_path, [{"prompt": "x"}], "dup.jsonl")
    config = tmp_path / "c.toml"
    args = ["prompts", "build", str(src), "--out", str(tmp_path / "p"), "--config", str(config), "--split", "off",
            "--tokenizer", str(bundled_kimi_path())]
    assert main(args) == 0
    before = config.read_text()
    assert main(args) == 2
    assert "a dataset named 'dup' is already there" in capsys.readouterr().err
    assert config.read_text() == before


def test_language_and_length_filters(tmp_path: Path) -> None:
    rows = [{"prompt": "Explain the halting problem in simple words."},
            {"prompt": "请用简单的话解释停机问题。"},
            {"prompt": "Объясните проблему остановки простыми словами."},
            {"prompt": "请解释这个函数：def f(x): return x * 2"},
            {"prompt": "Hi"},
            {"prompt": "Bonjour", "language": "fr"}]
    src = str(make_jsonl(tmp_path, rows, "lang.jsonl"))
    en = build(_opts(tmp_path, [src], split="off", languages=frozenset({"en"}), out_dir=tmp_path / "en"))
    assert [p.messages[0]["content"] for p in _read(en.datasets[0].path)] == [rows[0]["prompt"], "Hi"]
    assert en.sources[0].dropped["language"] == 4  # the language column says fr: not en
    zh = build(_opts(tmp_path, [src], split="off", languages=frozenset({"zh", "ru"}), out_dir=tmp_path / "zh"))
    assert [p.messages[0]["content"] for p in _read(zh.datasets[0].path)] == [rows[1]["prompt"], rows[2]["prompt"],
                                                                             rows[3]["prompt"]]
    sized = build(_opts(tmp_path, [src], split="off", min_tokens=12, max_tokens=20, out_dir=tmp_path / "len"))
    kept = _read(sized.datasets[0].path)
    tok = bundled_kimi()
    template = load_template("kimi-k2.5", tok)
    assert kept and all(12 <= prompt_tokens(tok, template, p.messages) <= 20 for p in kept)
    assert sized.sources[0].dropped["too_short"] + sized.sources[0].dropped["too_long"] == 6 - len(kept)


def test_unusable_rows_are_counted_with_a_reason(tmp_path: Path) -> None:
    rows = [{"conversations": [{"from": "gpt", "value": "only an answer"}]},
            {"conversations": [{"from": "human", "value": "Fine."}]}]
    result = build(_opts(tmp_path, [str(make_parquet(tmp_path, rows, "bad.parquet"))], split="off"))
    assert result.sources[0].dropped["unusable"] == 1
    assert "row 0: `conversations` has no user turn" == result.sources[0].example_unusable
    # Asked turn by turn, an empty conversation is said to be empty (not to lack a turn before a tool turn).
    empty = [{"conversations": []}, {"conversations": [{"from": "human", "value": "Fine."}]}]
    result = build(_opts(tmp_path, [str(make_jsonl(tmp_path, empty, "empty.jsonl"))], split="off", turns="all",
                         out_dir=tmp_path / "all"))
    assert result.sources[0].dropped["unusable"] == 1
    assert result.sources[0].example_unusable == "row 0: `conversations` is empty"


def test_hub_cache_is_read_offline_and_a_missing_dataset_is_never_downloaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hub_constants
    cache = tmp_path / "hub"
    repo = cache / "datasets--someorg--mathqa"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    data = repo / "snapshots" / commit / "data"
    data.mkdir(parents=True)
    datasets.Dataset.from_list([{"problem": f"Solve x+{i}=0."} for i in range(5)]).to_parquet(
        str(data / "train-00000-of-00001.parquet"))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    stay_offline()
    source = open_source(parse_source("someorg/mathqa"))
    assert len(source) == 5 and source.columns == ["problem"] and source.name == "mathqa"
    with pytest.raises(SourceError, match="not in the local Hugging Face cache.*--download"):
        open_source(parse_source("someorg/not-here"))


def test_bad_sources_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no such file or folder"):
        open_source(parse_source(str(tmp_path / "missing.parquet")))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(SourceError, match="unknown file type"):
        open_source(parse_source(str(tmp_path / "notes.txt")))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(SourceError, match="broken.parquet: cannot"):
        open_source(parse_source(str(tmp_path / "broken.parquet")))
    src = make_jsonl(tmp_path, [{"prompt": "x"}], "same.jsonl")
    with pytest.raises(BuildError, match="two sources are named 'same'"):
        build(_opts(tmp_path, [str(src), str(src)]))


def test_written_prompt_files_are_not_overwritten_without_force(tmp_path: Path) -> None:
    src = str(make_jsonl(tmp_path, [{"prompt": "x"}], "once.jsonl"))
    build(_opts(tmp_path, [src], split="off"))
    with pytest.raises(BuildError, match="once.jsonl: already exists"):
        build(_opts(tmp_path, [src], split="off"))
    build(_opts(tmp_path, [src], split="off", force=True))


def test_without_the_datasets_library_the_message_names_the_extra(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as when it is not installed
    with pytest.raises(SourceError, match=r"pip install 'draftgen\[prompts\]'"):
        open_source(parse_source(str(make_jsonl(tmp_path, [{"prompt": "x"}]))))


def test_turns_with_mixed_keys_in_one_arrow_column(tmp_path: Path) -> None:
    # Arrow gives every struct in a column every key: a from/value turn also has role/content = null.
    rows = [{"conversations": [{"from": "human", "value": "First?"}]},
            {"conversations": [{"role": "user", "content": "Second?"}]}]
    result = build(_opts(tmp_path, [str(make_parquet(tmp_path, rows, "mixed.parquet"))], split="off"))
    assert [p.messages for p in _read(result.datasets[0].path)] == [[{"role": "user", "content": "First?"}],
                                                                    [{"role": "user", "content": "Second?"}]]


def test_lengths_count_the_default_system_turn_of_the_config(tmp_path: Path) -> None:
    config = tmp_path / "sys.toml"
    old = make_jsonl(tmp_path, [{"id": "o1", "prompt": "old"}], "old.jsonl")
    config.write_text(f'[tokenizer]\npath = {orjson.dumps(str(bundled_kimi_path())).decode()}\n'
                      f'default_system = "You are a careful assistant who answers in full sentences."\n\n'
                      f'[[datasets]]\nname = "old"\nprompts = "{old.name}"\n')
    src = make_jsonl(tmp_path, [{"prompt": "What is 2+2?"}], "sums.jsonl")
    assert main(["prompts", "build", str(src), "--out", str(tmp_path / "p"), "--config", str(config),
                 "--split", "off"]) == 0
    tok = bundled_kimi()
    messages = [{"role": "user", "content": "What is 2+2?"}]
    with_system = prompt_tokens(tok, load_template("kimi-k2.5", tok, default_system=load_config(config)
                                                   .tokenizer.system_turn()), messages)
    assert with_system > prompt_tokens(tok, load_template("kimi-k2.5", tok), messages)
    assert f"# 1 prompts (all) from sums, {with_system:,} prompt tokens" in config.read_text()


def _three_turns(i: int) -> dict:
    return {"conversations": [{"from": "system", "value": "Be brief."},
                              {"from": "human", "value": f"What is {i} squared?"},
                              {"from": "gpt", "value": "the dataset's answer"},
                              {"from": "human", "value": "And cubed?"},
                              {"from": "gpt", "value": "another answer"},
                              {"from": "human", "value": f"And {i} to the fourth, with the steps shown?"},
                              {"from": "gpt", "value": "a third answer"}]}


def test_turns_all_keeps_every_user_turn_and_its_cost_grows_with_the_history(tmp_path: Path) -> None:
    """--turns all --max-turns 2: each conversation kept up to its 2nd user turn, as the source has it (the
    dataset's answers stay in the file; turns = "all" drops them when the run reads it); the entry says
    turns = "all" and its cost counts every turn's prompt side plus the earlier answers each history carries."""
    rows = [_three_turns(i) for i in range(4)]
    rows.append({"conversations": [{"from": "human", "value": "List the files."},
                                   {"from": "gpt", "value": "", "tool_calls": [{
                                       "id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
                                   {"from": "tool", "value": "a.txt"}, {"from": "human", "value": "Open it."}]})
    rows.append({"conversations": [{"from": "tool", "value": "orphan result"}, {"from": "human", "value": "Hm?"}]})
    src = make_jsonl(tmp_path, rows, "chat.jsonl")
    config = tmp_path / "job.toml"
    rc = main(["prompts", "build", str(src), "--out", str(tmp_path / "prompts"), "--config", str(config),
               "--tokenizer", str(bundled_kimi_path()), "--price-in", "0.6", "--price-out", "2.5", "--split", "off",
               "--turns", "all", "--max-turns", "2"])
    assert rc == 0
    cfg = load_config(config)
    (ds,) = cfg.datasets
    assert (ds.turns, ds.max_turns) == ("all", 2)
    lines = [orjson.loads(line) for line in ds.prompts.read_bytes().splitlines()]
    prompts = {o["id"]: o["messages"] for o in lines}
    assert len(prompts) == 5  # the orphan tool result leaves no user turn before it: unusable
    assert [m["role"] for m in prompts["chat:train:0"]] == ["system", "user", "assistant", "user"]
    # An agent line is kept whole through its last assistant message (one step: the call).
    assert prompts["chat:train:4"] == [{"role": "user", "content": "List the files."}, {
        "role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}]
    tok = bundled_kimi()
    template = load_template("kimi-k2.5", tok)
    sides = [[m for m in msgs if m["role"] != "assistant"] for msgs in prompts.values()]
    per_turn = [prompt_tokens(tok, template, side[: i + 1]) for side in sides
                for i, m in enumerate(side) if m["role"] == "user"]
    assert len(per_turn) == 9  # 4 conversations x 2 turns, and one of 1
    answer = 10240 / 2
    expected = (sum(per_turn) + 4 * answer) * 0.6e-6 + 9 * answer * 2.5e-6  # 4 histories carry one answer each
    at_most = (sum(per_turn) + 4 * 10240) * 0.6e-6 + 9 * 10240 * 2.5e-6
    text = config.read_text()
    assert (f"# 5 conversations (all) from chat, 9 turns asked one by one: {sum(per_turn):,} prompt tokens of user "
            f"turns over them, plus 4 earlier answers carried in their histories; estimated ${expected:,.2f}, at most "
            f"${at_most:,.2f}") in text
    assert 'turns = "all"\nmax_turns = 2' in text


def test_max_turns_without_turns_all_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_jsonl(tmp_path, [_three_turns(1)], "chat.jsonl")
    assert main(["prompts", "build", str(src), "--out", str(tmp_path / "p"), "--no-config", "--max-turns", "2",
                 "--tokenizer", str(bundled_kimi_path())]) != 0
    assert "--max-turns 2: caps the user turns of a conversation with --turns all" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_build_shows_a_sources_path_and_rows_as_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A source file named with Rich markup and an escape sequence (`[/x]` raised MarkupError: the command
    stopped), and a row whose role carries them: printed as text, the controls as visible escapes."""
    hostile = "\x1b]0;pwned\x07[/x]"
    folder = tmp_path / f"data{hostile}"  # data\x1b]0;pwned\x07[/ holding x]/
    folder.mkdir(parents=True)
    rows = [{"messages": [{"role": "user", "content": f"Question {i}?"}]} for i in range(5)]
    rows.append({"messages": [{"role": f"user{hostile}", "content": "Question?"}]})
    src = make_jsonl(folder, rows, "q.jsonl")
    rc = main(["prompts", "build", f"q={src}", "--out", str(tmp_path / "prompts"), "--no-config",
               "--tokenizer", str(bundled_kimi_path())])
    out = capsys.readouterr()
    said = out.out + out.err
    assert rc == 0, said
    assert "\x1b" not in said and "\x07" not in said, said
    flat = "".join(said.split())
    assert "data\\x1b]0;pwned\\x07[/x]/q.jsonl" in flat, said
    assert "firstunusablerow" in flat and "row5:messages[0]hasanunknownrole'user\\x1b]0;pwned\\x07[/x]'" in flat, said


# -- agent trajectories ---------------------------------------------------------------------------

GLAIVE_TOOLS = [{"name": "get_weather", "description": "Météo d'une ville",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
                {"name": "get_time", "description": "Time now", "parameters": {}}]


def _glaive(i: int) -> dict:
    """LLaMA-Factory's ShareGPT layout with tool turns (glaive-toolcall): `tools` a JSON string."""
    return {"conversations": [
        {"from": "human", "value": f"Weather in Paris and the time? ({i})"},
        {"from": "function_call", "value": '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                                           '{"name": "get_time", "arguments": {}}]'},
        {"from": "observation", "value": '["{\\"temp\\": 21}", "12:00"]'},
        {"from": "gpt", "value": "It is 21 degrees; noon."},
        {"from": "human", "value": "And in Tokyo?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "東京"}}'},
        {"from": "observation", "value": '{"temp": 18}'},
        {"from": "gpt", "value": "18 degrees."}],
        "system": "You can call tools.", "tools": orjson.dumps(GLAIVE_TOOLS).decode()}


def _build_lines(tmp_path: Path, src: Path, **kw) -> list[dict]:
    result = build(_opts(tmp_path, [str(src)], split="off", turns="all", **kw))
    (ds,) = result.datasets
    return [orjson.loads(line) for line in ds.path.read_bytes().splitlines()]


def test_sharegpt_function_call_and_observation_turns_become_an_openai_agent_line(tmp_path: Path) -> None:
    (line,) = _build_lines(tmp_path, make_jsonl(tmp_path, [_glaive(0)], "glaive.jsonl"))
    assert line["tools"] == [{"type": "function", "function": t} for t in GLAIVE_TOOLS]
    weather = {"id": "functions.get_weather:0", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    clock = {"id": "functions.get_time:1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    assert line["messages"] == [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Paris and the time? (0)"},
        {"role": "assistant", "content": "", "tool_calls": [weather, clock]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "functions.get_time:1", "content": "12:00"},
        {"role": "assistant", "content": "It is 21 degrees; noon."},
        {"role": "user", "content": "And in Tokyo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "functions.get_weather:2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "東京"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:2", "content": '{"temp": 18}'},
        {"role": "assistant", "content": "18 degrees."}]
    first = build(_opts(tmp_path, [str(tmp_path / "glaive.jsonl")], split="off", out_dir=tmp_path / "first"))
    assert [orjson.loads(x) for x in first.datasets[0].path.read_bytes().splitlines()] == [
        {"id": "glaive:train:0", "messages": [{"role": "system", "content": "You can call tools."},
                                              {"role": "user", "content": "Weather in Paris and the time? (0)"}]}]


def test_openai_agent_lines_are_kept_whole_with_their_tools(tmp_path: Path) -> None:
    """OpenAI layout in a parquet file (Arrow fills absent keys with null): calls keep their ids, an
    object's arguments become JSON text, a trailing user turn nobody answered is left out; each step's
    prompt is counted with the tools declared."""
    tools = [{"type": "function", "function": {"name": "bash", "description": "Run",
                                               "parameters": {"type": "object", "properties": {}}}}]
    rows = [{"messages": [
        {"role": "user", "content": f"Count files ({i})", "tool_calls": None, "tool_call_id": None},
        {"role": "assistant", "content": None, "tool_call_id": None, "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]},
        {"role": "tool", "content": "a\nb", "tool_call_id": f"call_{i}", "tool_calls": None},
        {"role": "assistant", "content": "Two.", "tool_calls": None, "tool_call_id": None},
        {"role": "user", "content": "Thanks", "tool_calls": None, "tool_call_id": None}],
        "tools": orjson.dumps(tools).decode()} for i in range(2)]
    src = make_parquet(tmp_path, rows, "agent.parquet")
    lines = _build_lines(tmp_path, src)
    assert [m["role"] for m in lines[0]["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert lines[0]["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]}
    assert lines[0]["messages"][2] == {"role": "tool", "tool_call_id": "call_0", "content": "a\nb"}
    assert lines[0]["tools"] == tools
    tok = bundled_kimi()
    template = load_template("kimi-k2.5", tok)
    messages = lines[0]["messages"]
    result = build(_opts(tmp_path, [str(src)], split="off", turns="all", out_dir=tmp_path / "again"))
    (ds,) = result.datasets
    # Each step's prompt side: the tools, the user turn and the tool result, without the dataset's answers:
    # the target's own earlier answers come on top, one for step 2 (history_answers), so none is priced twice.
    steps = [prompt_tokens(tok, template, messages[:1], tools),
             prompt_tokens(tok, template, [messages[0], messages[2]], tools)]
    assert steps[0] > prompt_tokens(tok, template, messages[:1])  # the tools are declared in every step's prompt
    assert ds.requests == 4 and ds.request_prompt_tokens == 2 * sum(steps) and ds.history_answers == 2


def test_swe_agent_and_openhands_trajectories_are_read(tmp_path: Path) -> None:
    """nebius/SWE-agent-trajectories (`trajectory` of {role system/user/ai, text, system_prompt, mask,
    cutoff_date}: text actions, a multi-turn conversation) and an OpenHands trajectory in OpenAI layout
    (nebius/SWE-rebench-openhands-trajectories: `trajectory` of OpenAI messages with tool calls)."""
    swe = [{"instance_id": f"repo__x-{i}", "model_name": "m", "target": True, "exit_status": "submitted",
            "trajectory": [
                {"role": "system", "text": "", "system_prompt": "SETTING: a shell.", "mask": False, "cutoff_date": ""},
                {"role": "user", "text": f"Fix issue {i}", "system_prompt": None, "mask": False, "cutoff_date": ""},
                {"role": "ai", "text": "DISCUSSION\nls\n```\nls\n```", "system_prompt": None, "mask": True,
                 "cutoff_date": ""},
                {"role": "user", "text": "a.py", "system_prompt": None, "mask": False, "cutoff_date": ""},
                {"role": "ai", "text": "submit", "system_prompt": None, "mask": True, "cutoff_date": ""}]}
           for i in range(2)]
    lines = _build_lines(tmp_path, make_parquet(tmp_path, swe, "swe.parquet"), out_dir=tmp_path / "swe")
    assert lines[0]["messages"] == [{"role": "system", "content": "SETTING: a shell."},
                                    {"role": "user", "content": "Fix issue 0"},
                                    {"role": "assistant", "content": "DISCUSSION\nls\n```\nls\n```"},
                                    {"role": "user", "content": "a.py"}]
    assert "tools" not in lines[0]
    hands = [{"instance_id": "r-1", "trajectory": [
        {"role": "system", "content": "You are OpenHands.", "name": None, "tool_call_id": None, "tool_calls": None},
        {"role": "user", "content": "Fix it", "name": None, "tool_call_id": None, "tool_calls": None},
        {"role": "assistant", "content": "Looking.", "name": None, "tool_call_id": None, "tool_calls": [
            {"function": {"arguments": '{"command": "ls"}', "name": "execute_bash"}, "id": "toolu_1",
             "type": "function"}]},
        {"role": "tool", "content": "a.py", "name": "execute_bash", "tool_call_id": "toolu_1", "tool_calls": None},
        {"role": "assistant", "content": "Done.", "name": None, "tool_call_id": None, "tool_calls": None}]}]
    (line,) = _build_lines(tmp_path, make_parquet(tmp_path, hands, "hands.parquet"), out_dir=tmp_path / "hands")
    # Asked once (--turns first), the same trajectory gives its system and first user turn.
    first = build(_opts(tmp_path, [str(tmp_path / "hands.parquet")], split="off", out_dir=tmp_path / "first"))
    assert [orjson.loads(x)["messages"] for x in first.datasets[0].path.read_bytes().splitlines()] == [
        [{"role": "system", "content": "You are OpenHands."}, {"role": "user", "content": "Fix it"}]]
    assert line["messages"][2] == {"role": "assistant", "content": "Looking.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "execute_bash", "arguments": '{"command": "ls"}'}}]}
    assert line["messages"][3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "a.py"}
    assert [m["role"] for m in line["messages"]] == ["system", "user", "assistant", "tool", "assistant"]


def test_prompts_build_takes_every_preset_on_its_command_line(tmp_path: Path) -> None:
    """`draftgen prompts build --preset P` takes each of presets.PRESETS (the CLI's list is its own,
    so --help stays fast): --preset trajectory, which docs/prompts.md names for SWE-agent, was refused."""
    src = tmp_path / "swe.jsonl"
    src.write_bytes(orjson.dumps({"trajectory": [{"role": "system", "text": "SETTING: a shell."},
                                                 {"role": "user", "text": "Fix issue 1"},
                                                 {"role": "ai", "text": "ls"}, {"role": "user", "text": "a.py"},
                                                 {"role": "ai", "text": "submit"}]}) + b"\n")
    assert main(["prompts", "build", str(src), "--out", str(tmp_path / "p"), "--no-config", "--split", "off",
                 "--preset", "trajectory", "--turns", "all", "--tokenizer", str(bundled_kimi_path())]) == 0
    (line,) = [orjson.loads(x) for x in (tmp_path / "p" / "swe.jsonl").read_bytes().splitlines()]
    assert line["messages"][:2] == [{"role": "system", "content": "SETTING: a shell."},
                                    {"role": "user", "content": "Fix issue 1"}]
    for preset in presets.PRESETS:
        with pytest.raises(SystemExit) as e:
            main(["prompts", "build", "--preset", preset, "--help"])
        assert e.value.code == 0, preset


def test_agent_rows_that_cannot_be_read_say_why(tmp_path: Path) -> None:
    rows = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "function_call", "value": "not json"}]},
            {"conversations": [{"from": "human", "value": "Hi"},
                               {"from": "function_call", "value": '{"arguments": {}}'}]},
            _glaive(1)]
    result = build(_opts(tmp_path, [str(make_jsonl(tmp_path, rows, "bad.jsonl"))], split="off", turns="all"))
    assert result.sources[0].dropped["unusable"] == 2 and result.sources[0].kept == 1
    assert result.sources[0].example_unusable in ("row 0: `conversations`[1] (function_call) is not JSON",
                                                  "row 1: `conversations`[1][0] has no function name")
