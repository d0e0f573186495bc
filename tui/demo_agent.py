"""The demo's agent dataset, core/data/demo/agent.jsonl (docs/agents.md); to write it again:

    python -m draftgen.tui.demo_agent [OUT]

20 agent lines in the OpenAI layout: a system turn, the tools (function schemas), a user task, two
tool steps (an assistant message with tool calls, then a `tool` result for each call) and a final
answer. The calls are what the simulator's target makes for the task (`moves`: simulator/tools.py
plans them from the task's text and the tools' names): 15 lines record exactly those calls, so with
tool_results = "match" every step is answered on the recorded results; every fourth line (5) records
a run_tests call at step 2 instead, so its conversation diverges there. The ids are Kimi-K2.5's own
shape, functions.NAME:IDX. Deterministic: the same file each time.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import orjson

from draftgen.simulator.tools import plan

LINES = 20
DIVERGE_EVERY = 4   # line i with i % DIVERGE_EVERY == DIVERGE_EVERY - 1 records another second call

SYSTEM = "You are a coding agent working in a Python repository. Use the tools to look before you answer."


def _tool(name: str, description: str, query: str) -> dict[str, Any]:
    """A function schema. Its arguments are those the simulator's target writes (a query and the round)."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": query},
            "round": {"type": "integer", "description": "which round of calls of the task this is"}},
            "required": ["query"]}}}


TOOLS = [
    _tool("search_code", "Search the repository; returns matching lines as path:line: text.",
          "text or a regular expression to look for"),
    _tool("read_file", "Read the file a query names.", "the file, or what it holds"),
    _tool("run_tests", "Run pytest on the tests a query names and return its summary.", "the tests to run"),
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


def _call(name: str, index: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"functions.{name}:{index}", "type": "function",
            "function": {"name": name, "arguments": orjson.dumps(args).decode()}}


def task(i: int) -> tuple[str, str, str, str]:
    """Line i's function, module, what goes wrong and the fix (past the list, the function gets _vN)."""
    fn, module, wrong, fix = TASKS[i % len(TASKS)]
    n = i // len(TASKS)
    return (fn if n == 0 else f"{fn}_v{n + 1}"), module, wrong, fix


def user_turn(i: int) -> str:
    """Line i's task. "tool rounds: 2" tells the simulator's target to make two rounds of calls."""
    fn, module, wrong, _ = task(i)
    return f"`{fn}` in {module} {wrong}. Find the cause and say how to fix it (tool rounds: 2)."


def moves(i: int) -> list[list[dict[str, Any]]]:
    """The target's calls at steps 1 and 2 of line i, as the simulator makes them (simulator/tools.py
    `plan`: from the task and the tools' names; one call, or two in parallel about one round in four),
    with Kimi's ids, functions.NAME:IDX counting the conversation's calls from 0."""
    rounds, n = [], 0
    for calls in plan(user_turn(i), [t["function"]["name"] for t in TOOLS]):
        rounds.append([_call(name, n + j, args) for j, (name, args) in enumerate(calls)])
        n += len(calls)
    return rounds


def _result(call: dict[str, Any], i: int) -> dict[str, Any]:
    """What the recorded agent's tool returned for `call` (a search hit, a file, a test summary)."""
    fn, module, wrong, _ = task(i)
    test = f"tests/test_{Path(module).stem}.py"
    name = call["function"]["name"]
    content = {"search_code": f"{module}:12: def {fn}(value):\n{test}:8: def test_{fn}():",
               "read_file": f"def {fn}(value):\n    # {wrong}\n    ...\n",
               "run_tests": f"FAILED {test}::test_{fn} - AssertionError\n1 failed, 7 passed in 0.21s"}[name]
    return {"role": "tool", "tool_call_id": call["id"], "content": content}


def line(i: int) -> dict[str, Any]:
    fn, module, wrong, fix = task(i)
    first, second = moves(i)
    if diverging(i):  # the recorded agent ran the tests where the target does something else
        second = [_call("run_tests", len(first), {"path": f"tests/test_{Path(module).stem}.py"})]
    return {"id": f"agent-{i}", "tools": TOOLS, "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": user_turn(i)},
        {"role": "assistant", "content": "", "tool_calls": first}, *(_result(c, i) for c in first),
        {"role": "assistant", "content": "", "tool_calls": second}, *(_result(c, i) for c in second),
        {"role": "assistant", "content": f"The cause is in `{fn}`: it {wrong}. Fix: {fix}."},
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
