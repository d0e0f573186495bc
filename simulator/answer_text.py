"""Canned answer text in three styles (code, maths, prose) that reads like a reasoning model's output.

Pure functions of a `random.Random`: the same seed gives the same texts. Reasoning is kept ASCII
so a cut at any token boundary of it is valid text; content uses a little Unicode (maths signs,
dashes, a Chinese phrase) and, rarely, a literal "<|im_end|>" inside code, which a tokenizer must
treat as ordinary text.
"""

from __future__ import annotations

import random

STYLES: tuple[str, ...] = ("code", "maths", "prose")
# Below this many characters an answer skips its closing lines, so short answers stay short.
_WRAP_UP_CHARS = 600

_TOPICS = {
    "code": ["a rate limiter", "a binary search", "an LRU cache", "a CSV parser", "a retry loop",
             "an interval merger", "a trie", "a topological sort", "a token bucket", "a ring buffer"],
    "maths": ["the quadratic", "the sum of the series", "the probability", "the integral",
              "the recurrence", "the expected value", "the limit", "the number of paths"],
    "prose": ["the history of the printing press", "how vaccines train the immune system",
              "why the sky is blue", "the trade-offs of remote work", "how tides work",
              "the causes of inflation", "what makes a good code review", "how bees navigate"],
}
_VERBS = ["check", "compute", "rewrite", "simplify", "verify", "compare", "split", "bound",
          "estimate", "test", "expand", "reorder", "trace", "count"]
_NOUNS = ["edge case", "base case", "invariant", "loop", "denominator", "boundary", "input",
          "first term", "constraint", "return value", "index", "example", "assumption", "step"]
_FILLERS = [
    "Let me think about this carefully.",
    "Hmm, wait. That does not look right, so let me re-check it.",
    "Actually, there is a simpler way to see this.",
    "I should double-check the {noun} before going further.",
    "The user probably wants a clear answer with a short explanation.",
    "Let me make sure the {noun} is handled correctly.",
    "OK, that matches what I expected.",
    "Maybe I should {verb} the {noun} first and then {verb2} the rest.",
]
_NAMES = ["parse", "merge", "solve", "count", "index", "retry", "lookup", "collect", "update", "window"]
_ARGS = ["items", "key", "limit", "values", "n", "text", "start", "end", "cache", "delay"]


def reasoning_text(rng: random.Random, style: str, target_chars: int) -> str:
    """A thinking trace of about `target_chars` characters (ASCII only)."""
    topic = rng.choice(_TOPICS[style])
    parts = [f"Okay, the user is asking about {topic}. "]
    size = len(parts[0])
    while size < target_chars:
        roll = rng.random()
        if roll < 0.3:
            s = rng.choice(_FILLERS).format(noun=rng.choice(_NOUNS), verb=rng.choice(_VERBS),
                                            verb2=rng.choice(_VERBS))
        elif roll < 0.6:
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            s = (f"If x = {a} and y = {b}, then x + y = {a + b} and x * y = {a * b}, "
                 f"so the {rng.choice(_NOUNS)} is {'fine' if (a * b) % 2 else 'even'}.")
        elif roll < 0.8:
            s = (f"First I need to {rng.choice(_VERBS)} the {rng.choice(_NOUNS)}, "
                 f"then {rng.choice(_VERBS)} the {rng.choice(_NOUNS)}.")
        else:
            s = f"Another approach: {rng.choice(_VERBS)} each {rng.choice(_NOUNS)} separately and compare."
        s += "\n\n" if rng.random() < 0.2 else " "
        parts.append(s)
        size += len(s)
    if target_chars >= _WRAP_UP_CHARS:
        parts.append("So I am fairly confident now. Let me write the answer.")
    return "".join(parts).rstrip()


def content_text(rng: random.Random, style: str, target_chars: int) -> str:
    """A final answer of about `target_chars` characters in the given style."""
    return {"code": _code, "maths": _maths, "prose": _prose}[style](rng, target_chars)


def _code(rng: random.Random, target_chars: int) -> str:
    topic = rng.choice(_TOPICS["code"])
    out = [f"Here is {topic} in Python, with a short explanation after the code.\n\n```python\n"]
    size = len(out[0])
    literal_marker = rng.random() < 0.08
    while size < target_chars:
        name, arg, arg2 = rng.choice(_NAMES), rng.choice(_ARGS), rng.choice(_ARGS)
        n = rng.randint(1, 64)
        body = (f"def {name}_{n}({arg}, {arg2}=None):\n"
                f"    \"\"\"{rng.choice(_VERBS).capitalize()} the {rng.choice(_NOUNS)} of `{arg}`.\"\"\"\n"
                f"    result = []\n"
                f"    for i, value in enumerate({arg}):\n"
                f"        if {arg2} is not None and i >= {arg2}:\n"
                f"            break\n"
                f"        result.append(value * {n} + i)\n"
                f"    return result\n\n")
        if literal_marker:
            # A literal special-token string inside an answer is ordinary text (docs/files.md, "Token reconstruction").
            body += 'END_OF_TURN = "<|im_end|>"  # the chat template\'s end marker, as plain text\n\n'
            literal_marker = False
        out.append(body)
        size += len(body)
    out.append("```\n")
    if target_chars >= _WRAP_UP_CHARS:
        out.append(f"\n- `{rng.choice(_NAMES)}` runs in O(n) time and O(n) extra space.\n"
                   f"- The {rng.choice(_NOUNS)} is handled before the loop, so empty input returns `[]`.\n")
    return "".join(out)


def _maths(rng: random.Random, target_chars: int) -> str:
    a, b = rng.randint(1, 9), rng.randint(1, 20)
    out = [f"We solve for x in x² + {a}x − {b} = 0.\n\n"]
    size = len(out[0])
    step = 1
    while size < target_chars:
        p, q = rng.randint(2, 40), rng.randint(2, 40)
        s = (f"**Step {step}.** {rng.choice(_VERBS).capitalize()} the {rng.choice(_NOUNS)}: "
             f"{p} × {q} = {p * q}, and {p * q} ÷ {p} = {q}, so the bound {q} ≤ {q + p} holds → "
             f"we continue.\n\n")
        out.append(s)
        size += len(s)
        step += 1
    disc = a * a + 4 * b
    if target_chars >= _WRAP_UP_CHARS:
        out.append(f"The discriminant is {a}² + 4·{b} = {disc}, so x = (−{a} ± √{disc}) / 2.\n\n")
    out.append(f"**Answer:** x = (−{a} ± √{disc}) / 2\n")
    return "".join(out)


def _prose(rng: random.Random, target_chars: int) -> str:
    topic = rng.choice(_TOPICS["prose"])
    out = [f"## {topic[0].upper()}{topic[1:]}\n\n"]
    size = len(out[0])
    while size < target_chars:
        if rng.random() < 0.25:
            s = "".join(f"- **{rng.choice(_NOUNS).capitalize()}**: it helps to {rng.choice(_VERBS)} "
                        f"the {rng.choice(_NOUNS)} early.\n" for _ in range(rng.randint(2, 4))) + "\n"
        else:
            s = (f"In short, the {rng.choice(_NOUNS)} matters more than it first seems — people "
                 f"often {rng.choice(_VERBS)} the {rng.choice(_NOUNS)} and miss the "
                 f"{rng.choice(_NOUNS)}. A careful look shows why.")
            if rng.random() < 0.1:
                s += " As the saying goes, 学而不思则罔."
            s += "\n\n"
        out.append(s)
        size += len(s)
    if target_chars >= _WRAP_UP_CHARS:
        out.append("In summary: start simple, check the assumptions, and revise as you learn more.\n")
    return "".join(out)


def style_of_prompt(text: str) -> str:
    """The answer style a prompt calls for, from a few keywords (cheap: no parsing)."""
    t = text[:2000].lower()
    if any(k in t for k in ("code", "function", "python", "implement", "program", "bug", "```", "class ")):
        return "code"
    if any(k in t for k in ("solve", "prove", "calculate", "integral", "equation", "how many",
                            "probability", "math", "what is ")):
        return "maths"
    return "prose"
