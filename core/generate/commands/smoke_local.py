"""The smoke test's free checks of the prompt files, before anything is paid for: the requests each dataset
sends (its prompts, or its conversations' turns) and the prompts holding special-token text."""

from __future__ import annotations

import functools
import threading
from collections.abc import AsyncIterator
from typing import Any

from draftgen.core.config import Config
from draftgen.core.config_tables import DatasetConfig
from draftgen.core.errors import DraftgenError
from draftgen.core.generate.commands.smoke_rows import SmokeRow, quoted
from draftgen.core.generate.loop.prompt_files import read_conversations, read_dataset, read_stoppable
from draftgen.core.generate.loop.prompts import Conversation, Prompt
from draftgen.core.generate.money.forecast import history_per_turn


def scan_prompts(ds: DatasetConfig, specials: Any = (), stop: threading.Event | None = None) -> tuple[int, int, str]:
    """Prompts in the file, those holding special-token text, and the first such token seen (`stop`: see
    prompt_files.py read_stoppable)."""
    from draftgen.core.tokens.template import special_text_pattern
    pattern = special_text_pattern(specials)
    n = flagged = 0
    first = ""
    for item in read_dataset(ds.prompts, ds.turns, ds.max_turns, stop):
        if isinstance(item, Conversation):  # its prompt side: the system and user turns (and tool results) it sends
            messages = item.prompt_side()
        elif isinstance(item, Prompt):
            messages = item.messages
        else:
            continue
        n += 1
        if pattern is not None:
            found = next((m for msg in messages if isinstance(msg.get("content"), str)
                          for m in [pattern.search(msg["content"])] if m), None)
            if found:
                flagged += 1
                first = first or found.group(0)
    return n, flagged, first


def count_turns(ds: DatasetConfig, stop: threading.Event | None = None) -> tuple[int, float, bool]:
    """A `turns = "all"` dataset's requests: the user turns (an agent line's steps) of its conversations
    (at most max_turns each), the mean earlier answers each request's history carries
    (forecast.history_per_turn), and whether it holds agent lines (smoke_agent.py checks their requests)."""
    # The run's reader (max_turns, the dataset's answers dropped).
    convs = [item for item in read_conversations(ds.prompts, ds.max_turns, stop) if isinstance(item, Conversation)]
    turns = [c.turns for c in convs]
    return sum(turns), history_per_turn(turns), any(c.steps is not None for c in convs)


def special_text_row(config: Config, name: str, flagged: int, first: str) -> SmokeRow:
    """A warning counting the prompts with special-token text, and how this run reads it."""
    reads = config.tokenizer.prompt_specials(config.api.server.kind.specials_as_tokens)
    how = ("read as the special token, as vLLM, SGLang and transformers serve tokenize the rendered prompt"
           if reads else "kept as text")
    return SmokeRow(f"{name}: special-token text", True,
                    f"{flagged} prompt(s) hold special-token text (e.g. {quoted(first)}): {how} ([tokenizer] "
                    f"prompt_special_tokens = \"{'special' if reads else 'text'}\"; check the prompt tokens row)",
                    warning=True)



async def special_text_rows(config: Config, tokenizer: Any, counts: dict[str, int]) -> AsyncIterator[SmokeRow]:
    """Per dataset with prompts, a warning counting those with special-token text (the target `tokenizer`'s
    special tokens; none looked for when it did not load), or the row of a prompt file that cannot be read."""
    for ds in config.datasets:
        if tokenizer is not None and counts[ds.name]:
            try:
                _, flagged, first = await read_stoppable(
                    functools.partial(scan_prompts, ds, tokenizer.special_tokens()))
                if flagged:
                    yield special_text_row(config, ds.name, flagged, first)
            except DraftgenError as e:
                yield SmokeRow(f"{ds.name}: prompts", False, str(e))
