"""The config's checks beyond a value's type: ranges, keys that only make sense together, and what a
later stage would refuse (an extract format its trainer cannot read), each raised at load with a
ConfigError naming the file and the dotted key. `config_load` calls them in the file's order.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from draftgen.core.config import ApiConfig
from draftgen.core.config_tables import (
    BudgetConfig,
    DatasetConfig,
    EngineConfig,
    ExtractConfig,
    MonitorConfig,
    TokenizerConfig,
    ValidationConfig,
    is_loopback,
    split_host_port,
)
from draftgen.core.errors import ConfigError

MAX_WORKERS = 1024


# Temperatures the API takes (OpenRouter's parameters: 0.0 to 2.0; OpenAI's the same range).
TEMPERATURE_RANGE = (0.0, 2.0)
# Reasoning efforts OpenRouter's reasoning-tokens guide names (`reasoning.effort`).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def check_turns(file: Path, i: int, ds: DatasetConfig, table: dict[str, Any]) -> None:
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


def check_cycles(file: Path, i: int, ds: DatasetConfig, table: dict[str, Any], request: dict[str, Any]) -> None:
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


def check_dataset(file: Path, i: int, ds: DatasetConfig, taken: set[str]) -> None:
    """A [[datasets]] entry's name (usable as a folder, not in `taken`), concurrency and sizes."""
    _check_dataset_name(file, i, ds.name, taken)
    where = f"datasets[{i}] ({ds.name})"
    if ds.concurrency < 1 or ds.concurrency > 100_000:
        raise ConfigError(f"{file}: {where}.concurrency must be between 1 and 100000, not {ds.concurrency}")
    _positive(file, f"{where}.max_tokens", ds.max_tokens)
    _positive(file, f"{where}.token_budget", ds.token_budget)


def _check_dataset_name(file: Path, i: int, name: str, taken: set[str]) -> None:
    """A dataset's name is a folder name, printed in the UI and the log: usable as one, and unique."""
    if not name or "/" in name or name.startswith(".") or name in ("merged", "hidden_states"):
        raise ConfigError(f"{file}: datasets[{i}].name {name!r} cannot be used as a folder name")
    if not name.isprintable():  # printed in the UI and the log, and a folder name: no control characters
        raise ConfigError(f"{file}: datasets[{i}].name {name!r} must be printable characters only "
                          f"(no control characters, tabs or line breaks)")
    if name in taken:
        raise ConfigError(f"{file}: datasets[{i}].name {name!r} is used twice")


def check_tables(file: Path, tables: Mapping[str, Any]) -> None:
    """The checks beyond their types of the tables other than [[datasets]] (`tables`: each by its name), in
    one order, so that a file with several mistakes is told the same one first every time."""
    _check_api(file, tables["api"])
    _check_budget(file, tables["budget"])
    _check_engine(file, tables["engine"])
    _check_extract(file, tables["extract"])
    _check_tokenizer(file, tables["tokenizer"])
    _check_validation(file, tables["validation"])
    _check_monitor(file, tables["monitor"])


def _check_api(file: Path, api: ApiConfig) -> None:
    if not api.base_url.startswith(("http://", "https://")):
        raise ConfigError(f"{file}: api.base_url must start with http:// or https://, not {api.base_url!r}")
    _positive(file, "api.request_timeout_s", api.request_timeout_s)
    _positive(file, "api.connect_timeout_s", api.connect_timeout_s)
    _positive(file, "api.credits_interval_s", api.credits_interval_s)
    _positive(file, "api.prompt_price_per_mtok", api.prompt_price_per_mtok, allow_zero=True)
    _positive(file, "api.completion_price_per_mtok", api.completion_price_per_mtok, allow_zero=True)
    _positive(file, "api.generation_lookup_s", api.generation_lookup_s, allow_zero=True)


def _check_budget(file: Path, budget: BudgetConfig) -> None:
    _positive(file, "budget.max_usd", budget.max_usd)
    _positive(file, "budget.credit_floor_usd", budget.credit_floor_usd, allow_zero=True)


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


def _positive(file: Path, where: str, value: float | int | None, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{file}: {where} must be {'>= 0' if allow_zero else '> 0'}, not {value!r}")
