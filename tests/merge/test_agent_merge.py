"""Merging the steps of agent conversations: one sample per step (per_turn), or one per conversation
whose loss mask covers every assistant message (per_conversation), ids and masks equal to Kimi-K2.5's
official chat template (tests/tokens/test_agent_template.py renders it)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from draftgen.core.config_load import config_from_dict
from draftgen.core.merge.merge import merge
from draftgen.core.tokens.store import TokenReader
from draftgen.core.tokens.tokenizer import bundled_kimi, bundled_kimi_path
from draftgen.core.tokens.workers import reconstruct_dataset
from tests.multiturn import write_records
from tests.tokens.test_agent_template import generated, reference

CONVERSATIONS = 12


def agent_run(tmp_path: Path, mode: str) -> tuple[Any, dict[str, list[dict[str, Any]]]]:
    """A run directory with dataset "A": the first generated agent conversations, every step answered
    (usage as the template counts it), reconstructed with the real Kimi tokenizer."""
    raw = {"output": {"dir": "run"}, "tokenizer": {"path": str(bundled_kimi_path())},
           "datasets": [{"name": "A", "prompts": "A.jsonl"}], "merge": {"multi_turn": mode}}
    config = config_from_dict(raw, tmp_path / "draftgen.toml")
    convs: dict[str, list[dict[str, Any]]] = {}
    lines = []
    for steps in generated()[:CONVERSATIONS]:
        done = []
        for step in steps:
            ids, _, start = reference(step)
            done.append({**step, "model": "moonshotai/kimi-k2.5", "generation_id": f"gen-{step['id']}",
                         "native_finish_reason": step["finish_reason"], "truncated": False,
                         "empty_content": not step["content"], "latency_s": 0.1, "attempts": 1, "ts": time.time(),
                         "usage": {"prompt_tokens": start, "completion_tokens": len(ids) - start, "cost": 0.001}})
        convs[steps[0]["conversation"]] = done
        lines += done
    write_records(config.run_dir / "A" / "responses.jsonl", lines)
    report = reconstruct_dataset(config, "A", workers=1)
    assert report.checked == len(lines) == report.valid
    return config, convs


def merged(config: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    reader = TokenReader(config.run_dir / "merged" / "tokens")
    return {e.id: (ids, mask) for e, (_, ids, mask) in zip(reader.entries, reader)}


def test_per_turn_keeps_every_step_as_the_template_renders_it(tmp_path: Path) -> None:
    config, convs = agent_run(tmp_path, "per_turn")
    stats = merge(config)
    samples = merged(config)
    steps = [s for conv in convs.values() for s in conv]
    assert stats.datasets[0].kept == len(steps) == len(samples)
    for step in steps:
        ids, mask, _ = reference(step)
        got_ids, got_mask = samples[f"A/{step['id']}"]
        assert got_ids.tolist() == ids and got_mask.tolist() == mask, step["id"]


def test_per_conversation_masks_every_assistant_message_of_the_last_step(tmp_path: Path) -> None:
    """The conversation's sample is its last step's ids (what the model saw there, tool loops and
    results included) with every earlier assistant message, `<think>` through `<|im_end|>`, in the
    loss mask beside the last answer."""
    tok = bundled_kimi()
    header = [tok.special_id("<|im_assistant|>"), *tok.encode_text("assistant"), tok.special_id("<|im_middle|>")]
    think, end = tok.special_id("<think>"), tok.special_id("<|im_end|>")
    config, convs = agent_run(tmp_path, "per_conversation")
    stats = merge(config)
    samples = merged(config)
    assert set(samples) == {f"A/{c}" for c in convs} and stats.datasets[0].kept == len(convs)
    for cid, steps in convs.items():
        ids, last_mask, _ = reference(steps[-1])
        got_ids, got_mask = samples[f"A/{cid}"]
        assert got_ids.tolist() == ids
        opens = [i for i in range(len(header), len(ids)) if ids[i - len(header):i] == header]
        assert len(opens) == len(steps)  # every step's assistant header: the history's and the last one's
        want = np.array(last_mask, dtype=np.uint8)
        for h in opens[:-1]:
            assert ids[h] == think
            want[h:ids.index(end, h) + 1] = 1
        assert got_mask.tolist() == want.tolist(), cid
        assert int(got_mask.sum()) > sum(last_mask) or len(steps) == 1
