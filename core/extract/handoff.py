"""The training hand-off: SpecForge's config and command for this run's data.

`draftgen train-command CONFIG` prints it and writes it; extraction leaves the same two files beside
its output when it finishes:

    hidden_states/specforge.json     the config `specforge train --config` reads (its typed schema)
    hidden_states/train-command.sh   the command, with the figures below as comments
    hidden_states/provenance.json    its "train-command" record (core/provenance.py): what made them,
                                     from which merge, model, layers and config, with each file's sha256

No value of the config runs in the script: the config's path is one quoted argument, the caller's
arguments follow it verbatim ("$@"), and the comments show line breaks and control characters of
paths, names and messages as escapes (core/quoting.py), so none ends its comment line.

What the pinned specforge 0.2.0 (pyproject's `gpu` extra) takes, read from its released code
(specforge/cli.py, specforge/config/schema.py, specforge/algorithms/eagle3/; checked by
tests/extract/test_specforge_contract.py, which parses our file with SpecForge's own `load_config` and
resolves it with its own `specforge train --plan`):
- one entry point, `specforge train --config FILE`; the config is strict (unknown keys refused);
- `data.max_length` defaults to 2,048 and the offline normaliser slices every sample to it
  (`normalize_offline_sample(max_len)`: ids, mask and both hidden states), without a word. A
  sample's answer is its end, so what is cut is what the draft learns from: max_length here is
  the longest merged sample, and the printout says how many samples a smaller one would cut;
- offline training: `data.hidden_states_path` and exactly one data source, so merged/train.jsonl
  (the same samples as conversations) is named in the comments, not in the config;
- `model.target_model_path` ([extract] model) and `model.aux_hidden_state_layer_ids`: SGLang's
  numbering of the layers extracted (stats.json's draft_layer_ids), three distinct ids;
- the draft config is derived from the target's when none is given; its draft vocabulary is then
  32,000 (`TargetDerivedDraftDefaults(draft_vocab_size=32000)` in eagle3/providers.py) and
  SpecForge builds the target-to-draft vocabulary map from the data, cached under
  `data.cache_dir` (set here to `<run>/specforge-cache`, not the working directory's ./cache).

The online variant, hidden_states/specforge-online.json (`online_config`): SpecForge computes the
target's features while it trains, from SGLang capture servers, and reads its samples through
specforge/data/prompt_builder.py `prepare_prompt_tasks`: a file whose first record has `input_ids`
and `loss_mask` is taken verbatim (cut to max_length; a sample with no loss token dropped), any
other file is re-rendered with SpecForge's chat template, which gives other ids than draftgen's
(the kimi templates add a default system prompt; Kimi-K2.5's own template drops the trained
answer's reasoning). So the online config names merged/train-tokens.jsonl as `data.prompts_path`
(the typed config's "already-tokenized JSONL records"; `train_data_path` would read the file the
same way). Online in 0.2.0 is disaggregated only (`deployment.mode`, Mooncake, external SGLang
servers) and an EAGLE-3 run there needs `model.vocab_mapping_path`: those describe the user's
cluster, so they are given on the command line (ONLINE_SITE_KEYS); checked by
tests/extract/test_specforge_online.py with SpecForge's own `load_config`, `--plan` and
`prepare_prompt_tasks`.
"""

from __future__ import annotations

import copy
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from draftgen.core.config import Config
from draftgen.core.errors import ConfigError, DraftgenError
from draftgen.core.files import write_atomic, write_json_atomic
from draftgen.core.merge.merge import TRAIN_TOKENS_FILE
from draftgen.core.quoting import one_line, sh_path
from draftgen.core.safe_text import visible
from draftgen.core.tokens import identity
from draftgen.core.tokens.store import INDEX_FILE, TokenReader

SPECFORGE_VERSION = "0.2.0"              # the gpu extra's pin (tests/extract/test_specforge_contract.py checks)
SPECFORGE_DEFAULT_MAX_LENGTH = 2048      # DataConfig.max_length's default
SPECFORGE_DRAFT_VOCAB = 32000            # TargetDerivedDraftDefaults(draft_vocab_size=...) for EAGLE-3
CONFIG_FILE, SCRIPT_FILE = "specforge.json", "train-command.sh"
ONLINE_CONFIG_FILE = "specforge-online.json"
SGLANG_CAPTURE_HEADROOM = 7              # SGLANG_CAPTURE_CONTEXT_HEADROOM: capture context >= max_length + 7
# What an online run needs that only the user's cluster knows: SpecForge 0.2.0's `--plan` refuses without
# each (key, what to give, what it is), as a dotted override on `specforge train`'s command line.
ONLINE_SITE_KEYS = (
    ("deployment.disaggregated.server_urls", '\'["http://HOST:PORT"]\'',
     "the SGLang capture servers serving the target model"),
    ("deployment.disaggregated.mooncake_master_server_addr", "HOST:PORT", "the Mooncake master"),
    ("deployment.disaggregated.mooncake_metadata_server", "http://HOST:PORT/metadata", "Mooncake's metadata server"),
    ("model.vocab_mapping_path", "FILE", "the draft's t2d/d2t vocabulary map (disaggregated EAGLE-3 runs "
     "do not derive one)"),
)
SHOWN_LENGTHS = (2048, 4096, 8192, 16384, 32768, 65536)


@dataclass(frozen=True)
class Cut:
    max_length: int
    samples: int        # samples longer than max_length
    tokens: int         # tokens past it
    loss_tokens: int    # of those, tokens trained on (loss_mask 1): the answers' ends


@dataclass
class Handoff:
    config: dict[str, Any]
    config_path: Path
    samples: int
    tokens: int
    longest: int
    max_length: int
    chosen: Cut                              # what max_length itself cuts (nothing unless asked for less)
    cuts: list[Cut]                          # SpecForge's default and other lengths below the longest
    aux_layer_ids: list[int] | None
    merge: str                               # which merge merged/ is
    hidden: str                              # what hidden_states/ holds
    train_jsonl: Path
    notes: list[str] = field(default_factory=list)
    # extract.format = "speculators": no .ckpt file for SpecForge's offline reader, so train-command.sh refuses
    offline_refusal: str = ""

    @property
    def command(self) -> str:
        return f"specforge train --config {sh_path(self.config_path)}"


def cut_at(reader: TokenReader, lengths: np.ndarray, max_length: int) -> Cut:
    over = np.nonzero(lengths > max_length)[0]
    loss = 0
    for k in over:
        _ids, mask = reader.raw(reader.entries[int(k)])
        loss += int(np.count_nonzero(mask[max_length:]))
    return Cut(max_length, int(len(over)), int(np.sum(lengths[over] - max_length)), loss)


def _aux_layer_ids(config: Config, notes: list[str]) -> list[int] | None:
    """SGLang's numbering of the extracted layers when they are an EAGLE-3 set of three: stats.json's, else from the
    config and the model's config.json; another set is named in `notes` with the trainers that take it."""
    layers: list[int] | None = None
    eagle: list[int] | None = None
    stats = config.run_dir / "hidden_states" / "stats.json"
    try:
        recorded = json.loads(stats.read_text(encoding="utf-8"))
        if recorded.get("layers"):
            layers = [int(x) for x in recorded["layers"]]
            ids = (recorded.get("trainer_layer_ids") or {}).get("eagle3", recorded.get("draft_layer_ids"))
            eagle = [int(x) for x in ids] if isinstance(ids, list) and len(ids) == 3 else None
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    if layers is None:
        from draftgen.core.extract.model_info import read_model_dims, resolve_aux_layers, trainer_layer_ids
        try:
            dims = read_model_dims(config.extract.model, trust_remote_code=config.extract.trust_remote_code)
            resolved = resolve_aux_layers(config.extract.aux_layers, dims, config.path)
            layers, eagle = list(resolved), trainer_layer_ids(resolved, dims)["eagle3"]
        except (ConfigError, DraftgenError) as e:
            notes.append(f"aux layer ids not set (SpecForge then takes the draft config's or [1, N/2-1, N-4]): {e}")
            return None
    if len(layers) != 3:
        notes.append(
            f"extract.aux_layers = {config.extract.aux_layers!r}: {len(layers)} layers {layers} (0-based layer "
            f"outputs; a DFlash or DSpark draft config's dflash_config.target_layer_ids = {layers}). SpecForge "
            f"{SPECFORGE_VERSION}'s EAGLE-3 and P-EAGLE take exactly three (model.aux_hidden_state_layer_ids, "
            f"application/planning.py), so this config sets none and does not train on these files; its offline "
            f"DFlash trainer reads a `hidden_states` key these files do not carry (docs/extraction.md, layer sets)")
        return None
    if eagle is None:
        notes.append(f"aux layer ids not set: SGLang cannot capture layers {layers} for this model (an EAGLE-3 "
                     f"draft config cannot name them)")
    return eagle


def _missing_notes(config: Config, reader: TokenReader, files: int, merge_id: str) -> list[str]:
    """What the missing samples are: skipped as longer than the context (stats*.json), or left to extract."""
    from draftgen.core.extract.plan import recorded_too_long
    from draftgen.core.extract.speculators_layout import existing_file
    hidden = config.run_dir / "hidden_states"
    recorded = recorded_too_long(hidden, merge_id, config.extract.model)
    skipped = {k: contexts for k, contexts in recorded.items()
               if k < len(reader) and existing_file(config.extract.format, hidden, k) is None}
    notes = []
    if skipped:
        context = max(max(c) for c in skipped.values())
        notes.append(f"{len(skipped):,} of {len(reader):,} samples are longer than the model's context "
                     f"({context:,} tokens) and were skipped, not extracted (see stats.json): training leaves "
                     f"them out; to extract them, give the model a larger context (its max_position_embeddings, "
                     f"or extract.sglang.context_length for the specforge backend) and run "
                     f"`draftgen extract {sh_path(config.path)}` again")
    left = len(reader) - files - len(skipped)
    if left > 0:
        notes.append(f"only {files:,} of {len(reader):,} samples extracted: `draftgen extract {sh_path(config.path)}` "
                     f"finishes the {left:,} left (training now would use those extracted alone)")
    return notes


def make_handoff(config: Config, *, max_length: int | None = None) -> Handoff:
    """The SpecForge config and command for `config`'s merged set and hidden states (reads only)."""
    if not config.extract.model:
        raise ConfigError(f"{config.path}: extract.model is not set: SpecForge needs the target model "
                          f"(model.target_model_path), the one the hidden states were extracted with")
    run = config.run_dir
    for path in (run, Path(config.extract.model)):
        try:
            str(path).encode()
        except UnicodeEncodeError:  # a name of bytes that are not UTF-8: JSON cannot hold it
            raise DraftgenError(f"{visible(str(path))}: not a UTF-8 name (it holds bytes shown as \\udcXX): "
                                "SpecForge's JSON config cannot name it; rename it, or link it from a UTF-8 "
                                "name, and set that in the config") from None
    merged, hidden = run / "merged", run / "hidden_states"
    if not (merged / "tokens" / INDEX_FILE).exists():
        raise DraftgenError(f"{merged / 'tokens' / INDEX_FILE}: not found; run `draftgen merge {sh_path(config.path)}` "
                            f"and `draftgen extract {sh_path(config.path)}` first")
    reader = TokenReader(merged / "tokens")
    lengths = np.array([e.length for e in reader.entries], dtype=np.int64)
    longest = int(lengths.max()) if len(lengths) else 0
    if max_length is not None and max_length < 1:
        raise DraftgenError(f"--max-length {max_length}: must be at least 1")
    chosen_length = max_length if max_length is not None else max(longest, 1)
    notes: list[str] = []
    fp = identity.read_fingerprint(merged / identity.FINGERPRINT_FILE)
    merge = fp.describe() if fp is not None else f"merged by an older draftgen ({len(reader):,} samples)"
    stored = identity.read_fingerprint(hidden / identity.HIDDEN_MERGE_FILE)
    files = identity.stored_samples(hidden) if hidden.is_dir() else 0
    if files == 0:
        hidden_text = "none yet: run `draftgen extract` first"
        notes.append(f"hidden_states/ holds no file yet: `draftgen extract {sh_path(config.path)}` first")
    elif fp is not None and stored is not None and not stored.same_merge(fp):
        hidden_text = f"{files:,} files of ANOTHER merge ({stored.describe()})"
        notes.append(f"hidden_states/ belongs to another merge than merged/: `draftgen extract {sh_path(config.path)} "
                     f"--start-over` (or --set-aside) before training")
    else:
        hidden_text = f"{files:,} of {len(reader):,} samples" + (f", {stored.describe()}" if stored else "")
        if files < len(reader):
            notes += _missing_notes(config, reader, files, stored.merge_id if stored is not None else "")
    refusal = ""
    if config.extract.format == "speculators":
        refusal = (f"these hidden states are speculators' hs_{{i}}.safetensors (extract.format = \"speculators\"): "
                   f"SpecForge's offline reader takes .ckpt files only and would find none; train with "
                   f"{sh_path(hidden.resolve() / 'train-speculators.sh')}, or SpecForge online "
                   f"(specforge-online.json)")
        notes.append(refusal)
    aux = _aux_layer_ids(config, notes)
    model: dict[str, Any] = {"target_model_path": config.extract.model, "torch_dtype": "bfloat16"}
    if config.extract.trust_remote_code:
        model["trust_remote_code"] = True
    if aux is not None:
        model["aux_hidden_state_layer_ids"] = aux
    spec = {
        "run_id": f"draftgen-{fp.merge_id}" if fp is not None else "draftgen",
        "output_dir": str((run / "draft").resolve()),
        "model": model,
        "data": {"hidden_states_path": str(hidden.resolve()), "max_length": chosen_length,
                 "cache_dir": str((run / "specforge-cache").resolve())},
        "training": {"strategy": "eagle3"},
    }
    shown = sorted({SPECFORGE_DEFAULT_MAX_LENGTH, *SHOWN_LENGTHS} - {chosen_length})
    return Handoff(config=spec, config_path=(hidden / CONFIG_FILE).resolve(), samples=len(reader),
                   tokens=int(lengths.sum()), longest=longest, max_length=chosen_length,
                   chosen=cut_at(reader, lengths, chosen_length),
                   cuts=[cut_at(reader, lengths, n) for n in shown if n < longest],
                   aux_layer_ids=aux, merge=merge, hidden=hidden_text,
                   train_jsonl=(merged / "train.jsonl").resolve(), notes=notes, offline_refusal=refusal)


def _cut_text(c: Cut, samples: int, verb: str = "cuts") -> str:
    if not c.samples:
        return f"{verb} nothing"
    return (f"{verb} {c.samples:,} of {samples:,} samples: {c.tokens:,} tokens, {c.loss_tokens:,} of them "
            f"trained on (answer tokens)")


def describe(h: Handoff) -> list[str]:
    """The figures, one line each (the comments of train-command.sh)."""
    lines = [f"SpecForge {SPECFORGE_VERSION} (draftgen's gpu extra): offline EAGLE-3 training on these hidden states",
             f"merged/: {h.merge}; longest sample {h.longest:,} tokens",
             f"hidden states: {h.hidden}",
             f"data.max_length = {h.max_length:,}: {_cut_text(h.chosen, h.samples)}"
             + ("" if h.chosen.samples else " (at least the longest sample)")]
    for c in h.cuts:
        default = " (SpecForge's default)" if c.max_length == SPECFORGE_DEFAULT_MAX_LENGTH else ""
        lines.append(f"  max_length {c.max_length:,}{default} {_cut_text(c, h.samples, 'would cut')}")
    aux = h.aux_layer_ids
    lines += [f"target model: {h.config['model']['target_model_path']}",
              f"aux layer ids (SGLang numbering): {aux if aux is not None else 'not set'}",
              f"draft vocabulary: {SPECFORGE_DRAFT_VOCAB:,} (the draft config SpecForge derives from the target; "
              f"the map from target ids is built from this data, cached in {h.config['data']['cache_dir']})",
              f"data: {h.config['data']['hidden_states_path']} (offline features: ids, mask, states); the same "
              f"samples as conversations: {h.train_jsonl}",
              f"output: {h.config['output_dir']}"]
    return lines + [f"NOTE: {n}" for n in h.notes]


def write_handoff(h: Handoff) -> tuple[Path, Path]:
    """hidden_states/specforge.json and train-command.sh (SpecForge's reader skips both: not .ckpt)."""
    h.config_path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(h.config_path, h.config)
    script = h.config_path.with_name(SCRIPT_FILE)
    run = (f"exec {h.command} \"$@\"\n" if not h.offline_refusal else
           f"echo {shlex.quote('train-command.sh: ' + one_line(h.offline_refusal))} >&2\nexit 1\n")
    body = "#!/bin/sh\n" + "".join(f"# {one_line(line)}\n" for line in describe(h)) + run
    write_atomic(script, body.encode())
    script.chmod(script.stat().st_mode | 0o100)
    return h.config_path, script


def online_config(h: Handoff) -> dict[str, Any]:
    """The online SpecForge config: the offline one with merged/train-tokens.jsonl (draftgen's ids, read
    verbatim) as its data instead of the hidden states, its own output and control folders, and the
    disaggregated deployment SpecForge 0.2.0 runs online training with (the cluster's addresses are
    ONLINE_SITE_KEYS, given on the command line)."""
    run = h.config_path.parent.parent
    spec = copy.deepcopy(h.config)
    spec["run_id"] = f"{spec['run_id']}-online"
    spec["output_dir"] = str((run / "draft-online").resolve())
    data = spec["data"]
    del data["hidden_states_path"]
    data["prompts_path"] = str(h.train_jsonl.with_name(TRAIN_TOKENS_FILE))
    spec["deployment"] = {"mode": "disaggregated", "disaggregated": {
        "control_dir": str((run / "specforge-online" / "control").resolve()), "backend": "mooncake"}}
    return spec


def online_command(path: Path) -> str:
    """`specforge train` on the online config, with a placeholder for each value only the cluster knows."""
    return (f"specforge train --config {sh_path(path)} "
            + " ".join(f"{key}={value}" for key, value, _ in ONLINE_SITE_KEYS))


def describe_online(h: Handoff, path: Path) -> list[str]:
    """What the online config is for and what it still needs, one line each."""
    tokens = h.train_jsonl.with_name(TRAIN_TOKENS_FILE)
    lines = [f"online training instead (SpecForge computes the target's features as it trains, from SGLang "
             f"capture servers): {path}",
             f"  data.prompts_path = {tokens}: draftgen's ids and loss masks, read as they are (not "
             f"merged/train.jsonl: SpecForge's re-rendering of it trains on other ids)",
             f"  the capture servers must serve at least {h.max_length + SGLANG_CAPTURE_HEADROOM:,} tokens of "
             f"context (data.max_length + {SGLANG_CAPTURE_HEADROOM}, SpecForge's headroom)",
             "  set for your cluster (SpecForge refuses to start without them):"]
    lines += [f"    {key}: {what}" for key, _, what in ONLINE_SITE_KEYS]
    if not tokens.is_file():
        lines.append(f"  NOTE: {tokens} not found (merged by an older draftgen): `draftgen merge` writes it")
    return lines + [f"  {online_command(path)}"]


def write_online(h: Handoff) -> Path:
    """hidden_states/specforge-online.json, beside the offline config (SpecForge's reader skips it: not .ckpt)."""
    path = h.config_path.with_name(ONLINE_CONFIG_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, online_config(h))
    return path


def _under(path: Path, folder: Path) -> str:
    """`path` as named under `folder` (speculators-data/state.json), its name when it is elsewhere."""
    try:
        return str(Path(path).resolve().relative_to(Path(folder).resolve()))
    except ValueError:
        return Path(path).name


def write_provenance(config: Config, h: Handoff, started_at: float, files: list[Path]) -> Path:
    """The hand-off's record in hidden_states/provenance.json (core/provenance.py): the command, versions, config
    and inputs, the model and its config's digest, the layers, max_length and each file written with its sha256."""
    from draftgen.core import provenance
    from draftgen.core.extract.model_info import read_model_config
    from draftgen.core.extract.readback import format_name, stored_dtype
    cfg = config.extract
    try:
        model = provenance.model_config_digest(read_model_config(cfg.model, trust_remote_code=cfg.trust_remote_code))
    except DraftgenError as e:
        model = {"config_sha256": None, "config_error": str(e)}
    merged = identity.read_fingerprint(config.run_dir / "merged" / identity.FINGERPRINT_FILE)
    stored = identity.read_fingerprint(h.config_path.parent / identity.HIDDEN_MERGE_FILE)
    rec = provenance.record(
        config, started_at,
        inputs={"merge_id": merged.merge_id if merged is not None else None,
                "hidden_states_merge_id": stored.merge_id if stored is not None else None},
        model={"path": cfg.model, **model}, layers=cfg.aux_layers,
        aux_hidden_state_layer_ids=h.aux_layer_ids, dtype=cfg.dtype, stored_dtype=stored_dtype(cfg),
        format=format_name(cfg), max_length=h.max_length, samples=h.samples, tokens=h.tokens,
        outputs=[{"file": _under(p, h.config_path.parent), "sha256": provenance.file_sha256(p)} for p in files])
    return provenance.add(h.config_path.parent, "train-command", rec)


def train_command(config: Config, *, max_length: int | None = None, out: TextIO | None = None) -> int:
    """`draftgen train-command CONFIG [--max-length N]`: print and write the hand-off; 0."""
    stream = out or sys.stdout
    started_at = time.time()
    h = make_handoff(config, max_length=max_length)
    try:
        config_path, script = write_handoff(h)
        online_path = write_online(h)
        written = [config_path, script, online_path]
        extra = []
        if config.extract.format == "speculators":  # vLLM's speculators reads these files: its config and command too
            from draftgen.core.extract import speculators_handoff
            extra = speculators_handoff.write(config, max_length=h.max_length)
            written += speculators_handoff.written_files(config)
        write_provenance(config, h, started_at, written)
    except OSError as e:
        from draftgen.core.files import disk_error
        raise disk_error(h.config_path, e) from e
    for line in describe(h) + describe_online(h, online_path) + extra:
        print(f"# {one_line(line)}", file=stream)
    print(f"# config ({one_line(str(config_path))}):", file=stream)
    for line in json.dumps(h.config, indent=2).splitlines():  # ASCII: JSON escapes the rest
        print(f"#   {line}", file=stream)
    print(f"# (also in {one_line(str(script))})", file=stream)
    print(h.command, file=stream, flush=True)
    return 0
