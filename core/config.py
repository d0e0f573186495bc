"""The run configuration: one TOML file loaded into frozen, typed objects.

Unknown keys and bad values raise ConfigError naming the file and the dotted key. Relative paths
are resolved against the config file's folder. The API key is never in the file: `api_key_env`
names the environment variable that holds it, read by `Config.api_key()`.

Longer than most modules (~520 lines) on purpose: every table's defaults, types and checks sit
together, next to the config reference they mirror (docs/config.md); split by table, a key's rule would
live far from the others it is checked against (budgets against concurrency, paths against the file).
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import math
import os
import stat
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

from draftgen.core.errors import ConfigError
from draftgen.core.request_keys import (
    COMPLETION_LIMIT_KEYS,
    OPENROUTER_ONLY_KEYS,
    check_reasoning_budget,
    check_request_table,
    known_key,
)
from draftgen.core.secrets import key_problem
from draftgen.core.server_kinds import KindName, configured_kind
from draftgen.core.servers import IDS_KEYS, ServerProfile, ids_request

__all__ = ["COMPLETION_LIMIT_KEYS", "OPENROUTER_ONLY_KEYS"]  # re-exported: smoke.py and others read them here


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
class BudgetConfig:
    max_usd: float | None = None
    credit_floor_usd: float = 0.0


# What the Kimi K2 and K2-Thinking chat templates insert when a conversation has no system turn.
KIMI_DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."


@dataclass(frozen=True)
class TokenizerConfig:
    path: str = "moonshotai/Kimi-K2.5"
    template: str = "kimi-k2.5"
    trust_remote_code: bool = False
    # The system turn rendered in front of a conversation that has none: "auto" (what the template
    # itself does: none for Kimi-K2.5, see core/tokens/template.py), "none", or the text itself.
    default_system: str = "auto"
    # Special-token text typed in a prompt ("<|im_end|>"): "special" reads it as the token, as vLLM,
    # SGLang and transformers serve tokenize a rendered prompt; "text" keeps it text; "auto": "special"
    # on a self-hosted server, "text" on OpenRouter (its providers' stacks are unknown and vary).
    prompt_special_tokens: str = "auto"

    def prompt_specials(self, self_hosted: bool) -> bool:
        """Whether special-token text in prompts is read as the special token on this server kind."""
        return self.prompt_special_tokens == "special" or (self.prompt_special_tokens == "auto" and self_hosted)

    def system_turn(self) -> str | None:
        """The default system text this run renders (and writes into train.jsonl), or None."""
        return None if self.default_system in ("auto", "none") else self.default_system

    def system_turn_why(self) -> str:
        if self.default_system == "auto":
            return ("auto: none, as the template itself renders (Kimi-K2.5's chat template adds no default "
                    "system turn, unlike K2's)" if self.template == "kimi-k2.5" else
                    "auto: whatever the tokenizer's own chat template renders")
        if self.default_system == "none":
            return "none: conversations without a system turn are rendered without one"
        return "tokenizer.default_system: rendered in front of every conversation without a system turn"


@dataclass(frozen=True)
class OutputConfig:
    dir: Path = Path("runs/draftgen")
    # The run directory (or a folder above it) may be writable by other users: shared on purpose. Off, a run
    # refuses such a directory (core/rundir.py check_private): another user could move its records away or
    # reset its spend ledger.
    shared: bool = False


@dataclass(frozen=True)
class EngineConfig:
    parallel: bool = False
    max_attempts: int = 8
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    snapshot_hz: float = 4.0
    # Reconstruct token ids as answers land (worker processes); `draftgen tokens` does it later otherwise.
    reconstruct: bool = True
    workers: int = 0  # 0 = one per core
    # Skip a prompt whose normalised text another dataset of the run directory answered
    # (core/generate/loop/duplicates.py).
    skip_cross_dataset_duplicates: bool = True


@dataclass(frozen=True)
class DatasetConfig:
    name: str
    prompts: Path
    concurrency: int = 64
    max_tokens: int = 4096
    token_budget: int | None = None
    # Merged over the top-level [request] table for this dataset only.
    request: dict[str, Any] = field(default_factory=dict)
    # Which user turns of a conversation are asked: "last" (the turns up to the last user turn, as the file
    # has them, one request: today's default), "first" (a leading system turn and the first user turn),
    # "all" (every user turn in order, each asked on the target's own earlier answers; docs/config.md).
    turns: Literal["first", "last", "all"] = "last"
    max_turns: int | None = None  # turns = "all": the user turns asked per conversation at most
    # turns = "all", an agent line's tool results (docs/multi-turn.md): "match", the dataset's recorded result
    # is sent only after calls that match the dataset's (else the conversation ends, diverged); "replay",
    # spliced after whatever the target called (each such step flagged and counted).
    tool_results: Literal["match", "replay"] = "match"
    # Sampling cycles: the i-th prompt of the file (0-based line index, `cycle_index`) is asked with
    # temperatures[i % n] and reasoning effort reasoning_efforts[i % m]; every turn of a conversation alike.
    temperatures: list[float] = field(default_factory=list)
    reasoning_efforts: list[str] = field(default_factory=list)

    @property
    def cycles(self) -> bool:
        """Sampling cycles are set: the body's temperature or reasoning effort varies by prompt."""
        return bool(self.temperatures or self.reasoning_efforts)

    @property
    def records_sampling(self) -> bool:
        """Its responses.jsonl lines carry `sampling` (core/records.py): cycles set, or turns = "all"."""
        return self.cycles or self.turns == "all"

    def sampling_at(self, index: int) -> tuple[float | None, str | None]:
        """(temperature, reasoning effort) the cycles give the prompt at `index` (None: not cycled)."""
        t = self.temperatures[index % len(self.temperatures)] if self.temperatures else None
        e = self.reasoning_efforts[index % len(self.reasoning_efforts)] if self.reasoning_efforts else None
        return t, e


def cycle_index(line: int) -> int:
    """The sampling-cycle index of the prompt on 1-based `line` of its file: the 0-based line index. Stable
    across runs and resumes (it depends on the file alone, not on what is answered), and shared by every
    turn of a conversation; blank or rejected lines take an index too (a clean file: the prompt's rank)."""
    return max(0, line - 1)


def sampling_of(body: dict[str, Any]) -> dict[str, Any]:
    """The record's `sampling` field from the body actually sent: its temperature and reasoning effort
    (`reasoning.effort` on OpenRouter, `reasoning_effort` on a self-hosted server), null when absent."""
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    return {"temperature": body.get("temperature"), "reasoning_effort": effort or body.get("reasoning_effort")}


@dataclass(frozen=True)
class MergeConfig:
    seed: int = 42
    # Providers whose answers merge leaves out (the `ignore` line for answers already paid for).
    exclude_providers: list[str] = field(default_factory=list)
    # Turns of a turns = "all" dataset: "per_turn", one sample per generation event (each turn's history
    # and its answer, loss on that answer); "per_conversation", one per conversation (its longest run of
    # good turns from turn 1, every assistant turn in the loss mask). docs/merge.md says what each costs.
    multi_turn: Literal["per_turn", "per_conversation"] = "per_turn"
    # The contamination filter (core/merge/contamination.py): benchmarks by name ("humaneval") and files
    # of benchmark prompts (relative to the config); samples whose prompt holds one are left out.
    exclude: list[str] = field(default_factory=list)
    exclude_files: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ValidationConfig:
    """What makes a sample clean and when a provider is flagged (core/tokens/policy.py)."""
    # |answer tokens - billed completion_tokens| up to this: the count agrees.
    count_tolerance: int = 2
    # Beyond that but within this share of the billed answer: a BPE split (kept, reported). More: the
    # sample is dropped as count_mismatch (another model or tokenizer produced it).
    split_share: float = 0.005
    # |reconstructed prompt tokens - usage.prompt_tokens| up to this: the prompt agrees.
    prompt_tolerance: int = 0
    # true: a sample whose prompt disagrees is dropped (false: kept and reported).
    drop_prompt_mismatch: bool = False
    # A provider with at least this many answers is flagged when its share of exact answer (or
    # prompt) counts is this far below the other providers' together.
    provider_min_answers: int = 20
    provider_exact_gap: float = 0.25
    # One server (or provider) judged on its own: flagged when under this share of its answers' counts
    # are exact, or when its differences have a constant non-zero mode (a template or parser offset).
    min_exact_share: float = 0.75
    # true: merge drops the samples of a source flagged on its own (false: keeps them, reported).
    drop_flagged_sources: bool = True
    # true: an answer whose tool calls carry ids not of the model's own shape (`functions.NAME:IDX`;
    # a provider rewrote them) is dropped, its rendered ids not being what the model generated
    # (false: kept, reported as foreign_tool_call_id).
    drop_foreign_tool_call_ids: bool = True


@dataclass(frozen=True)
class ExtractConfig:
    model: str = ""
    # "sglang" (draftgen's own SGLang driver) was removed: config_from_dict says what replaced it.
    backend: Literal["hf", "specforge"] = "hf"
    tp_size: int = 1
    aux_layers: str | list[int] = "eagle3"
    # The model's forward dtype; "fp8": the forward in bfloat16 and the files stored as float8_e4m3fn with one
    # float32 scale per token (format = "speculators" only; docs/extraction.md).
    dtype: Literal["bfloat16", "float32", "fp8"] = "bfloat16"
    # The files' layout: SpecForge's offline .ckpt files, or one hs_{i}.safetensors per row for vLLM's speculators.
    format: Literal["specforge", "speculators"] = "specforge"
    device: str = "auto"
    batch_tokens: int = 16384      # padded tokens per forward (the longest sample alone may exceed it)
    compress: bool = False
    trust_remote_code: bool = False
    # specforge backend: SGLang's static share of each GPU (weights + KV pool; 0 = chosen by the GPU
    # plan from the model and the cards, docs/extraction.md), its attention backend ("" = SGLang's
    # choice) and the /dev/shm NCCL needs, checked at start.
    mem_fraction_static: float = 0.0
    attention_backend: str = ""
    min_shm_gb: float = 1.0
    # [extract.sglang]: more SGLang ServerArgs, passed through as keyword arguments (specforge backend).
    sglang: dict[str, Any] = field(default_factory=dict)
    # The plan's time estimate when no earlier run of this directory measured one (0: unknown).
    tokens_per_s: float = 0.0
    # The run pauses before a batch while free disk is below its bytes plus this margin.
    min_free_gb: float = 1.0
    # The most hidden_states/ may hold, in GB (10^9 bytes; 0 = no limit): samples are extracted in merged
    # order while their estimated bytes fit, then the run stops and says what is left (docs/extraction.md).
    max_disk_gb: float = 0.0
    # true: hidden_states/ files 0640 and folders 0750 (readable by the group, e.g. a training job
    # running as another user); false: 0600/0700, this user only.
    group_readable: bool = False

    @property
    def compute_dtype(self) -> str:
        """The dtype the model runs in ("fp8" files come from a bfloat16 forward)."""
        return "bfloat16" if self.dtype == "fp8" else self.dtype


@dataclass(frozen=True)
class MonitorConfig:
    """[monitor]: what a live run shows outside its terminal and attach socket (docs/metrics.md)."""
    # "HOST:PORT" ("[::1]:9400" for IPv6): Prometheus text on http://HOST:PORT/metrics while a run is
    # live; "" (the default): off. Port 0 takes a free port, said in the log.
    metrics: str = ""
    # A HOST that is not loopback serves the run's figures to the network: refused unless this is set.
    metrics_public: bool = False

    def metrics_address(self) -> tuple[str, int] | None:
        """(host, port) of `metrics`, None when off; the config check has refused a malformed one."""
        return split_host_port(self.metrics) if self.metrics else None


def split_host_port(text: str) -> tuple[str, int]:
    """("127.0.0.1", 9400) from "127.0.0.1:9400", ("::1", 9400) from "[::1]:9400"; ValueError says why not."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError("must be HOST:PORT, e.g. \"127.0.0.1:9400\"")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError("an IPv6 address goes in brackets: \"[::1]:9400\"")
    if not port.isascii() or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"the port must be a number from 0 to 65535, not {port!r}")
    if not host or not host.isprintable() or any(c.isspace() or c in "/[]" for c in host):
        raise ValueError(f"{host!r} is not a host name or address")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """`host` names this machine only: localhost, 127.0.0.0/8 or ::1 (a name other than localhost is
    not taken on trust: it may resolve anywhere)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class SmokeConfig:
    prompt: str = "What is 2+2? Answer in one word."
    # None: each dataset's own max_tokens, so the request is exactly the run's (same fingerprint).
    max_tokens: int | None = None


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

    def request_body(self, dataset: DatasetConfig, messages: list[dict[str, Any]], *,
                     decided: bool = True, server_ids: bool = True, index: int | None = None) -> dict[str, Any]:
        """The exact body sent for a prompt of `dataset`: the [request] table as-is, then the dataset's
        (streamed as the smoke test decided, `ApiConfig.streams`; `decided` False: as configured), then
        the dataset's sampling cycles at the prompt's `index` (`cycle_index`; None: no cycle applied).
        With `[api] return_token_ids`, the keys that ask the server found at run start for its ids in
        this mode (core/servers.py; `server_ids` False: the plain `return_token_ids` switch)."""
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
        return body

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
        shape = {"base_url": list(self.api.servers) if self.api.servers else self.api.base_url, **body}
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


def _toml_string(text: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's, and DEL, which JSON leaves bare and TOML refuses, as \\u007f."""
    return orjson.dumps(text).decode().replace("\x7f", "\\u007f")


def toml_value(value: Any) -> str:
    """One TOML value: strings as basic strings, lists, inline tables."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, Path)):
        return _toml_string(str(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_string(str(k))} = {toml_value(x)}" for k, x in value.items()) + "}"
    if isinstance(value, (int, float)):
        return repr(value)  # TOML spells nan and inf as Python does
    raise TypeError(f"no TOML for {type(value).__name__}")


# ---------------------------------------------------------------------------------------------
# Loading and validation

_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
               Path: "a path string", dict: "a table", list: "a list"}


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is list:
        (inner,) = typing.get_args(tp)
        return f"a list of {_describe(inner).removeprefix('a ').removeprefix('an ')}s"
    return _TYPE_NAMES.get(origin or tp, str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; return it converted (ints to floats, strs to Paths)."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return _coerce_union(value, tp, where)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where} must be {_describe(tp)}, not {value!r}")
        return value
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be {_describe(tp)}, not {value!r}")
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table, not {value!r}")
        return value
    coerce = _SCALARS.get(tp)
    if coerce is None:
        raise TypeError(f"unhandled config type {tp!r}")  # a programming error, not a user one
    return coerce(value, where)


def _coerce_union(value: Any, tp: Any, where: str) -> Any:
    """`None` where the union allows it, else the first arm that takes the value."""
    if value is None and type(None) in typing.get_args(tp):
        return None
    arms = [arm for arm in typing.get_args(tp) if arm is not type(None)]
    if len(arms) == 1:  # `float | None`: the arm's own message ("must be a finite number")
        return _coerce(value, arms[0], where)
    for arm in arms:
        try:
            return _coerce(value, arm, where)
        except ConfigError:
            pass
    raise ConfigError(f"{where} must be {_describe(tp)}, not {value!r}")


def _coerce_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, not {value!r}")
    return value


def _coerce_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where} must be an integer, not {value!r}")
    return value


def _coerce_float(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be a number, not {value!r}")
    if not math.isfinite(value):  # TOML has nan and inf: a nan budget would never stop the run
        raise ConfigError(f"{where} must be a finite number, not {value!r}")
    return float(value)


def _no_nul(value: str, where: str) -> None:
    if "\x00" in value:  # names and paths reach the filesystem, which cannot hold a NUL
        raise ConfigError(f"{where} must not contain a NUL character (\\u0000), not {value!r}")


def _coerce_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, not {value!r}")
    _no_nul(value, where)
    return value


def _coerce_path(value: Any, where: str) -> Path:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a path string, not {value!r}")
    _no_nul(value, where)
    return Path(value)


def key_fields(cls: Any) -> list[dataclasses.Field[Any]]:
    """The fields of a config table (class or instance) that are its keys (not `ApiConfig.server`)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("key", True)]


# The plain annotations a config field may carry, each with its check.
_SCALARS: dict[Any, Callable[[Any, str], Any]] = {bool: _coerce_bool, int: _coerce_int, float: _coerce_float,
                                                 str: _coerce_str, Path: _coerce_path}


def _build(cls: type, table: Any, where: str, file: Path) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"{file}: [{where}] must be a table, not {table!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in key_fields(cls)}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise ConfigError(f"{file}: unknown key {where}.{unknown[0]} (known keys: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, f in fields.items():
        if name in table:
            kwargs[name] = _coerce(table[name], hints[name], f"{file}: {where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{file}: {where}.{name} is required")
    return cls(**kwargs)


def _positive(file: Path, where: str, value: float | int | None, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{file}: {where} must be {'>= 0' if allow_zero else '> 0'}, not {value!r}")


MAX_WORKERS = 1024

_TABLES = {"api": ApiConfig, "budget": BudgetConfig, "tokenizer": TokenizerConfig, "output": OutputConfig,
           "engine": EngineConfig, "merge": MergeConfig, "extract": ExtractConfig, "smoke": SmokeConfig,
           "validation": ValidationConfig, "monitor": MonitorConfig}


def _exists(path: Path) -> bool:
    """Path.exists() that says no (instead of raising) for a name too long for the filesystem."""
    try:
        return path.exists()
    except OSError:
        return False


def _check_prompts_path(file: Path, where: str, path: Path) -> None:
    """A prompt file must be a regular file: a FIFO blocks forever, a device never ends, a folder has no lines.
    A missing one is said when the dataset is read (a config may be written before its prompt files)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if stat.S_ISREG(mode):
        return
    kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "not a regular file")
    raise ConfigError(f"{file}: {where} names {path}, which is {kind}: a prompt file must be a regular "
                      f"JSONL(.gz) file")


def _completion_limit(file: Path, i: int, ds: DatasetConfig, explicit: bool, request: dict[str, Any]) -> DatasetConfig:
    """The dataset with the one answer cap its requests carry. An answer cap (`max_tokens`,
    `max_completion_tokens`, `max_output_tokens`, `max_new_tokens`: servers honour one name or another,
    so all are one cap) in [request] or the dataset's `request` must equal the dataset's `max_tokens`
    when that is set (the reservation and the token budget use it); set only in a request table, it is
    the dataset's."""
    found: dict[str, tuple[str, int]] = {}  # key -> (where, value), the dataset's table over [request] as in the body
    for where, table in (("request", request), (f"datasets[{i}].request", ds.request)):
        for key in COMPLETION_LIMIT_KEYS:
            if key not in table:
                continue
            value = table[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{file}: {where}.{key} must be a positive integer, not {value!r}")
            found[key] = (f"{where}.{key}", value)
    if not found:
        return ds
    caps = list(found.values())
    if explicit:
        for name, value in caps:
            if value != ds.max_tokens:
                raise ConfigError(f"{file}: {name} = {value} differs from datasets[{i}].max_tokens = {ds.max_tokens} "
                                  f"({ds.name}): the server would get {value} while the budgets reserve "
                                  f"{ds.max_tokens}; set one of them, or both to the same value")
        return ds
    (first, cap), *others = caps
    for name, value in others:
        if value != cap:
            raise ConfigError(f"{file}: {name} = {value} differs from {first} = {cap} ({ds.name}): the answer "
                              f"cap must be one number; set datasets[{i}].max_tokens instead")
    return dataclasses.replace(ds, max_tokens=cap)


def load_config(path: str | Path) -> Config:
    file = Path(path)
    try:
        raw = tomllib.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{file}: config file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{file}: not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"{file}: cannot read: {e.strerror}") from None
    return config_from_dict(raw, file)


def config_from_dict(raw: dict[str, Any], file: Path) -> Config:
    _check_top_level(raw, file)
    base = file.resolve().parent
    api_table, servers = _base_urls(raw.get("api", {}), file)
    parts = {name: _build(cls, api_table if name == "api" else raw.get(name, {}), name, file)
             for name, cls in _TABLES.items()}
    api: ApiConfig = parts["api"]
    if servers:
        api = parts["api"] = dataclasses.replace(api, servers=servers)
    request, pass_through = _request_table(raw, file, api)
    datasets = _datasets(raw, file, base, api, request, pass_through)
    _check_api(file, api)
    budget: BudgetConfig = parts["budget"]
    _positive(file, "budget.max_usd", budget.max_usd)
    _positive(file, "budget.credit_floor_usd", budget.credit_floor_usd, allow_zero=True)
    engine: EngineConfig = parts["engine"]
    _check_engine(file, engine)
    extract: ExtractConfig = parts["extract"]
    _check_extract(file, extract)
    tokenizer: TokenizerConfig = parts["tokenizer"]
    _check_tokenizer(file, tokenizer)
    validation: ValidationConfig = parts["validation"]
    _check_validation(file, validation)
    monitor: MonitorConfig = parts["monitor"]
    _check_monitor(file, monitor)
    # A local tokenizer folder is resolved against the config; an HF id (org/name) stays as written.
    tok_path = tokenizer.path
    if tok_path.startswith((".", "/", "~")) or _exists(base / tok_path):
        tokenizer = dataclasses.replace(tokenizer, path=str(base / Path(tok_path).expanduser()))
    if extract.model and (extract.model.startswith((".", "/", "~")) or _exists(base / extract.model)):
        extract = dataclasses.replace(extract, model=str(base / Path(extract.model).expanduser()))
    output: OutputConfig = parts["output"]
    out_dir = base / output.dir
    if _exists(out_dir) and not out_dir.is_dir():
        raise ConfigError(f"{file}: output.dir names {out_dir}, which is a file, not a folder: point output.dir "
                          f"at a folder (it is created if missing)")
    return Config(
        path=file, api=api, request=request, budget=budget, tokenizer=tokenizer,
        output=dataclasses.replace(output, dir=out_dir), datasets=tuple(datasets), engine=engine,
        merge=parts["merge"], extract=extract, smoke=parts["smoke"], validation=validation, monitor=monitor,
    )


def _check_top_level(raw: dict[str, Any], file: Path) -> None:
    """Only known tables and keys at the top, and no retired extract backend."""
    known = set(_TABLES) | {"request", "datasets"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{file}: unknown table or key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    extract_table = raw.get("extract")
    if isinstance(extract_table, dict) and extract_table.get("backend") == "sglang":
        raise ConfigError(f"{file}: extract.backend = \"sglang\" was replaced by \"specforge\" (SpecForge's maintained "
                          f"SGLang capture, pinned; see docs/gpu-extraction.md)")


def _request_table(raw: dict[str, Any], file: Path, api: ApiConfig) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The [request] table, checked, and the keys api.request_pass_through lets through unchecked."""
    request = raw.get("request", {})
    if not isinstance(request, dict):
        raise ConfigError(f"{file}: [request] must be a table, not {request!r}")
    for i, key in enumerate(api.request_pass_through):
        if known_key(key):
            raise ConfigError(f"{file}: api.request_pass_through[{i}] = {key!r} is a request key draftgen knows "
                              f"(core/request_keys.py decides what it may do): remove it from the list")
    pass_through = tuple(api.request_pass_through)
    check_request_table(file, "request", request, openrouter=api.openrouter_for_sure, pass_through=pass_through)
    return request, pass_through


def _datasets(raw: dict[str, Any], file: Path, base: Path, api: ApiConfig, request: dict[str, Any],
              pass_through: tuple[str, ...]) -> list[DatasetConfig]:
    """Every [[datasets]] entry, checked, with its answer cap settled and its prompts path resolved."""
    raw_datasets = raw.get("datasets")
    if not raw_datasets:
        raise ConfigError(f"{file}: no [[datasets]] (at least one is needed)")
    if not isinstance(raw_datasets, list):
        raise ConfigError(f"{file}: datasets must be an array of tables ([[datasets]])")
    datasets = []
    names: set[str] = set()
    for i, table in enumerate(raw_datasets):
        ds: DatasetConfig = _build(DatasetConfig, table, f"datasets[{i}]", file)
        where = f"datasets[{i}] ({ds.name})"
        own = f"datasets[{i}].request"
        check_request_table(file, own, ds.request, openrouter=api.openrouter_for_sure, pass_through=pass_through,
                            dataset=ds.name)
        _check_dataset_name(file, i, ds.name, names)
        names.add(ds.name)
        if ds.concurrency < 1 or ds.concurrency > 100_000:
            raise ConfigError(f"{file}: {where}.concurrency must be between 1 and 100000, not {ds.concurrency}")
        _positive(file, f"{where}.max_tokens", ds.max_tokens)
        _positive(file, f"{where}.token_budget", ds.token_budget)
        ds = _completion_limit(file, i, ds, "max_tokens" in table, request)
        check_reasoning_budget(file, "request", request, ds.max_tokens, ds.name)
        check_reasoning_budget(file, own, ds.request, ds.max_tokens, ds.name)
        _check_turns(file, i, ds, table)
        _check_cycles(file, i, ds, table, request)
        prompts = base / ds.prompts
        _check_prompts_path(file, f"datasets[{i}].prompts", prompts)
        datasets.append(dataclasses.replace(ds, prompts=prompts))
    return datasets


# Temperatures the API takes (OpenRouter's parameters: 0.0 to 2.0; OpenAI's the same range).
TEMPERATURE_RANGE = (0.0, 2.0)
# Reasoning efforts OpenRouter's reasoning-tokens guide names (`reasoning.effort`).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _check_turns(file: Path, i: int, ds: DatasetConfig, table: dict[str, Any]) -> None:
    """`max_turns` is a positive integer, and it and `tool_results` are for `turns = "all"` only (the other
    modes ask one request)."""
    if "tool_results" in table and ds.turns != "all":
        how = "set" if "turns" in table else "the default"
        raise ConfigError(f"{file}: datasets[{i}].tool_results = {ds.tool_results!r} (dataset {ds.name}): says how an "
                          f"agent line's tool results are sent with turns = \"all\", but datasets[{i}].turns is "
                          f"{ds.turns!r} ({how}); set turns = \"all\" or remove tool_results")
    if ds.max_turns is None:
        return
    name = f"{file}: datasets[{i}].max_turns = {ds.max_turns!r} (dataset {ds.name})"
    if ds.max_turns < 1:
        raise ConfigError(f"{name}: must be an integer >= 1 (the user turns asked per conversation at most)")
    if ds.turns != "all":
        how = "set" if "turns" in table else "the default"
        raise ConfigError(f"{name}: caps the turns asked with turns = \"all\", but datasets[{i}].turns is "
                          f"{ds.turns!r} ({how}); set turns = \"all\" or remove max_turns")


def _check_cycles(file: Path, i: int, ds: DatasetConfig, table: dict[str, Any], request: dict[str, Any]) -> None:
    """Cycle lists are non-empty, in the API's range, and not set beside the key they cycle in the dataset's
    own request table (one of the two would silently lose); [request]'s value is what a cycle overrides,
    except a reasoning budget, which OpenRouter does not take beside an effort."""
    for key in ("temperatures", "reasoning_efforts"):
        if key in table and not getattr(ds, key):
            raise ConfigError(f"{file}: datasets[{i}].{key} = [] (dataset {ds.name}): list at least one value, "
                              f"or remove the key")
    for k, t in enumerate(ds.temperatures):
        if not TEMPERATURE_RANGE[0] <= t <= TEMPERATURE_RANGE[1]:
            raise ConfigError(f"{file}: datasets[{i}].temperatures[{k}] = {t!r} (dataset {ds.name}): must be between "
                              f"{TEMPERATURE_RANGE[0]:g} and {TEMPERATURE_RANGE[1]:g} (the API's range)")
    for k, e in enumerate(ds.reasoning_efforts):
        if e not in REASONING_EFFORTS:
            raise ConfigError(f"{file}: datasets[{i}].reasoning_efforts[{k}] = {e!r} (dataset {ds.name}): must be one "
                              f"of {', '.join(REASONING_EFFORTS)} (OpenRouter's reasoning.effort values)")
    own = f"datasets[{i}].request"
    clashes = {"temperatures": ((own, "temperature"),),
               "reasoning_efforts": ((own, "reasoning_effort"), (own, "reasoning.effort"),
                                     (own, "reasoning.max_tokens"), ("request", "reasoning.max_tokens"),
                                     ("request", "reasoning_effort"))}  # on OpenRouter both would be sent
    tables = {own: ds.request, "request": request}
    for key, others in clashes.items():
        if not getattr(ds, key):
            continue
        for where, other in others:
            head, _, sub = other.partition(".")
            value = tables[where].get(head)
            if sub:
                value = value.get(sub) if isinstance(value, dict) else None
            if value is None:
                continue
            why = ("OpenRouter takes a reasoning effort or a reasoning budget, not both" if sub == "max_tokens"
                   else "the body would carry two efforts, and the record only the cycle's"
                   if (where, other) == ("request", "reasoning_effort")
                   else "the cycle would replace it in every body")
            raise ConfigError(f"{file}: datasets[{i}].{key} and {where}.{other} are both set (dataset {ds.name}): "
                              f"{why}; keep one")


def _check_dataset_name(file: Path, i: int, name: str, taken: set[str]) -> None:
    """A dataset's name is a folder name, printed in the UI and the log: usable as one, and unique."""
    if not name or "/" in name or name.startswith(".") or name in ("merged", "hidden_states"):
        raise ConfigError(f"{file}: datasets[{i}].name {name!r} cannot be used as a folder name")
    if not name.isprintable():  # printed in the UI and the log, and a folder name: no control characters
        raise ConfigError(f"{file}: datasets[{i}].name {name!r} must be printable characters only "
                          f"(no control characters, tabs or line breaks)")
    if name in taken:
        raise ConfigError(f"{file}: datasets[{i}].name {name!r} is used twice")


def _base_urls(table: Any, file: Path) -> tuple[Any, tuple[str, ...]]:
    """The [api] table with `base_url` one URL (a list's first), and the list's URLs (() for one URL). A list
    is a fleet of self-hosted servers: each a string, none twice, and not OpenRouter's (one API, one URL)."""
    if not isinstance(table, dict) or not isinstance(urls := table.get("base_url"), list):
        return table, ()
    if not urls:
        raise ConfigError(f"{file}: api.base_url = [] names no server: give one URL, or a list of them")
    for i, url in enumerate(urls):
        if not isinstance(url, str):
            raise ConfigError(f"{file}: api.base_url[{i}] must be a string (a URL), not {url!r}")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"{file}: api.base_url[{i}] must start with http:// or https://, not {url!r}")
        if "openrouter.ai" in url or table.get("kind") == "openrouter":
            raise ConfigError(f"{file}: api.base_url[{i}] = {url!r}: a list of URLs is a fleet of self-hosted "
                              f"servers (vLLM, SGLang); OpenRouter is one API at one URL: give it as a string")
    seen = [url.rstrip("/") for url in urls]
    for i, url in enumerate(seen):
        if url in seen[:i]:
            raise ConfigError(f"{file}: api.base_url[{i}] = {urls[i]!r} is listed twice")
    servers = tuple(seen) if len(seen) > 1 else ()
    return {**table, "base_url": urls[0]}, servers


def _check_api(file: Path, api: ApiConfig) -> None:
    if not api.base_url.startswith(("http://", "https://")):
        raise ConfigError(f"{file}: api.base_url must start with http:// or https://, not {api.base_url!r}")
    _positive(file, "api.request_timeout_s", api.request_timeout_s)
    _positive(file, "api.connect_timeout_s", api.connect_timeout_s)
    _positive(file, "api.credits_interval_s", api.credits_interval_s)
    _positive(file, "api.prompt_price_per_mtok", api.prompt_price_per_mtok, allow_zero=True)
    _positive(file, "api.completion_price_per_mtok", api.completion_price_per_mtok, allow_zero=True)
    _positive(file, "api.generation_lookup_s", api.generation_lookup_s, allow_zero=True)


def _check_monitor(file: Path, monitor: MonitorConfig) -> None:
    if not monitor.metrics:
        return
    try:
        host, _ = split_host_port(monitor.metrics)
    except ValueError as e:
        raise ConfigError(f"{file}: monitor.metrics = {monitor.metrics!r} {e}") from None
    if not is_loopback(host) and not monitor.metrics_public:
        raise ConfigError(f"{file}: monitor.metrics = {monitor.metrics!r} is not a loopback address: the run's "
                          f"figures (spend, balance, providers) would be served to the network; set "
                          f"monitor.metrics_public = true to mean it, or use \"127.0.0.1:PORT\"")


def _check_engine(file: Path, engine: EngineConfig) -> None:
    _positive(file, "engine.max_attempts", engine.max_attempts)
    _positive(file, "engine.snapshot_hz", engine.snapshot_hz)
    _positive(file, "engine.workers", engine.workers, allow_zero=True)
    if engine.workers > MAX_WORKERS:  # each is a process holding the tokenizer: a typo must not fork thousands
        raise ConfigError(f"{file}: engine.workers must be at most {MAX_WORKERS}, not {engine.workers}")


def _check_extract(file: Path, extract: ExtractConfig) -> None:
    if not extract.model.isprintable():  # a folder or hub id; it goes into SpecForge's config and train-command.sh
        raise ConfigError(f"{file}: extract.model {extract.model!r} must be printable characters only "
                          f"(no control characters, tabs or line breaks)")
    if not 0 <= extract.mem_fraction_static < 1:
        raise ConfigError(f"{file}: extract.mem_fraction_static must be between 0 and 1 (0: the GPU plan chooses), "
                          f"not {extract.mem_fraction_static!r}")
    _positive(file, "extract.min_shm_gb", extract.min_shm_gb, allow_zero=True)
    _positive(file, "extract.tp_size", extract.tp_size)
    _positive(file, "extract.tokens_per_s", extract.tokens_per_s, allow_zero=True)
    _positive(file, "extract.min_free_gb", extract.min_free_gb, allow_zero=True)
    _check_extract_format(file, extract)
    _check_aux_layers(file, extract.aux_layers)
    _check_max_disk(file, extract.max_disk_gb)
    for key in sorted(extract.sglang):
        if _speculative_key(key):
            raise ConfigError(
                f"{file}: extract.sglang.{key} is refused: "
                + ("it turns on speculative decoding" if key.replace("-", "_") == "speculative_algorithm"
                   else "it configures speculative decoding")
                + ", and with it on SGLang returns hidden states that belong to the draft tokens it verified, "
                "not to the sample's own tokens (sglang#26163): the files would train on wrong features. "
                "Capture runs without it; remove the key from [extract.sglang]")


# [extract.sglang] keys of SGLang 0.5.14's ServerArgs that turn speculative decoding on or configure it: its
# "Speculative decoding" sections (every `speculative_*` field and enable_multi_layer_eagle) and the two draft
# fields outside them (tests/extract/test_layer_sets_contract.py checks them against the pinned source).
SPECULATIVE_KEYS = frozenset({"enable_multi_layer_eagle", "enable_draft_weights_cpu_backup",
                              "decrypted_draft_config_file"})


def _speculative_key(key: str) -> bool:
    name = key.replace("-", "_")
    return name.startswith("speculative_") or name in SPECULATIVE_KEYS


# The named layer sets `[extract] aux_layers` takes (placed from the model's N by
# extract/model_info.resolve_aux_layers), read from SpecForge 0.2.0: P-EAGLE resolves its capture layers
# as EAGLE-3 does (algorithms/peagle/providers.py -> resolve_eagle_capture_layers); DSpark's draft is a
# DFlash draft (DSparkDraftModel(DFlashDraftModel)), whose target_layer_ids default to
# build_target_layer_ids(num_target_layers, K) as DFlash's do.
LAYER_SET_NAMES = ("eagle3", "peagle", "dflash:K", "dspark:K")


def parse_layer_set(aux_layers: str) -> tuple[str, int]:
    """("eagle3" | "peagle", 3) or ("dflash" | "dspark", K) from a named set; ValueError naming what is wrong."""
    if aux_layers in ("eagle3", "peagle"):
        return aux_layers, 3
    name, colon, count = aux_layers.partition(":")
    if name in ("dflash", "dspark") and colon and count.isdigit() and int(count) >= 1:
        return name, int(count)
    raise ValueError(f"extract.aux_layers must be a list of layer ids or one of {', '.join(LAYER_SET_NAMES)} "
                     f"(K: how many layers, e.g. \"dflash:5\"), not {aux_layers!r}")


def _check_aux_layers(file: Path, aux_layers: str | list[int]) -> None:
    """A named set (model_info.LAYER_SET_NAMES) or a non-empty, strictly ascending list of layer ids >= 0;
    the model's N bounds them when it is read (model_info.resolve_aux_layers)."""
    if isinstance(aux_layers, str):
        try:
            parse_layer_set(aux_layers)
        except ValueError as e:
            raise ConfigError(f"{file}: {e}") from None
        return
    if not aux_layers:
        raise ConfigError(f"{file}: extract.aux_layers lists no layer id (give some, or a named set: \"eagle3\", "
                          f"\"dflash:5\")")
    if any(isinstance(k, bool) or k < 0 for k in aux_layers) or list(aux_layers) != sorted(set(aux_layers)):
        raise ConfigError(f"{file}: extract.aux_layers {aux_layers!r}: the layer ids must be strictly ascending and "
                          f">= 0 (SGLang concatenates captured layers in model order)")


def _check_max_disk(file: Path, max_disk_gb: float) -> None:
    _positive(file, "extract.max_disk_gb", max_disk_gb, allow_zero=True)


def _check_extract_format(file: Path, extract: ExtractConfig) -> None:
    """What each trainer's files can carry, refused at load, before any weight loads."""
    if extract.format == "specforge" and extract.dtype == "fp8":
        raise ConfigError(f"{file}: extract.dtype = \"fp8\" needs extract.format = \"speculators\": SpecForge 0.2.0's "
                          f"offline reader (OfflineEagle3Dataset) loads the .ckpt tensors as stored and has no FP8 "
                          f"scales to undo, so it would train on the raw FP8 values. Set format = \"speculators\" "
                          f"(vLLM's speculators, FP8 with one scale per token) or dtype = \"bfloat16\"")
    if extract.format == "speculators" and extract.backend != "hf":
        raise ConfigError(f"{file}: extract.format = \"speculators\" takes the last decoder layer's output before the "
                          f"final norm, which the {extract.backend!r} backend (SGLang's capture) does not return; "
                          f"use backend = \"hf\", or format = \"specforge\"")
    if extract.format == "speculators" and extract.compress:
        raise ConfigError(f"{file}: extract.compress = true writes .ckpt.gz files, which speculators does not read "
                          f"(it opens hs_{{i}}.safetensors as they are); set compress = false, or dtype = \"fp8\" "
                          f"for half the bytes")


def _check_tokenizer(file: Path, tokenizer: TokenizerConfig) -> None:
    if tokenizer.template not in ("kimi-k2.5", "auto"):
        raise ConfigError(f"{file}: tokenizer.template must be \"kimi-k2.5\" or \"auto\", not {tokenizer.template!r}")
    if tokenizer.prompt_special_tokens not in ("auto", "text", "special"):
        raise ConfigError(f"{file}: tokenizer.prompt_special_tokens must be \"auto\", \"text\" or \"special\", "
                          f"not {tokenizer.prompt_special_tokens!r}")
    if not tokenizer.default_system.strip():
        raise ConfigError(f"{file}: tokenizer.default_system must be \"auto\", \"none\" or the system text, "
                          f"not an empty string")


def _check_validation(file: Path, validation: ValidationConfig) -> None:
    _positive(file, "validation.count_tolerance", validation.count_tolerance, allow_zero=True)
    _positive(file, "validation.prompt_tolerance", validation.prompt_tolerance, allow_zero=True)
    _positive(file, "validation.provider_min_answers", validation.provider_min_answers)
    for key in ("split_share", "provider_exact_gap", "min_exact_share"):
        if not 0 <= getattr(validation, key) <= 1:
            raise ConfigError(f"{file}: validation.{key} must be between 0 and 1, not {getattr(validation, key)!r}")
