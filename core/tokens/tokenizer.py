"""The target model's tokenizer: exact ids for ordinary text, special tokens looked up by name.

Three ways in, chosen by what `tokenizer.path` holds:

- a folder with `tiktoken.model` (Kimi style): loaded with tiktoken, no remote code. Special
  tokens come from the folder's `tokenizer_config.json` `added_tokens_decoder` when present, else
  from `special_tokens.json` beside it, else from the bundled Kimi table; every id of the reserved
  range left unnamed is `<|reserved_token_{id}|>`. The split pattern comes from `special_tokens.json`
  beside it, else the bundled Kimi pattern.
- a folder with `tokenizer.json`: loaded with the `tokenizers` library.
- anything else: a Hugging Face id, resolved in the local cache only (never downloaded). A cached
  snapshot with `tiktoken.model` or `tokenizer.json` loads as a folder above; otherwise through
  transformers `AutoTokenizer` (`trust_remote_code` as configured).

`encode_text` treats its input as ordinary text: a literal "<|im_end|>" typed in a prompt or an
answer stays text and is never turned into the special token. Special tokens are inserted by
`special_id(name)`, never written as numbers.
"""

from __future__ import annotations

import binascii
import functools
import importlib.resources
import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from draftgen.core.errors import TokenizerError

# Kimi's tokenization_kimi.py hands tiktoken at most 400,000 characters at a time and cuts runs of
# more than 25,000 whitespace or non-whitespace characters (tiktoken issue #195); ids at those
# cuts differ from an uncut encode, so the same cuts are made here to stay id-exact.
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000
# A run start followed by more than the limit of the same class: matched in linear time because
# the look-behind fails at once inside a run.
_LONG_RUN = re.compile(r"(?<!\S)\S{%d}|(?<!\s)\s{%d}" % (MAX_NO_WHITESPACES_CHARS + 1, MAX_NO_WHITESPACES_CHARS + 1))

KIMI_RESERVED_SPECIAL_TOKENS = 256


@runtime_checkable
class Tokenizer(Protocol):
    """What reconstruction needs from a tokenizer."""

    name: str
    vocab_size: int

    def encode_text(self, text: str) -> list[int]:
        """Ids of ordinary text; special-token look-alikes stay text."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids, special tokens included by name."""

    def special_id(self, name: str) -> int:
        """The id of special token `name`; TokenizerError when the tokenizer has none."""

    def special_tokens(self) -> Mapping[str, int]:
        """Every token the tokenizer matches as a unit before ordinary text (name -> id)."""

    @property
    def has_chat_template(self) -> bool: ...

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        """The tokenizer's own chat template rendered as text; TokenizerError when it has none."""


class _SpecialTable:
    """Name <-> id lookups shared by the tokenizer classes."""

    def __init__(self, name: str, specials: Mapping[str, int]) -> None:
        self._name = name
        self._specials = dict(specials)

    def special_id(self, name: str) -> int:
        try:
            return self._specials[name]
        except KeyError:
            raise TokenizerError(f"tokenizer {self._name}: has no special token {name!r}") from None

    def special_tokens(self) -> Mapping[str, int]:
        return self._specials


class _ChatTemplateText:
    """A Jinja chat template from a tokenizer folder, rendered the way transformers renders it."""

    def __init__(self, name: str, template: str | None, variables: dict[str, str]) -> None:
        self._name = name
        self._template = template
        self._variables = variables

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        if self._template is None:
            raise TokenizerError(f"tokenizer {self._name}: has no chat template "
                                 f"(no chat_template.jinja and no chat_template in tokenizer_config.json)")
        # Imported here: transformers takes seconds to import and only `auto` templates need it.
        from transformers.utils.chat_template_utils import render_jinja_template
        try:
            rendered = render_jinja_template(conversations=[messages], chat_template=self._template,
                                             add_generation_prompt=add_generation_prompt, **self._variables)
        except Exception as e:  # a template error is the user's template, shown as such
            raise TokenizerError(f"tokenizer {self._name}: its chat template failed: {e}") from e
        text = rendered[0] if isinstance(rendered, tuple) else rendered
        return text[0] if isinstance(text, list) else text


def split_long_runs(text: str, limit: int = MAX_NO_WHITESPACES_CHARS) -> list[str]:
    """Kimi's `_split_whitespaces_or_nonwhitespaces`: cut so no piece holds more than `limit`
    consecutive whitespace or non-whitespace characters (cuts every `limit` characters of a run)."""
    if limit == MAX_NO_WHITESPACES_CHARS:
        found = _LONG_RUN.search(text)
        if found is None:
            return [text]
        start_at = found.start()
    else:
        start_at = 0
    cuts: list[int] = []
    for run in re.finditer(r"\s+|\S+", text[start_at:]):
        begin, end = run.start() + start_at, run.end() + start_at
        cuts.extend(range(begin + limit, end, limit))
    if not cuts:
        return [text]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def encode_like_kimi(encode_ordinary: Callable[[str], list[int]], text: str) -> list[int]:
    """tiktoken `encode_ordinary` over the same pieces Kimi's own `encode` cuts the text into."""
    if len(text) <= MAX_NO_WHITESPACES_CHARS:
        return encode_ordinary(text)
    ids: list[int] = []
    for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
        for piece in split_long_runs(text[i:i + TIKTOKEN_MAX_ENCODE_CHARS]):
            ids.extend(encode_ordinary(piece))
    return ids


class TiktokenTokenizer(_SpecialTable, _ChatTemplateText):
    """A tiktoken BPE (Kimi's `tiktoken.model`) with its special-token table."""

    def __init__(self, name: str, encoding: Any, specials: Mapping[str, int], chat_template: str | None = None,
                 template_variables: dict[str, str] | None = None, lossless_text: bool = False) -> None:
        _SpecialTable.__init__(self, name, specials)
        _ChatTemplateText.__init__(self, name, chat_template, template_variables or {})
        self.name = name
        self.encoding = encoding
        # Byte-level BPE over UTF-8 with every single byte in the vocabulary: decode(encode_text(t)) == t
        # for every valid Unicode text (reconstruction relies on it to skip decoding its own ids).
        self.lossless_text = lossless_text
        self.vocab_size = int(encoding.n_vocab)
        self._encode_ordinary = encoding.encode_ordinary

    def encode_text(self, text: str) -> list[int]:
        return encode_like_kimi(self._encode_ordinary, text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(ids))


def _plain_tokenizers_copy(full: Any) -> Any:
    """The same tokenizer without its added tokens: encodes text the way the model's vocabulary
    does, never matching a special-token look-alike."""
    import tokenizers
    data = json.loads(full.to_str())
    data["added_tokens"] = []
    return tokenizers.Tokenizer.from_str(json.dumps(data))


class TokenizersTokenizer(_SpecialTable, _ChatTemplateText):
    """A `tokenizer.json` loaded with the fast `tokenizers` library."""

    def __init__(self, name: str, full: Any, chat_template: str | None = None,
                 template_variables: dict[str, str] | None = None) -> None:
        specials = {t.content: int(i) for i, t in full.get_added_tokens_decoder().items()}
        _SpecialTable.__init__(self, name, specials)
        _ChatTemplateText.__init__(self, name, chat_template, template_variables or {})
        self.name = name
        self.vocab_size = int(full.get_vocab_size(with_added_tokens=True))
        self._full = full
        self._plain = _plain_tokenizers_copy(full)

    def encode_text(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._full.decode(list(ids), skip_special_tokens=False)


class TransformersTokenizer(_SpecialTable):
    """A transformers tokenizer (AutoTokenizer), for models with neither tiktoken.model nor tokenizer.json."""

    def __init__(self, name: str, tok: Any) -> None:
        _SpecialTable.__init__(self, name, {str(k): int(v) for k, v in tok.get_added_vocab().items()})
        self.name = name
        self.vocab_size = int(len(tok))
        self._tok = tok
        backend = getattr(tok, "backend_tokenizer", None)
        model = getattr(tok, "model", None)
        self._plain = _plain_tokenizers_copy(backend) if backend is not None else None
        self._tiktoken = model if hasattr(model, "encode_ordinary") else None

    def encode_text(self, text: str) -> list[int]:
        if self._plain is not None:
            return self._plain.encode(text, add_special_tokens=False).ids
        if self._tiktoken is not None:
            return encode_like_kimi(self._tiktoken.encode_ordinary, text)
        return list(self._tok.encode(text, add_special_tokens=False, split_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        if self._tiktoken is not None:
            return self._tiktoken.decode(list(ids))
        return self._tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        if not self.has_chat_template:
            raise TokenizerError(f"tokenizer {self.name}: has no chat template")
        try:
            return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:
            raise TokenizerError(f"tokenizer {self.name}: its chat template failed: {e}") from e


# ---------------------------------------------------------------------------------------------
# Loading


def bundled_kimi_path() -> Path:
    """The folder of the bundled Kimi-K2 tokenizer (package data)."""
    return Path(str(importlib.resources.files("draftgen.core") / "data" / "kimi-k2"))


@functools.cache
def bundled_kimi() -> TiktokenTokenizer:
    """The real Kimi-K2 vocabulary bundled with draftgen (demo tokenizer and test fixture)."""
    tok = _load_tiktoken_folder(bundled_kimi_path())
    tok.name = "kimi-k2 (bundled)"
    return tok


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    except UnicodeDecodeError:
        raise TokenizerError(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read: {e.strerror}") from None


def _read_bpe_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken.model: one `base64-token rank` pair a line; errors name the line."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read: {e.strerror}") from None
    ranks: dict[bytes, int] = {}
    a2b = binascii.a2b_base64
    lineno = 0
    try:
        for lineno, line in enumerate(raw.splitlines(), 1):
            token, sep, rank = line.partition(b" ")
            if not sep:
                if not line.strip():
                    continue
                raise ValueError("expected `<base64 token> <rank>`")
            ranks[a2b(token, strict_mode=True)] = int(rank)
    except (ValueError, binascii.Error) as e:
        raise TokenizerError(f"{path}: line {lineno} is not a tiktoken BPE entry ({e})") from None
    if not ranks:
        raise TokenizerError(f"{path}: holds no tokens (empty or not a tiktoken BPE file)")
    if len(set(ranks.values())) != len(ranks):
        raise TokenizerError(f"{path}: two tokens share a rank (the file is damaged)")
    return ranks


def _bundled_table() -> dict[str, Any]:
    return _read_json(bundled_kimi_path() / "special_tokens.json")


def _chat_template_from(folder: Path, tok_config: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{jinja}: cannot read: {e}") from None
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) else None


def _template_variables(tok_config: dict[str, Any]) -> dict[str, str]:
    variables = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = tok_config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            variables[key] = value
    return variables


def _load_tiktoken_folder(folder: Path) -> TiktokenTokenizer:
    import tiktoken

    model = folder / "tiktoken.model"
    ranks = _read_bpe_ranks(model)
    n_base = max(ranks.values()) + 1
    config_path = folder / "tokenizer_config.json"
    tok_config = _read_json(config_path) if config_path.exists() else {}
    if not isinstance(tok_config, dict):
        raise TokenizerError(f"{config_path}: must hold a JSON object")
    beside = folder / "special_tokens.json"
    table = _read_json(beside) if beside.exists() else _bundled_table()
    if not isinstance(table, dict):
        raise TokenizerError(f"{beside}: must hold a JSON object")

    named: dict[int, str] = {}
    decoder = tok_config.get("added_tokens_decoder")
    if isinstance(decoder, dict) and decoder:
        where = config_path
        try:
            for key, value in decoder.items():
                named[int(key)] = str(value["content"] if isinstance(value, dict) else value)
        except (ValueError, KeyError, TypeError):
            raise TokenizerError(f"{config_path}: added_tokens_decoder must map ids to "
                                 f"{{\"content\": ...}} objects") from None
    else:
        where = beside if beside.exists() else bundled_kimi_path() / "special_tokens.json"
        try:
            named = {int(i): str(n) for n, i in dict(table.get("named", {})).items()}
        except (ValueError, TypeError):
            raise TokenizerError(f"{where}: \"named\" must map token names to integer ids") from None
        # A tiktoken.model cut at a line boundary (an interrupted copy) parses: only its size tells.
        expected = table.get("base_vocab_size")
        if isinstance(expected, int) and n_base != expected:
            raise TokenizerError(f"{model}: holds {n_base:,} tokens but {where} expects {expected:,}: the file is "
                                 f"cut short (copy it again) or belongs to another model (then put that model's "
                                 f"special_tokens.json or tokenizer_config.json beside it)")
    reserved = int(table.get("num_reserved_special_tokens", KIMI_RESERVED_SPECIAL_TOKENS))
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n_base, n_base + reserved)}
    for i, name in named.items():
        if i < n_base:
            raise TokenizerError(f"{where}: special token {name!r} has id {i}, inside the BPE vocabulary of {model}")
        specials[name] = i
    if len(set(specials.values())) != len(specials):
        raise TokenizerError(f"{where}: two special tokens share a name")

    alternatives = table.get("pat_str_alternatives")
    pat_str = table.get("pat_str") or ("|".join(alternatives) if isinstance(alternatives, list) else None)
    if not isinstance(pat_str, str) or not pat_str:
        pat_str = "|".join(_bundled_table()["pat_str_alternatives"])
    try:
        encoding = tiktoken.Encoding(name=str(folder), pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials)
    except Exception as e:  # tiktoken raises plain ValueErrors for bad patterns or overlapping ids
        raise TokenizerError(f"{folder}: tiktoken cannot build the tokenizer: {e}") from e
    lossless = all(bytes([b]) in ranks for b in range(256))
    return TiktokenTokenizer(str(folder), encoding, specials, _chat_template_from(folder, tok_config),
                             _template_variables(tok_config), lossless)


def _load_tokenizers_folder(folder: Path) -> TokenizersTokenizer:
    import tokenizers

    path = folder / "tokenizer.json"
    try:
        full = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception with a serde message
        raise TokenizerError(f"{path}: not a valid tokenizer.json ({e})") from None
    config_path = folder / "tokenizer_config.json"
    tok_config = _read_json(config_path) if config_path.exists() else {}
    if not isinstance(tok_config, dict):
        raise TokenizerError(f"{config_path}: must hold a JSON object")
    return TokenizersTokenizer(str(folder), full, _chat_template_from(folder, tok_config),
                               _template_variables(tok_config))


_TRANSFORMERS_FILES = ("tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model", "vocab.txt")


def _load_transformers(source: str, label: str, trust_remote_code: bool) -> TransformersTokenizer:
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, ImportError... all mean "cannot load"
        hint = "" if trust_remote_code else " (if the model ships its own tokenizer code, set tokenizer.trust_remote_code = true)"
        raise TokenizerError(f"tokenizer {label}: transformers cannot load it offline: {e}{hint}") from None
    return TransformersTokenizer(label, tok)


def _load_folder(folder: Path, trust_remote_code: bool) -> Tokenizer:
    if (folder / "tiktoken.model").exists():
        return _load_tiktoken_folder(folder)
    if (folder / "tokenizer.json").exists():
        return _load_tokenizers_folder(folder)
    if any((folder / f).exists() for f in _TRANSFORMERS_FILES):
        return _load_transformers(str(folder), str(folder), trust_remote_code)
    raise TokenizerError(f"{folder}: no tokenizer here (expected tiktoken.model, tokenizer.json or "
                         f"tokenizer_config.json)")


def _cached_snapshot(repo_id: str) -> Path | None:
    """The local Hugging Face cache folder of `repo_id`, or None; never touches the network."""
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached, bad id, hub library missing: all mean "not available offline"
        return None


def _looks_like_path(path: str) -> bool:
    return path.startswith((".", "/", "~")) or path.count("/") > 1 or "\\" in path


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, trust_remote_code: bool) -> Tokenizer:
    p = Path(path).expanduser()
    if p.is_file():
        if p.name in ("tiktoken.model", "tokenizer.json"):
            return _load_folder(p.parent, trust_remote_code)
        raise TokenizerError(f"{p}: a tokenizer path must be a folder (or its tiktoken.model / tokenizer.json)")
    if p.is_dir():
        if p.resolve() == bundled_kimi_path().resolve():
            return bundled_kimi()  # one copy per process, whichever way it is named
        return _load_folder(p, trust_remote_code)
    if _looks_like_path(path):
        raise TokenizerError(f"{p}: tokenizer folder not found")
    snapshot = _cached_snapshot(path)
    if snapshot is not None and ((snapshot / "tiktoken.model").exists() or (snapshot / "tokenizer.json").exists()):
        tok = _load_folder(snapshot, trust_remote_code)
        tok.name = path
        return tok
    if snapshot is not None:
        return _load_transformers(str(snapshot), path, trust_remote_code)
    raise TokenizerError(
        f"tokenizer {path!r}: not a local folder and not in the Hugging Face cache; draftgen never downloads "
        f"it. Download it where there is internet (`huggingface-cli download {path} --include '*.json' "
        f"'*.model' '*.jinja' '*.py' '*.txt'`) or set tokenizer.path to a local folder")


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Tokenizer:
    """Load the tokenizer at `path` (a folder or a Hugging Face id in the local cache); cached per process."""
    if not path:
        raise TokenizerError("tokenizer.path is empty")
    return _load_cached(str(path), bool(trust_remote_code))
