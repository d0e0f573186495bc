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
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from draftgen.cli.main import main
from draftgen.core.config_load import config_from_dict, load_config
from draftgen.core.config_values import toml_value
from draftgen.core.errors import ConfigError
from draftgen.core.quoting import one_line
from draftgen.core.tokens.store import TokenWriter
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from tests.generate.test_promptsets import make_jsonl

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
    assert f"# output: {one_line(str(run.resolve() / 'draft'))}\n" in text
    assert f"`draftgen extract {one_line(shlex.quote('./' + name))}` first\n" in text  # quoted, ./ before the -
    comments = text.split("\nexec ", 1)[0]  # the command's quoted path holds the run directory as it is
    assert all(line.startswith("#") and line.isprintable() for line in comments.splitlines())


def test_a_model_with_a_line_break_or_control_character_is_refused_naming_the_key(tmp_path: Path) -> None:
    for model in ("tiny\ntouch pwned", "tiny\x1b[2J", "tiny\r"):
        raw = {"datasets": [{"name": "B1", "prompts": "p.jsonl"}], "extract": {"model": model}}
        with pytest.raises(ConfigError, match=r"draftgen.toml: extract.model .* must be printable characters only"):
            config_from_dict(raw, tmp_path / "draftgen.toml")


def test_toml_value_reads_back_every_character() -> None:
    text = "".join(chr(c) for c in range(0x2100)) + "\U0001f600 \u2028\u2029 \ufeff end"
    for value in (text, "a\x7fb", '"; evil = true', "\\u0041\n[budget]\nmax_usd = 1e9"):
        assert tomllib.loads(f"k = {toml_value(value)}\nt = {toml_value({value: value})}") == {"k": value,
                                                                                                "t": {value: value}}


def test_prompts_build_writes_a_config_from_any_source_path(tmp_path: Path) -> None:
    # A source folder with an escape sequence and DEL (its path is in the header comment), prompt files
    # written into a folder with DEL (their path is a TOML string): the config loads back both.
    src_dir, out_dir = tmp_path / "da\x1b[2Jta\x7f\nrm -rf x", tmp_path / "prompts\x7f \"q\""
    src_dir.mkdir()
    src = make_jsonl(src_dir, [{"prompt": f"Question {i}?"} for i in range(5)], "mix.jsonl")
    config = tmp_path / "job.toml"
    assert main(["prompts", "build", str(src), "--out", str(out_dir), "--config", str(config),
                 "--tokenizer", str(bundled_kimi_path()), "--split", "off"]) == 0
    cfg = load_config(config)
    assert [d.prompts for d in cfg.datasets] == [out_dir / "mix.jsonl"]
    text = config.read_text()
    assert one_line(str(src)) in text and "\x1b" not in text
    assert [line for line in text.splitlines() if "rm -rf" in line][0].startswith("# Added by")


def test_the_demo_config_reads_back_any_install_path(tmp_path: Path) -> None:
    from draftgen.tui.demo import config_text
    tokenizer = tmp_path / 'site "packages"\\x\x7f' / "kimi-k2"
    path = tmp_path / "draftgen.toml"
    path.write_text(config_text("http://127.0.0.1:8080/api/v1", tokenizer), encoding="utf-8")
    cfg = load_config(path)
    assert (cfg.tokenizer.path, cfg.api.base_url) == (str(tokenizer), "http://127.0.0.1:8080/api/v1")


def test_the_commands_draftgen_suggests_paste_with_any_config_path(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A config file whose name holds spaces, quotes, `;` and `$(…)`: each `draftgen …` command a message
    suggests names it quoted (quoting.sh_path), so that the shell reads it back as the one path it is."""
    from tests.helpers import make_config
    folder = tmp_path / "my runs"
    folder.mkdir()
    path = folder / "kimi's run; $(touch pwned) & x.toml"
    make_config(folder, "http://127.0.0.1:9", [{"name": "a", "n": 2}]).path.rename(path)

    def suggested(*args: str) -> list[list[str]]:
        main([*args])
        out = capsys.readouterr()
        said = " ".join((out.out + out.err).split())
        commands = [shlex.split(c) for c in re.findall(r"`(draftgen [^`]*)`", said)]
        assert commands, said
        return commands

    # No run directory yet: report and merge say what makes one; retry-failed (nothing failed) what answers them.
    assert suggested("report", str(path)) == [["draftgen", "run", str(path)]]
    assert suggested("merge", str(path)) == [["draftgen", "run", str(path)]]
    (folder / "run").mkdir(mode=0o700)
    assert suggested("retry-failed", str(path)) == [["draftgen", "run", str(path)]]
    assert not list(tmp_path.rglob("pwned"))


def test_a_run_directory_whose_name_is_not_utf8_is_a_clear_error_not_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # A config in a folder named by bytes that are not UTF-8 (as a tarball or another system can leave), its
    # run directory beside it: SpecForge's JSON config cannot name it (orjson refused the lone surrogates
    # with a traceback, and no script was written).
    folder = Path(os.fsdecode(bytes(tmp_path) + b"/jobs\xff\x1b[2J"))
    run = folder / "run"
    with TokenWriter(run / "merged" / "tokens") as writer:
        writer.append("s0", np.arange(1, 4, dtype=np.uint32), np.ones(3, dtype=np.uint8))
    (folder / "c.toml").write_text('[output]\ndir = "run"\n[[datasets]]\nname = "B1"\nprompts = "p.jsonl"\n'
                                   '[extract]\nmodel = "m"\n')
    monkeypatch.chdir(folder)
    assert main(["train-command", "c.toml"]) == 2
    err = capsys.readouterr().err
    assert "not a UTF-8 name" in err and "\\udcff" in err and "\x1b" not in err, err
    assert not (run / "hidden_states" / "train-command.sh").exists()
