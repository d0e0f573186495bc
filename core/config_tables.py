"""The config's tables other than [api]: each a frozen dataclass whose fields are its keys, with their
defaults and what each means (docs/config.md mirrors them). `config_load` builds them from the TOML file,
`config_values` coerces each key by its annotation, `config_checks` checks what a type cannot say;
[api] and the whole `Config` are in `config`.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from draftgen.core.bodies import ChatBody, Sampling


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

    def prompt_specials(self, kind_reads_them: bool) -> bool:
        """Whether special-token text in prompts is read as the special token: "special", or "auto" where the
        server's kind reads them so (`ServerKind.specials_as_tokens`)."""
        return self.prompt_special_tokens == "special" or (self.prompt_special_tokens == "auto" and kind_reads_them)

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
    # refuses such a directory (core/private_dir.py check_private): another user could move its records away or
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


def sampling_of(body: ChatBody) -> Sampling:
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
    # "sglang" (draftgen's own SGLang driver) was removed: config_load says what replaced it.
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
