"""Hidden states belong to one merge: `hidden_states/merge.json` says which (core/tokens/identity.py).

Before extraction adds a file, `standing()` compares the folder with merged/ (read only, the same on
every rank of a torchrun job, so every rank takes the same way):

    empty    no hidden-state file yet: extraction starts, merge.json is written first
    same     merge.json names the merge of merged/ (by the digest of its samples)
    adopted  no merge.json (an older draftgen) but every file holds the ids and mask of merged/
             entry at its index: the folder is taken as this merge's (merge.json written)
    other    files of another merge: refused, saying what differs, unless the caller chose
             START_OVER (the hidden-state files, stats and merge.json deleted) or SET_ASIDE (the
             folder moved to hidden_states.merge-<id>/, nothing deleted)

`settle()` acts on it (rank 0 only, once every rank has joined the job: no rank can be deciding
from a folder half changed).
"""

from __future__ import annotations

# No torch at import: `draftgen extract` with nothing left to do never loads it.
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from draftgen.core.errors import DraftgenError
from draftgen.core.files import TMP_MARK, disk_error
from draftgen.core.quoting import sh_path
from draftgen.core.tokens import identity
from draftgen.core.tokens.store import TokenReader

REFUSE, START_OVER, SET_ASIDE = "refuse", "start_over", "set_aside"
CHOICES = (REFUSE, START_OVER, SET_ASIDE)
EMPTY, SAME, ADOPTED, OTHER = "empty", "same", "adopted", "other"


class HiddenStatesOfAnotherMerge(DraftgenError):
    """hidden_states/ holds files of another merge than merged/ and no choice was made."""


@dataclass(frozen=True)
class Standing:
    state: str
    current: identity.MergeFingerprint            # merged/ as it is now
    stored: identity.MergeFingerprint | None      # hidden_states/merge.json
    files: int                                    # hidden-state files in the folder
    mismatched: int = 0                           # files that hold another sample (no merge.json)

    @property
    def usable(self) -> bool:
        return self.state in (EMPTY, SAME, ADOPTED)

    def differences(self) -> list[str]:
        if self.stored is None and self.mismatched:
            return [f"{self.mismatched:,} of {self.files:,} files hold other samples than merged/ at their index "
                    f"(extracted by an older draftgen from another merge)"]
        return identity.differences(self.stored, self.current)


def _files(root: Path) -> list[tuple[int, Path]]:
    out = []
    for folder, _dirs, names in os.walk(root):
        for name in names:
            prefix = "data_" if name.startswith("data_") else "hs_" if name.startswith("hs_") else ""
            if prefix and name.endswith(identity.SAMPLE_SUFFIXES):
                digits = name.removeprefix(prefix).split(".", 1)[0]
                out.append((int(digits) if digits.isdigit() else -1, Path(folder) / name))
    return out


def _mismatched(root: Path, reader: TokenReader) -> int:
    """Files (no merge.json to go by) whose ids or mask are not merged/ entry at their index."""
    from draftgen.core.extract import layout  # torch: only for a folder without merge.json
    bad = 0
    for index, path in _files(root):
        if not 0 <= index < len(reader):
            bad += 1
            continue
        ids, mask = reader.arrays(reader.entries[index])
        try:
            if path.name.endswith(".safetensors"):  # speculators' file: its ids only (the mask is merged/'s)
                from draftgen.core.extract import speculators_layout
                same = np.array_equal(speculators_layout.load_sample(path)["token_ids"].numpy(), ids)
            else:
                got = layout.load_sample(path)
                same = (np.array_equal(got["input_ids"].numpy(), ids)
                        and np.array_equal(got["loss_mask"].numpy(), mask))
        except Exception:  # noqa: BLE001 - an unreadable file is not this merge's either
            same = False
        bad += not same
    return bad


def standing(root: Path, merged: Path, reader: TokenReader | None = None) -> Standing:
    """Where hidden_states/ (`root`) stands against merged/ (reads only)."""
    current = identity.merged_fingerprint(merged)
    files = identity.stored_samples(root) if root.is_dir() else 0
    stored = identity.read_fingerprint(root / identity.HIDDEN_MERGE_FILE)
    if current.same_merge(stored):
        return Standing(SAME, current, stored, files)
    if files == 0:
        return Standing(EMPTY, current, stored, 0)
    if stored is None:
        bad = _mismatched(root, reader if reader is not None else TokenReader(merged / "tokens"))
        return Standing(ADOPTED if bad == 0 else OTHER, current, None, files, bad)
    return Standing(OTHER, current, stored, files)


def refusal(s: Standing, root: Path, config_path: object) -> HiddenStatesOfAnotherMerge:
    came = s.stored.describe() if s.stored is not None else "an unrecorded merge"
    config = sh_path(str(config_path))
    return HiddenStatesOfAnotherMerge(
        f"{root}: holds {s.files:,} hidden-state files of {came}, but merged/ is {s.current.describe()} "
        f"({'; '.join(s.differences())}). Nothing is added to hidden states of another merge: "
        f"`draftgen extract {config} --start-over` deletes them and extracts this merge, or "
        f"`draftgen extract {config} --set-aside` moves them to {identity.aside_path(root, s.stored)}/ "
        f"(nothing deleted) and extracts this merge into a new {root.name}/")


def settle(root: Path, merged: Path, choice: str, config_path: object,
           reader: TokenReader | None = None) -> str:
    """Make `root` belong to merged/'s merge, or raise the refusal; returns what was done ('' if nothing)."""
    if choice not in CHOICES:
        raise DraftgenError(f"hidden states of another merge: {choice!r} is not one of {', '.join(CHOICES)}")
    s = standing(root, merged, reader)
    note = ""
    if s.state == OTHER:
        if choice == REFUSE:
            raise refusal(s, root, config_path)
        try:
            if choice == SET_ASIDE:
                dest = identity.set_aside(root, s.stored)
                note = f"{s.files:,} hidden-state files of another merge moved to {dest}"
            else:
                _start_over(root)
                note = f"{s.files:,} hidden-state files of another merge deleted (--start-over)"
        except OSError as e:
            raise disk_error(root, e) from e
    elif s.state == ADOPTED:
        note = f"{s.files:,} hidden-state files without a merge record checked: all are this merge's"
    if s.state != SAME:
        try:
            root.mkdir(parents=True, exist_ok=True)
            identity.write_fingerprint(root / identity.HIDDEN_MERGE_FILE, s.current)
        except OSError as e:
            raise disk_error(root, e) from e
    return note


def merge_question(run: Path) -> str | None:
    """What to ask before a merge (the TUI's `m`) when hidden_states/ holds files; None when it holds none.

    From the recorded fingerprints only (cheap enough for a key press); the merge itself decides."""
    hidden = run / "hidden_states"
    if not hidden.is_dir() or not identity.stored_samples(hidden, stop_at=1):
        return None
    stored = identity.read_fingerprint(hidden / identity.HIDDEN_MERGE_FILE)
    came = stored.describe() if stored is not None else "an unrecorded merge"
    return (f"hidden_states/ holds the hidden states of {came}. A merge that comes out different (new "
            f"answers, another seed) moves them aside to {identity.aside_path(hidden, stored).name}/ (nothing "
            f"deleted) and the next extraction starts afresh; a merge that comes out the same keeps them.")


def extract_question(run: Path) -> str | None:
    """What to ask before extracting (the TUI's `x`) when hidden_states/ records another merge than merged/.

    From the recorded fingerprints only; anything they cannot tell, extraction checks (and refuses)."""
    hidden = run / "hidden_states"
    stored = identity.read_fingerprint(hidden / identity.HIDDEN_MERGE_FILE)
    merged = identity.read_fingerprint(run / "merged" / identity.FINGERPRINT_FILE)
    if stored is None or merged is None or stored.same_merge(merged) or not hidden.is_dir():
        return None
    files = identity.stored_samples(hidden)
    if not files:
        return None
    return (f"hidden_states/ holds {files:,} files of {stored.describe()}, but merged/ is {merged.describe()} "
            f"({'; '.join(identity.differences(stored, merged))}). Nothing is added to hidden states of another "
            f"merge: start over (delete them) or set them aside (move them to "
            f"{identity.aside_path(hidden, stored).name}/, nothing deleted), then extract this merge.")


def _start_over(root: Path) -> None:
    """Delete what extraction wrote (files, their folders, stats, merge.json); anything else stays."""
    for _index, path in _files(root):
        path.unlink()
    for folder in root.glob("rows_*"):
        shutil.rmtree(folder, ignore_errors=True)  # temporary files of a killed run, the empty folders
    for tmp in root.glob(f".hs_*{TMP_MARK}*"):  # speculators' temporary files of a killed run
        tmp.unlink()
    for stats in root.glob("stats*.json"):
        stats.unlink()
    (root / identity.HIDDEN_MERGE_FILE).unlink(missing_ok=True)
