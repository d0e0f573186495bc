"""draftgen's merged/ and hidden_states/ read by SpecForge's released code: every file and row
the extraction writes is one SpecForge's own reader, loader and EAGLE-3 normaliser accept.

The SpecForge wheel the `gpu` extra pins is unpacked, not installed (its requirements pin a CUDA
torch and SGLang); its reader, feature store, training loader and EAGLE-3 normaliser are pure
python + torch and run from there in a subprocess (tests/specforge_read.py). The demo run goes
through the same reader in tests/test_demo.py.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch

from draftgen.core.config_load import config_from_dict
from draftgen.core.extract import extract
from draftgen.core.tokens.store import TokenReader, TokenWriter
from tests.pinned import read_with_specforge

N_LAYERS, HIDDEN, VOCAB = 8, 64, 500


def conversation_problem(messages: object) -> str | None:
    """The rules of SpecForge's scripts/conversation_validation.py `validate_conversation` (main branch).

    That script is not in the released wheel or sdist, so it cannot run from the pinned release:
    its rules are restated here and applied to what the release's `safe_conversations_generator` reads.
    """
    if not isinstance(messages, list) or not messages:
        return "conversations must be a non-empty list"
    expected, saw_user = "user", False
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not m["content"].strip():
            return f"message {i} content must be a non-empty string"
        if m.get("role") == "system" and not saw_user:
            continue
        if m.get("role") != expected:
            return f"message {i} expected role {expected!r}, got {m.get('role')!r}"
        saw_user, expected = True, "assistant" if expected == "user" else "user"
    return None if saw_user else "conversation has no user message"


def agent_conversation_problem(messages: list[dict]) -> str | None:
    """An agent sample (tool calls or results in it) as the release's GeneralParser takes it (core/merge/
    specforge.py): string contents (a turn of calls alone has ""), a first user turn after the system
    turn, each assistant turn after a user or tool turn, each tool turn after calls, the assistant's last
    (an answer, or the calls a step answered with).
    validate_conversation's strict user/assistant alternation is a chat rule: tool turns break it."""
    before = "system"
    for i, m in enumerate(messages):
        role = m.get("role")
        if not isinstance(m.get("content"), str):
            return f"message {i} content must be a string"
        allowed = {"system": ("system",) if i == 0 else (), "user": ("system", "assistant", "tool"),
                   "assistant": ("user", "tool"), "tool": ("calls", "tool")}.get(str(role), ())
        if before not in allowed:
            return f"message {i}: a {role!r} turn after a {before!r} one"
        before = "calls" if role == "assistant" and m.get("tool_calls") not in (None, "", "[]") else str(role)
    return None if before in ("assistant", "calls") else "the last turn is not the assistant's (an answer or calls)"


def as_specforge_reads(messages: list[dict]) -> list[dict]:
    """`messages` as SpecForge's `safe_conversations_generator` yields them: every list or dict value (the
    `tool_calls` every final assistant turn carries once a merge has a sample with tool calls, `[]` when
    it made none) as a JSON string, so Arrow sees one type."""
    return [{k: json.dumps(v, ensure_ascii=False) if isinstance(v, (list, dict)) else v for k, v in m.items()}
            for m in messages]


def check_run_with_specforge(run: Path, specforge_tree: Path) -> dict:
    """Every file and row of `run` accepted by SpecForge's reader, equal to what draftgen wrote."""
    got = read_with_specforge(run, specforge_tree)
    tokens = TokenReader(run / "merged" / "tokens")
    train = [orjson.loads(line) for line in (run / "merged" / "train.jsonl").read_bytes().splitlines()]
    assert len(got["samples"]) == len(tokens) == len(train)
    by_index = {int(Path(s["path"]).name.split("_")[1].split(".")[0]): s for s in got["samples"]}
    assert sorted(by_index) == list(range(len(tokens)))
    h = None
    for k, (_, ids, mask) in enumerate(tokens):
        s = by_index[k]
        t = len(ids)
        h = h or s["specs"]["hidden_state"][0][-1]
        assert s["specs"]["hidden_state"] == [[1, t, h], "bfloat16"]
        assert s["specs"]["aux_hidden_state"] == [[1, t, 3 * h], "bfloat16"]
        assert s["specs"]["input_ids"] == [[t], "int64"] and s["num_tokens"] == t
        # After the EAGLE-3 normaliser and the loader's batch of one: [1, 1, T, ...] states, [1, 1, T] ids.
        assert s["shapes"]["hidden_state"][-2:] == [t, 3 * h] and s["shapes"]["target"][-2:] == [t, h]
        assert s["input_ids"] == ids.tolist()
        assert s["loss_mask"] == [*mask.tolist()[:-1], 0]  # the normaliser zeroes the last position
    assert got["row_keys"] == ["conversations"]  # what the reader keeps of a row
    assert len(got["conversations"]) == len(train)
    for n, conv in enumerate(got["conversations"], 1):
        agent = any(m.get("role") == "tool" or m.get("tool_calls") not in (None, "", "[]") for m in conv)
        check = agent_conversation_problem if agent else conversation_problem
        assert check(conv) is None, f"train.jsonl line {n}: {check(conv)}"
        assert conv == as_specforge_reads(train[n - 1]["conversations"])
    return got


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=N_LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def make_run(tmp_path: Path, model_dir: Path, *, compress: bool = False) -> Path:
    run = tmp_path / "run"
    rng = np.random.default_rng(3)
    rows = []
    with TokenWriter(run / "merged" / "tokens") as writer:
        for k in range(6):
            n = int(rng.integers(4, 40))
            writer.append(f"s{k}", rng.integers(1, VOCAB, size=n), (rng.random(n) < 0.6).astype(np.uint8))
            system = [{"role": "system", "content": "Be brief."}] if k % 2 else []
            rows.append({"id": f"s{k}", "conversations": [*system, {"role": "user", "content": f"q{k}"},
                                                          {"role": "assistant", "content": f"<think>x</think>a{k}"}]})
    (run / "merged" / "train.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    raw = {"output": {"dir": str(run)}, "datasets": [{"name": "B1", "prompts": "p.jsonl"}],
           "extract": {"model": str(model_dir), "backend": "hf", "device": "cpu", "dtype": "float32",
                       "compress": compress, "batch_tokens": 64}}
    assert extract(config_from_dict(raw, tmp_path / "draftgen.toml")).written == 6
    return run


@pytest.mark.slow
def test_specforge_release_reads_merged_and_compressed_hidden_states(tmp_path: Path, model_dir: Path,
                                                                     specforge_tree: Path) -> None:
    # Plain .ckpt files go through the same reader in tests/test_demo.py; here the gzip form.
    run = make_run(tmp_path, model_dir, compress=True)
    got = check_run_with_specforge(run, specforge_tree)
    assert all(s["path"].endswith(".ckpt.gz") for s in got["samples"])


@pytest.mark.slow
def test_specforge_release_refuses_a_file_without_its_keys(tmp_path: Path, model_dir: Path,
                                                           specforge_tree: Path) -> None:
    # The reader is not a rubber stamp: a file missing loss_mask is refused by SpecForge itself.
    run = make_run(tmp_path, model_dir)
    path = next((run / "hidden_states").rglob("data_0.ckpt"))
    data = torch.load(path, weights_only=False)
    del data["loss_mask"]
    buf = io.BytesIO()
    torch.save(data, buf)
    path.write_bytes(buf.getvalue())
    with pytest.raises(AssertionError, match="missing required offline feature keys \\['loss_mask'\\]"):
        read_with_specforge(run, specforge_tree)


def test_conversation_rules_catch_a_bad_row() -> None:
    assert (conversation_problem([{"role": "assistant", "content": "a"}])
            == "message 0 expected role 'user', got 'assistant'")
    assert conversation_problem([{"role": "user", "content": " "}]) == "message 0 content must be a non-empty string"
    assert conversation_problem([{"role": "system", "content": "s"}]) == "conversation has no user message"
