"""The tokenizer types draftgen encodes with: one protocol, three implementations (tiktoken,
`tokenizers`, transformers), each giving exact ids for ordinary text and special tokens by name.

`encode_text` treats its input as ordinary text: a literal "<|im_end|>" typed in a prompt or an
answer stays text and is never turned into the special token. How a folder or a model id becomes
one of these: core/tokens/tokenizer.py.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from draftgen.core.errors import TokenizerError

# Kimi's tokenization_kimi.py hands tiktoken at most 400,000 characters at a time and cuts runs of
# more than 25,000 whitespace or non-whitespace characters (tiktoken issue #195); ids at those
# cuts differ from an uncut encode, so the same cuts are made here to stay id-exact.
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000
# Texts up to this long are encoded once per tokenizer and remembered (at most SHORT_TEXTS of them, the
# least recently used forgotten first): a conversation's role names and headers ("user", "assistant")
# come back in every answer, and a call into tiktoken costs more than the few tokens it returns.
SHORT_TEXT_CHARS = 16
SHORT_TEXTS = 1024
# A run start followed by more than the limit of the same class: matched in linear time because
# the look-behind fails at once inside a run.
_LONG_RUN = re.compile(rf"(?<!\S)\S{{{MAX_NO_WHITESPACES_CHARS + 1}}}|(?<!\s)\s{{{MAX_NO_WHITESPACES_CHARS + 1}}}")

KIMI_RESERVED_SPECIAL_TOKENS = 256


@runtime_checkable
class Tokenizer(Protocol):
    """What reconstruction needs from a tokenizer."""

    name: str
    vocab_size: int
    origin: str  # what was read (a file, or a file as transformers rebuilds it), for mismatch hints

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

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                    tools: list[Any] | None = None) -> str:
        """The tokenizer's own chat template rendered as text (`tools`: the request's function schemas,
        passed to the template as `tools`); TokenizerError when it has none."""


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

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                    tools: list[Any] | None = None) -> str:
        if self._template is None:
            raise TokenizerError(f"tokenizer {self._name}: has no chat template "
                                 f"(no chat_template.jinja and no chat_template in tokenizer_config.json)")
        # Imported here: transformers takes seconds to import and only `auto` templates need it.
        from transformers.utils.chat_template_utils import render_jinja_template
        try:
            rendered = render_jinja_template(conversations=[messages], tools=tools, chat_template=self._template,
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
        self.origin = name  # the file or folder the ids come from, named in mismatch hints
        self.encoding = encoding
        # Byte-level BPE over UTF-8 with every single byte in the vocabulary: decode(encode_text(t)) == t
        # for every valid Unicode text (reconstruction relies on it to skip decoding its own ids).
        self.lossless_text = lossless_text
        # encode_text never gives a special token's id: tiktoken's encode_ordinary gives the BPE's ranks only,
        # and the loader refuses a special id among them (tokenizer.py). Reconstruction relies on it to find
        # the think tags of its own ids among the answer's special pieces, without a pass over the span.
        self.text_ids_plain = True
        self.vocab_size = int(encoding.n_vocab)
        self._encode_ordinary = encoding.encode_ordinary
        # tiktoken's Rust encoder itself: `Encoding.encode_ordinary` is a Python call around it whose only work
        # is to replace lone surrogates when it raises UnicodeEncodeError (encode_text does the same by
        # calling that wrapper then). A frame less on each of an answer's texts.
        core = getattr(encoding, "_core_bpe", None)
        self._encode_core = core.encode_ordinary if core is not None else encoding.encode_ordinary
        # Keyed by the text, per tokenizer; tuples, so no caller can change what is remembered.
        self._encode_short = functools.lru_cache(maxsize=SHORT_TEXTS)(
            lambda text: tuple(encoding.encode_ordinary(text)))

    def encode_text(self, text: str) -> list[int]:
        n = len(text)
        if n <= SHORT_TEXT_CHARS:
            return list(self._encode_short(text))
        if n <= MAX_NO_WHITESPACES_CHARS:  # encode_like_kimi's one piece, without its call
            try:
                return self._encode_core(text)
            except UnicodeEncodeError:
                return self._encode_ordinary(text)
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
        self.origin = name  # the file or folder the ids come from, named in mismatch hints
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
        self.origin = name  # the file or folder the ids come from, named in mismatch hints
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

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                    tools: list[Any] | None = None) -> str:
        if not self.has_chat_template:
            raise TokenizerError(f"tokenizer {self.name}: has no chat template")
        try:
            return self._tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        except Exception as e:
            raise TokenizerError(f"tokenizer {self.name}: its chat template failed: {e}") from e
