"""Every row of OpenRouter's response table (docs/openrouter.md), plain and SSE, against the
simulator's scenarios over loopback: no prompt fails for a cause that is not its own, and once the
condition clears (by itself, on `r` / SIGUSR1, or by running the same command again) every prompt
is answered exactly once. A headless run that waits says so in its status line. Over 400 lines:
the table's rows are one parametrized set, with the harness that drives them."""

from __future__ import annotations

import asyncio
import io
import os
import signal
from pathlib import Path
from typing import Any

import orjson
import pytest

from draftgen.core.config import Config
from draftgen.core.errors import EXIT_KEY_REFUSED, DraftgenError, KeyRefusedError
from draftgen.core.generate.api.classify import RequestFailed, Whose
from draftgen.core.generate.commands.retry_failed import history_path, retry_failed
from draftgen.core.generate.commands.smoke import run_smoke
from draftgen.core.generate.loop.doubts import DOUBT_LIMIT, Doubts
from draftgen.core.generate.loop.engine import Engine
from draftgen.core.generate.loop.prompts import Prompt
from draftgen.core.live import snapshot as snap
from draftgen.core.live.summary import EXIT_INCOMPLETE
from draftgen.core.records import ErrorKind
from draftgen.core.rundir import RunDir
from draftgen.headless.printer import run_headless
from draftgen.simulator import SimConfig, SimServer
from draftgen.simulator.scenarios import BY_NAME
from tests.helpers import TEST_KEY, dataset_row, make_config, read_ids, until

# Each documented response, by whose problem OpenRouter's table says it is.
TRANSIENT = ("in_flight_budget", "rate_limited", "request_timeout", "no_provider_503", "provider_500",
             "provider_502", "gateway_504", "gateway_524", "error_body", "finish_error", "empty_choices",
             "stream_error")
PROMPT = {"context_length": "400_context_length", "invalid_prompt": "400_invalid_prompt",
          "moderation": "moderated", "payload_too_large": "413", "provider_400": "400"}
DATASET = ("unknown_model", "data_policy", "no_allowed_providers", "no_endpoints_support", "max_tokens_exceeded",
           "weight_exceeds_budget", "bad_parameter")
ACCOUNT_SELF_CLEARING = ("key_limit", "out_of_credits")   # a re-read of /key or /credits shows room again
ACCOUNT_BY_HAND = ("guardrail_budget", "workspace_budget")  # nothing to re-read: `r` / SIGUSR1
CLASS_OF = {**{n: Whose.TRANSIENT for n in TRANSIENT}, **{n: Whose.PROMPT for n in PROMPT},
            **{n: Whose.DATASET for n in DATASET}, "revoked_key": Whose.ACCOUNT,
            **{n: Whose.ACCOUNT for n in ACCOUNT_SELF_CLEARING + ACCOUNT_BY_HAND}}
STREAM = pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
A, B = 40, 12  # prompts in datasets a and b


def test_every_row_of_the_table_is_tested() -> None:
    assert set(CLASS_OF) == set(BY_NAME), "a simulator scenario no test here covers (or one that is gone)"
    assert all(CLASS_OF[n].value == BY_NAME[n].klass for n in CLASS_OF)


def sim_config(**kw: Any) -> SimConfig:
    return SimConfig(**{"seed": 3, "fixed_latency_s": 0.03, "mean_completion_tokens": 40, "retry_after_s": 0.05,
                        "processing_comment_s": 0.05, **kw})


def config_for(tmp_path: Path, sim: SimServer, stream: bool, *, a_max_tokens: int = 2000) -> Config:
    return make_config(tmp_path, sim.base_url,
                       [{"name": "a", "n": A, "concurrency": 4, "max_tokens": a_max_tokens},
                        {"name": "b", "n": B, "concurrency": 2, "max_tokens": 64}],
                       tables={"api": {"stream": stream, "credits_interval_s": 0.1, "request_timeout_s": 10},
                               "engine": {"parallel": True, "backoff_base_s": 0.01, "backoff_max_s": 0.1,
                                          "max_attempts": 3}})


class Watch:
    """An engine run in the background, with every state it went through."""

    def __init__(self, config: Config) -> None:
        self.events: list[tuple[str, str, str]] = []
        self.engine = Engine(config, TEST_KEY, seed=1,
                             on_event=lambda p: self.events.append((p.level, p.kind, p.text())))
        self.states: set[str] = set()
        self.lowest_limit = sum(d.concurrency for d in config.datasets)  # effective concurrency, at its lowest
        self.task = asyncio.create_task(self.engine.run())
        self._poll = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            self.states.add(self.engine.state)
            limit = sum(d.effective_concurrency for d in self.engine.snapshot().datasets)
            self.lowest_limit = min(self.lowest_limit, limit)
            await asyncio.sleep(0.005)

    async def until(self, predicate: Any, what: str, timeout: float = 20.0) -> None:
        async def poll() -> None:
            while not predicate():
                if self.task.done():
                    raise AssertionError(f"the run ended ({self.task.result()}) before {what}; events: "
                                         f"{[e[1:] for e in self.events if e[1] != 'dataset_start'][-8:]}")
                await asyncio.sleep(0.01)
        await asyncio.wait_for(poll(), timeout)

    async def result(self, timeout: float = 30.0) -> str:
        try:
            return await asyncio.wait_for(self.task, timeout)
        finally:
            self._poll.cancel()


def answered_once(config: Config) -> None:
    rd = RunDir(config.run_dir)
    for name, n in (("a", A), ("b", B)):
        ids = read_ids(rd.responses(name))
        assert len(ids) == len(set(ids)) == n, (name, len(ids), len(set(ids)))


def failures(config: Config, name: str) -> list[dict[str, Any]]:
    path = RunDir(config.run_dir).failures(name)
    return [orjson.loads(x) for x in path.read_bytes().splitlines()] if path.exists() else []


# -- transient: retried, never a pause, never a failure --------------------------------------------

@STREAM
@pytest.mark.parametrize("name", TRANSIENT)
async def test_transient_rows_fail_nothing_and_never_pause(tmp_path: Path, name: str, stream: bool) -> None:
    extra: dict[str, Any] = {"ratio": 0.0002, "retry_after": 0.05} if name == "in_flight_budget" else {}
    if name == "rate_limited":
        extra = {"retry_after": 0.05}
    if name in ("request_timeout", "no_provider_503", "provider_500", "provider_502", "gateway_504",
                "gateway_524") and stream:
        extra = {"midstream": True}  # half of these as an error chunk of a stream under way
    async with SimServer(sim_config(), port=0) as sim:
        config = config_for(tmp_path, sim, stream)
        limited = name in ("in_flight_budget", "rate_limited")
        # The two that must lower the limit last until a dataset's limit was cut, not 0.6 s nor a count of
        # answers: a storm is 5 or more in 5 s of one dataset's (concurrency.py), and how 8 of them fall
        # between the two datasets (5 + 3, or 4 + 4: no storm) is the machine's doing. A limit never cut
        # times the wait out.
        sim.scenario(name, True, after=0.1, **({} if limited else {"duration": 0.6}), **extra)
        run = Watch(config)
        if limited:
            await run.until(lambda: run.lowest_limit < 6 and sim.stats.scenarios.get(name, 0) >= 8,
                            f"the limit cut by the answers of {name}")
            sim.scenario(name, False)
        state = await run.result()
        hits = sim.stats.scenarios.get(name, 0)
    assert state == snap.RunState.DONE
    assert hits > 0, f"the scenario {name} never answered"
    assert snap.RunState.PAUSED not in run.states, "a transient response paused the run"
    if limited:
        assert run.lowest_limit < 6, "a 429 or a full in-flight budget lowers the effective concurrency (AIMD)"
    assert failures(config, "a") == failures(config, "b") == []
    answered_once(config)


@pytest.mark.parametrize("name", ["no_provider_503", "provider_502"])
async def test_an_error_chunk_is_the_services_by_its_code(tmp_path: Path, name: str) -> None:
    """An error chunk mid-stream carries the status it stands for in `error.code`. One prompt meets it
    on every try for 1.5 s while every other prompt is answered. Coded 503 (no provider meets the
    routing) it is the service's outage: no attempt spent, answered once it clears (before, the
    others' answers made its third chunk its own fault, and under load the 0.6 s window of the test
    above did that to whichever prompt it caught). Coded 502 it may be a provider that dies on this
    very prompt: it fails after max_attempts (3), with its reason, and only that prompt."""
    async with SimServer(sim_config(), port=0) as sim:
        config = config_for(tmp_path, sim, True)
        sim.scenario(name, True, duration=1.5, match="Question a-7:", midstream=True)
        run = Watch(config)
        state = await run.result()
        hits = sim.stats.scenarios.get(name, 0)
    assert state == snap.RunState.DONE
    assert failures(config, "b") == []
    if name == "no_provider_503":
        assert hits > 3, f"met {hits} times: not more than max_attempts (3), the case is not shown"
        assert failures(config, "a") == []
        answered_once(config)
    else:
        # A fault counts only once another prompt has been answered since it was first sent: 3 or more tries.
        (failed,) = failures(config, "a")
        assert (failed["id"], failed["error_kind"]) == ("a-7", "200_error") and failed["attempts"] >= 3
        assert hits == failed["attempts"]


def test_an_error_in_a_200_is_an_outage_by_its_code_only() -> None:
    """`error.code` as OpenRouter sends it (a number, the status it stands for): 503 and 429 are the
    service's; any other code, a word or nothing leaves it an answer fault (counted against
    max_attempts while others are answered)."""
    def failed(code: object) -> RequestFailed:
        return RequestFailed(ErrorKind.ERROR_IN_200, "error chunk mid-stream", code=code)
    assert failed(503).outage and failed("503").outage
    assert failed(429).outage and failed(429).slow_down  # a rate limit met mid-stream lowers the limit too
    assert not failed(502).outage and not failed(500).outage and not failed(408).outage  # maybe the prompt's
    assert not failed("server_error").outage and not failed(None).outage and not failed(True).outage
    assert not failed(400).outage and not failed(503).slow_down
    assert not RequestFailed(ErrorKind.BAD_BODY, "cut", code=503).outage  # only errors inside a 200 carry one


# -- the prompt's own: that prompt fails, with its reason; nothing else does ---------------------

@STREAM
@pytest.mark.parametrize("name", sorted(PROMPT))
async def test_prompt_rows_fail_that_prompt_only(tmp_path: Path, name: str, stream: bool) -> None:
    async with SimServer(sim_config(), port=0) as sim:
        config = config_for(tmp_path, sim, stream)
        sim.scenario(name, True, match="Question a-7:")
        run = Watch(config)
        assert await run.result() == snap.RunState.DONE
        requests = sim.stats.scenarios.get(name, 0)
    failed = failures(config, "a")
    assert [f["id"] for f in failed] == ["a-7"] and failed[0]["error_kind"] == PROMPT[name]
    assert failed[0]["attempts"] == 1 and failed[0]["message"] and requests == 1  # not retried
    assert failures(config, "b") == []
    rd = RunDir(config.run_dir)
    assert len(set(read_ids(rd.responses("a")))) == A - 1 and len(read_ids(rd.responses("b"))) == B


async def test_a_400_naming_no_cause_on_the_last_prompt_fails_it_at_the_dataset_end(tmp_path: Path) -> None:
    """The last prompt sent gets a provider's 400 that names no known cause: no later request can show
    the parameters work, but the dataset answered the others with them, so it is the prompt's own."""
    async with SimServer(sim_config(), port=0) as sim:
        config = config_for(tmp_path, sim, False)
        sim.scenario("provider_400", True, match=f"Question a-{A - 1}:")
        run = Watch(config)
        assert await run.result() == snap.RunState.DONE
    assert [(f["id"], f["error_kind"]) for f in failures(config, "a")] == [(f"a-{A - 1}", "400")]
    assert dataset_row(run.engine, "a").status == snap.DatasetStatus.DONE


async def test_a_few_prompts_refusing_at_once_do_not_stop_a_busy_dataset(tmp_path: Path) -> None:
    """3 % of prompts get their own 400 naming no cause, 200 in flight: more than five come back (at once)
    before any request sent after them is answered. The dataset waits for its requests in flight, their
    answers show the parameters work, and those prompts fail as their own; the dataset finishes."""
    async with SimServer(sim_config(fixed_latency_s=0.5), port=0) as sim:
        config = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 600, "concurrency": 200, "max_tokens": 64}])
        sim.scenario("provider_400", True, rate=0.03)
        run = Watch(config)
        assert await run.result(timeout=60) == snap.RunState.DONE
        refused = sim.stats.scenarios.get("provider_400", 0)
    failed = failures(config, "a")
    assert refused >= 6 and len(failed) == refused and {f["error_kind"] for f in failed} == {"400"}
    a = run.engine.snapshot().datasets[0]
    assert a.status == snap.DatasetStatus.DONE and a.done + a.failed == 600


async def test_only_a_refused_prompt_left_stops_until_a_smoke_test_shows_the_parameters_work(tmp_path: Path) -> None:
    """A rerun whose only prompt left gets a 400 naming no cause answers nothing to tell whose it is: the
    dataset stops (the prompt stays eligible) and says a smoke test settles it; after one, it fails."""
    from draftgen.core.generate.commands.smoke import run_smoke
    from draftgen.core.tokens.tokenizer import bundled_kimi_path

    async with SimServer(sim_config(), port=0) as sim:
        def config(n: int) -> Config:
            return make_config(tmp_path, sim.base_url, [{"name": "a", "n": n, "concurrency": 4, "max_tokens": 200}],
                               tables={"tokenizer": {"path": str(bundled_kimi_path())}})
        assert await Watch(config(9)).result() == snap.RunState.DONE
        sim.scenario("provider_400", True, match="Question a-9:")
        run = Watch(config(10))  # one prompt added: the provider refuses it
        assert await run.result() == snap.RunState.STOPPED
        a = run.engine.snapshot().datasets[0]
        assert a.status == snap.DatasetStatus.STOPPED and "draftgen smoke" in a.message
        assert failures(config(10), "a") == []
        assert (await run_smoke(config(10), TEST_KEY)).cost_per_request.get("a")
        again = Watch(config(10))
        assert await again.result() == snap.RunState.DONE
    assert [(f["id"], f["error_kind"]) for f in failures(config(10), "a")] == [("a-9", "400")]


@STREAM
@pytest.mark.slow
async def test_a_parameter_refused_mid_run_at_2000_in_flight_fails_no_prompt(tmp_path: Path, stream: bool) -> None:
    """The provider starts refusing a parameter mid-run with a 400 naming no known cause, while 2,000
    requests sent before are still being answered: those answers do not make the refusals the prompts'
    own (they were sent before them); the dataset stops and no prompt is failed (all stay eligible)."""
    # Held until 2,000 are in flight (however slowly a busy machine admits), and refused from the
    # 2,001st request on: every refusal comes after the 2,000 were sent.
    async with SimServer(sim_config(fixed_latency_s=2.0, hold_until_in_flight=2000), port=0) as sim:
        config = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 3000, "concurrency": 2000, "max_tokens": 64}],
                             tables={"api": {"stream": stream}})
        sim.scenario("bad_parameter", True, what="top_k", after_requests=2000)
        run = Watch(config)
        assert await run.result(timeout=60) == snap.RunState.STOPPED
        refused = sim.stats.scenarios.get("bad_parameter", 0)
        peak = sim.stats.peak_in_flight
    a = run.engine.snapshot().datasets[0]
    assert peak == 2000 and refused >= 5 and a.done >= 1900
    assert a.failed == 0 and failures(config, "a") == []
    assert a.status == snap.DatasetStatus.STOPPED and "request parameters" in a.message and "top_k" in a.message


def test_at_the_end_only_an_answer_sent_after_a_refused_request_makes_its_refusal_its_own() -> None:
    """However the sends and refusals interleave (every prompt left sent before the first refusal came
    back, as on a fast machine), at the dataset's end a refused prompt fails as its own only when a request
    sent after it was answered; `DOUBT_LIMIT` or more with every answer sent before them stay eligible
    (the dataset stops); fewer fail (the last prompt of a dataset refused alone)."""
    def refused(doubts: Doubts, seqs: range, sent: int) -> None:
        for seq in seqs:
            doubts.add(Prompt(f"p{seq}", [], seq), RequestFailed(ErrorKind.BAD_REQUEST, "400"), 1, seq, sent)

    mid_run = Doubts()  # 2,000 answered, all sent before the 1,000 refused ones
    mid_run.answered(2000)
    refused(mid_run, range(2001, 3001), 3000)
    own, stop = mid_run.settle()
    assert own == [] and stop and len(mid_run) == 1000

    busy = Doubts()  # refusals among the last requests, some sent after them answered
    refused(busy, range(590, 597), 600)
    busy.answered(594)  # 590-593 proven their own; 594-596 unproven, fewer than DOUBT_LIMIT
    own, stop = busy.settle()
    assert [d.seq for d in own] == list(range(590, 597)) and not stop and len(busy) == 0

    mixed = Doubts()  # 3 proven their own, DOUBT_LIMIT or more with no answer sent after them
    refused(mixed, range(590, 600), 600)
    mixed.answered(593)
    own, stop = mixed.settle()
    assert [d.seq for d in own] == [590, 591, 592] and stop and [d.seq for d in mixed.items] == list(range(593, 600))
    assert 600 - 593 >= DOUBT_LIMIT

    last = Doubts()  # the last prompt refused alone, the others answered before it was sent
    last.answered(99)
    refused(last, range(100, 101), 100)
    assert [d.seq for d in last.settle()[0]] == [100] and len(last) == 0

    smoke = Doubts()  # the last smoke test answered this request shape: the parameters work
    smoke.smoke_answered = True
    refused(smoke, range(1, 11), 10)
    own, stop = smoke.settle()
    assert len(own) == 10 and not stop


# -- the dataset's routing or settings: the dataset stops, its prompts stay eligible --------------

@STREAM
@pytest.mark.parametrize("name", DATASET)
async def test_dataset_rows_stop_the_dataset_and_a_rerun_finishes_it(tmp_path: Path, name: str,
                                                                      stream: bool) -> None:
    # max_tokens_exceeded lowers every endpoint's limit to 1000: a (2000) is over it, b (64) is not.
    params: dict[str, Any] = {"limit": 1000} if name == "max_tokens_exceeded" else {"match": "Question a-"}
    async with SimServer(sim_config(), port=0) as sim:
        config = config_for(tmp_path, sim, stream)
        sim.scenario(name, True, after=0.1, **params)
        run = Watch(config)
        assert await run.result() == snap.RunState.STOPPED  # prompts are left: not DONE, run again
        s = run.engine.snapshot()
        a, b = s.datasets
        assert a.status == snap.DatasetStatus.STOPPED and a.done < A and "run again" in a.message
        if name in ("max_tokens_exceeded", "weight_exceeds_budget"):
            assert "max_tokens" in a.message
        if name == "unknown_model":  # the model is the whole run's: every dataset stops
            assert b.status == snap.DatasetStatus.STOPPED and "check [api] model" in b.message
        else:
            assert b.status == snap.DatasetStatus.DONE and b.done == B  # the other dataset is not touched
        assert failures(config, "a") == failures(config, "b") == []
        assert snap.RunState.PAUSED not in run.states
        # The user fixes the routing (here: the condition clears) and runs the same command again.
        sim.scenario(name, False)
        again = Watch(config)
        assert await again.result() == snap.RunState.DONE
    assert failures(config, "a") == []
    answered_once(config)


# -- the account: admission stops run-wide, nothing fails, it resumes ------------------------------

@STREAM
@pytest.mark.parametrize("name", ACCOUNT_SELF_CLEARING)
async def test_account_rows_hold_the_run_and_resume_by_themselves(tmp_path: Path, name: str,
                                                                  stream: bool) -> None:
    async with SimServer(sim_config(), port=0) as sim:
        config = config_for(tmp_path, sim, stream)
        sim.scenario(name, True, after=0.1)
        run = Watch(config)
        await run.until(lambda: run.engine.state == snap.RunState.PAUSED and run.engine.account is not None,
                        "the account condition held the run")
        e = run.engine
        # Through a 403 or 402, or before one: the balance read from GET /key or /credits at the floor.
        if "credit_floor_usd" in e.alert:
            assert ("GET /key" in e.alert) if name == "key_limit" else ("GET /credits" in e.alert)
        else:
            assert ("limit" in e.alert) if name == "key_limit" else ("credits" in e.alert)
        assert "r resumes now" in e.alert and e.snapshot().waiting == e.alert
        await asyncio.sleep(0.3)  # three re-checks: the condition is still there
        await run.until(lambda: e.in_flight == 0, "the requests in flight to finish")
        assert e.state == snap.RunState.PAUSED
        asked = sim.stats.requests_total
        await asyncio.sleep(0.2)
        assert sim.stats.requests_total == asked, "nothing is admitted while the account holds the run"
        sim.scenario(name, False)  # the key's cap is raised / credits are added
        assert await run.result() == snap.RunState.DONE  # with no `r`: a re-read of the account found room
    assert any(kind == "account" and "cleared" in msg for _, kind, msg in run.events)
    assert failures(config, "a") == failures(config, "b") == []
    answered_once(config)


@STREAM
@pytest.mark.parametrize("name", ACCOUNT_BY_HAND)
async def test_budget_rows_hold_until_r(tmp_path: Path, name: str, stream: bool) -> None:
    async with SimServer(sim_config(), port=0) as sim:
        config = config_for(tmp_path, sim, stream)
        sim.scenario(name, True, after=0.1)
        run = Watch(config)
        await run.until(lambda: run.engine.account is not None, "the budget held the run")
        e = run.engine
        assert "resets at" in e.alert and name.split("_")[0] in e.alert
        sim.scenario(name, False)  # raised by an admin: nothing draftgen can read says so
        await asyncio.sleep(0.3)
        assert e.state == snap.RunState.PAUSED
        e.resume()  # `r`
        assert await run.result() == snap.RunState.DONE
    assert failures(config, "a") == failures(config, "b") == []
    answered_once(config)


@STREAM
async def test_a_revoked_key_drains_fails_nothing_and_a_rerun_finishes(tmp_path: Path, stream: bool) -> None:
    async with SimServer(sim_config(), port=0) as sim:
        config = config_for(tmp_path, sim, stream)
        run = Watch(config)
        # Revoked once a's first answer is in (not after a time: a loaded machine may answer none by
        # then): the at most 4 of a's in flight finish, a's rest meets the 401.
        await run.until(lambda: run.engine.datasets["a"].done > 0, "a's first answer")
        sim.scenario("revoked_key", True)
        assert await run.result() == snap.RunState.DRAINED  # in-flight requests finished, the rest is left
        assert run.engine.key_refused is not None and "401" in run.engine.alert
        assert failures(config, "a") == failures(config, "b") == []
        done = len(read_ids(RunDir(config.run_dir).responses("a")))
        assert 0 < done < A
        sim.scenario("revoked_key", False)  # a new key
        again = Watch(config)
        assert await again.result() == snap.RunState.DONE
    answered_once(config)


# -- headless: never waiting in silence; SIGUSR1; the exit code of a refused key -------------------

async def _headless(config: Config, out: io.StringIO, **kw: Any) -> int:
    return await run_headless(config, TEST_KEY, skip_smoke=True, interval_s=0.05, out=out, reconstruct=False, **kw)


async def test_headless_says_waiting_on_a_key_limit_and_sigusr1_resumes(tmp_path: Path) -> None:
    async with SimServer(sim_config(), port=0) as sim:
        config = config_for(tmp_path, sim, False)
        sim.scenario("guardrail_budget", True, after=0.1)
        out = io.StringIO()
        task = asyncio.create_task(_headless(config, out))
        for _ in range(400):
            await asyncio.sleep(0.02)
            if "ALERT: a guardrail budget" in out.getvalue():
                break
        text = out.getvalue()
        assert "WAITING (PAUSED)" in text and "ALERT: a guardrail budget is spent" in text, text[-2000:]
        sim.scenario("guardrail_budget", False)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert await asyncio.wait_for(task, 30) == 0
    answered_once(config)


async def test_headless_says_waiting_through_an_outage(tmp_path: Path) -> None:
    async with SimServer(sim_config(), port=0) as sim:
        config = config_for(tmp_path, sim, False)
        # From the 5th request on, until the status line has said it (not for a time: a start slowed by
        # load could begin after a timed outage had ended).
        sim.scenario("no_provider_503", True, after_requests=4)
        out = io.StringIO()
        task = asyncio.create_task(_headless(config, out))
        try:
            await until(lambda: "WAITING: all" in out.getvalue() or task.done(), "a WAITING status line")
        except BaseException:
            task.cancel()
            raise
        sim.scenario("no_provider_503", False)
        assert await asyncio.wait_for(task, 30) == 0
    assert "WAITING: all" in out.getvalue() and "backing off" in out.getvalue()
    answered_once(config)


async def test_headless_exits_with_the_refused_key_code(tmp_path: Path) -> None:
    async with SimServer(sim_config(), port=0) as sim:
        config = config_for(tmp_path, sim, False)
        sim.scenario("revoked_key", True, after=0.1)
        out = io.StringIO()
        assert await asyncio.wait_for(_headless(config, out), 30) == EXIT_KEY_REFUSED
    assert "API key was refused (401)" in out.getvalue()


# -- start-up checks name the cause ------------------------------------------------------------

async def test_startup_names_a_missing_prompt_file(tmp_path: Path) -> None:
    async with SimServer(sim_config(), port=0) as sim:
        config = config_for(tmp_path, sim, False)
        config.datasets[1].prompts.unlink()
        with pytest.raises(DraftgenError, match="b.jsonl: prompt file not found"):
            await _headless(config, io.StringIO())


async def test_startup_names_an_unreachable_base_url_and_waits_for_it(tmp_path: Path) -> None:
    async with SimServer(sim_config(), port=0) as sim:
        port = sim.port
    config = make_config(tmp_path, f"http://127.0.0.1:{port}/api/v1", [{"name": "a", "n": 3}])
    cause = f"cannot connect to 127.0.0.1:{port} (connection refused)"
    out = io.StringIO()
    task = asyncio.create_task(_headless(config, out))
    for _ in range(500):
        await asyncio.sleep(0.02)
        if f"WAITING: {cause}" in out.getvalue():
            break
    text = out.getvalue()
    assert f"warn     {cause}: check [api] base_url" in text, text[-2000:]  # said at start
    assert f"WAITING: {cause}" in text and "WAITING (RUNNING)" in text, text[-2000:]  # and while it waits
    os.kill(os.getpid(), signal.SIGINT)  # the user fixes the address: drain, nothing failed
    assert await asyncio.wait_for(task, 30) == EXIT_INCOMPLETE  # prompts left: run again
    assert not RunDir(config.run_dir).failures("a").exists() or not failures(config, "a")
    result = await run_smoke(config, TEST_KEY)
    assert not result.passed and f"key (GET /key: {cause} (after " in result.summary()  # retried, then said


async def test_startup_names_a_refused_key(tmp_path: Path) -> None:
    async with SimServer(sim_config(api_key="the-right-key"), port=0) as sim:
        config = config_for(tmp_path, sim, False)
        with pytest.raises(KeyRefusedError, match=r"was refused .*401") as caught:
            await _headless(config, io.StringIO())
        assert caught.value.exit_code == EXIT_KEY_REFUSED and TEST_KEY not in str(caught.value)
        result = await run_smoke(config, TEST_KEY)
    assert "key (GET /key: HTTP 401" in result.summary()


# -- retry-failed: prompts failed by mistake become eligible again -------------------------------

async def test_retry_failed_makes_chosen_failures_eligible_and_keeps_their_history(tmp_path: Path) -> None:
    async with SimServer(sim_config(), port=0) as sim:
        config = config_for(tmp_path, sim, False)
        rd = RunDir(config.run_dir)
        rd.dataset("a").mkdir(parents=True)
        # An older run failed a-0..a-9 for the key's problem and a-10 for its own.
        lines = [orjson.dumps({"id": f"a-{i}", "messages": [], "error_kind": "401", "status": 401,
                               "message": "HTTP 401: User not found.", "attempts": 1, "ts": 1.0}) for i in range(10)]
        own = orjson.dumps({"id": "a-10", "messages": [], "error_kind": "moderated", "status": 403,
                            "message": "flagged", "attempts": 1, "ts": 1.0})
        rd.failures("a").write_bytes(b"\n".join([*lines[:5], own, *lines[5:]]) + b"\n")
        result = retry_failed(config, dataset="a", kinds=frozenset({"401"}))
        assert [dict(r.moved) for r in result] == [{"401": 10}] and result[0].kept == 1
        assert rd.failures("a").read_bytes() == own + b"\n"  # the kept line byte for byte
        history = [orjson.loads(x) for x in history_path(rd, "a").read_bytes().splitlines()]
        assert [h["id"] for h in history] == [f"a-{i}" for i in range(10)] and all("retried_at" in h for h in history)
        run = Watch(config)
        assert await run.result() == snap.RunState.DONE
    assert read_ids(rd.failures("a")) == ["a-10"]
    ids = read_ids(rd.responses("a"))
    assert len(ids) == len(set(ids)) == A - 1 and {f"a-{i}" for i in range(10)} <= set(ids)


# -- the classification itself: metadata first, words only as a hint ----------------------------

def _body(code: int, message: str, metadata: dict[str, Any] | None = None) -> bytes:
    err: dict[str, Any] = {"code": code, "message": message}
    if metadata is not None:
        err["metadata"] = metadata
    return orjson.dumps({"error": err})


@pytest.mark.parametrize("status, body, kind, whose", [
    # The in-flight budget by its limit_source, whatever the words say.
    (402, _body(402, "Something new", {"limit_source": "openrouter_in_flight_budget"}), "402_in_flight",
     Whose.TRANSIENT),
    (402, _body(402, "Insufficient credits"), "402", Whose.ACCOUNT),
    (402, _body(402, "weight_exceeds_budget: too big", {"limit_source": "openrouter_credits"}), "402_weight",
     Whose.DATASET),
    # A budget by its limit_source on either status (the docs say 403, a page says 402).
    (402, _body(402, "Budget exceeded", {"limit_source": "openrouter_guardrail_budget"}), "403_limit", Whose.ACCOUNT),
    (403, _body(403, "Reworded", {"limit_source": "openrouter_workspace_budget"}), "403_limit", Whose.ACCOUNT),
    (403, _body(403, "Key limit exceeded (total limit)"), "403_limit", Whose.ACCOUNT),
    (403, _body(403, "Your input was flagged", {"reasons": ["x"], "flagged_input": "..."}), "moderated",
     Whose.PROMPT),
    (403, _body(403, "Forbidden"), "403", Whose.ACCOUNT),
    (401, _body(401, "No auth credentials found"), "401", Whose.ACCOUNT),
    (404, _body(404, "No endpoints found matching your data policy"), "404_no_endpoints", Whose.DATASET),
    (404, _body(404, "No allowed providers are available for the selected model."), "404_no_endpoints",
     Whose.DATASET),
    (404, _body(404, "foo/bar is not a valid model ID"), "404", Whose.DATASET),
    (400, _body(400, "too long", {"code": "context_length_exceeded"}), "400_context_length", Whose.PROMPT),
    (400, _body(400, "max_tokens_exceeded: 9999 > 4096"), "400_max_tokens", Whose.DATASET),
    (400, _body(400, "Bad request"), "400", Whose.PROMPT),
    (413, b"Payload Too Large", "413", Whose.PROMPT),
    (503, _body(503, "No available model provider that meets your routing requirements"), "5xx", Whose.TRANSIENT),
    (524, b"error code: 524", "5xx", Whose.TRANSIENT),
    (408, _body(408, "Request timed out"), "408", Whose.TRANSIENT),
    (429, _body(429, "Rate limit exceeded"), "429", Whose.TRANSIENT),
])
def test_classification_by_status_and_metadata(status: int, body: bytes, kind: str, whose: Whose) -> None:
    from draftgen.core.generate.api.classify import classify_status
    e = classify_status(status, body, {"Retry-After": "3"})
    assert (e.kind, e.whose, e.retry_after) == (kind, whose, 3.0)
    assert (e.account is not None) == (whose is Whose.ACCOUNT)


@STREAM
async def test_a_prompt_left_alone_with_its_faults_fails_after_max_attempts(tmp_path: Path, stream: bool) -> None:
    """A prompt whose every answer is faulty, with nothing else of its dataset in flight and nothing else
    answered since its first try, has no evidence that the fault is the service's: its faults spend
    attempts, so it fails after max_attempts instead of being asked (and paid for) forever. Here the
    dataset has that one prompt and the service answers it with errors from the start."""
    async with SimServer(sim_config(), port=0) as sim:
        config = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 1, "concurrency": 1, "max_tokens": 64}],
                             tables={"api": {"stream": stream, "request_timeout_s": 10},
                                     "engine": {"backoff_base_s": 0.01, "backoff_max_s": 0.05, "max_attempts": 3}})
        sim.scenario("error_body", True)
        state = await asyncio.wait_for(Watch(config).result(), 60)
        hits = sim.stats.scenarios.get("error_body", 0)
    assert state == snap.RunState.DONE
    failed = failures(config, "a")
    assert [f["attempts"] for f in failed] == [3] and hits == 3


def test_retry_failed_says_a_kind_of_kept_answers_is_not_a_failure(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`--kind length`: a cut answer is in responses.jsonl, not failures.jsonl; the command says so instead of
    listing it among the failure kinds it found none of."""
    from draftgen.cli.main import main
    config = make_config(tmp_path, "http://127.0.0.1:9/api/v1", [{"name": "a", "n": 2}])
    assert main(["retry-failed", str(config.path), "--kind", "length,401"]) == 0
    out = capsys.readouterr().out
    (listed,) = [x for x in out.splitlines() if x.startswith("no failure of kind 401, length; failure kinds: 429, ")]
    kinds = listed.partition("failure kinds: ")[2].split(", ")
    assert "401" in kinds and "400_context_length" in kinds and not {"length", "empty_content", "no_ids"} & set(kinds)
    assert "length: answers kept in responses.jsonl (marked), not failures; retry-failed does not ask them again" in out


def test_retry_failed_shows_a_failures_kind_from_the_file_escaped(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """failures.jsonl is a file (an older version's, or edited): the kinds it names are printed with their
    controls as visible escapes."""
    from draftgen.cli.main import main
    config = make_config(tmp_path, "http://127.0.0.1:9/api/v1", [{"name": "a", "n": 2}])
    path = RunDir(config.run_dir).failures("a")
    path.parent.mkdir(parents=True)
    path.write_bytes(orjson.dumps({"id": "a-0", "error_kind": "401\x1b]0;pwned\x07", "error": "x"}) + b"\n")
    assert main(["retry-failed", str(config.path)]) == 0
    out = capsys.readouterr().out
    assert "a: 1 failed prompt(s) eligible again (401\\x1b]0;pwned\\x07: 1)" in out and "\x1b" not in out, out


async def test_a_drain_ends_the_wait_of_a_request_backing_off(tmp_path: Path) -> None:
    """A drain while every request waits out a long backoff before its retry: the run ends at once, the
    waiting prompts given up unrecorded (stay eligible). Before, the wait ran its course first: a backoff
    of up to backoff_max_s held a drained run's exit (the soak's SIGHUP drain passed its 60 s on a busy
    machine with 0 requests in flight)."""
    async with SimServer(sim_config(), port=0) as sim:
        config = make_config(tmp_path, sim.base_url, [{"name": "a", "n": A, "concurrency": 4}],
                             tables={"api": {"stream": False, "request_timeout_s": 10},
                                     "engine": {"backoff_base_s": 600, "backoff_max_s": 600, "max_attempts": 3}})
        sim.scenario("provider_502", True)
        run = Watch(config)
        await run.until(lambda: run.engine.backing_off == 4, "every request backing off")
        run.engine.drain()
        state = await run.result(timeout=60)  # the backoffs alone would take 600 s
    assert state == snap.RunState.DRAINED, state
    assert run.engine.backing_off == 0
    assert failures(config, "a") == []  # given up, not failed: they stay eligible
