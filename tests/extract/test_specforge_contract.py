"""The specforge backend against the source of the releases pyproject's `gpu` extra pins, without a GPU.

SpecForge 0.2.0 and SGLang 0.5.14 are downloaded once per pytest cache (`pip download --no-deps`,
tests/pinned.py) and read with `ast` (tests/contract.py): nothing of them is imported or installed.
A renamed function, a dropped parameter, a changed capture-id rule or a clashing ServerArgs key
fails here, in CI, instead of after an 8-GPU job has loaded its weights. The training hand-off
(`draftgen train-command`) is the exception, at the end: its config is parsed by the release's own
`load_config` and `specforge train --plan`, run in a subprocess.
"""

from __future__ import annotations

import ast
import io
import itertools
import re
from pathlib import Path

import pytest

from tests.contract import (
    BATCH_FIELDS,
    CALL_SITES,
    CAPTURE_METHODS,
    CONTRACT,
    Sources,
    _class_fields,
    _find,
    call_keywords,
    call_sites,
    check_call_sites,
    check_expectations,
    check_imports,
    imports_of,
    server_args_collisions,
)
from tests.extract import test_extract
from tests.pinned import ROOT, gpu_pins, run_with_specforge

model_dir = test_extract.model_dir  # the tiny Llama fixture, for the hand-off test

BACKEND = ROOT / "core" / "extract" / "specforge_backend.py"
BACKEND_REL = "draftgen/core/extract/specforge_backend.py"


@pytest.fixture(scope="session")
def releases(specforge_tree: Path, sglang_tree: Path) -> Sources:
    return Sources([specforge_tree, sglang_tree])


def capture_files(src: Sources) -> dict[str, ast.Module]:
    """SpecForge's offline capture package and the distributed helpers it uses: the code our backend runs."""
    root = next(r for r in src.roots if (r / "specforge").is_dir())
    rels = [p.relative_to(root).as_posix() for p in sorted((root / "specforge" / "offline_capture").rglob("*.py"))]
    rels.append("specforge/distributed.py")
    return {rel: src.tree(rel) for rel in rels}  # type: ignore[misc]


def our_server_args() -> set[str]:
    from draftgen.core.extract.specforge_backend import server_args
    return set(server_args(max_forward_tokens=1, max_samples=1, mem_fraction_static=0.5, attention_backend="fa3"))


@pytest.mark.slow
def test_extra_pins_are_specforges_own(releases: Sources) -> None:
    # The extra pins SpecForge and exactly the sglang/torch/transformers its release requires.
    pins = gpu_pins()
    meta = (next(r for r in releases.roots if (r / "specforge").is_dir())
            / f"specforge-{pins['specforge']}.dist-info" / "METADATA").read_text()
    required = dict(re.findall(r"^Requires-Dist: ([A-Za-z0-9_.-]+)==([^\s;]+)\s*$", meta, re.M))
    for name in ("sglang", "torch", "transformers"):
        assert pins[name] == required[name], f"gpu extra pins {name}=={pins[name]}, SpecForge requires {required[name]}"


def test_backend_imports_exist_in_pinned_specforge(releases: Sources) -> None:
    tree = ast.parse(BACKEND.read_text())
    assert {m for m, _, _ in imports_of(tree, BACKEND_REL, ("specforge",))} == {
        "specforge.distributed", "specforge.offline_capture"}
    assert check_imports(releases, {BACKEND_REL: tree}, ("specforge", "sglang")) == []


def test_specforge_capture_imports_exist_in_pinned_sglang(releases: Sources) -> None:
    assert check_imports(releases, capture_files(releases), ("specforge", "sglang")) == []


def test_called_functions_signatures_and_rules_hold(releases: Sources) -> None:
    assert check_expectations(releases, CONTRACT) == []


def test_server_args_are_fields_and_do_not_clash_with_specforges(releases: Sources) -> None:
    assert server_args_collisions(releases, our_server_args()) == []


def test_backend_uses_only_the_contracted_names() -> None:
    # The contract lists what the backend touches on SpecForge's objects; a new call must be added there.
    tree = ast.parse(BACKEND.read_text())
    on_capture = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                  and isinstance(n.value, ast.Attribute) and n.value.attr == "capture"
                  and isinstance(n.value.value, ast.Name) and n.value.value.id == "self"}
    on_result = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                 and isinstance(n.value, ast.Name) and n.value.id == "out"}
    assert on_capture == CAPTURE_METHODS
    assert on_result == BATCH_FIELDS
    loads = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "load_offline_eagle3_capture"]
    assert len(loads) == 1 and {k.arg for k in loads[0].keywords} == {"torch_dtype", "trust_remote_code", None}


def _broken(src: Sources, rel: str, old: str, new: str) -> Sources:
    root = next(r for r in src.roots if (r / rel).is_file())
    text = (root / rel).read_text()
    assert old in text, f"{rel}: {old!r} not found: the mutation would test nothing"
    return Sources(src.roots, overrides={rel: text.replace(old, new)})


def test_a_renamed_function_fails_the_contract(releases: Sources) -> None:
    sf = "specforge/offline_capture/sglang.py"
    broken = _broken(releases, sf, "def set_capture_layers(", "def set_layers_to_capture(")
    assert any("set_capture_layers: not found" in p for p in check_expectations(broken, CONTRACT))
    broken = _broken(releases, sf, "def load_offline_eagle3_capture(", "def load_offline_capture_v2(")
    problems = check_expectations(broken, CONTRACT) + check_imports(
        broken, {BACKEND_REL: ast.parse(BACKEND.read_text())}, ("specforge",))
    assert any("load_offline_eagle3_capture" in p for p in problems)
    # SGLang under SpecForge's capture: a renamed method, a renamed class it imports, a dropped parameter.
    runner = "sglang/srt/model_executor/model_runner.py"
    broken = _broken(releases, runner, "def init_attention_backends(", "def init_attention_backend(")
    assert any("ModelRunner.init_attention_backends: not found" in p for p in check_expectations(broken, CONTRACT))
    fbi = "sglang/srt/model_executor/forward_batch_info.py"
    broken = _broken(releases, fbi, "class CaptureHiddenMode(", "class HiddenCaptureMode(")
    assert any("has no CaptureHiddenMode" in p for p in check_imports(broken, capture_files(broken), ("sglang",)))
    broken = _broken(releases, "sglang/srt/managers/schedule_batch.py", "origin_input_ids: array[int],",
                     "input_ids: array[int],")
    assert any("Req.__init__: no parameter 'origin_input_ids'" in p for p in check_expectations(broken, CONTRACT))


def test_a_changed_capture_rule_or_server_arg_fails_the_contract(releases: Sources) -> None:
    broken = _broken(releases, "sglang/srt/models/deepseek_v2.py", "if layer_ids and layer_ids[0] == 1:",
                     "if layer_ids:")
    assert any("DeepseekV2ForCausalLM.set_eagle3_layers_to_capture: its source no longer has" in p
               for p in check_expectations(broken, CONTRACT))
    broken = _broken(releases, "sglang/srt/server_args.py", "    max_total_tokens:", "    max_total_num_tokens:")
    assert "ServerArgs has no field 'max_total_tokens' (the specforge backend passes it)" in \
        server_args_collisions(broken, our_server_args())
    assert any("duplicate keyword" in p for p in server_args_collisions(releases, our_server_args() | {"tp_size"}))


# The calls themselves: every keyword the backend passes binds to the pinned signature.

def _backend_tree(text: str | None = None) -> ast.Module:
    return ast.parse(text if text is not None else BACKEND.read_text())


def test_every_backend_call_binds_to_the_pinned_signature(releases: Sources) -> None:
    calls = call_sites(_backend_tree(), set(CALL_SITES))
    assert {c.callee for c in calls} == set(CALL_SITES)
    assert check_call_sites(releases, _backend_tree(), CALL_SITES, our_server_args()) == []


def test_a_keyword_renamed_upstream_fails_at_the_call_site(releases: Sources) -> None:
    sf = "specforge/offline_capture/sglang.py"
    for rel, old, new, called in [
        (sf, "capture_method: str = \"eagle3\",\n    ) -> None:\n        self.capture_layers",
         "method: str = \"eagle3\",\n    ) -> None:\n        self.capture_layers", "set_capture_layers"),
        (sf, "        loss_mask: torch.Tensor,\n    ) -> OfflineCaptureBatch:",
         "        target_mask: torch.Tensor,\n    ) -> OfflineCaptureBatch:", "capture"),
        ("specforge/distributed.py", "timeout: int = 10, tp_size: int = 1,", "timeout: int = 10, tp_degree: int = 1,",
         "init_distributed"),
    ]:
        broken = _broken(releases, rel, old, new)
        problems = check_call_sites(broken, _backend_tree(), CALL_SITES, our_server_args())
        assert any(f"{called}(...) does not bind" in p for p in problems), (called, problems)


def test_a_dropped_or_misspelt_keyword_in_the_backend_fails(releases: Sources) -> None:
    text = BACKEND.read_text()
    for old, new in [("loss_mask=attention_mask)", ")"),
                     ("init_distributed(timeout=DIST_TIMEOUT_MIN, tp_size=tp_size)",
                      "init_distributed(timeout=DIST_TIMEOUT_MIN, tp=tp_size)"),
                     ('capture_method="eagle3"', 'capture_mode="eagle3"')]:
        assert old in text, old
        problems = check_call_sites(releases, _backend_tree(text.replace(old, new)), CALL_SITES, our_server_args())
        assert problems and "does not bind" in problems[0], (new, problems)


def test_reserved_server_args_are_what_specforges_build_passes(releases: Sources) -> None:
    from draftgen.core.extract.specforge_backend import SPECFORGE_SETS
    passed, forwards = call_keywords(releases, "specforge.offline_capture.sglang_backend.capture",
                                     "OfflineSGLangCaptureBackend.build", "ServerArgs")
    assert forwards and set(SPECFORGE_SETS) == passed


def test_sglang_table_is_checked_against_the_pinned_server_args(releases: Sources) -> None:
    from draftgen.core.errors import ConfigError
    from draftgen.core.extract.specforge_backend import check_sglang_table, server_args
    fields = _class_fields(_find(releases.tree("sglang/srt/server_args.py"), "ServerArgs"))  # type: ignore[arg-type]
    table = {"context_length": 32768, "kv_cache_dtype": "fp8_e4m3", "enable_dp_attention": False}
    check_sglang_table(table, "k.toml", fields)
    merged = server_args(max_forward_tokens=1, max_samples=1, mem_fraction_static=0.5, attention_backend="",
                         extra=table)
    assert server_args_collisions(releases, set(merged)) == []
    for bad, says in [({"tp_size": 8}, "SpecForge's capture sets it"), ({"max_total_tokens": 1}, "set by draftgen"),
                      ({"context_lenght": 1}, "not a field of SGLang's ServerArgs")]:
        with pytest.raises(ConfigError, match=says):
            check_sglang_table(bad, "k.toml", fields)


def test_the_page_sizes_sglang_forces_are_the_ones_the_kv_margin_knows(releases: Sources) -> None:
    # A backend added upstream with a larger forced page would make the KV pool too small for a batch.
    import re as _re

    from draftgen.core.extract.gpu_plan import FORCED_PAGE_SIZES, LARGEST_PAGE
    text = next(r / "sglang/srt/server_args.py" for r in releases.roots
                if (r / "sglang/srt/server_args.py").is_file()).read_text()
    forced = {int(n) for n in _re.findall(r"self\.page_size = (\d+)", text)}
    assert forced and max(forced) <= LARGEST_PAGE, forced
    for backend in FORCED_PAGE_SIZES:
        assert f'"{backend}"' in text, f"{backend}: no longer an attention backend SGLang names"


# ---------------------------------------------------------------------------------------------
# The training hand-off (core/extract/handoff.py), parsed by SpecForge's own config loader and CLI.
# Unlike the checks above this one runs the release's code (pure python + pydantic) in a
# subprocess, as tests/extract/test_specforge_release.py does: its schema is a pydantic model, checked best
# by itself.


def specforge_parse(config_json: Path, specforge_tree: Path) -> dict:
    return run_with_specforge("specforge_train_config.py", config_json, specforge_tree, "SpecForge refused")


@pytest.mark.slow
def test_train_command_output_is_accepted_by_the_pinned_specforge(specforge_tree: Path, tmp_path: Path,
                                                                  model_dir: Path) -> None:
    import json
    import zipfile

    from draftgen.core.extract import extract
    from draftgen.core.extract.handoff import (
        SPECFORGE_DEFAULT_MAX_LENGTH,
        SPECFORGE_DRAFT_VOCAB,
        SPECFORGE_VERSION,
        train_command,
    )
    from draftgen.core.merge.merge import merge
    from draftgen.core.tokens.store import TokenReader
    from tests.merge.test_hidden_states_merge import answers, make_config
    config = make_config(tmp_path, model_dir, seed=4)
    answers(config.run_dir, 9)
    merge(config)
    stats = extract(config)
    hidden = config.run_dir / "hidden_states"
    left = json.loads((hidden / "specforge.json").read_text())  # what extraction left beside its files
    assert train_command(config, out=io.StringIO()) == 0
    assert json.loads((hidden / "specforge.json").read_text()) == left

    got = specforge_parse(hidden / "specforge.json", specforge_tree)
    longest = max(e.length for e in TokenReader(config.run_dir / "merged" / "tokens").entries)
    assert got["plan_rc"] == 0 and '"role": "all"' in got["plan"]
    assert got["mode"] == "offline" and got["strategy"] == "eagle3" and got["train_data_path"] == ""
    assert got["max_length"] == longest  # nothing sliced off by SpecForge's normaliser
    assert got["hidden_states_path"] == str(hidden.resolve())
    assert got["target_model_path"] == str(model_dir)
    assert got["aux_hidden_state_layer_ids"] == stats.draft_layer_ids
    # What the hand-off says of SpecForge is SpecForge's: its default, its draft vocabulary, its version.
    assert got["default_max_length"] == SPECFORGE_DEFAULT_MAX_LENGTH
    assert got["draft_vocab_size"] == SPECFORGE_DRAFT_VOCAB
    assert gpu_pins()["specforge"] == SPECFORGE_VERSION
    wheel = next((specforge_tree.parent / "wheels").glob(f"specforge-{SPECFORGE_VERSION}-*.whl"))
    with zipfile.ZipFile(wheel) as z:  # `specforge train` is the release's console script
        entry = z.read(f"specforge-{SPECFORGE_VERSION}.dist-info/entry_points.txt").decode()
    assert re.search(r"^specforge\s*=\s*specforge\.cli:main$", entry, re.M)
    assert (hidden / "train-command.sh").read_text().rstrip().endswith(
        f"exec specforge train --config {hidden.resolve() / 'specforge.json'} \"$@\"")

    # A config SpecForge would refuse fails here (the check can fail): two aux ids.
    bad = json.loads((hidden / "specforge.json").read_text())
    bad["model"]["aux_hidden_state_layer_ids"] = bad["model"]["aux_hidden_state_layer_ids"][:2]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(AssertionError, match="exactly three"):
        specforge_parse(tmp_path / "bad.json", specforge_tree)


def test_the_self_checks_kimi_form_is_what_the_pinned_sglang_loads_for_kimi_k25(sglang_tree: Path) -> None:
    """The class the released SGLang registers for Kimi-K2.5, the config it reads, and the weight names its
    load_weights takes: the self-check's tiny Kimi (tiny_models.kimi_form) must be built for exactly these."""
    from draftgen.core.extract.model_info import DEEPSEEK_FAMILY_ARCHS
    from draftgen.core.extract.tiny_models import KIMI_ARCH, TINY_VISION
    model = (sglang_tree / "sglang/srt/models/kimi_k25.py").read_text()
    config = (sglang_tree / "sglang/srt/configs/kimi_k25.py").read_text()
    assert f"EntryClass = [{KIMI_ARCH}]" in model and KIMI_ARCH in DEEPSEEK_FAMILY_ARCHS
    assert "self.language_model = DeepseekV3ForCausalLM(\n                config.text_config," in model
    assert 'yield name.replace("language_model.", ""), loaded_weight' in model  # our prefix, stripped
    assert 'if "vision_tower" in name or "mm_projector" in name:' in model      # vision weights: by name only
    assert 'model_type = "kimi_k25"' in config
    assert "text_config = DeepseekV3Config(**text_config)" in config
    assert "vision_config = KimiK25VisionConfig(**vision_config)" in config
    # Every vision setting SGLang reads from vision_config: given by TINY_VISION, or a parameter of
    # KimiK25VisionConfig with a default (the text_hidden_size kimi_form adds is one).
    start = model.index("class MoonViT3dPretrainedModel")
    read = set(re.findall(r"config\.(\w+)", model[start:model.index("class KimiK25ForConditionalGeneration")]))
    vision_init = config[config.index("class KimiK25VisionConfig"):config.index("class KimiK25Config")]
    defaults = set(re.findall(r"^\s{8}(\w+): [^=\n]+ = ", vision_init, re.M))
    assert read and read <= set(TINY_VISION) | defaults | {"text_hidden_size"}, read - set(TINY_VISION) - defaults
    assert {"vt_hidden_size"} <= read and "vt_hidden_size" in TINY_VISION  # the projector's name, not a parameter


# -- multi-turn merges read by SpecForge's own code ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["per_turn", "per_conversation"])
def test_specforges_parser_tokenizes_a_multi_turn_merge_as_we_wrote_it(tmp_path: Path, specforge_tree: Path,
                                                                       mode: str) -> None:
    """SpecForge's ThinkingParser with its kimi-k2-thinking template, on each train.jsonl row of a merge of
    3-turn conversations: the ids and the loss mask it builds are merged/tokens' entry for that row.
    per_turn rows are parsed with train_only_last_turn (loss on the turn's own answer), per_conversation
    rows without (every assistant turn)."""
    from draftgen.core.merge.merge import merge
    from draftgen.core.tokens.store import TokenReader
    from tests.multiturn import multi_turn_run
    config, _ = multi_turn_run(tmp_path, merge={"multi_turn": mode})
    merge(config)
    got = run_with_specforge("specforge_parse.py", config.run_dir, specforge_tree, "SpecForge's parser refused")
    reader = TokenReader(config.run_dir / "merged" / "tokens")
    ours = [(ids.tolist(), mask.tolist()) for _, ids, mask in reader]
    assert got["parser"] == "ThinkingParser" and got["mode"] == mode
    assert len(got["rows"]) == len(ours) == (8 if mode == "per_turn" else 4)
    for row, (ids, mask) in zip(got["rows"], ours, strict=True):
        assert row["input_ids"] == ids
        assert row["loss_mask"] == mask
    # The per-conversation rows train several turns: SpecForge masks three spans where a turn-3 sample ends.
    spans = [sum(1 for a, b in itertools.pairwise([0, *m]) if b > a) for _, m in ours]
    assert max(spans) == (1 if mode == "per_turn" else 3)


@pytest.fixture(scope="module")
def kimi_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny real Llama over the whole Kimi vocabulary, so a merge's real token ids can be extracted."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftgen.core.tokens.tokenizer import bundled_kimi
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=bundled_kimi().vocab_size, max_position_embeddings=512,
                      tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tiny-llama-kimi-vocab")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["per_turn", "per_conversation"])
def test_hidden_states_of_a_multi_turn_merge_are_read_by_specforges_reader(tmp_path: Path, specforge_tree: Path,
                                                                           kimi_vocab_model: Path, mode: str) -> None:
    from draftgen.core.extract import extract
    from draftgen.core.merge.merge import merge
    from tests.extract.test_specforge_release import check_run_with_specforge
    from tests.multiturn import multi_turn_run
    extract_table = {"extract": {"model": str(kimi_vocab_model), "backend": "hf", "device": "cpu",
                                 "dtype": "float32"}}
    config, _ = multi_turn_run(tmp_path, merge={"multi_turn": mode}, tables=extract_table)
    stats = merge(config)
    assert extract(config).written == stats.samples
    got = check_run_with_specforge(config.run_dir, specforge_tree)  # ids and masks as merged, rows as written
    turns = [sum(1 for m in conv if m["role"] == "assistant") for conv in got["conversations"]]
    assert sorted(turns) == ([1, 1, 1, 1, 2, 2, 3, 3] if mode == "per_turn" else [1, 1, 3, 3])
