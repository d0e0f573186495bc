"""Hidden states belong to one merge: a re-merge after extraction (another seed, more answers) can
never leave hidden_states/ holding files of another merge than merged/ (core/tokens/identity.py,
core/extract/claim.py, the guard in core/merge/merge.py). Every file is checked against
merged/tokens at its index, as SpecForge's reader would pair them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import orjson
import pytest

from draftgen.core.config import Config
from draftgen.core.config_load import config_from_dict
from draftgen.core.errors import DraftgenError
from draftgen.core.extract import claim, extract, layout
from draftgen.core.merge.merge import merge
from draftgen.core.tokens import identity
from draftgen.core.tokens.store import TokenReader
from tests.extract import test_extract
from tests.merge.test_merge import Sample, user, write_dataset

model_dir = test_extract.model_dir  # the tiny Llama, on CPU
NAN_TOKEN = test_extract.NAN_TOKEN


def make_config(tmp_path: Path, model: Path, seed: int) -> Config:
    raw = {"output": {"dir": "run"}, "merge": {"seed": seed}, "datasets": [{"name": "A", "prompts": "A.jsonl"}],
           "extract": {"model": str(model), "backend": "hf", "device": "cpu", "dtype": "float32"}}
    return config_from_dict(raw, tmp_path / "draftgen.toml")


def answers(run: Path, n: int) -> None:
    """`n` answers of dataset A; a larger `n` keeps the first ones as they were (more answers arrived)."""
    shutil.rmtree(run / "A", ignore_errors=True)
    write_dataset(run, "A", [Sample(f"a{i}", user(f"prompt {i}")) for i in range(n)], seed=5, vocab=NAN_TOKEN)


def check_files_match_merged(run: Path) -> int:
    """Every file SpecForge would read holds merged/tokens entry k's ids and mask, k its index; a file a sample."""
    reader = TokenReader(run / "merged" / "tokens")
    paths = sorted(os.path.join(r, f) for r, _, fs in os.walk(run / "hidden_states") for f in fs
                   if f.endswith((".ckpt", ".ckpt.gz")))
    assert len(paths) == len(reader)
    for path in paths:
        index = int(Path(path).name.removeprefix("data_").split(".")[0])
        ids, mask = reader.arrays(reader.entries[index])
        data = layout.load_sample(Path(path))
        assert np.array_equal(data["input_ids"].numpy(), ids), path
        assert np.array_equal(data["loss_mask"].numpy(), mask), path
    return len(paths)


def recorded(run: Path, folder: str) -> identity.MergeFingerprint:
    name = identity.FINGERPRINT_FILE if folder == "merged" else identity.HIDDEN_MERGE_FILE
    fp = identity.read_fingerprint(run / folder / name)
    assert fp is not None
    return fp


def test_a_reseeded_merge_is_refused_then_sets_the_old_hidden_states_aside(tmp_path: Path, model_dir: Path) -> None:
    first = make_config(tmp_path, model_dir, seed=1)
    run = first.run_dir
    answers(run, 12)
    merge(first)
    extract(first)
    assert check_files_match_merged(run) == 12
    assert recorded(run, "hidden_states") == recorded(run, "merged")
    before = (run / "merged" / "tokens" / "index.jsonl").read_bytes()

    reseeded = make_config(tmp_path, model_dir, seed=2)
    with pytest.raises(DraftgenError, match=r"12 hidden-state files .*seed 1 -> 2.*--replace-hidden-states"):
        merge(reseeded)
    assert (run / "merged" / "tokens" / "index.jsonl").read_bytes() == before  # merged/ left as it was
    assert check_files_match_merged(run) == 12

    stats = merge(reseeded, replace_hidden_states=True)
    old_id = recorded(run, "merged").merge_id
    assert "set aside" in stats.hidden_states and not (run / "hidden_states").exists()
    aside = [p for p in run.iterdir() if p.name.startswith("hidden_states.merge-")]
    assert len(aside) == 1 and identity.stored_samples(aside[0]) == 12  # nothing deleted
    assert old_id != identity.read_fingerprint(aside[0] / identity.HIDDEN_MERGE_FILE).merge_id

    extract(reseeded)
    assert check_files_match_merged(run) == 12
    assert recorded(run, "hidden_states").merge_id == old_id and recorded(run, "merged").seed == 2


def test_the_same_merge_again_keeps_the_hidden_states(tmp_path: Path, model_dir: Path) -> None:
    config = make_config(tmp_path, model_dir, seed=1)
    answers(config.run_dir, 6)
    merge(config)
    extract(config)
    stats = merge(config)  # no new answers, same seed: the same samples in the same order
    assert "kept" in stats.hidden_states
    assert extract(config).nothing_to_do and check_files_match_merged(config.run_dir) == 6


def test_a_merge_that_gained_samples_never_keeps_files_of_the_old_one(tmp_path: Path, model_dir: Path) -> None:
    # More answers arrived: the shuffle puts new samples at old indices. The old files, each
    # self-consistent, must neither stay beside the new merge nor be counted as done.
    config = make_config(tmp_path, model_dir, seed=3)
    run = config.run_dir
    answers(run, 8)
    merge(config)
    extract(config)
    old = recorded(run, "hidden_states")
    answers(run, 14)
    with pytest.raises(DraftgenError, match=r"samples 8 -> 14.*inputs changed"):
        merge(config)
    merge(config, replace_hidden_states=True)

    # The old folder put back by hand (or copied in from elsewhere): extraction refuses to add to it.
    aside = next(p for p in run.iterdir() if p.name.startswith("hidden_states.merge-"))
    os.rename(aside, run / "hidden_states")
    with pytest.raises(claim.HiddenStatesOfAnotherMerge, match=r"8 hidden-state files .*samples 8 -> 14.*--start-over"):
        extract(config)
    assert identity.stored_samples(run / "hidden_states") == 8  # nothing written, nothing deleted

    stats = extract(config, on_other_merge=claim.START_OVER)
    assert stats.written == 14 and stats.skipped_existing == 0 and "deleted" in stats.claim_note
    assert check_files_match_merged(run) == 14
    assert recorded(run, "hidden_states").same_merge(recorded(run, "merged")) and not old.same_merge(
        recorded(run, "merged"))


def test_hidden_states_without_a_record_are_checked_file_by_file(tmp_path: Path, model_dir: Path) -> None:
    # Extracted by an older draftgen (no merge.json): adopted when every file is merged/'s, refused otherwise.
    config = make_config(tmp_path, model_dir, seed=1)
    run = config.run_dir
    answers(run, 6)
    merge(config)
    extract(config)
    (run / "hidden_states" / identity.HIDDEN_MERGE_FILE).unlink()
    assert extract(config).nothing_to_do
    assert recorded(run, "hidden_states").same_merge(recorded(run, "merged"))

    (run / "hidden_states" / identity.HIDDEN_MERGE_FILE).unlink()
    with pytest.raises(DraftgenError, match="no record of the merge they came from"):
        merge(make_config(tmp_path, model_dir, seed=9))
    os.rename(run / "hidden_states", tmp_path / "kept")  # as an older draftgen did: re-merged under them
    merge(make_config(tmp_path, model_dir, seed=9))
    os.rename(tmp_path / "kept", run / "hidden_states")  # no record to compare: the files are read
    with pytest.raises(claim.HiddenStatesOfAnotherMerge, match=r"of 6 files hold other samples"):
        extract(config)
    stats = extract(config, on_other_merge=claim.SET_ASIDE)
    assert stats.written == 6 and "moved to" in stats.claim_note
    assert check_files_match_merged(run) == 6


def test_merge_and_extract_commands_refuse_and_name_their_flags(tmp_path: Path, model_dir: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from draftgen.cli.main import main
    run = tmp_path / "run"
    answers(run, 5)
    cfg = tmp_path / "draftgen.toml"

    def write(seed: int) -> str:
        cfg.write_text(f'[output]\ndir = "{run}"\n[merge]\nseed = {seed}\n[[datasets]]\nname = "A"\n'
                       f'prompts = "A.jsonl"\n[extract]\nmodel = "{model_dir}"\nbackend = "hf"\ndevice = "cpu"\n'
                       f'dtype = "float32"\n')
        return str(cfg)

    assert main(["merge", write(1)]) == 0
    assert main(["extract", str(cfg)]) == 0
    capsys.readouterr()
    assert main(["merge", write(2)]) == 2
    assert "--replace-hidden-states" in capsys.readouterr().err
    assert main(["merge", write(2), "--replace-hidden-states"]) == 0
    # The old folder put back (copied in from elsewhere): the command refuses before its plan.
    os.rename(next(run.glob("hidden_states.merge-*")), run / "hidden_states")
    capsys.readouterr()
    assert main(["extract", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "seed 1 -> 2" in err and "--start-over" in err and "--set-aside" in err
    assert main(["extract", str(cfg), "--set-aside"]) == 0
    assert "every sample of merge" in capsys.readouterr().out
    assert check_files_match_merged(run) == 5
    stats = orjson.loads((run / "hidden_states" / "stats.json").read_bytes())
    assert stats["merge_id"] == recorded(run, "merged").merge_id


def test_report_says_which_merge_the_hidden_states_belong_to(tmp_path: Path, model_dir: Path) -> None:
    import io

    from draftgen.tui.report import report
    config = make_config(tmp_path, model_dir, seed=1)
    run = config.run_dir
    answers(run, 6)
    merge(config)
    first = recorded(run, "merged")
    extract(config, stop=None)
    out = io.StringIO()
    report(run, out, width=400)
    assert f"hidden states: 6 of 6 samples of merge {first.merge_id}" in out.getvalue()
    assert "the merge in merged/" in out.getvalue()
    os.rename(run / "hidden_states", tmp_path / "kept")
    answers(run, 9)
    merge(config)
    os.rename(tmp_path / "kept", run / "hidden_states")
    out = io.StringIO()
    report(run, out, width=400)
    text = out.getvalue()
    assert f"merged/: merge {recorded(run, 'merged').merge_id} (9 samples" in text
    assert f"6 of 6 samples of merge {first.merge_id}" in text and "ANOTHER merge" in text and "samples 6 -> 9" in text


def test_the_tui_questions_come_from_the_recorded_merges(tmp_path: Path, model_dir: Path) -> None:
    # What the `m` and `x` keys ask (tui/keys.py through Pipeline.merge_question / extract_question).
    run = tmp_path / "run"
    first = make_config(tmp_path, model_dir, seed=1)
    answers(run, 5)
    merge(first)
    assert claim.merge_question(run) is None and claim.extract_question(run) is None  # nothing extracted yet
    extract(first)
    old = recorded(run, "hidden_states")
    asked = claim.merge_question(run)
    assert asked is not None and old.merge_id in asked and f"hidden_states.merge-{old.merge_id}/" in asked
    assert claim.extract_question(run) is None  # they are merged/'s
    merge(make_config(tmp_path, model_dir, seed=2), replace_hidden_states=True)
    assert claim.extract_question(run) is None  # set aside: a fresh folder
    os.rename(run / f"hidden_states.merge-{old.merge_id}", run / "hidden_states")
    asked = claim.extract_question(run)
    assert asked is not None and "5 files of merge" in asked and "seed 1 -> 2" in asked


def test_a_merge_while_an_extraction_reads_merged_is_refused(tmp_path: Path, model_dir: Path) -> None:
    """An extraction holds the run directory's merge lock from before it opens merged/tokens to its end: a
    merge asked for meanwhile (another shell, another seed, more answers) refuses, so hidden states are never
    written from one merge while merge.json records another."""
    config = make_config(tmp_path, model_dir, seed=1)
    answers(config.run_dir, 6)
    merge(config)
    answers(config.run_dir, 9)  # more answers arrived: a merge now would put other samples at old indices
    refused: list[str] = []

    def mid_extraction(_progress: object) -> None:
        if not refused:
            with pytest.raises(DraftgenError, match="an extraction is running") as e:
                merge(make_config(tmp_path, model_dir, seed=2))
            refused.append(str(e.value))

    stats = extract(config, progress=mid_extraction)
    assert refused and stats.written == 6
    assert check_files_match_merged(config.run_dir) == 6  # every file is the merge merged/ still holds
    assert merge(make_config(tmp_path, model_dir, seed=2), replace_hidden_states=True).samples == 9  # after: fine
