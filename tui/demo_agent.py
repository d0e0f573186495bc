"""The demo's agent dataset, core/data/demo/agent.jsonl (docs/agents.md); to write it again:

    python -m draftgen.tui.demo_agent [OUT]

20 agent lines in the OpenAI layout: a system turn, the tools (function schemas), a user task, two
tool steps (an assistant message with tool calls, then a `tool` result for each call) and a final
answer. The calls are what the simulator's target makes for such a task (`moves` below): 15 lines
record exactly those calls, so with tool_results = "match" every step is answered on the recorded
results; every fourth line (5) records another second call than the target's, so its conversation
diverges at step 2. The ids are Kimi-K2.5's own shape, functions.NAME:IDX. Deterministic: the same
file each time.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import orjson

LINES = 20
DIVERGE_EVERY = 4   # line i with i % DIVERGE_EVERY == DIVERGE_EVERY - 1 records another second call

SYSTEM = "You are a coding agent working in a Python repository. Use the tools to look before you answer."


def _tool(name: str, description: str, **params: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": "string", "description": v}
                                                        for k, v in params.items()},
                       "required": list(params)}}}


TOOLS = [
    _tool("search_code", "Search the repository; returns matching lines as path:line: text.",
          query="text or a regular expression to look for"),
    _tool("read_file", "Read a file of the repository.", path="the file's path from the repository root"),
    _tool("run_tests", "Run pytest on a path and return its summary.", path="a test file or folder"),
]

# (function, module, what goes wrong, the fix): one task a line, cycled with a suffix past the list.
TASKS = [
    ("parse_date", "utils/dates.py", "returns the wrong month for ISO dates", "use %m, not %M, in the format"),
    ("slugify", "text/slug.py", "keeps trailing dashes", "strip '-' after joining the words"),
    ("chunked", "utils/iter.py", "drops the last partial chunk", "yield the remainder after the loop"),
    ("merge_config", "config/merge.py", "overwrites nested tables", "merge dicts recursively"),
    ("retry", "net/retry.py", "sleeps once more after the last attempt", "sleep only between attempts"),
    ("parse_size", "utils/units.py", "reads 1KiB as 1000 bytes", "use 1024 for the binary prefixes"),
    ("read_jsonl", "io/jsonl.py", "fails on a blank last line", "skip empty lines"),
    ("percentile", "stats/summary.py", "is off by one for p100", "clamp the index to len - 1"),
    ("normalize_path", "fs/paths.py", "turns a/../b into /b", "join before normalising"),
    ("dedupe", "utils/seq.py", "changes the order of items", "keep the first of each, in order"),
]


def _call(name: str, index: int, **args: str) -> dict[str, Any]:
    return {"id": f"functions.{name}:{index}", "type": "function",
            "function": {"name": name, "arguments": orjson.dumps(args).decode()}}


def _result(call: dict[str, Any], content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call["id"], "content": content}


def moves(fn: str, module: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The target's calls at steps 1 and 2 for a task on `fn` in `module`: it searches for the
    definition, then reads the file and its test file at once (two parallel calls)."""
    test = f"tests/test_{Path(module).stem}.py"
    return ([_call("search_code", 0, query=f"def {fn}")],
            [_call("read_file", 1, path=module), _call("read_file", 2, path=test)])


def task(i: int) -> tuple[str, str, str, str]:
    """Line i's function, module, what goes wrong and the fix (past the list, the function gets _vN)."""
    fn, module, wrong, fix = TASKS[i % len(TASKS)]
    n = i // len(TASKS)
    return (fn if n == 0 else f"{fn}_v{n + 1}"), module, wrong, fix


def line(i: int) -> dict[str, Any]:
    fn_i, module, wrong, fix = task(i)
    first, second = moves(fn_i, module)
    diverges = diverging(i)
    if diverges:  # the recorded agent ran the tests where the target reads the files
        second = [_call("run_tests", 1, path=f"tests/test_{Path(module).stem}.py")]
    test = f"tests/test_{Path(module).stem}.py"
    results_1 = [_result(first[0], f"{module}:12: def {fn_i}(value):")]
    if diverges:
        results_2 = [_result(second[0], f"FAILED {test}::test_{fn_i} - AssertionError\n1 failed, 7 passed in 0.21s")]
    else:
        results_2 = [_result(second[0], f"def {fn_i}(value):\n    # {wrong}\n    ...\n"),
                     _result(second[1], f"def test_{fn_i}():\n    assert {fn_i}(EXAMPLE) == EXPECTED\n")]
    return {"id": f"agent-{i}", "tools": TOOLS, "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"`{fn_i}` in {module} {wrong}. Find the cause and say how to fix it."},
        {"role": "assistant", "content": "", "tool_calls": first}, *results_1,
        {"role": "assistant", "content": "", "tool_calls": second}, *results_2,
        {"role": "assistant", "content": f"The cause is in `{fn_i}`: {wrong}. Fix: {fix}."},
    ]}


def dataset() -> bytes:
    """The file's bytes: LINES lines, one JSON object each."""
    return b"".join(orjson.dumps(line(i)) + b"\n" for i in range(LINES))


def diverging(i: int) -> bool:
    """Line i records another second call than the target makes."""
    return i % DIVERGE_EVERY == DIVERGE_EVERY - 1


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "core/data/demo/agent.jsonl"
    out.write_bytes(dataset())
    print(out)
