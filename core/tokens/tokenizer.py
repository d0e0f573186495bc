"""Loading the target model's tokenizer (the types it loads into: core/tokens/encoders.py).

Three ways in, chosen by what `tokenizer.path` holds:

- a folder with `tiktoken.model` (Kimi style): loaded with tiktoken, no remote code. Special
  tokens come from the folder's `tokenizer_config.json` `added_tokens_decoder` when present, else
  from `special_tokens.json` beside it, else from the bundled Kimi table; every id of the reserved
  range left unnamed is `<|reserved_token_{id}|>`. The split pattern comes from `special_tokens.json`
  beside it, else the bundled Kimi pattern.
- a folder with `tokenizer.json`: loaded with the `tokenizers` library, as transformers'
  `AutoTokenizer` builds it for that folder when it can (offline, `trust_remote_code` as configured):
  the serving stack's class may rebuild the file's pre-tokenizer (transformers 5's `Qwen2Tokenizer`
  splits digits one by one), and ids must be the server's. `origin` says which was read.
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
from pathlib import Path
from typing import Any

from draftgen.core.errors import TokenizerError
from draftgen.core.tokens.encoders import (
    KIMI_RESERVED_SPECIAL_TOKENS,
    MAX_NO_WHITESPACES_CHARS,
    TiktokenTokenizer,
    Tokenizer,
    TokenizersTokenizer,
    TransformersTokenizer,
    split_long_runs,
)

__all__ = ["MAX_NO_WHITESPACES_CHARS", "TiktokenTokenizer", "Tokenizer", "TokenizersTokenizer", "TransformersTokenizer",
           "bundled_kimi", "bundled_kimi_path", "load_tokenizer", "split_long_runs"]


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
        for lineno, line in enumerate(raw.splitlines(), 1):  # noqa: B007 - the except names the line
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


def _served_backend(folder: Path, trust_remote_code: bool) -> tuple[Any, str] | None:
    """The fast tokenizer transformers builds for `folder` (what transformers serve, vLLM and SGLang
    load), with its class name; None when transformers cannot load it offline."""
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception:  # missing config, remote code refused, no transformers: the file alone then
        return None
    backend = getattr(tok, "backend_tokenizer", None)
    return (backend, type(tok).__name__) if backend is not None else None


def _differing_parts(a: Any, b: Any) -> list[str]:
    """The top-level tokenizer.json sections (normalizer, pre_tokenizer, model...) that differ."""
    da, db = json.loads(a.to_str()), json.loads(b.to_str())
    return [k for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k)]


def _load_tokenizers_folder(folder: Path, trust_remote_code: bool = False) -> TokenizersTokenizer:
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
    origin = str(path)
    # The serving stack loads the folder with AutoTokenizer, whose class may rebuild parts of the file
    # (transformers 5's Qwen2Tokenizer splits digits whatever tokenizer.json says): encode as it does.
    served = _served_backend(folder, trust_remote_code) if (folder / "config.json").exists() or \
        "tokenizer_class" in tok_config else None
    if served is not None:
        backend, cls = served
        parts = _differing_parts(full, backend)
        if parts:
            full = backend
            origin = (f"{path} as transformers loads it ({cls}, whose {', '.join(parts)} differ from the "
                      f"file's; the serving stack encodes with {cls} too)")
    tok = TokenizersTokenizer(str(folder), full, _chat_template_from(folder, tok_config),
                              _template_variables(tok_config))
    tok.origin = origin
    return tok


_TRANSFORMERS_FILES = ("tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model", "vocab.txt")


def _load_transformers(source: str, label: str, trust_remote_code: bool) -> TransformersTokenizer:
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, ImportError... all mean "cannot load"
        hint = "" if trust_remote_code else (" (if the model ships its own tokenizer code, "
                                             "set tokenizer.trust_remote_code = true)")
        raise TokenizerError(f"tokenizer {label}: transformers cannot load it offline: {e}{hint}") from None
    return TransformersTokenizer(label, tok)


def _load_folder(folder: Path, trust_remote_code: bool) -> Tokenizer:
    if (folder / "tiktoken.model").exists():
        return _load_tiktoken_folder(folder)
    if (folder / "tokenizer.json").exists():
        return _load_tokenizers_folder(folder, trust_remote_code)
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
        f"it. Download it first (nothing is paid for until it loads): `{download_command(path)}`, "
        f"or set tokenizer.path to a local folder")


def hf_cli() -> str:
    """The download command of the installed huggingface_hub: `hf` from 0.34 on (1.0 dropped
    `huggingface-cli`), `huggingface-cli` before."""
    try:
        import huggingface_hub
        major, minor = (int(x) for x in huggingface_hub.__version__.split(".")[:2])
    except (ImportError, ValueError):
        return "hf"  # not installed: `pip install huggingface_hub` brings `hf`
    return "hf" if (major, minor) >= (0, 34) else "huggingface-cli"


def download_command(repo: str) -> str:
    """The shell command that puts a tokenizer's files (not the weights) in the Hugging Face cache."""
    return f"{hf_cli()} download {repo} --include '*.json' '*.model' '*.jinja' '*.py' '*.txt'"


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Tokenizer:
    """Load the tokenizer at `path` (a folder or a Hugging Face id in the local cache); cached per process."""
    if not path:
        raise TokenizerError("tokenizer.path is empty")
    return _load_cached(str(path), bool(trust_remote_code))
