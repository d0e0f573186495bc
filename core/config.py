"""The run configuration: one TOML file loaded into frozen, typed objects (`config_load.load_config`).

This module holds the whole `Config` and its [api] table, and what a run asks of them: the exact body
sent for a prompt, the request's fingerprint, the key. The other tables are in `config_tables`, a
key's coercion by its type in `config_values`, the checks beyond a type in `config_checks`.

Relative paths are resolved against the config file's folder. The API key is never in the file:
`api_key_env` names the environment variable that holds it, read by `Config.api_key()`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import orjson

from draftgen.core.bodies import ChatBody, ChatMessage
from draftgen.core.config_tables import (
    BudgetConfig,
    DatasetConfig,
    EngineConfig,
    ExtractConfig,
    MergeConfig,
    MonitorConfig,
    OutputConfig,
    SmokeConfig,
    TokenizerConfig,
    ValidationConfig,
)
from draftgen.core.config_values import key_fields
from draftgen.core.errors import ConfigError
from draftgen.core.secrets import key_problem
from draftgen.core.server_kinds import KindName, configured_kind
from draftgen.core.servers import IDS_KEYS, ServerProfile, ids_request


@dataclass(frozen=True)
class ApiConfig:
    base_url: str = "https://openrouter.ai/api/v1"
    # "openrouter" (account endpoints, usage.cost, routing, generation records), "openai-compatible"
    # (SGLang, vLLM, transformers serve: none of those), or "auto" (core/server_kinds.py; the run's kind
    # is `server.kind`).
    kind: KindName = "auto"
    api_key_env: str = "OPENROUTER_API_KEY"
    model: str = "moonshotai/kimi-k2.5"
    request_timeout_s: float = 1800.0
    connect_timeout_s: float = 30.0
    # None: stream against OpenRouter (aborting a stream stops its billing; the generation id comes
    # with the headers), not elsewhere. See `streams`.
    stream: bool | None = None
    referer: str = "https://github.com/draftgen/draftgen"
    title: str = "draftgen"
    credits_interval_s: float = 60.0
    # Ask the server for the generated token ids (vLLM, SGLang: each release its own way, found at run
    # start, core/servers.py); they become the sample's ids and the text is checked against them.
    return_token_ids: bool = False
    # A management key's variable: the only key GET /credits answers (else GET /key's limit_remaining).
    management_key_env: str = ""
    # USD per million tokens, for servers without OpenRouter's endpoints listing; set, they win over it.
    prompt_price_per_mtok: float | None = None
    completion_price_per_mtok: float | None = None
    # How long an abandoned generation is looked up (GET /generation?id=, retried on 404) before it is
    # left pending for the next run or `draftgen ledger`.
    generation_lookup_s: float = 120.0
    # Request keys draftgen does not know, sent as written (core/request_keys.py): their effect on what is
    # generated and billed is the user's to know; the reservation counts them as changing nothing.
    request_pass_through: list[str] = field(default_factory=list)
    # Not a key: what this run found of its server (core/servers.py), its own for each loaded config and
    # shared by the copies `dataclasses.replace` makes of it (the same run, the same server).
    server: ServerProfile = field(default_factory=ServerProfile, compare=False, repr=False,
                                  metadata={"key": False})
    # Not a key of its own: every URL of a `base_url` list (a fleet of self-hosted servers,
    # core/generate/api/fleet.py), `base_url` being the first; () when base_url is one URL.
    servers: tuple[str, ...] = field(default=(), metadata={"key": False})

    def __post_init__(self) -> None:
        self.server.configure(configured_kind(self.kind, self.base_url))

    @property
    def fleet(self) -> tuple[str, ...]:
        """Every server's URL: the list's, else the one base_url."""
        return self.servers or (self.base_url,)

    @property
    def openrouter_for_sure(self) -> bool:
        """The kind is OpenRouter's whatever the server answers (set so, or `auto` on openrouter.ai)."""
        return self.kind == "openrouter" or (self.kind == "auto" and "openrouter.ai" in self.base_url)

    @property
    def streams(self) -> bool:
        """Whether requests stream: `stream` when set; else on OpenRouter; else on a server whose smoke test
        decides it, the mode that keeps text as generated (`ServerProfile.note_stream`), else not."""
        if self.configured_streams or self.stream is not None:
            return self.configured_streams
        return self.server.kind.smoke_decides_stream and bool(self.server.stream)

    @property
    def configured_streams(self) -> bool:
        """The mode from the config alone (no smoke test's decision): what the request fingerprint holds."""
        if self.stream is not None:
            return self.stream
        return "openrouter.ai" in self.base_url and self.server.kind.streams_by_default

    @property
    def stream_decided(self) -> bool:
        """Streaming because a smoke test decided it (not the config)."""
        return self.streams and not self.configured_streams

    def management_key(self) -> str:
        """The management key from `management_key_env`, or "" when none is configured or set."""
        return os.environ.get(self.management_key_env, "") if self.management_key_env else ""


@dataclass(frozen=True)
class Config:
    path: Path
    api: ApiConfig
    request: dict[str, Any]
    budget: BudgetConfig
    tokenizer: TokenizerConfig
    output: OutputConfig
    datasets: tuple[DatasetConfig, ...]
    engine: EngineConfig
    merge: MergeConfig
    extract: ExtractConfig
    smoke: SmokeConfig
    validation: ValidationConfig = ValidationConfig()
    monitor: MonitorConfig = MonitorConfig()

    @property
    def run_dir(self) -> Path:
        return self.output.dir

    def api_key(self) -> str:
        """The key from the environment variable the config names; a clear error when it is unset or
        unusable (whitespace, a line break, a control character: said without quoting the key)."""
        key = os.environ.get(self.api.api_key_env, "")
        if not key:
            raise ConfigError(
                f"{self.path}: api.api_key_env names ${self.api.api_key_env}, which is not set "
                f"(export {self.api.api_key_env}=... before running)"
            )
        for where, name, value in (("api_key_env", self.api.api_key_env, key),
                                   ("management_key_env", self.api.management_key_env, self.api.management_key())):
            problem = key_problem(value) if value else None
            if problem:
                raise ConfigError(f"{self.path}: the key in ${name} (api.{where}) {problem}: export it again "
                                  f"without it (the key itself is not shown)")
        return key

    def request_body(self, dataset: DatasetConfig, messages: list[ChatMessage], *,
                     decided: bool = True, server_ids: bool = True, index: int | None = None) -> ChatBody:
        """The exact body sent for a prompt of `dataset`: the [request] table as-is, then the dataset's
        (streamed as the smoke test decided, `ApiConfig.streams`; `decided` False: as configured), then
        the dataset's sampling cycles at the prompt's `index` (`cycle_index`; None: no cycle applied).
        With `[api] return_token_ids`, the keys that ask the server found at run start for its ids in
        this mode (core/servers.py; `server_ids` False: the plain `return_token_ids` switch). The tables'
        keys are the user's, any of those core/request_keys.py lets through: built as a plain dict, the
        body is a `ChatBody` from here on (core/bodies.py): the one cast that makes a body."""
        body: dict[str, Any] = {"model": self.api.model, "messages": messages, "max_tokens": dataset.max_tokens}
        body.update(self.request)
        body.update(dataset.request)
        if index is not None and dataset.cycles:
            self._cycle(body, dataset, index)
        kind = self.api.server.kind
        if self.api.return_token_ids:
            if server_ids and kind.returns_ids:
                for key in IDS_KEYS:
                    body.pop(key, None)
                streams = self.api.streams if decided else self.api.configured_streams
                body.update(ids_request(self.api.server.release, streams))
            else:
                body["return_token_ids"] = True
        for key in self.dropped_keys(dataset):
            del body[key]
        if self.api.streams if decided else self.api.configured_streams:
            body["stream"] = True
            if kind.stream_usage_asked:  # vLLM and SGLang put usage in a stream only when asked
                body["stream_options"] = {"include_usage": True}
        return cast(ChatBody, body)

    def _cycle(self, body: dict[str, Any], dataset: DatasetConfig, index: int) -> None:
        """The cycles' temperature and reasoning effort for the prompt at `index`, into `body`: the effort
        as OpenRouter's `reasoning.effort` (beside the table's other reasoning keys), or as the top-level
        `reasoning_effort` vLLM and SGLang read on a self-hosted server (`reasoning` is OpenRouter-only)."""
        temperature, effort = dataset.sampling_at(index)
        if temperature is not None:
            body["temperature"] = temperature
        if effort is not None:
            self.api.server.kind.put_effort(body, effort)

    def dropped_keys(self, dataset: DatasetConfig) -> list[str]:
        """The request keys of `dataset` the server's kind does not take (OpenRouter-only keys for an
        openai-compatible server), left out of its bodies."""
        return [k for k in self.api.server.kind.dropped_keys if k in self.request or k in dataset.request]

    def kind_warning(self) -> str:
        """One warning naming the OpenRouter-only keys dropped for an openai-compatible server ("" if none)."""
        kind = self.api.server.kind
        keys = sorted({k for d in self.datasets for k in self.dropped_keys(d)}, key=kind.dropped_keys.index)
        if not keys:
            return ""
        one = len(keys) == 1
        return (f"{self.path}: [request] {', '.join(keys)} {'is' if one else 'are'} OpenRouter-only, not sent to "
                f"{kind.label} at {self.api.base_url} (remove {'it' if one else 'them'} to silence this)")

    def request_shape(self, dataset: DatasetConfig) -> dict[str, Any]:
        """Everything about a request except its messages: what the smoke test must have checked (the
        configured mode: the smoke test that decided a self-hosted server's mode checked both)."""
        body = self.request_body(dataset, [], decided=False, server_ids=False)
        body.pop("messages")
        # A fleet's every server (the smoke test checked each): a server added or removed makes it stale.
        shape: dict[str, Any] = {"base_url": list(self.api.servers) if self.api.servers else self.api.base_url, **body}
        if dataset.cycles:  # only when set: a config without cycles keeps its fingerprint
            shape["cycles"] = {"temperatures": dataset.temperatures, "reasoning_efforts": dataset.reasoning_efforts}
        return shape

    def fingerprint(self, dataset: DatasetConfig) -> str:
        return hashlib.sha256(orjson.dumps(self.request_shape(dataset), option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]

    def run_fingerprint(self) -> str:
        """One fingerprint over every dataset's request shape (what `run` compares with smoke.json)."""
        shapes = sorted({self.fingerprint(d) for d in self.datasets})
        return hashlib.sha256("|".join(shapes).encode()).hexdigest()[:16]

    def public_dict(self) -> dict[str, Any]:
        """The config as written to run.json: no secrets (the key is only ever named, never read here)."""
        def convert(value: Any) -> Any:
            if dataclasses.is_dataclass(value):
                return {f.name: convert(getattr(value, f.name)) for f in key_fields(value)}
            if isinstance(value, Path):
                return str(value)
            if isinstance(value, (list, tuple)):
                return [convert(v) for v in value]
            if isinstance(value, dict):
                return {k: convert(v) for k, v in value.items()}
            return value
        out = convert(self)
        if self.api.servers:  # a fleet: base_url as it was written, a list
            out["api"]["base_url"] = list(self.api.servers)
        out["tokenizer"]["system_turn"] = {"rendered": self.tokenizer.system_turn(),
                                           "why": self.tokenizer.system_turn_why()}
        return out
