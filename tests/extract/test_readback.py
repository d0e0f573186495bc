"""Provenance beside every output and the read-back check (issue 53 points 5 and 6), with the tiny real Llama
on the CPU: a real merge, extraction and hand-off write provenance.json in merged/ and hidden_states/;
`draftgen check` reads every file back by SpecForge's rules and `extract --validate` redoes only the bad ones."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch

from draftgen.core import provenance
from draftgen.core.config import Config
from draftgen.core.config_load import load_config
from draftgen.core.extract import extract, layout, readback
from draftgen.core.extract.command import extract_command
from draftgen.core.extract.handoff import train_command
from draftgen.core.merge.merge import merge
from draftgen.core.tokens import identity
from tests.extract import test_extract
from tests.merge.test_merge import Sample, user, write_dataset

model_dir = test_extract.model_dir  # the tiny Llama (H=64, 8 layers), on CPU
KEY = "sk-or-v1-" + "0123456789abcdef" * 4


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_config(tmp_path: Path, model: Path) -> Config:
    (tmp_path / "A.jsonl").write_text('{"id": "a0", "prompt": "prompt 0"}\n')
    path = tmp_path / "draftgen.toml"
    path.write_text(f'[output]\ndir = "run"\n[[datasets]]\nname = "A"\nprompts = "A.jsonl"\n'
                    f'[extract]\nmodel = "{model}"\nbackend = "hf"\ndevice = "cpu"\ndtype = "float32"\n')
    return load_config(path)


def test_provenance_beside_merged_hidden_states_and_the_handoff(tmp_path: Path, model_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path, model_dir)
    run = config.run_dir
    write_dataset(run, "A", [Sample(f"a{i}", user(f"prompt {i}")) for i in range(6)], seed=5,
                  vocab=test_extract.NAN_TOKEN)
    # The key is in the environment and, were a user to paste it on the command line, in argv: never written.
    monkeypatch.setenv("OPENROUTER_API_KEY", KEY)
    monkeypatch.setattr(sys, "argv", ["draftgen", "merge", str(config.path), f"--note={KEY}"])
    merge(config)
    extract(config)
    train_command(config, out=io.StringIO())
    fp = identity.read_fingerprint(run / "merged" / identity.FINGERPRINT_FILE)
    assert fp is not None

    merged = provenance.read(run / "merged")
    hidden = provenance.read(run / "hidden_states")
    assert set(merged) == {"merge"} and set(hidden) == {"extract", "train-command"}
    head = subprocess.run(["git", "-C", str(Path(provenance.__file__).resolve().parent.parent), "rev-parse", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    for rec in (merged["merge"], hidden["extract"], hidden["train-command"]):
        assert rec["command"] == ["draftgen", "merge", str(config.path), "--note=[redacted]"]
        assert rec["draftgen"]["version"] == "0.1.0" and rec["draftgen"]["commit"] == head
        assert rec["versions"]["torch"] == importlib.metadata.version("torch")
        assert rec["versions"]["transformers"] == importlib.metadata.version("transformers")
        assert set(rec["versions"]) >= {"python", "torch", "transformers", "sglang", "specforge"}
        assert all(isinstance(v, str) and v for v in rec["versions"].values())  # "absent" when not installed
        assert rec["config"] == {"path": str(config.path), "sha256": sha256(config.path)}
        assert rec["inputs"]["prompt_files"] == [{"dataset": "A", "path": str(tmp_path / "A.jsonl"),
                                                  "sha256": sha256(tmp_path / "A.jsonl")}]
        assert rec["inputs"]["merge_id"] == fp.merge_id
        assert rec["host"] and rec["started_at"] <= rec["ended_at"]
    assert merged["merge"]["inputs"]["samples_sha256"] == fp.samples_sha256
    assert hidden["extract"]["inputs"]["samples_sha256"] == fp.samples_sha256
    for rec in (hidden["extract"], hidden["train-command"]):
        assert rec["model"]["path"] == str(model_dir)
        assert rec["model"]["config_sha256"] == sha256(model_dir / "config.json")
        assert (rec["format"], rec["stored_dtype"], rec["dtype"]) == ("specforge", "bfloat16", "float32")
    assert hidden["extract"]["layers"] == [1, 3, 4] and hidden["extract"]["written"] == 6
    assert hidden["train-command"]["aux_hidden_state_layer_ids"] == [1, 3, 4]  # a Llama: SGLang numbers them alike
    outputs = {o["file"]: o["sha256"] for o in hidden["train-command"]["outputs"]}
    assert outputs == {name: sha256(run / "hidden_states" / name)
                       for name in ("specforge.json", "train-command.sh", "specforge-online.json")}
    for folder in ("merged", "hidden_states"):
        assert KEY[9:21] not in (run / folder / provenance.PROVENANCE_FILE).read_text()
    # SpecForge's reader takes .ckpt files only: the records are no samples; the merge id is the samples' alone.
    assert len(readback.specforge_files(run / "hidden_states")) == 6
    assert identity.merged_fingerprint(run / "merged").same_merge(fp)


@pytest.mark.parametrize("via", ["extract", "train-command"])
def test_the_speculators_hand_off_is_in_its_provenance_record(tmp_path: Path, model_dir: Path, via: str) -> None:
    config = test_extract.make_run(tmp_path, model_dir, samples=test_extract.make_samples(n=3),
                                   format="speculators", dtype="fp8")
    extract(config)  # leaves the hand-off and its record as it ends
    if via == "train-command":
        train_command(config, out=io.StringIO())
    hidden = config.run_dir / "hidden_states"
    outputs = {o["file"]: o["sha256"] for o in provenance.read(hidden)["train-command"]["outputs"]}
    data = sorted(str(p.relative_to(hidden)) for p in (hidden / "speculators-data").rglob("*") if p.is_file())
    assert "speculators-data/state.json" in data
    names = ["speculators-train.yaml", "train-speculators.sh", *data]
    assert {k: outputs[k] for k in names if k in outputs} == {k: sha256(hidden / k) for k in names}
    assert {"specforge.json", "train-command.sh", "specforge-online.json"} <= set(outputs)


def test_records_added_at_once_are_all_kept_and_the_lock_is_in_the_run_directory(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "hidden_states"
    folder.mkdir(parents=True)
    code = ("import sys; from pathlib import Path; from draftgen.core import provenance\n"
            "for i in range(40): provenance.add(Path(sys.argv[1]), f'{sys.argv[2]}-{i}', {'i': i})\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(folder), f"w{k}"]) for k in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert set(provenance.read(folder)) == {f"w{k}-{i}" for k in range(3) for i in range(40)}
    # hidden_states/ holds the records only (what a trainer or `ls` sees); the lock is the run directory's.
    assert sorted(p.name for p in folder.iterdir()) == [provenance.PROVENANCE_FILE]
    assert provenance.lock_path(folder) == tmp_path / "run" / ".hidden_states.provenance.lock"
    assert provenance.lock_path(folder).is_file()


def test_check_finds_a_truncated_and_a_swapped_file_and_validate_redoes_only_those(tmp_path: Path,
                                                                                 model_dir: Path) -> None:
    config = test_extract.make_run(tmp_path, model_dir)
    extract(config)
    root = config.run_dir / "hidden_states"
    out = io.StringIO()
    assert readback.check_command(config, out=out) == 0
    assert f"checked {test_extract.N_SAMPLES} files" in out.getvalue() and "14 good, 0 bad" in out.getvalue()

    truncated, swapped = layout.sample_path(root, 2), layout.sample_path(root, 5)
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])  # a copy cut short
    sample = layout.load_sample(swapped)
    ids = sample["input_ids"].clone()
    ids[[0, 1]] = ids[[1, 0]]  # two ids swapped: shapes, dtypes and states as they were
    torch.save({**{k: v.clone() for k, v in sample.items()}, "input_ids": ids}, swapped)
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in root.rglob("*.ckpt") if p not in (truncated, swapped)}

    out = io.StringIO()
    assert readback.check_command(config, out=out) == 1
    text = out.getvalue()
    assert "12 good, 2 bad" in text
    assert "bad: rows_0-2000/data_2.ckpt (sample 2, id s2): unreadable (truncated or corrupt)" in text
    assert ("bad: rows_0-2000/data_5.ckpt (sample 5, id s5): input_ids differ from merged/tokens from token 0 on"
            in text)
    assert "--validate` checks again, removes the 2 bad files" in text

    assert extract(config).written == 0  # a plain extraction sees every file there: it redoes nothing
    out = io.StringIO()
    assert extract_command(config, None, out=out, validate=True) == 0
    stats = orjson.loads((root / "stats.json").read_bytes())
    assert stats["written"] == 2 and stats["skipped_existing"] == 12
    assert [b["index"] for b in stats["redone"]] == [2, 5]
    assert "data_5.ckpt (sample 5) was bad, extracted again: input_ids differ" in out.getvalue()
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in before} == before  # the good ones untouched
    assert provenance.read(root)["extract"]["redone"] == [2, 5]
    out = io.StringIO()
    assert readback.check_command(config, out=out) == 0 and "14 good, 0 bad" in out.getvalue()
    arrays = test_extract.token_arrays(config)
    for k in (2, 5):
        got = layout.load_sample(layout.sample_path(root, k))
        assert got["input_ids"].tolist() == arrays[k][0].tolist()


def test_speculators_fp8_check_finds_a_truncated_and_a_swapped_file_and_validate_redoes_only_those(
        tmp_path: Path, model_dir: Path, speculators_pythonpath: str) -> None:
    from safetensors.torch import save_file

    from draftgen.core.extract import speculators_layout as speculators
    from tests.extract.test_speculators_format import read_with_speculators
    config = test_extract.make_run(tmp_path, model_dir, format="speculators", dtype="fp8")
    extract(config)
    root = config.run_dir / "hidden_states"
    out = io.StringIO()
    assert readback.check_command(config, out=out) == 0
    assert "speculators files, H=64, 3 aux layers, float8_e4m3fn" in out.getvalue()
    assert f"{test_extract.N_SAMPLES} good, 0 bad" in out.getvalue()

    truncated, swapped = speculators.sample_path(root, 2), speculators.sample_path(root, 5)
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])  # a copy cut short
    sample = {k: v.clone() for k, v in speculators.load_sample(swapped).items()}
    sample["token_ids"][[0, 1]] = sample["token_ids"][[1, 0]]  # two ids swapped: shapes, dtypes, states as they were
    save_file(sample, str(swapped), metadata={"producer": "draftgen"})
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in root.glob("hs_*.safetensors")
              if p not in (truncated, swapped)}
    assert len(before) == test_extract.N_SAMPLES - 2

    out = io.StringIO()
    assert readback.check_command(config, out=out) == 1
    text = out.getvalue()
    assert f"{test_extract.N_SAMPLES - 2} good, 2 bad" in text
    assert "bad: hs_2.safetensors (sample 2, id s2): unreadable (truncated or corrupt)" in text
    assert "bad: hs_5.safetensors (sample 5, id s5): token_ids differ from merged/tokens from token 0 on" in text

    assert extract(config).written == 0  # a plain extraction sees every file there: it redoes nothing
    out = io.StringIO()
    assert extract_command(config, None, out=out, validate=True) == 0
    stats = orjson.loads((root / "stats.json").read_bytes())
    assert stats["written"] == 2 and stats["skipped_existing"] == test_extract.N_SAMPLES - 2
    assert [b["index"] for b in stats["redone"]] == [2, 5]
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in before} == before  # the good ones untouched
    out = io.StringIO()
    assert readback.check_command(config, out=out) == 0
    # aux_layers changed between runs: the files of the old layers (same shape) are bad (--validate would redo them).
    other = dataclasses.replace(config, extract=dataclasses.replace(config.extract, aux_layers=[0, 2, 5]))
    out = io.StringIO()
    assert readback.check_command(other, out=out) == 1
    assert f"0 good, {test_extract.N_SAMPLES} bad" in out.getvalue()
    assert ("bad: hs_0.safetensors (sample 0, id s0): holds layers [2, 4, 5, 8] (vLLM's numbering, its metadata), "
            "not the configured [1, 3, 6, 8]") in out.getvalue()
    # And speculators' own FP8 reader takes every file, the two redone ones included.
    got = read_with_speculators(config.run_dir, tmp_path / "read", speculators_pythonpath)
    assert got["existing"] == list(range(test_extract.N_SAMPLES))
    assert all(f["ids_equal"] for f in got["files"])


def test_each_speculators_rule_names_what_is_wrong(tmp_path: Path, model_dir: Path) -> None:
    from safetensors.torch import save_file

    from draftgen.core.extract import speculators_layout as speculators
    config = test_extract.make_run(tmp_path, model_dir, samples=test_extract.make_samples(n=1),
                                   format="speculators", dtype="fp8")
    extract(config)
    root = config.run_dir / "hidden_states"
    path = speculators.sample_path(root, 0)
    ids, mask = test_extract.token_arrays(config)[0]
    t = len(ids)
    good = {k: v.clone() for k, v in speculators.load_sample(path).items()}
    fp8 = readback.expected_of(config.extract, test_extract.HIDDEN, 3)
    assert (fp8.dtype, fp8.scale_key) == ("float8_e4m3fn", "hidden_states_scales")
    assert readback.check_speculators_file(path, ids, mask, fp8) is None

    def why(**changes: object) -> str | None:
        data = {**{k: v.clone() for k, v in good.items()}, **changes}
        save_file({k: v for k, v in data.items() if v is not None}, str(path))
        return readback.check_speculators_file(path, ids, mask, fp8)

    assert why(hidden_states_scales=None) == ("no hidden_states_scales (FP8 states need their per-token scales) "
                                              "(speculators reads token_ids, hidden_states, hidden_states_scales)")
    assert why(hidden_states_scales=good["hidden_states_scales"].reshape(t)) == (
        f"hidden_states_scales is float32 [{t}], expected float32 [{t}, 1, 1]")
    zero = good["hidden_states_scales"].clone()
    zero[0] = 0.0
    assert why(hidden_states_scales=zero) == "hidden_states_scales holds a scale that is not finite and positive"
    huge = good["hidden_states_scales"].clone()
    huge[0] = 1e38  # finite and positive, but the dequantized states (bf16) overflow as FP8Transfer computes them
    assert why(hidden_states_scales=huge) == "NaN or Inf in its hidden states (slot 0, dequantized)"
    assert why(hidden_states=good["hidden_states"][:, 1:].clone()) == (
        "hidden_states holds 3 layer slots, not 4 (the 3 configured aux layers, then the last layer)")
    assert why(hidden_states=good["hidden_states"].float()) == (
        f"hidden_states is float32 [{t}, 4, 64], expected float8_e4m3fn [{t}, 4, 64]")
    assert why(token_ids=good["token_ids"][:-1].clone()) == (
        f"hidden_states is float8_e4m3fn [{t}, 4, 64], expected float8_e4m3fn [{t - 1}, 4, 64]")
    # A bf16 set: no scales wanted, and a NaN in the states is found.
    bf16 = readback.Expected(hidden_size=test_extract.HIDDEN, layers=3)
    states = good["hidden_states"].to(torch.bfloat16)
    states[1, 2, 3] = float("nan")
    save_file({"token_ids": good["token_ids"], "hidden_states": states}, str(path))
    assert readback.check_speculators_file(path, ids, mask, bf16) == "NaN or Inf in its hidden states (slot 2)"
    # Each file names its layers (vLLM's numbering): one extracted with other aux_layers is bad, though its shape
    # is the same (the same count of layers); a file naming none (another tool's) is not judged by it.
    assert fp8.layer_ids is None  # expected_of without the ids
    named = readback.expected_of(config.extract, test_extract.HIDDEN, 3, [2, 4, 5, 8])
    save_file(good, str(path), metadata={"target_layer_ids": "[2, 4, 5, 8]"})
    assert readback.check_speculators_file(path, ids, mask, named) is None
    save_file(good, str(path), metadata={"target_layer_ids": "[1, 3, 6, 8]"})
    assert readback.check_speculators_file(path, ids, mask, named) == (
        "holds layers [1, 3, 6, 8] (vLLM's numbering, its metadata), not the configured [2, 4, 5, 8]: extracted "
        "with another extract.aux_layers")
    save_file(good, str(path))
    assert readback.check_speculators_file(path, ids, mask, named) is None
    # Files of names speculators counts but no row owns (hs_007, hs_99 past the rows) are listed, not read.
    shutil.copy(root / "hs_0.safetensors", root / "hs_007.safetensors")
    shutil.copy(root / "hs_0.safetensors", root / "hs_99.safetensors")
    assert [(i, p.name) for i, p in readback.speculators_files(root)] == [
        (0, "hs_0.safetensors"), (-1, "hs_007.safetensors"), (99, "hs_99.safetensors")]


def test_check_lists_files_the_trainer_would_read_that_are_no_sample(tmp_path: Path, model_dir: Path) -> None:
    from draftgen.cli.main import main
    config = test_extract.make_run(tmp_path, model_dir, samples=test_extract.make_samples(n=4))
    extract(config)
    root = config.run_dir / "hidden_states"
    stray = root / "rows_0-2000" / "extra.ckpt"
    shutil.copy(layout.sample_path(root, 1), stray)
    second = layout.sample_path(root, 3, compress=True)
    shutil.copy(layout.sample_path(root, 3), second)  # not gzip: and a second file for sample 3 anyway
    result = readback.check_folder(root, _reader(config), readback.Expected(hidden_size=test_extract.HIDDEN,
                                                                             layers=3))
    assert result.checked == 4 and result.good == 4 and result.missing == []
    assert [(b.index, b.path.name) for b in result.bad] == [(3, "data_3.ckpt.gz"), (-1, "extra.ckpt")]
    assert "a second file for sample 3" in result.bad[0].why and "not a sample of merged/tokens" in result.bad[1].why
    removed, left = readback.remove_bad(result)
    assert [b.path for b in removed] == [second] and [b.path for b in left] == [stray]
    assert stray.exists() and not second.exists()
    # The command line: `draftgen check CONFIG` exits 1 while the stray file is there, 0 once it is gone.
    path = tmp_path / "draftgen.toml"
    path.write_text(f'[output]\ndir = "{config.run_dir}"\n[[datasets]]\nname = "B1"\nprompts = "p.jsonl"\n'
                    f'[extract]\nmodel = "{model_dir}"\nbackend = "hf"\ndevice = "cpu"\ndtype = "float32"\n')
    (tmp_path / "p.jsonl").write_text("")
    assert main(["check", str(path)]) == 1
    os.unlink(stray)
    assert main(["check", str(path)]) == 0


def test_each_rule_names_what_is_wrong(tmp_path: Path, model_dir: Path) -> None:
    config = test_extract.make_run(tmp_path, model_dir, samples=test_extract.make_samples(n=1))
    extract(config)
    path = layout.sample_path(config.run_dir / "hidden_states", 0)
    ids, mask = test_extract.token_arrays(config)[0]
    good = {k: v.clone() for k, v in layout.load_sample(path).items()}  # not the file's mmap: it is rewritten
    expected = readback.Expected(hidden_size=test_extract.HIDDEN, layers=3)
    assert readback.check_specforge_file(path, ids, mask, expected) is None

    def why(**changes: object) -> str | None:
        data = {k: v.clone() for k, v in good.items()}
        data.update(changes)
        data = {k: v for k, v in data.items() if v is not None}
        torch.save(data, path)
        return readback.check_specforge_file(path, ids, mask, expected)

    nan = good["hidden_state"].clone()
    nan[0, 0, 0] = float("nan")
    assert why(hidden_state=nan) == "NaN or Inf in its hidden states"
    assert why(aux_hidden_state=None) == ("no tensor aux_hidden_state (SpecForge reads input_ids, loss_mask, "
                                          "hidden_state, aux_hidden_state)")
    assert why(aux_hidden_state=good["aux_hidden_state"][..., : 2 * test_extract.HIDDEN].clone()) == (
        "aux_hidden_state holds 2 layers of H=64, not 3 (the configured aux layers)")
    assert why(hidden_state=good["hidden_state"].float()) == (
        f"hidden_state is float32 [1, {len(ids)}, 64], expected bfloat16 [1, {len(ids)}, 64]")
    flipped = good["loss_mask"].clone()
    flipped[-1] = 1 - flipped[-1]
    assert why(loss_mask=flipped) == f"loss_mask differs from merged/tokens at token {len(ids) - 1}"
    # The FP8 hook: a format that stores FP8 names its scales' key, and a file without them is bad.
    torch.save(good, path)
    fp8 = readback.Expected(hidden_size=test_extract.HIDDEN, layers=3, scale_key="hidden_states_scales")
    assert readback.check_specforge_file(path, ids, mask, fp8) == (
        "no hidden_states_scales (FP8 states need their per-token scales)")


def _reader(config: Config):  # noqa: ANN202 - TokenReader
    from draftgen.core.tokens.store import TokenReader
    return TokenReader(config.run_dir / "merged" / "tokens")
