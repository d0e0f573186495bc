"""The checks that cost nothing, run before the first billed request (a smoke test's or a run's):
every prompt file read through (a missing file, a JSON array, a file with no usable line), and the
tokenizer and chat template loaded when the run or smoke test will need them. The key and the
prices are free too: they are read (GET /key, GET /models) before any completion is asked, in
preflight.py and smoke.py."""

from __future__ import annotations

import threading

from draftgen.core.config import Config
from draftgen.core.generate.loop.prompt_files import read_dataset
from draftgen.core.generate.loop.prompts import Conversation, Prompt


def count_prompts(config: Config, stop: threading.Event | None = None) -> dict[str, int]:
    """Usable prompts per dataset; raises PromptFileError naming the first file that cannot be used
    (ReadingStopped once `stop` is set)."""
    return {ds.name: sum(item.turns if isinstance(item, Conversation) else isinstance(item, Prompt)
                         for item in read_dataset(ds.prompts, ds.turns, ds.max_turns, stop))
            for ds in config.datasets}


def check_tokenizer(config: Config) -> None:
    """Load the tokenizer and the chat template; raises TokenizerError (or ConfigError) saying how to fix it."""
    from draftgen.core.tokens.template import load_template
    from draftgen.core.tokens.tokenizer import load_tokenizer
    tok = load_tokenizer(config.tokenizer.path, config.tokenizer.trust_remote_code)
    load_template(config.tokenizer.template, tok, default_system=config.tokenizer.system_turn())


def check_inputs(config: Config, *, tokenizer: bool, stop: threading.Event | None = None) -> None:
    """Every local input a run needs, before anything is paid for (a quit sets `stop`: ReadingStopped)."""
    if tokenizer:  # one file to load: said before a prompt file is read through
        check_tokenizer(config)
    count_prompts(config, stop)
