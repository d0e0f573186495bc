"""Crash-and-resume soak: `draftgen run --headless` against a faulty simulator, killed over and over.

    python benchmarks/soak.py [--kills 40] [--prompts 24000] [--faults 429=0.05,500=0.04,...]
                              [--scenarios moderation:rate=0.01,rate_limited:rate=0.02,...]
                              [--storm 60] [--concurrency 48] [--seed 1] [--dir DIR]

The simulator runs in this process (so its per-prompt counters can be read directly); each run is a
real `python -m draftgen.cli.main run CONFIG --headless --skip-smoke` subprocess in its own session,
with live token reconstruction on (the bundled Kimi tokenizer) and its output in a log file, as
under nohup. The plan:

- `--kills` times: start the run, SIGKILL its main process at a random moment (during start-up,
  or a random time after it answers again), as `kill -9 PID` or the OOM killer would;
- once in the first third: SIGTERM to its process group, once in the second third: SIGHUP to its
  process group (a closed tmux pane, a dropped SSH session): each must drain (in-flight requests
  finish and are written), exit 0, leave no process behind and leave the token files in step;
- with `--storm S`: one run meets a 429 storm (every request answered 429 for S seconds): its
  effective concurrency must drop during the storm and climb back to the configured value after;
- a last run to completion, then `draftgen tokens CONFIG`.

After every process: no response or failure acknowledged on disk before is missing, no id twice,
no process of its session left behind (the reconstruction workers must die with their run).
Beside the faults, rows of OpenRouter's response table run as simulator scenarios (`--scenarios`,
default DEFAULT_SCENARIOS): prompts of their own that fail (moderation, context length, invalid
prompt) and transient answers (a provider's 429, 503 routing, 200 carrying an error).
At the end (`audit`): every prompt id answered, failed or skipped exactly once (skipped only where
a token budget ran out), failed only for a reason of its own (classify.py: the prompt's own kinds,
or an answer fault repeated after others were answered); one token entry per answer, and a sample
re-reconstructed gives identical
ids and loss mask; the spend recorded (sum of usage.cost) matches what the simulator billed: every
prompt's billing is explained by its written answer, plus generations billed but never written:
those of faults nobody could read (drop, hang, truncated: the service bills them, see
simulator/faults.py) and answers a SIGKILL left (at most one per request in flight at the
kill; the simulator bills an abandoned plain request in full, as OpenRouter does).

The figures print as a table; exit status 0 only if no check failed. The short form runs in the
suite (tests/run/test_soak.py). Over 400 lines on purpose: one script to copy to a machine and run, with
its audit next to the plan it checks.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import orjson
import psutil

from draftgen.core.config import Config
from draftgen.core.config_load import load_config
from draftgen.core.config_tables import DatasetConfig
from draftgen.core.generate.api.classify import ANSWER_KINDS, WHOSE, Whose
from draftgen.core.generate.loop.prompt_files import read_prompts
from draftgen.core.generate.loop.prompts import Prompt
from draftgen.core.live.summary import EXIT_COMPLETE, EXIT_INCOMPLETE
from draftgen.core.records import ErrorKind
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.reconstruct import reconstruct_record
from draftgen.core.tokens.store import TokenReader
from draftgen.core.tokens.template import load_template
from draftgen.core.tokens.tokenizer import bundled_kimi, bundled_kimi_path
from draftgen.simulator import FAULT_KINDS, SimConfig, SimServer, SimStats, parse_faults, prompt_key
from draftgen.simulator.scenarios import parse_scenarios

KEY_ENV = "DG_SOAK_KEY"
SOAK_KEY = "sk-or-v1-soak-not-a-real-key-5f0e1d2c3b4a"
# Every fault kind of the simulator, about 35% of requests in all.
DEFAULT_FAULTS = {"429": 0.05, "500": 0.04, "502": 0.03, "503": 0.03, "524": 0.03, "drop": 0.03,
                  "hang": 0.02, "truncated": 0.03, "error200": 0.03, "finish_error": 0.03, "empty_choices": 0.03}
# Rows of OpenRouter's table mixed in (simulator scenarios; see simulator/scenarios.py).
# Scenarios share their draws (one per prompt for a prompt's own problems, one per request for the
# rest) and the first in the order the service meets them answers, so the rates climb.
DEFAULT_SCENARIOS = {"context_length": {"rate": 0.005}, "invalid_prompt": {"rate": 0.01},
                     "moderation": {"rate": 0.02}, "rate_limited": {"rate": 0.02, "retry_after": 0.05},
                     "no_provider_503": {"rate": 0.04}, "provider_502": {"rate": 0.05},
                     "finish_error": {"rate": 0.06}, "stream_error": {"rate": 0.07}}
MAX_TOKENS = 400
MEAN_TOKENS = 80
EPS_USD = 1e-9
# The headless detail line of the run's limits: "limit E/C | avg completion ..." (effective/configured).
_LIMIT = re.compile(rb"\n +limit ([\d,]+)/([\d,]+) \|")

# Faults whose generation ran and is billed though no client could read it (simulator/faults.py).
BILLED_FAULTS = ("drop", "hang", "truncated")


# ---------------------------------------------------------------------------------------------
# The run directory and config


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return orjson.dumps(v).decode()
    return repr(v)


def write_prompt_file(path: Path, prefix: str, n: int) -> None:
    """Prompts of every shape the loader takes: plain, messages with a system turn, conversations."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for i in range(n):
            pid = f"{prefix}{i}"
            if i % 7 == 3:
                line = {"id": pid, "messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user",
                                                 "content": f"Implement function f{i} in Python ({pid})."}]}
            elif i % 11 == 5:
                line = {"id": pid, "conversations": [
                    {"from": "human", "value": f"What is {i} + {i}?"}, {"from": "gpt", "value": f"{2 * i}."},
                    {"from": "human", "value": f"And {i} * 3? Solve it step by step (item {pid})."}]}
            else:
                line = {"id": pid, "prompt": f"Question {pid}: explain item {i} in a few sentences."}
            f.write(orjson.dumps(line) + b"\n")


def write_config(root: Path, base_url: str, *, prompts: int, concurrency: int, workers: int, max_attempts: int,
                 budget: bool) -> Path:
    """Two datasets (two thirds and one third of the prompts); the second has a token budget that
    runs out when `budget`."""
    n_a = prompts * 2 // 3
    n_b = prompts - n_a
    write_prompt_file(root / "prompts" / "a.jsonl", "a-", n_a)
    write_prompt_file(root / "prompts" / "b.jsonl", "b-", n_b)
    tables: list[tuple[str, dict[str, Any]]] = [
        ("api", {"base_url": base_url, "api_key_env": KEY_ENV, "model": "moonshotai/kimi-k2.5",
                 "request_timeout_s": 2.0, "connect_timeout_s": 2.0, "credits_interval_s": 5.0}),
        ("request", {"temperature": 0.6, "include_reasoning": True}),
        ("engine", {"max_attempts": max_attempts, "backoff_base_s": 0.02, "backoff_max_s": 0.5, "reconstruct": True,
                    "workers": workers, "snapshot_hz": 4.0}),
        ("tokenizer", {"path": str(bundled_kimi_path()), "template": "kimi-k2.5"}),
        ("output", {"dir": "run"}),
    ]
    lines: list[str] = []
    for name, values in tables:
        lines += [f"[{name}]"] + [f"{k} = {_toml(v)}" for k, v in values.items()] + [""]
    lines += ["[[datasets]]", 'name = "a"', 'prompts = "prompts/a.jsonl"', f"concurrency = {concurrency}",
              f"max_tokens = {MAX_TOKENS}", ""]
    lines += ["[[datasets]]", 'name = "b"', 'prompts = "prompts/b.jsonl"', f"concurrency = {max(2, concurrency // 2)}",
              f"max_tokens = {MAX_TOKENS}"]
    if budget:
        # About 60% of what the dataset's answers need: the rest is skipped when it runs out.
        lines.append(f"token_budget = {int(n_b * MEAN_TOKENS * 0.6)}")
    path = root / "draftgen.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class DiskState:
    """What responses.jsonl and failures.jsonl hold now (whole lines only), per dataset."""
    answered: dict[str, list[str]]
    failed: dict[str, list[str]]
    torn: int  # half-written last lines (left by a SIGKILL; the next run cuts them)

    def ids(self) -> set[tuple[str, str, str]]:
        out = {(ds, i, "answered") for ds, ids in self.answered.items() for i in ids}
        return out | {(ds, i, "failed") for ds, ids in self.failed.items() for i in ids}

    def written(self) -> int:
        return sum(len(v) for v in self.answered.values())

    def duplicates(self) -> int:
        dup = 0
        for ds in self.answered:
            a, f = self.answered[ds], self.failed.get(ds, [])
            dup += len(a) - len(set(a)) + len(f) - len(set(f)) + len(set(a) & set(f))
        return dup


def whole_lines(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The parsed whole lines of a JSONL file, and whether a half-written last line follows them."""
    if not path.exists():
        return [], False
    data = path.read_bytes()
    torn = bool(data) and not data.endswith(b"\n")
    # The last piece is "" after a whole last line, or the torn part of one.
    return [orjson.loads(x) for x in data.split(b"\n")[:-1] if x.strip()], torn


def read_disk(config: Config) -> DiskState:
    rd = RunDir(config.run_dir)
    answered, failed, torn = {}, {}, 0
    for ds in config.datasets:
        recs, t1 = whole_lines(rd.responses(ds.name))
        fails, t2 = whole_lines(rd.failures(ds.name))
        answered[ds.name] = [str(r["id"]) for r in recs]
        failed[ds.name] = [str(r["id"]) for r in fails]
        torn += t1 + t2
    return DiskState(answered, failed, torn)


# ---------------------------------------------------------------------------------------------
# The audit of a finished run directory against the simulator's counters


@dataclass
class Audit:
    prompts: int = 0
    answered: int = 0
    failed: int = 0
    skipped: int = 0
    duplicates: int = 0
    token_entries: int = 0
    token_missing: int = 0
    token_extra: int = 0
    token_duplicates: int = 0
    sampled: int = 0
    sample_mismatch: int = 0
    recorded_usd: float = 0.0
    billed_usd: float = 0.0
    served_unwritten: int = 0      # answers the simulator billed that no responses.jsonl line holds
    served_unwritten_usd: float = 0.0
    problems: list[str] = field(default_factory=list)


def _own_reason(kind: str) -> bool:
    """A failure kind that may be the prompt's own (classify.py); an outage, the dataset's settings or the
    account never fail a prompt."""
    try:
        k = ErrorKind(kind)
    except ValueError:
        return False
    return WHOSE.get(k) is Whose.PROMPT or k in ANSWER_KINDS


def audit(config: Config, stats: SimStats, *, tokens: bool = True, sample: int = 50, seed: int = 0,
          budgeted: tuple[str, ...] = ()) -> Audit:
    """Check a run directory after the last run (see the module docstring); `problems` lists what failed.
    `budgeted`: datasets allowed to skip prompts because their token budget ran out."""
    a = Audit()
    rd = RunDir(config.run_dir)
    rng = random.Random(seed)
    recorded_by_key: dict[str, float] = {}
    written_by_key: collections.Counter[str] = collections.Counter()
    prompt_keys: set[str] = set()
    samples: list[dict[str, Any]] = []
    for ds in config.datasets:
        prompts = {p.id: p for p in read_prompts(ds.prompts) if isinstance(p, Prompt)}
        recs, torn_r = whole_lines(rd.responses(ds.name))
        fails, torn_f = whole_lines(rd.failures(ds.name))
        if torn_r or torn_f:
            a.problems.append(f"{ds.name}: a half-written last line after a clean finish")
        answered = _audit_outcomes(a, ds, prompts, recs, fails, budgeted)
        for p in prompts.values():
            prompt_keys.add(prompt_key(p.messages))
        for r in recs:
            k = prompt_key(r["messages"])
            written_by_key[k] += 1
            cost = float((r.get("usage") or {}).get("cost") or 0.0)
            recorded_by_key[k] = recorded_by_key.get(k, 0.0) + cost
            a.recorded_usd += cost
        if tokens:
            samples += _audit_token_files(a, TokenReader(rd.tokens(ds.name)), recs, answered, rng, sample)
    if tokens:
        _audit_samples(a, config, samples)
    _audit_spend(a, stats, prompt_keys, written_by_key, recorded_by_key)
    return a


def _audit_outcomes(a: Audit, ds: DatasetConfig, prompts: dict[str, Prompt], recs: list[dict[str, Any]],
                    fails: list[dict[str, Any]], budgeted: tuple[str, ...]) -> set[str]:
    """Each prompt answered or failed once (skipped only where its token budget ran out), each failure
    with a reason of the prompt's own; the ids answered."""
    answered = [str(r["id"]) for r in recs]
    failed = [str(r["id"]) for r in fails]
    dup = len(answered) - len(set(answered)) + len(failed) - len(set(failed)) + len(set(answered) & set(failed))
    a.duplicates += dup
    if dup:
        a.problems.append(f"{ds.name}: {dup} prompt id(s) written twice")
    unknown = (set(answered) | set(failed)) - set(prompts)
    if unknown:
        a.problems.append(f"{ds.name}: {len(unknown)} id(s) on disk that no prompt has, e.g. {sorted(unknown)[:3]}")
    skipped = set(prompts) - set(answered) - set(failed)
    a.prompts += len(prompts)
    a.answered += len(set(answered))
    a.failed += len(set(failed))
    a.skipped += len(skipped)
    if skipped:
        used = sum(int((r.get("usage") or {}).get("completion_tokens") or 0) for r in recs)
        limit = ds.token_budget
        if ds.name not in budgeted or limit is None or used <= limit - ds.max_tokens:
            a.problems.append(f"{ds.name}: {len(skipped)} prompt(s) neither answered nor failed, and no "
                              f"budget ran out (used {used:,} of {limit}), e.g. {sorted(skipped)[:3]}")
    for f in fails:
        if not f.get("error_kind") or not f.get("message") or not f.get("attempts"):
            a.problems.append(f"{ds.name}: failure line without a reason: {str(f)[:200]}")
            break
        if not _own_reason(str(f["error_kind"])):
            a.problems.append(f"{ds.name}: prompt {f.get('id')} failed for a cause not its own: "
                              f"{f['error_kind']} ({str(f.get('message'))[:120]})")
            break
    return set(answered)


def _audit_token_files(a: Audit, reader: TokenReader, recs: list[dict[str, Any]], answered: set[str],
                       rng: random.Random, sample: int) -> list[dict[str, Any]]:
    """One token entry per answer (counted into `a`); up to `sample` answers picked to re-reconstruct."""
    counts = collections.Counter(e.id for e in reader.entries)
    a.token_entries += len(reader.entries)
    a.token_duplicates += sum(n - 1 for n in counts.values() if n > 1)
    a.token_missing += sum(1 for i in answered if counts.get(i, 0) == 0)
    a.token_extra += sum(1 for i in counts if i not in answered)
    by_id = {str(r["id"]): r for r in recs}
    picked = rng.sample(sorted(answered & set(counts)), min(sample, len(answered & set(counts))))
    return [{"reader": reader, "rec": by_id[i]} for i in picked]


def _audit_samples(a: Audit, config: Config, samples: list[dict[str, Any]]) -> None:
    """The token files agree with the answers, and the sampled answers re-reconstruct to the same ids."""
    if a.token_missing or a.token_extra or a.token_duplicates:
        a.problems.append(f"token files disagree with the answers: {a.token_missing} answer(s) without tokens, "
                          f"{a.token_extra} token entr(y/ies) without an answer, {a.token_duplicates} twice")
    tok = bundled_kimi()
    template = load_template(config.tokenizer.template, tok)
    for s in samples:
        rec, reader = s["rec"], s["reader"]
        want = reconstruct_record(tok, template, rec)
        ids, mask = reader.arrays(reader.entry(str(rec["id"])))
        a.sampled += 1
        if ids.tolist() != want.input_ids.tolist() or mask.tolist() != want.loss_mask.tolist():
            a.sample_mismatch += 1
    if a.sample_mismatch:
        a.problems.append(f"{a.sample_mismatch} of {a.sampled} sampled answers re-reconstruct differently")


def _audit_spend(a: Audit, stats: SimStats, prompt_keys: set[str], written_by_key: collections.Counter[str],
                 recorded_by_key: dict[str, float]) -> None:
    """Every prompt's billing is its written answer's cost, plus answers served and never written."""
    a.billed_usd = stats.billed_usd
    strangers = set(stats.prompt_answers) - prompt_keys
    if strangers:
        a.problems.append(f"the simulator served {len(strangers)} prompt(s) this run does not have")
    for k in prompt_keys | set(stats.prompt_answers):
        served, billed = stats.prompt_answers.get(k, 0), stats.prompt_cost.get(k, 0.0)
        written, recorded = written_by_key.get(k, 0), recorded_by_key.get(k, 0.0)
        if written > served:
            a.problems.append(f"prompt {k[:10]}: {written} answer(s) written, {served} served")
        elif written == served and abs(billed - recorded) > EPS_USD:
            a.problems.append(f"prompt {k[:10]}: recorded ${recorded:.8f}, billed ${billed:.8f}")
        elif written < served:
            a.served_unwritten += served - written
            a.served_unwritten_usd += billed - recorded
            if billed - recorded <= 0:
                a.problems.append(f"prompt {k[:10]}: {served - written} unwritten answer(s) billed nothing")
    if a.recorded_usd > a.billed_usd + EPS_USD:
        a.problems.append(f"recorded ${a.recorded_usd:.6f} is more than billed ${a.billed_usd:.6f}")
    if abs((a.billed_usd - a.recorded_usd) - a.served_unwritten_usd) > 1e-6:
        a.problems.append(f"billed - recorded = ${a.billed_usd - a.recorded_usd:.6f}, but unwritten answers cost "
                          f"${a.served_unwritten_usd:.6f}")


# ---------------------------------------------------------------------------------------------
# Processes


def session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (a run started with start_new_session: its workers included)."""
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out


async def reap_session(sid: int, grace_s: float) -> int:
    """Wait up to `grace_s` for the session to empty; kill and count what is still there."""
    deadline = time.monotonic() + grace_s
    left = session_pids(sid)
    while left and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        left = session_pids(sid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(left)


@dataclass
class Step:
    how: str                     # "SIGKILL", "SIGTERM", "SIGHUP", "storm", "final"
    phase: str = ""              # where a kill landed: "start-up" or "running"
    returncode: int | None = None
    answers: int = 0             # answers written during this process
    unwritten: int = 0           # answers served during it (billed, not a fault) and never written
    faulted: int = 0             # generations billed for faults no client could read (BILLED_FAULTS)
    in_flight_bound: int = 0     # what it could have had in flight
    orphans: int = 0
    lost: int = 0
    duplicates: int = 0
    tokens_in_step: bool | None = None
    drained: bool | None = None
    finished_early: bool = False
    seconds: float = 0.0


@dataclass
class StormReport:
    seconds: float
    configured: int
    before: int
    lowest: int
    highest_during: int
    recovered_to: int
    recovery_s: float | None         # from the end of the storm to the configured limit
    first_req_s: float               # requests/s the simulator got in the storm's first 10 s
    last_req_s: float                # ... and in its last 10 s
    limits: list[tuple[float, int, int]] = field(default_factory=list)


@dataclass
class SoakOptions:
    kills: int = 40
    prompts: int = 24000
    faults: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_FAULTS))
    scenarios: dict[str, dict[str, Any]] = field(default_factory=lambda: {k: dict(v) for k, v in
                                                                          DEFAULT_SCENARIOS.items()})
    storm_s: float = 60.0
    concurrency: int = 48
    workers: int = 1
    max_attempts: int = 4
    seed: int = 1
    latency_scale: float = 0.02
    running_window_s: float = 4.0    # a kill lands up to this long after the run answers again
    startup_share: float = 0.25      # share of kills aimed at start-up instead
    budget: bool = True
    sample: int = 100                # answers re-reconstructed per dataset
    final_timeout_s: float = 900.0


@dataclass
class SoakReport:
    options: SoakOptions
    steps: list[Step]
    faults: dict[str, int]
    audit: Audit
    storm: StormReport | None
    torn_lines: int
    sim_requests: int
    seconds: float
    problems: list[str]
    scenarios: dict[str, int] = field(default_factory=dict)   # responses each table row sent

    @property
    def kills(self) -> int:
        return sum(1 for s in self.steps if s.how in ("SIGKILL", "storm") and not s.finished_early)

    @property
    def lost(self) -> int:
        return sum(s.lost for s in self.steps)

    @property
    def duplicates(self) -> int:
        return sum(s.duplicates for s in self.steps) + self.audit.duplicates

    @property
    def orphans(self) -> int:
        return sum(s.orphans for s in self.steps)

    def table(self) -> str:
        a = self.audit
        drains = [s for s in self.steps if s.how in ("SIGTERM", "SIGHUP")]
        phases = collections.Counter(s.phase if s.how == "SIGKILL" else "storm" for s in self.steps
                                     if s.how in ("SIGKILL", "storm") and not s.finished_early)
        rows = [
            ("kills survived (SIGKILL)", f"{self.kills} ({phases.get('start-up', 0)} in start-up, "
                                          f"{phases.get('running', 0)} while answering, "
                                          f"{phases.get('storm', 0)} after the 429 storm)"),
            ("drains (SIGTERM/SIGHUP to the group)",
             ", ".join(f"{s.how}: exit {s.returncode}, {'drained' if s.drained else 'NOT drained'}, tokens "
                       f"{'in step' if s.tokens_in_step else 'NOT in step'}" for s in drains) or "none"),
            ("processes left behind", f"{self.orphans}  (must be 0)"),
            ("half-written lines cut on restart", f"{self.torn_lines}"),
            ("records lost", f"{self.lost}  (must be 0)"),
            ("duplicates", f"{self.duplicates}  (must be 0)"),
            ("prompts", f"{a.prompts:,}: {a.answered:,} answered, {a.failed:,} failed, {a.skipped:,} skipped "
                        "(budget)"),
            ("simulator requests", f"{self.sim_requests:,}"),
            ("faults injected", ", ".join(f"{k} {self.faults.get(k, 0):,}" for k in (*FAULT_KINDS, "max_in_flight")
                                          if self.faults.get(k))),
            ("table rows sent", ", ".join(f"{k} {n:,}" for k, n in sorted(self.scenarios.items())) or "none"),
            ("token entries", f"{a.token_entries:,}: {a.token_missing} missing, {a.token_extra} extra, "
                              f"{a.token_duplicates} twice; {a.sampled} re-reconstructed, {a.sample_mismatch} differ"),
            ("spend recorded / billed", f"${a.recorded_usd:.6f} / ${a.billed_usd:.6f}"),
            ("billed, never written", f"${a.served_unwritten_usd:.6f} for {a.served_unwritten} answer(s) served at "
                                      f"kills (bound: {sum(s.in_flight_bound for s in self.steps if s.how != 'final')} "
                                      "in flight)"),
        ]
        if self.storm is not None:
            st = self.storm
            rows.append((f"429 storm ({st.seconds:.0f} s)",
                         f"limit {st.before}/{st.configured} before, lowest {st.lowest} during, back to "
                         f"{st.recovered_to} " + (f"{st.recovery_s:.0f} s after" if st.recovery_s is not None
                                                  else "(not recovered)")
                         + f"; load {st.first_req_s:.0f} requests/s at its start, {st.last_req_s:.0f} at its end"))
        rows.append(("wall time", f"{self.seconds:.0f} s"))
        rows.append(("result", "PASS" if not self.problems else "FAIL"))
        width = max(len(r[0]) for r in rows)
        out = [f"{k:<{width}}  {v}" for k, v in rows]
        out += [f"  problem: {p}" for p in self.problems]
        return "\n".join(out)


class Soak:
    def __init__(self, options: SoakOptions, root: Path, *, log: TextIO | None = None) -> None:
        self.o = options
        self.root = Path(root)
        self.log = log
        self.rng = random.Random(options.seed)
        self.steps: list[Step] = []
        self.acknowledged: set[tuple[str, str, str]] = set()
        self.torn = 0
        self.problems: list[str] = []
        self.storm: StormReport | None = None
        self.env = {**os.environ, KEY_ENV: SOAK_KEY}
        self._n = 0

    def say(self, text: str) -> None:
        if self.log is not None:
            print(text, file=self.log, flush=True)

    async def run(self) -> SoakReport:
        o = self.o
        t0 = time.monotonic()
        sim_cfg = SimConfig(seed=o.seed, latency_scale=o.latency_scale, mean_completion_tokens=MEAN_TOKENS,
                            faults=o.faults, retry_after_s=0.05, hang_s=120.0, scenarios=o.scenarios)
        async with SimServer(sim_cfg, port=0) as sim:
            self.sim = sim
            self.config_path = write_config(self.root, sim.base_url, prompts=o.prompts, concurrency=o.concurrency,
                                            workers=o.workers, max_attempts=o.max_attempts, budget=o.budget)
            self.config = load_config(self.config_path)
            plan = ["SIGKILL"] * o.kills
            if o.kills >= 2:
                plan.insert(o.kills // 3, "SIGTERM")
                plan.insert(2 * o.kills // 3 + 1, "SIGHUP")
            else:
                plan += ["SIGTERM", "SIGHUP"]
            if o.storm_s > 0:
                plan.insert(min(len(plan), 4), "storm")  # early: the first dataset still has work
            for how in plan:
                step = await self._step(how)
                self.steps.append(step)
                self.say(f"  {how:<7} {step.phase:<9} exit {step.returncode} after {step.seconds:4.1f} s: "
                         f"{step.answers} answers written, {step.unwritten} served unwritten, "
                         f"{step.orphans} left behind")
                if step.finished_early:
                    break
            final = await self._step("final")
            self.steps.append(final)
            if final.returncode != 0:
                self.problems.append(f"the last run exited {final.returncode}")
            await self._tokens_command()
            stats = sim.stats
        a = await asyncio.to_thread(audit, self.config, stats, sample=o.sample, seed=o.seed,
                                    budgeted=("b",) if o.budget else ())
        bound = sum(s.in_flight_bound for s in self.steps if s.how != "final")
        faulted = sum(s.faulted for s in self.steps)
        if a.served_unwritten - faulted > bound:
            self.problems.append(f"{a.served_unwritten - faulted} answers served and never written, more than the "
                                 f"{bound} that could be in flight at the kills")
        measured = sum(s.unwritten for s in self.steps)
        if measured + faulted != a.served_unwritten:
            self.problems.append(f"served-unwritten per process add up to {measured} (+{faulted} billed faults), "
                                 f"the audit counts {a.served_unwritten}")
        return SoakReport(o, self.steps, dict(stats.faults), a, self.storm, self.torn,
                          stats.requests_total, time.monotonic() - t0, self.problems + a.problems,
                          dict(stats.scenarios))

    # -- one process ----------------------------------------------------------------------------

    async def _start(self) -> tuple[asyncio.subprocess.Process, Path]:
        self._n += 1
        log_path = self.root / f"run-{self._n:03d}.log"
        with open(log_path, "wb") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "draftgen.cli.main", "run", str(self.config_path), "--headless", "--skip-smoke",
                "--interval", "0.5", env=self.env, stdout=log, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True)
        return proc, log_path

    async def _wait(self, proc: asyncio.subprocess.Process, timeout: float) -> int | None:
        try:
            return await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            return None

    async def _settle_sim(self) -> None:
        # Handlers of a dead client are cancelled when its sockets close, and the generations it
        # left run on to their bill (docs/openrouter.md, "Billing"); give them a moment.
        deadline = time.monotonic() + 30.0
        while (self.sim.stats.in_flight or self.sim.stats.generations_running) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _billed_unreadable(self) -> tuple[int, int]:
        """(generations billed, of them faults no client could read: drop, hang, truncated)."""
        st = self.sim.stats
        return st.generations_billed, sum(st.faults.get(k, 0) for k in BILLED_FAULTS)

    def _in_flight_bound(self) -> int:
        return sum(d.concurrency for d in self.config.datasets)

    async def _step(self, how: str) -> Step:
        step = Step(how)
        disk0 = read_disk(self.config)
        billed0, faulted0 = self._billed_unreadable()
        served0 = self.sim.stats.answers_total
        t0 = time.monotonic()
        if how == "storm":
            storm_config(self.config_path, self.o, on=True)
            # No background 429s in this run: the limit starts at the configured value and must get back there.
            self.sim.update(faults={k: v for k, v in self.o.faults.items() if k != "429"})
        proc, log_path = await self._start()
        if how == "final":
            await self._to_the_end(step, proc)
        elif how == "SIGKILL":
            await self._kill(step, proc, served0)
        elif how in ("SIGTERM", "SIGHUP"):
            await self._drain_by_signal(step, proc, log_path, served0)
        elif how == "storm":
            await self._storm(step, proc, log_path)
        step.seconds = time.monotonic() - t0
        step.orphans = await reap_session(proc.pid, 3.0)
        if step.orphans:
            self.problems.append(f"{how}: {step.orphans} process(es) of the run still alive 3 s after it ended")
        await self._settle_sim()
        self._check_disk(step, disk0)
        billed, faulted = self._billed_unreadable()
        step.faulted = faulted - faulted0
        step.unwritten = (billed - billed0) - step.faulted - step.answers
        if how != "SIGKILL" and how != "storm" and step.unwritten:
            self.problems.append(f"{how}: {step.unwritten} answer(s) served and not written without a kill")
        if how in ("SIGTERM", "SIGHUP", "final") and not step.finished_early:
            step.tokens_in_step = self._tokens_in_step()
            if not step.tokens_in_step:
                self.problems.append(f"{how}: after a clean exit the token files do not match the answers")
        if step.finished_early and step.returncode != 0:
            self.problems.append(f"{how}: the run exited {step.returncode} by itself: "
                                 f"{log_path.read_bytes()[-600:].decode(errors='replace')}")
        return step

    async def _to_the_end(self, step: Step, proc: asyncio.subprocess.Process) -> None:
        """The last run: left to finish on its own (killed past final_timeout_s)."""
        step.returncode = await self._wait(proc, self.o.final_timeout_s)
        if step.returncode is None:
            self.problems.append(f"the last run did not finish within {self.o.final_timeout_s:.0f} s")
            os.killpg(proc.pid, signal.SIGKILL)
            step.returncode = await proc.wait()

    async def _kill(self, step: Step, proc: asyncio.subprocess.Process, served0: int) -> None:
        """SIGKILL at a random moment: during start-up (startup_share of the kills) or while answering."""
        if self.rng.random() < self.o.startup_share:
            step.phase = "start-up"
            await asyncio.sleep(self.rng.uniform(0.0, 2.0))
        else:
            step.phase = "running"
            if await until_answering(self.sim, proc, served0, 60.0):
                await asyncio.sleep(self.rng.uniform(0.0, self.o.running_window_s))
        if proc.returncode is None:
            step.in_flight_bound = self._in_flight_bound()
            proc.send_signal(signal.SIGKILL)  # the main process only, as `kill -9 PID` does
        else:
            step.finished_early = True
        step.returncode = await proc.wait()

    async def _drain_by_signal(self, step: Step, proc: asyncio.subprocess.Process, log_path: Path,
                               served0: int) -> None:
        """SIGTERM or SIGHUP while answering: the run must drain and exit 0 or 3 within 60 s."""
        how = step.how
        step.phase = "running"
        await until_answering(self.sim, proc, served0, 60.0)
        await asyncio.sleep(self.rng.uniform(0.0, 1.0))
        if proc.returncode is not None:
            step.finished_early = True
            step.returncode = proc.returncode
            return
        # The whole process group, as a closing terminal or `kill -TERM -PGID` does.
        os.killpg(proc.pid, getattr(signal, how))
        step.returncode = await self._wait(proc, 60.0)
        if step.returncode is None:
            self.problems.append(f"{how}: the run did not exit within 60 s of the signal")
            os.killpg(proc.pid, signal.SIGKILL)
            step.returncode = await proc.wait()
        text = log_path.read_bytes()
        # A drain exits 0 when nothing was left to ask, 3 (incomplete) when prompts were left.
        step.drained = (step.returncode in (EXIT_COMPLETE, EXIT_INCOMPLETE)
                        and f"{how}: draining".encode() in text)
        if not step.drained:
            self.problems.append(f"{how}: exit {step.returncode}, not a clean drain: "
                                 f"{text[-600:].decode(errors='replace')}")

    async def _storm(self, step: Step, proc: asyncio.subprocess.Process, log_path: Path) -> None:
        """A 429 storm while answering (storm.py), then SIGKILL; the faults are put back after it."""
        step.phase = "running"
        try:
            self.storm = await run_storm(self.sim, proc, log_path, self.o, self.say, self.problems)
        finally:
            storm_config(self.config_path, self.o, on=False)
            self.sim.update(faults=self.o.faults, retry_after_s=0.05)
        step.in_flight_bound = self._in_flight_bound()
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        else:
            step.finished_early = True
        step.returncode = await proc.wait()

    def _check_disk(self, step: Step, disk0: DiskState) -> None:
        """No acknowledged record lost, no id twice; the answers this step wrote."""
        how = step.how
        disk = read_disk(self.config)
        self.torn += disk.torn
        now = disk.ids()
        lost = self.acknowledged - now
        step.lost = len(lost)
        if lost:
            self.problems.append(f"{how}: {len(lost)} acknowledged record(s) gone, e.g. {sorted(lost)[:3]}")
        self.acknowledged |= now
        step.duplicates = disk.duplicates()
        if step.duplicates:
            self.problems.append(f"{how}: {step.duplicates} id(s) on disk twice")
        step.answers = disk.written() - disk0.written()

    def _tokens_in_step(self) -> bool:
        rd = RunDir(self.config.run_dir)
        disk = read_disk(self.config)
        for ds in self.config.datasets:
            entries = [e.id for e in TokenReader(rd.tokens(ds.name)).entries]
            if sorted(entries) != sorted(disk.answered[ds.name]):
                return False
        return True

    async def _tokens_command(self) -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "draftgen.cli.main", "tokens", str(self.config_path), env=self.env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 300)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            self.problems.append("draftgen tokens did not finish within 300 s")
            return
        if proc.returncode != 0:
            self.problems.append(f"draftgen tokens exited {proc.returncode}: {out.decode(errors='replace')[-600:]}")


async def until_answering(sim: SimServer, proc: asyncio.subprocess.Process, served0: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while sim.stats.answers_total == served0 and proc.returncode is None:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return proc.returncode is None


def storm_config(path: Path, o: SoakOptions, *, on: bool) -> None:
    """The storm's run may retry for the whole storm (Retry-After spaces the retries)."""
    normal = (f"max_attempts = {o.max_attempts}", "backoff_max_s = 0.5")
    storm = (f"max_attempts = {int(o.storm_s) + 20}", "backoff_max_s = 2.0")
    old, new = (normal, storm) if on else (storm, normal)
    text = path.read_text()
    for a, b in zip(old, new):
        text = text.replace(a, b)
    path.write_text(text)

async def run_storm(sim: SimServer, proc: asyncio.subprocess.Process, log_path: Path, o: SoakOptions,
                    say: Callable[[str], None], problems: list[str]) -> StormReport:
    """A 429 storm of storm_s seconds on a live run. The limit is read from the run's own status
    lines ("limit E/C": effective and configured, over the datasets running); the load from the
    simulator's request counter. What went wrong goes to `problems`."""
    served0 = sim.stats.answers_total
    await until_answering(sim, proc, served0, 60.0)
    await asyncio.sleep(3.0)
    t0 = time.monotonic()
    limits: list[tuple[float, int, int]] = []   # (seconds since the storm began, effective, configured)
    load: list[tuple[float, int]] = []          # (seconds, simulator requests so far)

    def sample() -> tuple[int, int] | None:
        load.append((time.monotonic() - t0, sim.stats.requests_total))
        found = _LIMIT.findall(log_path.read_bytes()[-4000:])
        if not found:
            return None
        effective, configured = (int(x.replace(b",", b"")) for x in found[-1])
        limits.append((round(time.monotonic() - t0, 2), effective, configured))
        return effective, configured

    before = sample() or (0, 0)
    sim.update(faults={"429": 1.0}, retry_after_s=1.0)
    say(f"  429 storm for {o.storm_s:.0f} s (limit {before[0]}/{before[1]} before)")
    while time.monotonic() - t0 < o.storm_s and proc.returncode is None:
        await asyncio.sleep(0.5)
        sample()
    sim.update(faults={k: v for k, v in o.faults.items() if k != "429"}, retry_after_s=0.05)
    end = time.monotonic() - t0
    recovered: float | None = None
    while proc.returncode is None and time.monotonic() - t0 - end < 180:
        await asyncio.sleep(0.5)
        now = sample()
        if now is not None and now[0] >= now[1]:
            recovered = time.monotonic() - t0 - end
            break
    during = [e for t, e, _ in limits if 0 < t <= end]
    window = min(10.0, end / 3)
    first = [r for t, r in load if t <= window]
    last = [r for t, r in load if end - window <= t <= end]
    storm = StormReport(
        o.storm_s, before[1], before[0], min(during, default=before[0]), max(during, default=before[0]),
        limits[-1][1] if limits else 0, recovered,
        (first[-1] - first[0]) / window if len(first) > 1 else 0.0,
        (last[-1] - last[0]) / window if len(last) > 1 else 0.0, limits)
    if not during or min(during) >= before[0]:
        problems.append(f"429 storm: the limit did not drop (before {before[0]}, during {during[:5]}...)")
    if storm.last_req_s >= storm.first_req_s:
        problems.append(f"429 storm: the load did not drop ({storm.first_req_s:.0f} requests/s in its "
                             f"first {window:.0f} s, {storm.last_req_s:.0f} in its last)")
    if recovered is None:
        problems.append("429 storm: the limit did not climb back to the configured value within 180 s")
    return storm


async def soak(options: SoakOptions, root: Path, *, log: TextIO | None = None) -> SoakReport:
    """Run the whole soak in `root` (an empty folder) and return its report."""
    return await Soak(options, root, log=log).run()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=40, help="SIGKILLs (default 40)")
    p.add_argument("--prompts", type=int, default=24000, help="prompts in all, over two datasets (default 24000)")
    p.add_argument("--faults", default=",".join(f"{k}={v:g}" for k, v in DEFAULT_FAULTS.items()),
                   help="simulator fault rates, KIND=RATE,... (default: every kind, ~35%% in all)")
    p.add_argument("--scenarios", default=",".join(
        name + "".join(f":{k}={v:g}" for k, v in params.items()) for name, params in DEFAULT_SCENARIOS.items()),
        help="rows of OpenRouter's table mixed in, NAME:KEY=VALUE,... ('' for none)")
    p.add_argument("--storm", type=float, default=60.0, help="seconds of 429 storm in one run (0: none)")
    p.add_argument("--concurrency", type=int, default=48, help="concurrency of the first dataset (default 48)")
    p.add_argument("--workers", type=int, default=1, help="reconstruction worker processes (default 1)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-budget", action="store_true", help="no token budget on the second dataset")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed unless it fails)")
    args = p.parse_args(argv)
    options = SoakOptions(kills=args.kills, prompts=args.prompts, faults=parse_faults(args.faults),
                          scenarios=parse_scenarios(args.scenarios),
                          storm_s=args.storm, concurrency=args.concurrency, workers=args.workers, seed=args.seed,
                          budget=not args.no_budget)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="draftgen-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"soak in {root}: {options.kills} SIGKILLs, SIGTERM and SIGHUP once each, {options.prompts} prompts, "
          f"faults {', '.join(f'{k}={v:g}' for k, v in options.faults.items()) or 'none'}"
          + (f", a {options.storm_s:.0f} s 429 storm" if options.storm_s else ""), flush=True)
    report = asyncio.run(soak(options, root, log=sys.stdout))
    print(report.table())
    if not report.problems and not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if not report.problems else 1


if __name__ == "__main__":
    sys.exit(main())
