import gzip

import orjson
import pytest

from draftgen.core.errors import PromptFileError
from draftgen.core.generate.loop.prompt_files import read_prompts
from draftgen.core.generate.loop.prompts import Prompt, Rejection


def lines(*objs):
    return b"".join((o if isinstance(o, bytes) else orjson.dumps(o)) + b"\n" for o in objs)


def test_all_three_shapes_and_rejections(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(lines(
        {"id": 1, "prompt": "What is 2+2?"},
        {"id": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
        {"id": "c1", "conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"},
                                       {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "dropped"}]},
        {"id": "c2", "conversations": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
        b"{not json",
        {"id": "x"},
        {"id": 1, "prompt": "duplicate"},
        {"id": "last-assistant", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        b"\xff\xfe{\"id\": 9}",
        {"prompt": "no id"},
        [1, 2],
    ))
    items = list(read_prompts(path))
    prompts = [i for i in items if isinstance(i, Prompt)]
    rejected = {i.line: i for i in items if isinstance(i, Rejection)}
    assert [p.id for p in prompts] == ["1", "m", "c1", "c2"]
    assert prompts[0].messages == [{"role": "user", "content": "What is 2+2?"}]
    assert prompts[2].messages == [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                                   {"role": "user", "content": "Q2"}]
    assert prompts[3].messages == [{"role": "user", "content": "Q"}]
    assert "not valid JSON" in rejected[5].reason
    assert "no `prompt`" in rejected[6].reason
    assert "duplicate id '1'" in rejected[7].reason
    assert "last message must be from the user" in rejected[8].reason
    assert "UTF-8" in rejected[9].reason or "JSON" in rejected[9].reason
    assert "missing `id`" in rejected[10].reason
    assert "not a JSON object" in rejected[11].reason


def test_gzip_and_missing_file(tmp_path):
    path = tmp_path / "p.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(lines(*({"id": i, "prompt": f"q{i}"} for i in range(100))))
    assert sum(isinstance(i, Prompt) for i in read_prompts(path)) == 100
    with pytest.raises(PromptFileError, match="prompt file not found"):
        list(read_prompts(tmp_path / "missing.jsonl"))
