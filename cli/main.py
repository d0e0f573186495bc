"""The `draftgen` command: parses arguments, calls into core/ (or the TUI), and is the one place
where user-facing errors are caught and printed without a traceback (`--debug` shows it)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from draftgen.core import runtime
from draftgen.core.errors import DraftgenError, ExitCode
from draftgen.core.quoting import sh_path
from draftgen.core.safe_text import visible

EXIT_CODES = """exit codes:
  0  complete: every prompt answered, failed for a reason of its own, or skipped by a token budget
  1  the smoke test failed (smoke, or run without a passing smoke test); check found bad files
  2  error: bad config or input, a stage that failed, an internal error
  3  incomplete: the run was drained, stopped, waiting on the account, or limited by max_usd;
     run again to resume
  4  the API key was refused (401, at start or mid-run): set a valid key, run again
  130  interrupted before the run started

start with `draftgen demo`; `draftgen COMMAND -h` for a command's options"""


def _config(path: str):  # noqa: ANN202 - Config; imported lazily to keep `--help` fast
    from draftgen.core.config_load import load_config
    return load_config(path)


def _config_to_write(path: str):  # noqa: ANN202 - Config
    """The config of a command that writes into its run directory (run, smoke, retry-failed, ledger,
    tokens, merge, extract, train-command): the run directory is refused first if other users can write
    it, or a folder above it without the sticky bit, unless `[output] shared = true` (core/private_dir.py
    check_private). Checked here, once for every such command, before anything is written or sent."""
    from draftgen.core.private_dir import check_private
    config = _config(path)
    check_private(config.run_dir, config.path, shared=config.output.shared)
    return config


def cmd_run(args: argparse.Namespace) -> int:
    config = _config_to_write(args.config)
    key = config.api_key()
    if args.headless:
        from draftgen.core.run import registry
        from draftgen.headless.printer import run_headless
        then = {str(s.flag): bool(getattr(args, str(s.flag))) for s in registry.chained()}
        return runtime.run(run_headless(config, key, skip_smoke=args.skip_smoke, interval_s=args.interval,
                                        then=then))
    from draftgen.tui.launch import run_tui
    return runtime.run(run_tui(config, key, skip_smoke=args.skip_smoke))


def _run_dir(where: str) -> Path:
    """The run directory named by `where`: the directory itself, or a config (its [output] dir)."""
    path = Path(where)
    try:
        os.stat(path)
    except PermissionError:
        raise DraftgenError(f"{path}: permission denied (a run directory is owner-only: use it as the user who "
                            "started the run)") from None
    except OSError:
        pass  # said below
    if path.is_file():
        run_dir = Path(_config(where).run_dir)
        if not run_dir.is_dir():
            raise DraftgenError(f"{path}: its run directory {run_dir} does not exist yet: "
                                f"`draftgen run {sh_path(where)}` makes it")
        return run_dir
    if not path.is_dir():
        raise DraftgenError(f"{path}: no such run directory or config file (give the config, e.g. kimi.toml, "
                            "or its [output] dir)")
    return path


def cmd_attach(args: argparse.Namespace) -> int:
    from draftgen.tui.launch import attach_tui
    return runtime.run(attach_tui(_run_dir(args.run_dir)))


def cmd_smoke(args: argparse.Namespace) -> int:
    from draftgen.core.files import exclusive
    from draftgen.core.generate.commands.smoke import smoke_command
    config = _config_to_write(args.config)
    key = config.api_key()
    with exclusive(config.run_dir, "draftgen smoke"):  # the liveness rule: not beside a live run
        return smoke_command(config, key)


def cmd_retry_failed(args: argparse.Namespace) -> int:
    from draftgen.core.generate.commands.retry_failed import retry_failed_command
    return retry_failed_command(_config_to_write(args.config), args.dataset, args.kind)


def cmd_tokens(args: argparse.Namespace) -> int:
    from draftgen.core.tokens.command import tokens_command
    return tokens_command(_config_to_write(args.config))


def cmd_merge(args: argparse.Namespace) -> int:
    from draftgen.core.merge.command import merge_command
    return merge_command(_config_to_write(args.config), replace_hidden_states=args.replace_hidden_states)


def cmd_extract(args: argparse.Namespace) -> int:
    from draftgen.core.extract import extract_command, parse_shard
    if args.self_check:
        from draftgen.core.extract.command import self_check_command
        return self_check_command(_config(args.config) if args.config else None, long_tokens=args.long_tokens)
    if not args.config:
        raise DraftgenError("draftgen extract: give the config file (or --self-check)")
    if args.shard:
        parse_shard(args.shard)  # a bad --shard (or auto with no launcher) fails before the config is read
    if args.plan:
        from draftgen.core.extract.command import plan_command
        return plan_command(_config(args.config), args.shard)
    on_other = "start_over" if args.start_over else "set_aside" if args.set_aside else "refuse"
    return extract_command(_config_to_write(args.config), args.shard, on_other_merge=on_other,
                           validate=args.validate)


def cmd_check(args: argparse.Namespace) -> int:
    from draftgen.core.extract import parse_shard
    from draftgen.core.extract.readback import check_command
    shard = parse_shard(args.shard) if args.shard else (0, 1)  # a bad --shard fails before the config is read
    return check_command(_config(args.config), shard)


def cmd_train_command(args: argparse.Namespace) -> int:
    from draftgen.core.extract.handoff import train_command
    return train_command(_config_to_write(args.config), max_length=args.max_length)


def cmd_prompts_build(args: argparse.Namespace) -> int:
    from draftgen.core.promptsets.command import BuildRequest, build_command
    return build_command(BuildRequest(
        sources=args.sources, out_dir=Path(args.out), config=None if args.no_config else Path(args.config),
        preset=args.preset, mapping=args.map, turns=args.turns, max_turns=args.max_turns, n=args.n, seed=args.seed,
        languages=args.language,
        min_tokens=args.min_tokens, max_tokens=args.max_tokens, split=args.split, short=args.short,
        long=args.long, tokenizer=args.tokenizer, template=args.template, price_in=args.price_in,
        price_out=args.price_out, model=args.model, output_dir=args.output_dir, download=args.download,
        subset=args.subset, force=args.force))


def cmd_simulate(args: argparse.Namespace) -> int:
    from draftgen.simulator.cli import run
    return run(args)


def cmd_report(args: argparse.Namespace) -> int:
    from draftgen.tui.report import report_command
    return report_command(_run_dir(args.run_dir))


def cmd_demo(args: argparse.Namespace) -> int:
    from draftgen.tui.demo import demo_command
    return demo_command(args)


def cmd_ledger(args: argparse.Namespace) -> int:
    from draftgen.core.generate.money.reconcile import ledger_command
    config = _config_to_write(args.config)
    return ledger_command(config, config.api_key(), unknown_from_key=args.unknown_from_key)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftgen", description="EAGLE-3 draft-model training data from a target model, run from a live "
        "terminal UI.", epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(fn=fn)
        return p

    p = add("smoke", cmd_smoke, "check key, credits and one request per dataset shape; exit 0 only if all pass")
    p.add_argument("config", help="the config file (e.g. kimi.toml)")
    p = add("run", cmd_run, "generate answers (the TUI; --headless for nohup/CI)")
    p.add_argument("config", help="the config file (e.g. kimi.toml)")
    p.add_argument("--headless", action="store_true", help="no TUI: a status line every few seconds")
    p.add_argument("--skip-smoke", action="store_true", help="start without a passing smoke test")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between headless status lines")
    from draftgen.core.run import registry
    for stage in registry.chained():  # --merge, --extract: the stages of core/run/registry.py with a flag
        p.add_argument(f"--{stage.flag}", action="store_true", help=stage.flag_help)
    p = add("retry-failed", cmd_retry_failed, "make failed prompts eligible again (their lines move to "
            "failures.history.jsonl); the next run answers them")
    p.add_argument("config", help="the config file (e.g. kimi.toml)")
    p.add_argument("--dataset", help="only this dataset (default: all)")
    p.add_argument("--kind", help="only failures of these error kinds, comma-separated (e.g. 401,404_no_endpoints)")
    p = add("ledger", cmd_ledger, "price pending generations and print the spend ledger's reconciliation")
    p.add_argument("config", help="the config file (e.g. kimi.toml)")
    p.add_argument("--unknown-from-key", action="store_true",
                   help="exit 1 (with the time left) while attempts that have no generation id (a killed "
                        "run's) may still be running; those that cannot are priced from GET /key usage with "
                        "or without it")
    p = add("attach", cmd_attach, "watch a run started elsewhere, read-only")
    p.add_argument("run_dir", metavar="CONFIG_OR_RUN_DIR",
                   help="the run's config file, or its run directory ([output] dir)")
    p = add("report", cmd_report, "how a run went: counts per dataset, spend and its history charts")
    p.add_argument("run_dir", metavar="CONFIG_OR_RUN_DIR",
                   help="the run's config file, or its run directory ([output] dir)")
    p = add("tokens", cmd_tokens, "reconstruct token ids of the answers on disk and validate them")
    p.add_argument("config", help="the config file (e.g. kimi.toml)")
    p = add("merge", cmd_merge, "merge all datasets into one deduplicated, shuffled training set")
    p.add_argument("config", help="the config file (e.g. kimi.toml)")
    p.add_argument("--replace-hidden-states", action="store_true",
                   help="merge even when hidden_states/ holds files of the current merge: if the new merge "
                   "differs, they are moved aside to hidden_states.merge-<id>/ (nothing deleted) and `extract` "
                   "starts afresh; without it such a merge is refused")
    p = add("extract", cmd_extract, "run the target model over the merged set and save hidden states")
    p.add_argument("config", nargs="?", help="the config file (e.g. kimi.toml); optional with --self-check")
    p.add_argument("--shard", help="i/N: this machine's share of the samples; auto: from the Slurm array or "
                   "the multi-node torchrun that started it")
    p.add_argument("--plan", action="store_true",
                   help="print what would be done (per shard: samples, tokens, bytes, free space, time) and exit")
    other = p.add_mutually_exclusive_group()
    other.add_argument("--start-over", action="store_true",
                       help="when hidden_states/ holds files of another merge than merged/ (another seed, more "
                       "answers): delete them and extract this merge (without a choice such a run is refused)")
    other.add_argument("--set-aside", action="store_true",
                       help="the same, but move the old folder to hidden_states.merge-<id>/ instead of deleting it")
    p.add_argument("--validate", action="store_true",
                   help="read every hidden-state file back first (as `draftgen check` does); the bad ones are "
                   "removed and extracted again, with the missing ones (nothing else)")
    p.add_argument("--self-check", action="store_true",
                   help="check the configured backend end to end on tiny random models first (minutes)")
    p.add_argument("--long-tokens", type=int, default=16384, metavar="N",
                   help="--self-check: length of its long sample (default 16384)")
    p = add("check", cmd_check, "read every hidden-state file back by the trainer's rules (shapes, dtype, "
            "finite values, ids equal to merged/tokens, layer count) and list the bad ones; exit 1 if any")
    p.add_argument("config", help="the config file (e.g. kimi.toml)")
    p.add_argument("--shard", help="i/N: only this shard's files (as `extract --shard i/N` wrote them)")
    p = add("train-command", cmd_train_command, "SpecForge's training config and command for this run's merged "
            "set and hidden states (max_length fits the longest sample), and its online config "
            "(specforge-online.json: the merged token ids, pre-tokenized); written to hidden_states/")
    p.add_argument("config", help="the config file (e.g. kimi.toml)")
    p.add_argument("--max-length", type=int, metavar="N",
                   help="data.max_length (default: the longest merged sample; a smaller one cuts samples, "
                   "and the printout says how many)")
    p = add("prompts", lambda a: 0, "prompt files from datasets on disk (parquet, arrow, JSON, saved or cached)")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    b = verbs.add_parser("build", help="sample, dedupe, measure and split datasets into prompt files and "
                         "[[datasets]] entries", description="Build prompt files from local datasets: "
                         "SOURCE is [NAME=]PATH_OR_HUB_ID[:SPLIT] (a save_to_disk folder, a .parquet/.arrow/"
                         ".json/.jsonl file, a folder of data files, or a dataset in the local Hugging Face cache).")
    b.set_defaults(fn=cmd_prompts_build)
    b.add_argument("sources", nargs="+", metavar="SOURCE",
                   help="[NAME=]WHERE[:SPLIT]: a save_to_disk folder, a data file "
                   "or folder of them, or a Hub id in the local cache")
    b.add_argument("--out", default="prompts", help="folder for the prompt files (default ./prompts)")
    b.add_argument("--config", default="draftgen.toml", help="config to add [[datasets]] to; started if absent "
                   "(default ./draftgen.toml)")
    b.add_argument("--no-config", action="store_true", help="write the prompt files only")
    b.add_argument("--preset", choices=("auto", "sharegpt", "openai", "instruction", "text", "trajectory"),
                   default="auto", help="row layout (default: detected from the columns; trajectory: an agent "
                   "trajectory column, SWE-agent's or OpenAI messages)")
    b.add_argument("--map", help="explicit columns: prompt=COL[,input=COL][,system=COL] or messages=COL or "
                   "conversations=COL[,tools=COL]")
    b.add_argument("--turns", choices=("first", "last", "all"), default="first",
                   help="conversations: the first user turn (default), everything up to the last one (one "
                   "request), or all: every user turn asked in order on the target's own answers (turns = \"all\")")
    b.add_argument("--max-turns", type=int, help="with --turns all: user turns kept per conversation at most")
    b.add_argument("-n", type=int, help="prompts per source (default: all usable rows)")
    b.add_argument("--seed", type=int, default=42, help="sampling seed (default 42)")
    b.add_argument("--language", help="keep these languages, e.g. en or en,zh (a language column, else the script)")
    b.add_argument("--min-tokens", type=int, help="drop prompts shorter than this (target tokenizer)")
    b.add_argument("--max-tokens", type=int, help="drop prompts longer than this (target tokenizer)")
    b.add_argument("--split", default="auto", help="short/long threshold in prompt tokens: auto (suggested), "
                   "off, or a number")
    b.add_argument("--short", help="short class CONCURRENCY/MAX_TOKENS (default 2000/10240)")
    b.add_argument("--long", help="long class CONCURRENCY/MAX_TOKENS (default 500/16384)")
    b.add_argument("--tokenizer", help="target tokenizer folder or cached HF id (default: the config's, "
                   "else moonshotai/Kimi-K2.5)")
    b.add_argument("--template", choices=("kimi-k2.5", "auto"), help="chat template (default: the config's)")
    b.add_argument("--price-in", type=float, help="USD per million prompt tokens, for the cost estimate")
    b.add_argument("--price-out", type=float, help="USD per million completion tokens, for the cost estimate")
    b.add_argument("--model", default="moonshotai/kimi-k2.5", help="api.model of a config started here")
    b.add_argument("--output-dir", help="output.dir of a config started here (default runs/<config name>)")
    b.add_argument("--download", action="store_true", help="allow downloading a Hub dataset not in the cache")
    b.add_argument("--subset", help="the dataset's configuration (subset) name, for a folder or Hub id")
    b.add_argument("--force", action="store_true", help="overwrite prompt files already in --out")
    p = add("simulate", cmd_simulate, "serve a local OpenRouter-compatible API to rehearse against")
    try:
        from draftgen.simulator.cli import add_arguments
        add_arguments(p)
    except ImportError:
        pass
    p = add("demo", cmd_demo, "the whole pipeline offline in about a minute")
    p.add_argument("--headless", action="store_true", help="no TUI: print the stage summaries")
    p.add_argument("--dir", default="draftgen-demo", help="where to write the demo run (default ./draftgen-demo)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()  # `draftgen` alone: the commands, what each does, and the exit codes
        return 0
    # Everything draftgen writes (run directories: answers, spend, events; prompt files) is owner-only,
    # whatever the shell's umask: the modes core/ passes explicitly cover only the files it opens itself.
    os.umask(0o077)
    try:
        return int(args.fn(args) or 0)
    except DraftgenError as e:
        if args.debug:
            raise
        # A message may quote a file's line, a path or a server's words: its controls shown as escapes.
        print(f"draftgen: error: {visible(str(e))}", file=sys.stderr)
        return int(e.exit_code)
    except OSError as e:
        # The filesystem said no where no DraftgenError names it (a run folder that cannot be made: a
        # name too long, a file in the way, no permission): the path and the reason, no traceback.
        if args.debug:
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(f"draftgen: error: {visible(f'{where}{e.strerror or e}')}", file=sys.stderr)
        return ExitCode.ERROR
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
