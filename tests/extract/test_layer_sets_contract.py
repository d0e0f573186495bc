"""The named layer sets and the speculative-decoding refusal against the pinned releases' own source.

SpecForge 0.2.0 and SGLang 0.5.14 are downloaded once per pytest cache (tests/pinned.py) and read with
`ast`; SpecForge's `build_target_layer_ids` (pure Python) is run from its own source, nothing else of
either is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from draftgen.core.config_checks import SPECULATIVE_KEYS, _speculative_key
from draftgen.core.extract.model_info import ModelDims, dflash_layers, eagle3_layers, resolve_aux_layers


def _function(path: Path, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text(), str(path))
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def test_dflash_placement_is_specforges_build_target_layer_ids(specforge_tree: Path) -> None:
    fn = _function(specforge_tree / "specforge" / "modeling" / "draft" / "dflash.py", "build_target_layer_ids")
    scope: dict[str, object] = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "dflash.py", "exec"), scope)  # noqa: S102 (its own source)
    build = scope["build_target_layer_ids"]
    for n in range(4, 129):
        for k in range(1, 9):
            assert list(dflash_layers(n, k)) == build(n, k), (n, k)  # type: ignore[operator]
    # DFlash reads layer k as hidden_states[k + 1]: the same 0-based layer outputs draftgen numbers by.
    extract = _function(specforge_tree / "specforge" / "modeling" / "draft" / "dflash.py", "extract_context_feature")
    assert "offset = 1" in ast.unparse(extract) and "hidden_states[layer_id + offset]" in ast.unparse(extract)


def test_peagle_takes_eagle3s_layers_and_dspark_dflashs(specforge_tree: Path) -> None:
    algorithms = specforge_tree / "specforge" / "algorithms"
    peagle = ast.unparse(_function(algorithms / "peagle" / "providers.py", "resolve_capture_layers"))
    assert "resolve_eagle_capture_layers" in peagle
    dspark = ast.unparse(_function(algorithms / "dspark" / "providers.py", "resolve_capture_layers"))
    assert "resolve_dflash_capture_layers" in dspark
    tree = ast.parse((specforge_tree / "specforge" / "modeling" / "draft" / "dspark.py").read_text())
    draft = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "DSparkDraftModel")
    assert [ast.unparse(b) for b in draft.bases] == ["DFlashDraftModel"]
    eagle = ast.unparse(_function(algorithms / "model_providers.py", "resolve_eagle_capture_layers"))
    assert "[1, num_layers // 2 - 1, num_layers - 4]" in eagle and "len(layers) != 3" in eagle
    dims = ModelDims(61, 7168, "kimi")
    assert resolve_aux_layers("peagle", dims) == eagle3_layers(61) == (1, 29, 57)


def test_every_speculative_server_arg_of_the_pinned_sglang_is_refused(sglang_tree: Path) -> None:
    src = (sglang_tree / "sglang" / "srt" / "server_args.py").read_text()
    # Its "Speculative decoding" and "Speculative decoding (ngram)" sections, up to the next one.
    section = src.split("    # Speculative decoding\n", 1)[1].split("    # Expert parallelism\n", 1)[0]
    fields = re.findall(r"^    (\w+): A\[", section, re.M)
    assert "speculative_algorithm" in fields and len(fields) > 20
    assert [f for f in fields if not _speculative_key(f)] == []
    every = set(re.findall(r"^    (\w+): A\[", src, re.M))
    assert SPECULATIVE_KEYS <= every  # the draft fields outside the section exist under these names
    # and no ordinary key is caught by the rule
    assert not [f for f in every - set(fields) - SPECULATIVE_KEYS if _speculative_key(f)]


@pytest.mark.parametrize("n", [8, 36, 61])
def test_dflash_five_is_within_the_capturable_layers(n: int) -> None:
    layers = resolve_aux_layers("dflash:5", ModelDims(n, 64, "m"))
    assert layers[0] == 1 and layers[-1] == n - 3 and len(layers) == 5
