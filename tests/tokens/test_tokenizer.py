"""Tokenizer loading on the real Kimi-K2 vocabulary, a tokenizers-built tokenizer.json, and broken folders."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from draftgen.core.errors import TokenizerError
from draftgen.core.tokens import tokenizer as tokmod
from draftgen.core.tokens.tokenizer import (
    MAX_NO_WHITESPACES_CHARS,
    TiktokenTokenizer,
    TokenizersTokenizer,
    bundled_kimi,
    bundled_kimi_path,
    load_tokenizer,
    split_long_runs,
)

TABLE = json.loads((bundled_kimi_path() / "special_tokens.json").read_text())
VECTORS = TABLE["test_vectors"]

ROUND_TRIPS = {
    "code": 'def f(x: int) -> int:\n\tif x <= 0:\n\t\treturn 0  # base\n    return x * f(x - 1)\n\n'
            'print(f"{f(5)!r}")\n',
    "cjk": "你好，世界！これは日本語の文です。한국어 문장입니다。",
    "emoji": "Ship it 🚀🚀 — 👩‍👩‍👧‍👦 family, flags 🇫🇷🇯🇵, skin 👍🏽.",
    "whitespace": "a  b   c\t\t\td\n\n\n\ne \r\n f" + " " * 37 + "\n" + "\t" * 9 + "end   ",
    "look_alikes": "type <|im_end|> or <think> and </think> or [EOS] <|im_user|> literally",
    "empty": "",
}


def _reference_split(s: str, limit: int) -> list[str]:
    """Kimi's `_split_whitespaces_or_nonwhitespaces`, transcribed as a plain loop."""
    current, is_space, start, out = 0, s[0].isspace() if s else False, 0, []
    for i, ch in enumerate(s):
        now = ch.isspace()
        if is_space ^ now:
            current, is_space = 1, now
        else:
            current += 1
            if current > limit:
                out.append(s[start:i])
                start, current = i, 1
    out.append(s[start:])
    return out


pytestmark = pytest.mark.usefixtures("fresh_tokenizers")


def test_plain_text_vector() -> None:
    tok = bundled_kimi()
    assert tok.encode_text(VECTORS["plain_text"]["text"]) == VECTORS["plain_text"]["ids"]


def test_chat_vector_through_the_encoding() -> None:
    tok = bundled_kimi()
    vec = VECTORS["chat_with_specials"]
    assert tok.encoding.encode(vec["text"], allowed_special="all") == vec["ids"]
    assert tok.decode(vec["ids"]) == vec["text"]


def test_specials_by_name_never_by_number() -> None:
    tok = bundled_kimi()
    assert tok.vocab_size == TABLE["model_vocab_size"]
    for name, i in TABLE["named"].items():
        assert tok.special_id(name) == i
    assert tok.special_id("<|reserved_token_163589|>") == 163589
    assert len(tok.special_tokens()) == TABLE["num_reserved_special_tokens"]
    with pytest.raises(TokenizerError, match="no special token '<|im_start|>'"):
        tok.special_id("<|im_start|>")


@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_round_trips(name: str) -> None:
    tok = bundled_kimi()
    text = ROUND_TRIPS[name]
    ids = tok.encode_text(text)
    assert tok.decode(ids) == text
    assert ids == tok.encoding.encode_ordinary(text)
    assert not set(ids) & set(tok.special_tokens().values())


def test_literal_special_stays_text() -> None:
    tok = bundled_kimi()
    ids = tok.encode_text("<|im_end|>")
    assert tok.special_id("<|im_end|>") not in ids and len(ids) > 1
    assert tok.decode(ids) == "<|im_end|>"


def test_long_runs_are_cut_like_kimi() -> None:
    tok = bundled_kimi()
    blob = "QUJD" * 16_000 + " tail " + " " * 30_000 + "x"  # 64,000 non-space chars, 30,001 spaces
    pieces = _reference_split(blob, MAX_NO_WHITESPACES_CHARS)
    assert split_long_runs(blob) == pieces and len(pieces) > 2
    assert tok.encode_text(blob) == [i for p in pieces for i in tok.encoding.encode_ordinary(p)]
    assert tok.decode(tok.encode_text(blob)) == blob


def test_split_matches_reference_on_random_strings() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        s = "".join(rng.choice("ab \n\u3000é") for _ in range(rng.randint(0, 30)))
        limit = rng.randint(1, 6)
        assert split_long_runs(s, limit) == _reference_split(s, limit), (s, limit)


def test_bundled_loads_by_path_like_any_folder(tmp_path: Path) -> None:
    folder = tmp_path / "kimi"
    shutil.copytree(bundled_kimi_path(), folder)
    tok = load_tokenizer(str(folder))
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.encode_text(VECTORS["plain_text"]["text"]) == VECTORS["plain_text"]["ids"]
    assert load_tokenizer(str(folder / "tiktoken.model")).special_id("<think>") == 163606


def test_tiktoken_folder_takes_specials_from_tokenizer_config(tmp_path: Path) -> None:
    folder = tmp_path / "kimi"
    folder.mkdir()
    shutil.copy(bundled_kimi_path() / "tiktoken.model", folder)
    # No special_tokens.json: the bundled pattern; names from added_tokens_decoder; the rest reserved.
    decoder = {str(i): {"content": n, "special": True} for n, i in TABLE["named"].items()}
    decoder["163589"] = {"content": "<|custom|>", "special": True}
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    tok = load_tokenizer(str(folder))
    assert tok.special_id("<|custom|>") == 163589
    assert tok.special_id("<|im_end|>") == 163586
    assert tok.special_id("<|reserved_token_163592|>") == 163592
    assert tok.encode_text(VECTORS["plain_text"]["text"]) == VECTORS["plain_text"]["ids"]


def test_tiktoken_folder_without_any_table_uses_kimi_defaults(tmp_path: Path) -> None:
    folder = tmp_path / "kimi"
    folder.mkdir()
    shutil.copy(bundled_kimi_path() / "tiktoken.model", folder)
    tok = load_tokenizer(str(folder))
    assert tok.special_id("</think>") == 163607
    assert not tok.has_chat_template


def build_tokenizer_json(folder: Path, chat_template: str | None = None) -> Path:
    """A small byte-level BPE with chat specials, trained here with the `tokenizers` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = [*ROUND_TRIPS.values(), "Hello world, the answer is four. Let me think step by step."] * 20
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|im_start|>", "<|im_end|>"], show_progress=False)
    tk.train_from_iterator(corpus, trainer)
    tk.add_tokens(["<think>", "</think>"])  # added but not special, as in Qwen3
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    config: dict = {"eos_token": "<|im_end|>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_tokenizer_json_folder(tmp_path: Path) -> None:
    folder = build_tokenizer_json(tmp_path / "tj")
    tok = load_tokenizer(str(folder))
    assert isinstance(tok, TokenizersTokenizer)
    end = tok.special_id("<|im_end|>")
    think = tok.special_id("<think>")
    for text in ROUND_TRIPS.values():
        ids = tok.encode_text(text)
        assert tok.decode(ids) == text
    looks = tok.encode_text("<|im_end|> <think>")
    assert end not in looks and think not in looks
    assert tok.decode([end]) == "<|im_end|>"


@pytest.mark.slow
def test_other_folders_load_through_transformers(tmp_path: Path) -> None:
    """No tiktoken.model, no tokenizer.json: transformers' AutoTokenizer (offline) reads the folder."""
    from tokenizers import Tokenizer

    built = Tokenizer.from_file(str(build_tokenizer_json(tmp_path / "tj") / "tokenizer.json"))
    folder = tmp_path / "gpt2-style"
    folder.mkdir()
    built.model.save(str(folder))  # vocab.json + merges.txt
    specials = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "eos_token": "<|im_end|>",
        "added_tokens_decoder": {str(built.token_to_id(t)): {"content": t, "special": True} for t in specials}}))
    tok = load_tokenizer(str(folder))
    assert isinstance(tok, tokmod.TransformersTokenizer)
    assert tok.special_id("<|im_end|>") == built.token_to_id("<|im_end|>")
    assert tok.special_id("<|im_end|>") not in tok.encode_text("say <|im_end|> here")
    assert tok.decode(tok.encode_text("Hello <|im_end|> world")) == "Hello <|im_end|> world"
    (folder / "vocab.json").write_text("{broken")
    tokmod._load_cached.cache_clear()
    with pytest.raises(TokenizerError, match="transformers cannot load it offline"):
        load_tokenizer(str(folder))


def test_hf_id_resolves_in_the_local_cache_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hf

    cache = tmp_path / "hub"
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(cache))
    with pytest.raises(TokenizerError, match="not in the Hugging Face cache; draftgen never downloads"):
        load_tokenizer("someorg/some-model")
    repo = cache / "models--someorg--some-model"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    build_tokenizer_json(repo / "snapshots" / commit)
    tok = load_tokenizer("someorg/some-model")
    assert tok.name == "someorg/some-model"
    assert tok.decode(tok.encode_text("Hello world")) == "Hello world"


def test_missing_and_empty_folders(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=f"{tmp_path / 'nope'}: tokenizer folder not found"):
        load_tokenizer(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="no tokenizer here"):
        load_tokenizer(str(tmp_path / "empty"))
    with pytest.raises(TokenizerError, match="empty"):
        load_tokenizer("")


def test_corrupt_tiktoken_model_names_the_line(tmp_path: Path) -> None:
    folder = tmp_path / "bad"
    folder.mkdir()
    lines = (bundled_kimi_path() / "tiktoken.model").read_bytes().splitlines()[:50]
    lines[41] = b"!!!notbase64 41"
    (folder / "tiktoken.model").write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(TokenizerError, match=r"tiktoken.model: line 42 is not a tiktoken BPE entry"):
        load_tokenizer(str(folder))
    (folder / "tiktoken.model").write_bytes(b"")
    with pytest.raises(TokenizerError, match="holds no tokens"):
        load_tokenizer(str(folder))


def test_corrupt_json_files_are_named(tmp_path: Path) -> None:
    folder = tmp_path / "bad-json"
    folder.mkdir()
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(TokenizerError, match=r"tokenizer.json: not a valid tokenizer.json"):
        load_tokenizer(str(folder))

    kimi = tmp_path / "bad-config"
    kimi.mkdir()
    shutil.copy(bundled_kimi_path() / "tiktoken.model", kimi)
    (kimi / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: not valid JSON \(line 1"):
        load_tokenizer(str(kimi))
    (kimi / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"5": {"content": "<x>"}}}))
    with pytest.raises(TokenizerError, match="inside the BPE vocabulary"):
        load_tokenizer(str(kimi))


def test_a_tokenizer_json_folder_encodes_as_transformers_loads_it(tmp_path: Path) -> None:
    """transformers 5 loads a qwen2 folder with Qwen2Tokenizer, which splits digits whatever the
    folder's tokenizer.json pre-tokenizer says; the serving stack counts with it, so draftgen must too."""
    import tokenizers
    from transformers import AutoTokenizer

    from draftgen.core.tokens.tokenizer import load_tokenizer
    from tests.selfhosted_model import build_tiny_reasoning_model
    folder = build_tiny_reasoning_model(tmp_path / "qwen2")
    text = "What is 22+2? Answer 4."
    served = AutoTokenizer.from_pretrained(str(folder), local_files_only=True).encode(text, add_special_tokens=False)
    raw = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert served != raw  # the case this is about: the file alone counts otherwise
    tok = load_tokenizer(str(folder))
    assert tok.encode_text(text) == served
    assert str(folder / "tokenizer.json") in tok.origin and "Qwen2Tokenizer" in tok.origin
    assert "pre_tokenizer" in tok.origin
    assert tok.special_id("<|im_end|>") == (AutoTokenizer.from_pretrained(str(folder))
                                            .convert_tokens_to_ids("<|im_end|>"))


def test_short_texts_are_encoded_once_and_given_back_as_new_lists() -> None:
    """The role names and headers every answer renders are encoded once per tokenizer (core/tokens/encoders.py
    SHORT_TEXT_CHARS): the ids are tiktoken's own, each call hands back a list of its own (one a caller
    changes is not what the next call gets), and the cache stays within SHORT_TEXTS texts."""
    from draftgen.core.tokens.encoders import SHORT_TEXT_CHARS, SHORT_TEXTS
    tok = bundled_kimi()
    texts = ["user", "assistant", "system", " ", "答案 🚀", "x" * SHORT_TEXT_CHARS, "y" * (SHORT_TEXT_CHARS + 1)]
    for text in texts:
        first = tok.encode_text(text)
        assert first == tok.encoding.encode_ordinary(text), text
        first.append(-1)
        assert tok.encode_text(text) == tok.encoding.encode_ordinary(text), text
    assert tok._encode_short.cache_info().hits >= len(texts) - 1  # the short ones, asked twice
    for i in range(SHORT_TEXTS + 10):
        assert tok.encode_text(f"q{i}") == tok.encoding.encode_ordinary(f"q{i}")
    assert tok._encode_short.cache_info().currsize <= SHORT_TEXTS
