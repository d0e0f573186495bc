"""`draftgen demo`: the whole pipeline offline in about a minute.

The built-in simulator serves on a free loopback port (realistic latency, a provider mix, a little
fault injection); five small bundled datasets (one runs out of its token budget, one has two bad
lines, one is 30 conversations of 3 user turns asked turn by turn: turns = "all", behind
MULTI_TURN_DEMO, one is 20 agent lines with tools asked step by step: AGENT_ENTRY) go through smoke,
generation with the bundled Kimi tokenizer reconstructing as answers land, merge, and extraction
with a tiny random-weight Llama on the CPU. The run directory stays for the user to look at.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from importlib.resources import files
from pathlib import Path
from typing import TextIO

from draftgen.core import runtime
from draftgen.core.config import Config
from draftgen.core.config_load import load_config
from draftgen.core.config_values import toml_value
from draftgen.core.errors import DraftgenError

DEMO_KEY_ENV = "DRAFTGEN_DEMO_KEY"
DEMO_KEY = "sk-demo-local-simulator-not-a-secret"

CONFIG = """\
# The demo's config: the same file format a real run uses (see docs/config.md).
[api]
base_url = {base_url}          # the simulator started by `draftgen demo`
api_key_env = {key_env}
model = "moonshotai/kimi-k2.5"
request_timeout_s = 60
credits_interval_s = 5

[request]
temperature = 0.6
include_reasoning = true
[request.provider]
ignore = ["fireworks", "baseten"]
sort = "price"
allow_fallbacks = true
quantizations = ["int4"]

[budget]
max_usd = 5.0
credit_floor_usd = 1.0

[tokenizer]
path = {tokenizer}             # the bundled Kimi-K2 tiktoken vocabulary
template = "kimi-k2.5"

[output]
dir = "run"

[engine]
parallel = true
backoff_base_s = 0.2
backoff_max_s = 2.0

[[datasets]]
name = "code"
prompts = "prompts/code.jsonl"
concurrency = 48
max_tokens = 4096

[[datasets]]
name = "maths"
prompts = "prompts/maths.jsonl"
concurrency = 64
max_tokens = 4096

[[datasets]]
name = "chat"                    # a small token budget: it runs out and skips the rest
prompts = "prompts/chat.jsonl"
concurrency = 16
max_tokens = 2048
token_budget = 30000
{multi_turn}
[extract]
model = "tiny-model"             # a 4-layer random-weight Llama with the Kimi vocabulary
backend = "hf"
dtype = "float32"
device = "cpu"
"""


# The multi-turn demo: 30 conversations x 3 user turns, each turn asked in order on the target's own earlier
# answers (turns = "all"; the file's own assistant turns are dropped). Off: the entry is written commented.
# Concurrency 30: every conversation open at once, so its 90 turns take three answers' time, not fifteen.
MULTI_TURN_DEMO = True  # multi-turn demo: the engine reads turns = "all" (conversations.py)
MULTI_TURN_ENTRY = """\
[[datasets]]
name = "dialogue"                # multi-turn demo: every user turn asked on the target's own answers
prompts = "prompts/dialogue.jsonl"
concurrency = 30
max_tokens = 2048
turns = "all"
"""


# The agent demo (docs/agents.md): 20 lines with tools, each two tool steps then an answer, every step
# asked in order on the target's own calls and the dataset's tool results (tool_results = "match", the
# default); 5 record a second call the simulator's target does not make, so they diverge at step 2.
# tui/demo_agent.py writes agent.jsonl.
AGENT_ENTRY = """\
[[datasets]]
name = "agent"                   # agent demo: every step of a tool loop asked on the target's own calls
prompts = "prompts/agent.jsonl"
concurrency = 20
max_tokens = 2048
turns = "all"
"""


def multi_turn_entry(enabled: bool) -> str:
    """The dialogue dataset's [[datasets]] entry for the demo's config, commented out unless `enabled`."""
    if enabled:
        return "\n" + MULTI_TURN_ENTRY
    return "\n# multi-turn demo (off until the engine reads turns = \"all\"):\n" + "".join(
        f"# {line}\n" for line in MULTI_TURN_ENTRY.splitlines())


def build_tiny_model(folder: Path) -> None:
    """A random-weight Llama small enough for the CPU, with the Kimi vocabulary size so that the
    reconstructed token ids are valid inputs. 8 layers: the fewest for which EAGLE-3's default
    layers [1, N//2-1, N-4] are distinct and ascending ([1, 3, 4])."""
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        raise DraftgenError("the demo's extraction step needs torch: pip install torch==2.13.0 "
                            "(CPU build) and pip install -e '.[extract]'") from None
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # its bars would draw over the demo's own output
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=163840, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=65536,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)


def prepare(root: Path, base_url: str) -> Config:
    """Write prompts, the tiny model and the config into `root`; return the loaded config."""
    from draftgen.core.tokens.tokenizer import bundled_kimi_path
    root.mkdir(parents=True, exist_ok=True)
    prompts = root / "prompts"
    prompts.mkdir(exist_ok=True)
    for name in ("code", "maths", "chat", "dialogue", "agent"):
        src = files("draftgen.core").joinpath("data", "demo", f"{name}.jsonl")
        (prompts / f"{name}.jsonl").write_bytes(src.read_bytes())
    model = root / "tiny-model"
    if not (model / "config.json").exists():
        build_tiny_model(model)
    path = root / "draftgen.toml"
    path.write_text(config_text(base_url, bundled_kimi_path()), encoding="utf-8")
    return load_config(path)


def config_text(base_url: str, tokenizer: str | Path) -> str:
    """The demo's config for this simulator and tokenizer folder (where draftgen is installed: any path)."""
    return CONFIG.format(base_url=toml_value(base_url), key_env=toml_value(DEMO_KEY_ENV),
                         tokenizer=toml_value(tokenizer),
                         multi_turn=multi_turn_entry(MULTI_TURN_DEMO) + "\n" + AGENT_ENTRY)


async def run_demo(root: Path, *, headless: bool, out: TextIO = sys.stdout, latency_scale: float = 0.3) -> int:
    from draftgen.simulator import SimConfig, SimServer
    run_dir = root / "run"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a demo starts from scratch; a real run resumes instead
    os.environ[DEMO_KEY_ENV] = DEMO_KEY
    sim_config = SimConfig(seed=7, latency_scale=latency_scale, mean_completion_tokens=500, credits=25.0,
                           faults={"429": 0.03, "500": 0.01, "502": 0.01, "drop": 0.005, "truncated": 0.005})
    async with SimServer(sim_config, port=0) as sim:
        config = prepare(root, sim.base_url)
        print(f"draftgen demo: simulator at {sim.base_url}, run directory {run_dir}", file=out, flush=True)
        if headless:
            from draftgen.core.generate.commands.smoke import run_smoke
            from draftgen.core.generate.commands.smoke_result import print_result
            from draftgen.headless.printer import run_headless
            result = await run_smoke(config, DEMO_KEY)
            print_result(result)
            if not result.passed:
                return 1
            code = await run_headless(config, DEMO_KEY, interval_s=3.0, out=out,
                                      then={"merge": True, "extract": True})
        else:
            from draftgen.tui.launch import run_tui
            code = await run_tui(config, DEMO_KEY, after_run=["merge", "extract"])
    # Lines that fit an 80-column pane but for the paths (a tmux split is often that narrow).
    print(f"\ndraftgen demo finished (exit {code}). Look around in\n  {run_dir}", file=out)
    for path, what in what_exists(run_dir):
        print(f"  {path:<26} {what}", file=out)
    print(f"The config it used: {root / 'draftgen.toml'}\nCounts and charts: draftgen report {run_dir}",
          file=out, flush=True)
    return code


def what_exists(run_dir: Path) -> list[tuple[str, str]]:
    """The demo's outputs that were made, relative to the run directory: a demo stopped early lists
    no merged/ or hidden_states/."""
    rows = []
    datasets = sorted(p.parent.name for p in run_dir.glob("*/responses.jsonl"))
    if datasets:
        rows.append(("<dataset>/responses.jsonl", f"the answers ({', '.join(datasets)})"))
    if any(run_dir.glob("*/tokens/index.jsonl")):
        rows.append(("<dataset>/tokens/", "token ids, loss masks, validation report"))
    if (run_dir / "merged" / "train.jsonl").exists():
        rows.append(("merged/train.jsonl", "the training set as conversations, to read"))
    if (run_dir / "merged" / "train-tokens.jsonl").exists():
        rows.append(("merged/train-tokens.jsonl", "its token ids, loss masks: online training reads it"))
    if any((run_dir / "hidden_states").glob("rows_*/*.ckpt*")):
        rows.append(("hidden_states/", "what EAGLE-3 trains on"))
    if (run_dir / "history.jsonl").exists():
        rows.append(("history.jsonl", "the rates over time (draftgen report prints them)"))
    if (run_dir / "events.log").exists():
        rows.append(("events.log", "what happened, in order"))
    return rows


def demo_command(args: argparse.Namespace) -> int:
    return runtime.run(run_demo(Path(args.dir).resolve(), headless=args.headless))
