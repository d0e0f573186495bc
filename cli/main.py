"""The `draftgen` command: parses arguments, calls into core/ (or the TUI), and is the one place
where user-facing errors are caught and printed without a traceback (`--debug` shows it)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from pathlib import Path

from draftgen.core.errors import DraftgenError


def _config(path: str):  # noqa: ANN202 - Config; imported lazily to keep `--help` fast
    from draftgen.core.config import load_config
    return load_config(path)


def cmd_run(args: argparse.Namespace) -> int:
    config = _config(args.config)
    key = config.api_key()
    if args.headless:
        from draftgen.core.live.headless import run_headless
        return asyncio.run(run_headless(config, key, skip_smoke=args.skip_smoke,
                                        interval_s=args.interval, merge=args.merge, extract=args.extract))
    from draftgen.tui.launch import run_tui
    return asyncio.run(run_tui(config, key, skip_smoke=args.skip_smoke))


def cmd_attach(args: argparse.Namespace) -> int:
    from draftgen.tui.launch import attach_tui
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise DraftgenError(f"{run_dir}: no such run directory")
    return asyncio.run(attach_tui(run_dir))


def cmd_smoke(args: argparse.Namespace) -> int:
    from draftgen.core.generate.smoke import smoke_command
    config = _config(args.config)
    return smoke_command(config, config.api_key())


def cmd_tokens(args: argparse.Namespace) -> int:
    from draftgen.core.tokens.command import tokens_command
    return tokens_command(_config(args.config))


def cmd_merge(args: argparse.Namespace) -> int:
    from draftgen.core.merge.merge import merge_command
    return merge_command(_config(args.config))


def cmd_extract(args: argparse.Namespace) -> int:
    from draftgen.core.extract import extract_command, parse_shard
    if args.self_check:
        from draftgen.core.extract.command import self_check_command
        return self_check_command(_config(args.config) if args.config else None, long_tokens=args.long_tokens)
    if not args.config:
        raise DraftgenError("draftgen extract: give the config file (or --self-check)")
    if args.shard:
        parse_shard(args.shard)  # a bad --shard fails before the config is read
    return extract_command(_config(args.config), args.shard)


def cmd_simulate(args: argparse.Namespace) -> int:
    from draftgen.core.simulator.cli import run
    return run(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from draftgen.tui.demo import demo_command
    return demo_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftgen", description="EAGLE-3 draft-model training data "
                                     "from a target model, run from a live terminal UI.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(fn=fn)
        return p

    p = add("smoke", cmd_smoke, "check key, credits and one request per dataset shape; exit 0 only if all pass")
    p.add_argument("config")
    p = add("run", cmd_run, "generate answers (the TUI; --headless for nohup/CI)")
    p.add_argument("config")
    p.add_argument("--headless", action="store_true", help="no TUI: a status line every few seconds")
    p.add_argument("--skip-smoke", action="store_true", help="start without a passing smoke test")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between headless status lines")
    p.add_argument("--merge", action="store_true", help="headless: merge when generation is done")
    p.add_argument("--extract", action="store_true", help="headless: extract after merging")
    p = add("attach", cmd_attach, "watch a run started elsewhere, read-only")
    p.add_argument("run_dir")
    p = add("tokens", cmd_tokens, "reconstruct token ids of the answers on disk and validate them")
    p.add_argument("config")
    p = add("merge", cmd_merge, "merge all datasets into one deduplicated, shuffled training set")
    p.add_argument("config")
    p = add("extract", cmd_extract, "run the target model over the merged set and save hidden states")
    p.add_argument("config", nargs="?")
    p.add_argument("--shard", help="i/N: this machine's share of the samples")
    p.add_argument("--self-check", action="store_true",
                   help="check the configured backend end to end on tiny random models first (minutes)")
    p.add_argument("--long-tokens", type=int, default=16384, metavar="N",
                   help="--self-check: length of its long sample (default 16384)")
    p = add("simulate", cmd_simulate, "serve a local OpenRouter-compatible API to rehearse against")
    try:
        from draftgen.core.simulator.cli import add_arguments
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
    try:
        return int(args.fn(args) or 0)
    except DraftgenError as e:
        if args.debug:
            raise
        print(f"draftgen: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        # The filesystem said no where no DraftgenError names it (a run folder that cannot be made: a
        # name too long, a file in the way, no permission): the path and the reason, no traceback.
        if args.debug:
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(f"draftgen: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
