"""Tokenize a draftgen merge's train.jsonl with SpecForge's released parser; run as a script with the
unpacked release on PYTHONPATH.

    python tests/specforge_parse.py RUN_DIR

What SpecForge 0.2.0 does with a row when it tokenizes train.jsonl itself (its `prepare_hidden_states`
script, or online training given conversations; draftgen's online hand-off gives it the pre-tokenized
merged/train-tokens.jsonl instead, tests/specforge_prompts.py), from its own modules:
`safe_conversations_generator` reads the rows, the `kimi-k2-thinking` template of
`specforge.data.template` picks the parser (`parser_type` "thinking": `ThinkingParser`, chosen the way
`preprocessing.preprocess_conversations` chooses it; that module is not imported, it needs `datasets`),
and the parser renders the conversation, tokenizes it and builds the loss mask from the template's
assistant header through its end-of-turn token. `train_only_last_turn` is what the merge's mode asks
(merged/stats.json `multi_turn`): "per_turn" trains the last turn only, "per_conversation" every
assistant turn.

The tokenizer handed to it is the bundled Kimi tokenizer (tiktoken, special tokens recognised in text,
as a Hugging Face tokenizer encodes), and its `apply_chat_template` renders Kimi-K2.5's turns
(`<|im_system|>`/`<|im_user|>`/`<|im_assistant|>`, `<|im_middle|>`, `<|im_end|>`), each assistant turn
as `<think>{its reasoning_content}</think>{content}`: the rows carry reasoning on the last turn only, so
the earlier turns render `<think></think>` as served. The checkpoint's own Jinja file is not bundled,
and it differs here: it renders the last answer as `<think></think>{content}` too, dropping the
reasoning (docs/training.md), so this checks SpecForge's parser and mask, not Kimi's template.
Prints one JSON object: per row, SpecForge's input_ids and loss_mask.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

OPENERS = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>"}


class KimiForSpecForge:
    """The calls SpecForge's parser makes of a tokenizer, answered with the bundled Kimi tokenizer."""

    pad_token_id = 0
    unk_token_id = 0
    bos_token = None

    def __init__(self) -> None:
        from draftgen.core.tokens.tokenizer import bundled_kimi
        self.encoding = bundled_kimi().encoding

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = False, **_: Any) -> str:
        assert not tokenize and not add_generation_prompt
        out = []
        for m in messages:
            role = m["role"]
            body = m.get("content") or ""
            if role == "assistant":
                body = f"<think>{m.get('reasoning_content') or ''}</think>{body}"
            out.append(f"{OPENERS.get(role, '<|im_system|>')}{role}<|im_middle|>{body}<|im_end|>")
        return "".join(out)

    def encode(self, text: str, add_special_tokens: bool = False, **_: Any) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    def __call__(self, text: str, return_tensors: str | None = None, **_: Any) -> Any:
        import torch
        return SimpleNamespace(input_ids=torch.tensor([self.encode(text)], dtype=torch.long))


def main(run_dir: str) -> None:
    from specforge.data.parse import GeneralParser, ThinkingParser
    from specforge.data.template import TEMPLATE_REGISTRY
    from specforge.utils import safe_conversations_generator

    run = Path(run_dir)
    template = TEMPLATE_REGISTRY.get("kimi-k2-thinking")
    parser_cls = {"general": GeneralParser, "thinking": ThinkingParser}[template.parser_type]
    parser = parser_cls(KimiForSpecForge(), template)  # type: ignore[arg-type]
    mode = json.loads((run / "merged" / "stats.json").read_text())["multi_turn"]
    rows = []
    for row in safe_conversations_generator(str(run / "merged" / "train.jsonl")):
        ids, mask = parser.parse(row["conversations"], 1 << 20, train_only_last_turn=mode == "per_turn")
        rows.append({"input_ids": ids.tolist(), "loss_mask": mask.tolist()})
    print(json.dumps({"parser": parser_cls.__name__, "mode": mode, "rows": rows}))


if __name__ == "__main__":
    main(sys.argv[1])
