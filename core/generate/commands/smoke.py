"""`draftgen smoke CONFIG`: check everything a run depends on with one request per request shape.

The checklist (each row pass/fail with its reason):
- key: GET /key answers (the key is valid); for an openai-compatible server (`[api] kind`, or GET /key
  404) this row, balance, provider and usage's cost say "n/a (self-hosted)" and pass;
- prices: the worst-case prices each dataset's routing allows (the endpoints listing or the config);
- balance: the live balance (account.py) against the projected cost of the run (and `max_usd`, the
  floor); an unknown balance (an ordinary key without a cap) is a warning, not a failure;
- per distinct dataset request shape (the exact body the run sends, the smoke prompt as message):
  the request answers; content; reasoning present where the request asks for it (and which field
  carried it); tool calls; the model that answered; usage with cost; the provider is not one the
  routing ignores; finish_reason; the answer reconstructed with the target tokenizer and validated
  (its count judged by the sample policy, core/tokens/policy.py: a provider whose count is off by more
  than a BPE split is named, with the `ignore` line to add); the prompt's token count against
  `usage.prompt_tokens` (a mismatch says which `[tokenizer] default_system` would match the provider);
  the cost of the request;
- turn 2 (a dataset that asks every turn of its conversations, `turns = "all"`): a second request of
  the shape, its first answer sent back as history the way the API documents (`FOLLOW_UP` as the next
  user turn), paid for like the first; its prompt tokens against the history rendered with the
  template's history rule: the per-turn prompt check, before a run conditions every later turn on it;
- agent steps (a `turns = "all"` dataset with agent lines): a small tool loop of the shape, its tools
  accepted, the call ids' shape, the tool history accepted, each step's prompt tokens (smoke_agent.py);
- stream (a self-hosted server): the same request streamed and not, before the shape requests
  (stream_check.py): the mode that keeps the text as generated is noted for them and, with `[api]
  stream` unset, recorded in smoke.json for `run`; set to the mode that rewrites text, the row fails
  with the fix, and a tokens row that counts off names the server's parser, not the template.
`smoke.json` keeps the result with the run's request fingerprint: `run` starts at full concurrency
only when the fingerprint matches a passing smoke test.

The smoke requests are paid for like a run's: reserved against `max_usd` at the worst case of the body
sent, on spend.jsonl before they leave, booked as they end (billing.py), in the ledger's "(smoke)"
dataset. An outage answer (429, 5xx, 408, no connection: classify.py) is retried with the run's
backoff, honouring Retry-After, up to `SMOKE_TRIES` tries within `SMOKE_RETRY_S`; each retry is a
request of its own on the ledger, with its own reservation. Each smoke request is a run's `Request`
(loop/request.py), asked by the same attempts on the smoke test's terms (loop/smoke_request.py).

Here are the checklist's flow (`run_smoke`: `_SmokeTest`'s steps in order) and its requests; the rows
are built beside it: smoke_local.py (the prompt files), smoke_account.py (key, prices, balance and the
projection's figures), smoke_answer.py (each answer, turn 2, the stream row), smoke_agent.py (the
agent steps); smoke_result.py holds the result smoke.json keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import time
from collections.abc import Callable
from typing import Any

from draftgen.core import runtime
from draftgen.core.bodies import ChatBody
from draftgen.core.config import Config
from draftgen.core.config_tables import DatasetConfig
from draftgen.core.errors import DiskError, DraftgenError, LedgerBusyError
from draftgen.core.files import write_json_atomic
from draftgen.core.generate.api.account import AccountStatus
from draftgen.core.generate.api.answer import ChatAnswer
from draftgen.core.generate.api.client import ChatClient
from draftgen.core.generate.api.fleet import answers_differ, server_name
from draftgen.core.generate.api.preflight import ask_release
from draftgen.core.generate.api.prices import fetch_prices
from draftgen.core.generate.commands.precheck import check_tokenizer
from draftgen.core.generate.commands.smoke_account import (
    SMOKE_RETRY_S,
    SMOKE_TRIES,
    KeyCheck,
    balance_row,
    dataset_figures,
    price_rows,
)
from draftgen.core.generate.commands.smoke_answer import Reconstruct, mode_row, shape_rows, turn_two_body, turn_two_rows
from draftgen.core.generate.commands.smoke_local import count_turns, scan_prompts, special_text_rows
from draftgen.core.generate.commands.smoke_result import SmokeResult, print_result
from draftgen.core.generate.commands.smoke_rows import Asked, SmokeRow, smoke_body
from draftgen.core.generate.commands.stream_check import SAMPLED_SEEDS, SAMPLED_TEMPERATURE, has_text, stream_pair
from draftgen.core.generate.loop.prompt_files import read_stoppable
from draftgen.core.generate.loop.prompts import Prompt
from draftgen.core.generate.loop.request import Request
from draftgen.core.generate.loop.smoke_record import last_smoke
from draftgen.core.generate.loop.smoke_request import SmokeLedger, SmokeTerms, SmokeWindow
from draftgen.core.generate.money.forecast import SmokeFigures, forecast
from draftgen.core.generate.money.settle import Settler
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.live import snapshot as snap
from draftgen.core.records import ResponseRecord, stored_responses
from draftgen.core.rundir import RunDir
from draftgen.core.secrets import Redactor


def _on_disk(rd: RunDir, ds: DatasetConfig) -> tuple[int, int, float]:
    """(answers, completion tokens, cost) already in the dataset's responses.jsonl."""
    answers = tokens = 0
    cost = 0.0
    for _, raw in stored_responses(rd.responses(ds.name)):
        usage = ResponseRecord.from_dict(raw).usage
        answers += 1
        tokens += usage.completion_tokens
        cost += usage.cost
    return answers, tokens, cost


class _SmokeTest:
    """One smoke test's state, and its steps in the order `run_smoke` takes them."""

    def __init__(self, config: Config, api_key: str, progress: Callable[[snap.StageProgress], None] | None,
                 spend: SpendLedger | None, settler: Settler | None, *, rundir: RunDir | None = None,
                 redact: Redactor | None = None) -> None:
        self.config = config
        self.api_key = api_key
        self.progress = progress
        self.spend = spend
        self.own_spend = spend is None
        self.settler = settler
        self.redact = redact or Redactor(api_key, config.api.management_key())
        self.result = SmokeResult(fingerprint="")
        self.shapes: dict[str, DatasetConfig] = {}
        self.reconstruct = Reconstruct(config, self.add)
        self.local_error = ""
        self.ledger_error = ""
        self.counts: dict[str, int] = {}   # requests each dataset sends: its prompts, or turns (turns = "all")
        self.history: dict[str, float] = {}  # turns = "all": mean earlier answers a request carries
        self.sent: list[bool] = []  # a request left: the smoke test ran (a passing smoke.json is replaced)
        self.account: AccountStatus | None = None
        self.unreachable = False  # the address does not answer: advice is about the network, not the config
        self.rng = random.Random()
        self.deadline = 0.0
        self.prices: dict[str, Any] = {}
        self.rd = rundir or RunDir(config.run_dir)
        self.on_disk: dict[str, tuple[int, int, float]] = {}
        self.stream_row: SmokeRow | None = None
        self.parser = ""  # the stream row's cause when the run's mode rewrites text (for the tokens rows)
        self.answers: list[Asked] = []
        self.turn_two: dict[str, Asked] = {}  # per shape of a multi-turn dataset: its second turn
        self.fleet_rows: list[SmokeRow] = []  # a fleet's servers after the first, each compared with it
        self.agents: set[str] = set()  # datasets with agent lines: their shapes' tool exchange (smoke_agent.py)
        self.agent: dict[str, tuple[DatasetConfig, list[Asked]]] = {}  # per such shape: its dataset, its steps
        self.spent = 0.0

    def add(self, row: SmokeRow) -> None:
        self.result.rows.append(SmokeRow(row.check, row.passed, self.redact(row.detail), row.warning))
        if self.progress is not None:
            self.progress(snap.StageProgress(
                "smoke", state=snap.StageState.RUNNING, done=len(self.result.rows),
                total=2 + len(self.config.datasets) + 9 * len(self.shapes) + 5 * len(self.agents),
                checks=tuple((r.check, r.passed, r.detail) for r in self.result.rows)))

    async def check_local(self) -> None:
        """The free checks first (precheck.py): nothing is paid for while a local input is unusable."""
        try:
            await asyncio.to_thread(check_tokenizer, self.config)
        except DraftgenError as e:
            self.reconstruct.failed(SmokeRow("tokenizer", False, str(e)))
            self.local_error = "not sent: the tokenizer could not be loaded (see the tokenizer row)"
        for ds in self.config.datasets:
            try:
                # A stop now cancels the smoke test: the count stops with it (read_stoppable).
                if ds.turns == "all":
                    self.counts[ds.name], self.history[ds.name], agent = await read_stoppable(
                        functools.partial(count_turns, ds))
                    if agent:
                        self.agents.add(ds.name)
                else:
                    self.counts[ds.name] = (await read_stoppable(functools.partial(scan_prompts, ds, ())))[0]
            except DraftgenError as e:
                self.add(SmokeRow(f"{ds.name}: prompts", False, str(e)))
                self.counts[ds.name] = 0
                self.local_error = self.local_error or \
                    f"not sent: {ds.name}'s prompt file cannot be used (see its prompts row)"

    async def check_key(self, client: ChatClient) -> None:
        key = KeyCheck(self.config, self.redact, self.rng)
        self.add(await key.row(client, self.deadline))
        self.account, self.unreachable = key.account, key.unreachable
        if key.account is not None:
            self.result.balance_usd = key.account.balance

    async def check_prices(self, client: ChatClient) -> None:
        """The request shapes (the kind's: an openai-compatible server gets no OpenRouter-only keys) and
        the worst-case price of each dataset's."""
        config = self.config
        self.result.fingerprint = config.run_fingerprint()
        for ds in config.datasets:
            self.shapes.setdefault(config.fingerprint(ds), ds)
        if warning := config.kind_warning():
            self.add(SmokeRow("request keys", True, warning, warning=True))
        self.prices, listing_error = await fetch_prices(client, config)
        for row in price_rows(config, self.prices, listing_error, self.unreachable):
            self.add(row)

    async def open_ledger(self) -> None:
        """The directory's spend ledger, unless a run's is open in this process (or the key is in doubt)."""
        rd = self.rd
        self.on_disk = {ds.name: await asyncio.to_thread(_on_disk, rd, ds) for ds in self.config.datasets}
        # Without GET /key the key is in doubt (its row says why), and a new ledger could not record
        # the key's usage before its first attempt (`draftgen ledger --unknown-from-key` needs it).
        self.ledger_error = "" if self.account is not None or not self.config.api.server.kind.has_account else \
            "not sent: GET /key failed (see the key row)"
        if self.spend is not None or self.ledger_error:
            return
        spend = self.spend = SpendLedger(rd.spend)
        opening = asyncio.ensure_future(asyncio.to_thread(
            _open_spend, spend, rd, self.on_disk, None if self.account is None else self.account.key_usage))
        try:
            await asyncio.shield(opening)
        except asyncio.CancelledError:  # quit while the thread opens it: close it (and its lock) once open
            with contextlib.suppress(Exception):
                await opening
            spend.close()
            raise
        except LedgerBusyError as e:
            self.ledger_error = f"not sent: {e}"
        except (DiskError, OSError) as e:
            self.ledger_error = f"not sent: the spend ledger cannot be written ({e})"

    async def ask(self, client: ChatClient, fp: str, ds: DatasetConfig, body: ChatBody | None = None) -> Asked:
        """One smoke request of `ds`'s shape (or `body`), reserved, on the ledger, retried on an outage."""
        config = self.config
        body = smoke_body(config, ds) if body is None else body
        fail = functools.partial(SmokeRow, f"{ds.name}: request", False)
        if self.local_error or self.ledger_error:
            return fp, body, fail(self.local_error or self.ledger_error), 0.0
        if self.prices[ds.name] is None and config.budget.max_usd is not None:
            return fp, body, fail("not sent: max_usd is set and no price is known (see the prices row)"), 0.0
        outcome, took = await self._try(client, ds, body)
        return fp, body, outcome, took

    async def _try(self, client: ChatClient, ds: DatasetConfig, body: ChatBody) -> tuple[ChatAnswer | SmokeRow,
                                                                                                float]:
        """The request asked as a run's is (request.py `Request.attempts`) and its outcome booked on the
        smoke test's terms (smoke_request.py): the answer and its seconds, or the row that fails the request."""
        spend = self.spend
        assert spend is not None
        terms = SmokeTerms(self.config, client, SmokeLedger(SMOKE, spend, self.settler, self.prices, self.sent),
                           SmokeWindow(SMOKE_TRIES, self.deadline, self.rng), ds)
        req = Request(terms, Prompt(f"smoke:{ds.name}", body.get("messages") or [], 0), body=body)
        fail = functools.partial(SmokeRow, f"{ds.name}: request", False)
        try:
            await terms.book(req, await req.attempts())
        except Exception as e:  # noqa: BLE001 - any failure is this row's failure (the attempt is booked abandoned)
            return fail(f"{type(e).__name__}: {e}"), 0.0
        result = terms.result
        return (result, terms.took) if isinstance(result, ChatAnswer) else (fail(result), 0.0)

    async def ask_shapes(self, client: ChatClient) -> None:
        """The comparison (self-hosted) first, then one request per shape, all at once: a run's shapes
        differ only in their parameters."""
        try:
            if self.config.api.server.kind.smoke_decides_stream and self.shapes and not self.ledger_error:
                await _compare_modes(self, client)
            self.answers = await asyncio.gather(*(self.ask(client, fp, ds) for fp, ds in self.shapes.items()))
            await self.ask_turn_two(client)
            await self.ask_fleet(client)
            if self.agents:
                from draftgen.core.generate.commands.smoke_agent import ask_agent
                self.agent = await ask_agent(self, client, self.agents)
            # The ledger is the spend (the smoke requests and abandoned attempts included).
            spend = self.spend
            self.spent = spend.spent_usd if spend is not None and spend.is_open else \
                await asyncio.to_thread(_spent_on_disk, self.rd, self.on_disk)
        finally:
            if self.own_spend and self.spend is not None:
                self.spend.close()

    async def ask_fleet(self, first_client: ChatClient) -> None:
        """A fleet ([api] base_url a list; `first_client` is the first server's): every other server is asked
        the first shape's smoke request (on the ledger like the others) and which release it is; a server
        that answers otherwise than the first (model, prompt tokens or ids: the template, ids, release) is
        refused by name in its row."""
        servers = self.config.api.servers
        if not servers or not self.answers or self.local_error or self.ledger_error:
            return  # nothing was sent to the first server either: its rows say why
        fp, body, first, _ = self.answers[0]
        if not isinstance(first, ChatAnswer):
            self.fleet_rows.append(SmokeRow("servers", False, f"not compared: the first server, "
                                            f"{server_name(servers[0])}, did not answer (see the request row)"))
            return
        ids = self.config.api.return_token_ids
        first_release = (await ask_release(first_client))[1] if ids else None
        for url in servers[1:]:
            name = server_name(url)
            async with _client(self.config, url, self.api_key, self.redact) as client:
                release = (await ask_release(client))[1] if ids else None
                _, _, answer, took = await self.ask(client, fp, self.shapes[fp], body)
            if isinstance(answer, SmokeRow):
                self.fleet_rows.append(SmokeRow(f"server {name}", False, f"refused: {answer.detail}; fix the "
                                                "server or remove it from [api] base_url"))
                continue
            differ = answers_differ(first, answer)
            if ids and release != first_release:
                labels = [r.label if r is not None else "no release named" for r in (release, first_release)]
                differ.append(f"it is {labels[0]}, the first {labels[1]} (token ids are asked per release)")
            if differ:
                self.fleet_rows.append(SmokeRow(f"server {name}", False, f"refused: answers otherwise than "
                                                f"{server_name(servers[0])}: {'; '.join(differ)}; fix the "
                                                "server or remove it from [api] base_url"))
            else:
                self.fleet_rows.append(SmokeRow(f"server {name}", True, f"answers as {server_name(servers[0])} "
                                                f"in {took:.2f} s: model {answer.model!r}, "
                                                f"{answer.usage.prompt_tokens} prompt tokens, ids "
                                                f"{'returned' if answer.token_ids is not None else 'not returned'}"
                                                + (f", {release.label}" if release is not None else "")))

    async def ask_turn_two(self, client: ChatClient) -> None:
        """A second turn for each shape of a multi-turn dataset (`turns = "all"`, whichever dataset of the
        shape says it) whose first turn answered with content."""
        multi = {self.config.fingerprint(ds) for ds in self.config.datasets if ds.turns == "all"}
        firsts = [(fp, body, a) for fp, body, a, _ in self.answers
                  if fp in multi and isinstance(a, ChatAnswer) and a.content.strip()]
        asked = await asyncio.gather(*(self.ask(client, fp, self.shapes[fp], turn_two_body(self.config, body, a))
                                       for fp, body, a in firsts))
        self.turn_two = {fp: a for (fp, _, _), a in zip(firsts, asked)}

    async def answer_rows(self) -> SmokeFigures | None:
        """Each shape's rows; the costliest answer's figures for the projection."""
        smoke: SmokeFigures | None = None
        if self.stream_row is not None:
            self.add(self.stream_row)
        for fp, body, answer, took in self.answers:
            ds = self.shapes[fp]
            if isinstance(answer, SmokeRow):
                self.add(answer)
                continue
            self.add(SmokeRow(f"{ds.name}: request", True, f"answered in {took:.2f} s "
                              f"(shape {fp}, max_tokens {body['max_tokens']})"))
            for row in await asyncio.to_thread(shape_rows, self.config, ds, body, answer, self.reconstruct,
                                               self.parser):
                self.add(row)
            if fp in self.turn_two:
                for row in await asyncio.to_thread(turn_two_rows, self.config, ds, self.turn_two[fp],
                                                   self.reconstruct):
                    self.add(row)
            if fp in self.agent:
                from draftgen.core.generate.commands.smoke_agent import agent_rows
                for row in await asyncio.to_thread(agent_rows, self.config, *self.agent[fp], self.reconstruct):
                    self.add(row)
            if not answer.priced:  # no usage.cost: its row says so; the projection does not take it as $0
                continue
            for other in self.config.datasets:
                if self.config.fingerprint(other) == fp:
                    self.result.cost_per_request[other.name] = answer.usage.cost
            if answer.usage.completion_tokens and (smoke is None or answer.usage.cost > smoke.cost_usd):
                smoke = SmokeFigures(answer.usage.completion_tokens, answer.usage.cost, took)
        for row in self.fleet_rows:
            self.add(row)
        return smoke

    def finish(self) -> None:
        """smoke.json written (or the last passing one kept when nothing was sent), the stage ended."""
        rd, result = self.rd, self.result
        rd.root.mkdir(parents=True, exist_ok=True)
        if not self.sent and last_smoke(rd, result.fingerprint, "passed") is True:
            # Refused before any request (a run holds the ledger, a local input): the test did not run.
            self.add(SmokeRow("smoke.json", True, f"kept the last passing smoke test in {rd.smoke_json}: this one "
                              "sent no request", warning=True))
        else:
            write_json_atomic(rd.smoke_json, result.to_dict())  # a full disk: the last smoke.json stays as it was
        if self.progress is not None:
            final = snap.StageState.DONE if result.passed else snap.StageState.FAILED
            self.progress(snap.StageProgress("smoke", state=final, done=len(result.rows),
                                             total=len(result.rows), message=result.summary(),
                                             checks=tuple((r.check, r.passed, r.detail) for r in result.rows)))


async def _compare_modes(test: _SmokeTest, client: ChatClient) -> None:
    """The same request streamed and not (stream_check.py): the row, and the mode that keeps the text
    noted for the shape requests that follow and recorded for `run`. A comparison that decides nothing
    leaves an earlier decision for this server as it was: a smoke test asked for mid-run (the TUI's `s`)
    never turns a running run back to the mode that rewrites text."""
    config = test.config
    fp, ds = next(iter(test.shapes.items()))
    body = smoke_body(config, ds)
    pair = await asyncio.gather(*(test.ask(client, fp, ds, b) for b in stream_pair(body)))
    streamed, plain = pair[0][2], pair[1][2]
    how, sampled, tried = "greedy request", False, 0
    for seed in SAMPLED_SEEDS:
        if isinstance(streamed, SmokeRow) or isinstance(plain, SmokeRow) or has_text(streamed) or has_text(plain):
            break
        # Empty on both sides compares nothing: a sampled, seeded request, one mode after the other.
        tried += 1
        how = f"sampled request (temperature {SAMPLED_TEMPERATURE}, seed {seed}; the greedy one came back empty)"
        sampled = True
        streamed_body, plain_body = stream_pair(body, temperature=SAMPLED_TEMPERATURE, seed=seed)
        streamed = (await test.ask(client, fp, ds, streamed_body))[2]
        plain = (await test.ask(client, fp, ds, plain_body))[2]
    test.stream_row, verdict = mode_row(config, streamed, plain, how, sampled, tried)
    if verdict is not None:
        test.parser = verdict.parser
        test.result.stream = verdict.decided
        config.api.server.note_stream(verdict.decided)


def _project(test: _SmokeTest, smoke: SmokeFigures | None) -> None:
    """The projection from each dataset's figures, and the balance row against it."""
    config, result = test.config, test.result
    result.smoke_answer = smoke
    figures = dataset_figures(config, test.counts, test.on_disk, test.prices, test.history)
    plan = forecast(figures, spent_usd=test.spent, max_usd=config.budget.max_usd, smoke=smoke,
                    parallel=config.engine.parallel)
    known = plan.left_usd > 0 or not any(d.answers_left for d in plan.datasets)
    if known:
        result.projected_cost_usd = plan.total_usd
        result.projection = plan
    test.add(balance_row(config, test.account, result.balance_usd, plan,
                          plan.total_usd - test.spent if known else None, test.redact))



async def run_smoke(config: Config, api_key: str, progress: Callable[[snap.StageProgress], None] | None = None,
                    spend: SpendLedger | None = None, settler: Settler | None = None, *, rundir: RunDir | None = None,
                    redact: Redactor | None = None) -> SmokeResult:
    """Run the checklist, write smoke.json, return the result (never raises for a failed check).

    The smoke requests are billed like any other: each is reserved against `max_usd` at its worst
    case, on spend.jsonl before it leaves, and booked as it ends (billing.py). `spend` is the ledger of
    a run open in this process (its reservations count, `settler` prices what is abandoned); without
    one the directory's ledger is opened here, and what is abandoned is looked up by the next run or
    `draftgen ledger`. `rundir` and `redact`: the run's, when a run in this process asks for it."""
    test = _SmokeTest(config, api_key, progress, spend, settler, rundir=rundir, redact=redact)
    await test.check_local()
    async with _client(config, config.api.base_url, api_key, test.redact) as client:
        test.deadline = time.monotonic() + SMOKE_RETRY_S  # one window for the whole smoke test's retries
        await test.check_key(client)
        await test.check_prices(client)
        await test.open_ledger()
        await test.ask_shapes(client)
    smoke = await test.answer_rows()
    async for row in special_text_rows(config, test.reconstruct.tokenizer, test.counts):
        test.add(row)
    _project(test, smoke)
    test.finish()
    return test.result


def _client(config: Config, url: str, api_key: str, redact: Redactor) -> ChatClient:
    """The smoke test's client of the server at `url` ([api] base_url, or one server of a fleet)."""
    return ChatClient(url, api_key, concurrency=4, request_timeout_s=min(config.api.request_timeout_s, 600),
                      connect_timeout_s=config.api.connect_timeout_s, referer=config.api.referer,
                      title=config.api.title, server=config.api.server, redact=redact)


SMOKE = "(smoke)"  # the spend ledger's "dataset" of the smoke requests


def _spent_on_disk(rd: RunDir, on_disk: dict[str, tuple[int, int, float]]) -> float:
    """The spend so far when the smoke test could not open the ledger: the ledger read as it is, else
    the answers' cost."""
    if rd.spend.exists():
        return SpendLedger.read(rd.spend).spent_usd
    return sum(cost for _, _, cost in on_disk.values())


def _open_spend(spend: SpendLedger, rd: RunDir, on_disk: dict[str, tuple[int, int, float]],
                key_usage: float | None) -> None:
    """Open the directory's ledger; the first time, carry the cost of answers already on disk and
    record the key's usage (as a run's opening does, core/generate/loop/opening.py)."""
    rd.root.mkdir(parents=True, exist_ok=True)
    spend.open()
    for name, (_, _, cost) in on_disk.items():
        spend.carry(name, cost)
    if key_usage is not None:
        spend.set_key_baseline(key_usage)


def smoke_command(config: Config, api_key: str) -> int:
    result = runtime.run(run_smoke(config, api_key))
    print_result(result)
    return 0 if result.passed else 1
