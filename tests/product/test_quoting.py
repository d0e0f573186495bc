"""No value breaks out of what draftgen writes for another program (core/quoting.py).

train-command.sh, run with a real `sh` against a stand-in `specforge` that records its argv: a run
directory, a config file's name and a model holding newlines, `$(…)`, backticks, quotes, `;`, `&`,
spaces and a leading `-` run nothing, and the config's path and the caller's arguments arrive
verbatim; the same for the command `draftgen train-command` prints. TOML draftgen writes (`prompts
build` into a config, the demo's config) reads back the paths it was given, whatever they hold.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from draftgen.cli.main import main
from draftgen.core.config import config_from_dict, toml_value
from draftgen.core.errors import ConfigError
from draftgen.core.quoting import visible
from draftgen.core.tokens.store import TokenWriter

# Each would create a file named `pwned` in the working directory, if any part of it ran.
PAYLOAD = "-x 'q' \"d\" ; touch pwned & $(touch pwned) `touch pwned` | touch pwned"
HOSTILE = PAYLOAD + "\ntouch pwned\n\r\x1b]0;title\x07\x9b2J end"   # a path, a name: line breaks and controls too
CALLER_ARGS = ["--training.num_epochs", "2", "a b", "$(touch pwned)", "`touch pwned`", "x;touch pwned", "'", '"',
               "", "-\ntouch pwned", "\\"]

STAND_IN = f"""#!{sys.executable}
import os, sys
with open(os.environ["ARGV_OUT"], "wb") as f:
    f.write(b"\\0".join(os.fsencode(a) for a in sys.argv[1:]))
"""


def run_sh(args: list[str], cwd: Path, bin_dir: Path, stdin: str | None = None) -> list[str]:
    """`sh ARGS` in `cwd` with the stand-in `specforge` first on PATH: the arguments it was given."""
    out = cwd.parent / "argv"
    out.unlink(missing_ok=True)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "ARGV_OUT": str(out)}
    proc = subprocess.run(["sh", *args], cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=60)
    assert not list(cwd.parent.rglob("pwned")), f"a value ran as a command: {proc.stderr}"
    assert proc.returncode == 0, proc.stderr
    assert out.exists(), f"specforge was not run: {proc.stderr}"
    return [a.decode() for a in out.read_bytes().split(b"\0")]


def test_train_command_sh_runs_no_value_and_passes_the_arguments_verbatim(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir()
    work.mkdir()
    (bin_dir / "specforge").write_text(STAND_IN)
    (bin_dir / "specforge").chmod(0o755)
    run = tmp_path / HOSTILE / HOSTILE
    with TokenWriter(run / "merged" / "tokens") as writer:
        for k, n in enumerate((5, 9, 3)):
            writer.append(f"s{k}", np.arange(1, n + 1, dtype=np.uint32), np.ones(n, dtype=np.uint8))
    (run / "hidden_states").mkdir()
    (run / "hidden_states" / "stats.json").write_text(json.dumps({"draft_layer_ids": [1, 3, 4]}))
    model = PAYLOAD  # a hub id or folder: printable characters only (refused otherwise, below)
    name = HOSTILE + ".toml"  # relative, starting with "-": a note's suggested command must not take it for an option
    (work / name).write_text(f'[output]\ndir = {toml_value(run)}\n[[datasets]]\nname = "B1"\nprompts = "p.jsonl"\n'
                             f'[extract]\nmodel = {toml_value(model)}\n', encoding="utf-8")
    monkeypatch.chdir(work)
    assert main(["train-command", "--", name]) == 0
    printed = capsys.readouterr().out

    hidden = run.resolve() / "hidden_states"
    script, config_json = hidden / "train-command.sh", hidden / "specforge.json"
    assert run_sh([str(script), *CALLER_ARGS], work, bin_dir) == ["train", "--config", str(config_json), *CALLER_ARGS]
    # What train-command prints is the same: comments, then the command, run as it is.
    assert run_sh([], work, bin_dir, stdin=printed) == ["train", "--config", str(config_json)]
    assert json.loads(config_json.read_text())["model"]["target_model_path"] == model
    text = script.read_text()
    assert f"# target model: {model}\n" in text
    assert f"# output: {visible(str(run.resolve() / 'draft'))}\n" in text
    assert f"`draftgen extract {visible(shlex.quote('./' + name))}` first\n" in text  # quoted, ./ before the -
    comments = text.split("\nexec ", 1)[0]  # the command's quoted path holds the run directory as it is
    assert all(line.startswith("#") and line.isprintable() for line in comments.splitlines())


def test_a_model_with_a_line_break_or_control_character_is_refused_naming_the_key(tmp_path: Path) -> None:
    for model in ("tiny\ntouch pwned", "tiny\x1b[2J", "tiny\r"):
        raw = {"datasets": [{"name": "B1", "prompts": "p.jsonl"}], "extract": {"model": model}}
        with pytest.raises(ConfigError, match=r"draftgen.toml: extract.model .* must be printable characters only"):
            config_from_dict(raw, tmp_path / "draftgen.toml")
