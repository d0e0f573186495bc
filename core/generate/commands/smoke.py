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
  the cost of the request.
`smoke.json` keeps the result with the run's request fingerprint: `run` starts at full concurrency
only when the fingerprint matches a passing smoke test.

The smoke requests are paid for like a run's: reserved against `max_usd` at the worst case of the body
sent, on spend.jsonl before they leave, booked as they end (billing.py), in the ledger's "(smoke)"
dataset. An outage answer (429, 5xx, 408, no connection: classify.py) is retried with the run's
backoff, honouring Retry-After, up to `SMOKE_TRIES` tries within `SMOKE_RETRY_S`; each retry is a
request of its own on the ledger, with its own reservation.

Over 400 lines: the checklist is one flow (`run_smoke`), with the row builders it calls beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from draftgen.core import runtime
from draftgen.core.config import COMPLETION_LIMIT_KEYS, Config, DatasetConfig
from draftgen.core.errors import DiskError, DraftgenError, LedgerBusyError
from draftgen.core.files import write_json_atomic
from draftgen.core.generate.api.account import AccountStatus, read_account
from draftgen.core.generate.api.classify import ANSWER_KINDS, Whose
from draftgen.core.generate.api.client import ChatAnswer, ChatClient, RequestFailed
from draftgen.core.generate.api.preflight import note_key_answer
from draftgen.core.generate.api.prices import body_max_tokens, body_worst_case, fetch_prices
from draftgen.core.generate.commands.precheck import check_tokenizer
from draftgen.core.generate.loop.attempts import backoff_delay
from draftgen.core.generate.loop.prompts import Prompt, read_prompts
from draftgen.core.generate.loop.smoke_record import last_smoke
from draftgen.core.generate.money.billing import book_answer, book_failure, look_up, reserve_one
from draftgen.core.generate.money.forecast import DatasetFigures, RunForecast, SmokeFigures, forecast
from draftgen.core.generate.money.settle import Settler
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.live import snapshot as snap
from draftgen.core.records import ResponseRecord
from draftgen.core.rundir import RunDir, iter_jsonl
from draftgen.core.secrets import Redactor
from draftgen.core.units import clip, usd


@dataclass(frozen=True)
class SmokeRow:
    check: str
    passed: bool
    detail: str
    warning: bool = False  # passed, but worth reading (an unknown balance)


@dataclass
class SmokeResult:
    fingerprint: str
    rows: list[SmokeRow] = field(default_factory=list)
    cost_per_request: dict[str, float] = field(default_factory=dict)  # dataset name -> $ of its smoke request
    projected_cost_usd: float | None = None
    balance_usd: float | None = None
    projection: RunForecast | None = None
    smoke_answer: SmokeFigures | None = None  # the projection's pace and price before a run has answers

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    def summary(self) -> str:
        """One line: the count, and each failed check with its cause ("key (cannot connect to …)")."""
        failed = [r for r in self.rows if not r.passed]
        head = f"{len(self.rows) - len(failed)}/{len(self.rows)} checks passed"
        if not failed:
            return head
        # Cut at a word: the whole detail is in the checklist table and smoke.json.
        return head + "; failed: " + ", ".join(f"{r.check} ({clip(r.detail, 160)})" for r in failed)

    def to_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "passed": self.passed, "checked_at": time.time(),
                "rows": [{"check": r.check, "passed": r.passed, "detail": r.detail, "warning": r.warning}
                         for r in self.rows],
                "cost_per_request": self.cost_per_request, "projected_cost_usd": self.projected_cost_usd,
                "balance_usd": self.balance_usd,
                "smoke_answer": None if self.smoke_answer is None else dataclasses.asdict(self.smoke_answer)}


# How long (and how often) the smoke test retries an outage (429, 5xx, 408, unreachable) before its
# row fails: a momentary rate limit must not end a nohup job before it starts, a real outage must.
SMOKE_RETRY_S = 120.0
SMOKE_TRIES = 8


def _outage(e: RequestFailed) -> bool:
    """A transient error of the service's (not an answer fault, which says something about the request;
    an error chunk coded 503 or 429 is the service's, RequestFailed.outage)."""
    return e.whose is Whose.TRANSIENT and (e.kind not in ANSWER_KINDS or e.outage)


def smoke_body(config: Config, ds: DatasetConfig) -> dict[str, Any]:
    """The body the smoke test sends for `ds`: the run's, with the smoke prompt (and `[smoke] max_tokens`
    in every answer-cap key the body carries, so the server and the reservation see the same cap)."""
    body = config.request_body(ds, [{"role": "user", "content": config.smoke.prompt}])
    if config.smoke.max_tokens is not None:
        for key in COMPLETION_LIMIT_KEYS:
            if key in body or key == "max_tokens":
                body[key] = config.smoke.max_tokens
    return body


def _norm(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def _asks_reasoning(body: dict[str, Any]) -> bool:
    r = body.get("reasoning")
    if isinstance(r, dict):
        if r.get("exclude") or r.get("enabled") is False:
            return False
        return True
    return bool(body.get("include_reasoning"))


def _count_prompts(ds: DatasetConfig, specials: Any = ()) -> tuple[int, int, str]:
    """Prompts in the file, those holding special-token text, and the first such token seen."""
    from draftgen.core.tokens.template import special_text_pattern
    pattern = special_text_pattern(specials)
    n = flagged = 0
    first = ""
    for item in read_prompts(ds.prompts):
        if not isinstance(item, Prompt):
            continue
        n += 1
        if pattern is not None:
            found = next((m for msg in item.messages if isinstance(msg.get("content"), str)
                          for m in [pattern.search(msg["content"])] if m), None)
            if found:
                flagged += 1
                first = first or found.group(0)
    return n, flagged, first


def special_text_row(config: Config, name: str, flagged: int, first: str) -> SmokeRow:
    """A warning counting the prompts with special-token text, and how this run reads it."""
    reads = config.tokenizer.prompt_specials(config.api.self_hosted)
    how = ("read as the special token, as vLLM, SGLang and transformers serve tokenize the rendered prompt"
           if reads else "kept as text")
    return SmokeRow(f"{name}: special-token text", True,
                    f"{flagged} prompt(s) hold special-token text (e.g. {first!r}): {how} ([tokenizer] "
                    f"prompt_special_tokens = \"{'special' if reads else 'text'}\"; check the prompt tokens row)",
                    warning=True)


def _on_disk(rd: RunDir, ds: DatasetConfig) -> tuple[int, int, float]:
    """(answers, completion tokens, cost) already in the dataset's responses.jsonl."""
    answers = tokens = 0
    cost = 0.0
    for _, raw in iter_jsonl(rd.responses(ds.name)):
        usage = ResponseRecord.from_dict(raw).usage
        answers += 1
        tokens += usage.completion_tokens
        cost += usage.cost
    return answers, tokens, cost


def _answer_rows(config: Config, ds: DatasetConfig, body: dict[str, Any], a: ChatAnswer,
                 reconstruct_fn: Callable[..., Any]) -> list[SmokeRow]:
    label = f"{ds.name}:"
    ignore = {_norm(p) for p in (body.get("provider") or {}).get("ignore", []) or []}
    rows = [SmokeRow(f"{label} content", bool(a.content.strip()),
                     repr(a.content[:60]) if a.content.strip() else "empty content (reasoning may have used up "
                     "max_tokens)")]
    if _asks_reasoning(body):
        rows.append(SmokeRow(f"{label} reasoning", bool(a.reasoning),
                             f"{len(a.reasoning or '')} chars of reasoning" if a.reasoning else
                             "the request asks for reasoning but none came back (checked `reasoning`, "
                             "`reasoning_content`, `reasoning_details`)"))
    else:
        rows.append(SmokeRow(f"{label} reasoning", True, "not requested" if not a.reasoning else
                             f"not requested, yet {len(a.reasoning)} chars of reasoning came back"))
    tools_sent = bool(body.get("tools"))
    rows.append(SmokeRow(f"{label} tool calls", tools_sent or not a.tool_calls,
                         f"{len(a.tool_calls or [])} tool call(s)" + ("" if tools_sent or not a.tool_calls
                                                                      else " without tools in the request")))
    want = config.api.model
    model_ok = bool(a.model) and (_norm(a.model).startswith(_norm(want)) or _norm(want).startswith(_norm(a.model)))
    rows.append(SmokeRow(f"{label} model", model_ok, f"{a.model!r} (asked for {want!r})"))
    u = a.usage
    tokens = f"{u.prompt_tokens} prompt + {u.completion_tokens} completion tokens ({u.reasoning_tokens} reasoning)"
    if config.api.self_hosted:  # no usage.cost, no provider: the ledger prices tokens at [api] prices
        rows.append(SmokeRow(f"{label} usage", u.completion_tokens > 0,
                             f"{tokens}; cost n/a (self-hosted)" if u.completion_tokens > 0 else
                             f"no completion_tokens in usage ({tokens}): token budgets and prices need them"))
        rows.append(SmokeRow(f"{label} provider", True, "n/a (self-hosted)"))
    else:
        rows.append(SmokeRow(f"{label} usage", u.completion_tokens > 0 and u.cost > 0,
                             f"{tokens}, cost {usd(u.cost)}"
                             + ("" if u.cost > 0 else ": no cost in usage (budgets need it)")))
        provider_ok = bool(a.provider) and _norm(a.provider) not in ignore
        rows.append(SmokeRow(f"{label} provider", provider_ok,
                             f"{a.provider!r}" + (" is in provider.ignore" if not provider_ok else "")
                             if a.provider else "no provider in the response"))
    rows.append(SmokeRow(f"{label} finish", a.finish_reason == "stop",
                         f"finish_reason {a.finish_reason!r}, native {a.native_finish_reason!r}"))
    rec = reconstruct_fn(body["messages"], a)
    if rec is None:
        rows.append(SmokeRow(f"{label} tokens", False, "the tokenizer could not be loaded"))
        return rows
    rows.append(_tokens_row(config, label, rec, a.provider))
    rows.append(_prompt_row(config, label, rec, body["messages"], reconstruct_fn))
    return rows


def _tokens_row(config: Config, label: str, rec: Any, provider: str | None) -> SmokeRow:
    """The answer's ids: structure checked, count judged by the sample policy (a BPE split passes)."""
    from draftgen.core.tokens.fidelity import routing_name, toml_list
    from draftgen.core.tokens.policy import SamplePolicy
    verdict = SamplePolicy.from_config(config).judge(rec.failed_checks, rec.count_diff, rec.billed_tokens)
    detail = (f"{rec.span_tokens} answer tokens vs {rec.billed_tokens} billed (diff {rec.count_diff})"
              + (f"; failed: {', '.join(rec.failed_checks)}" if rec.failed_checks else "; all checks pass"))
    if rec.source == "backend" or "matches_backend" in rec.failed_checks:
        detail += ("; the server's token ids " + ("differ from" if "matches_backend" in rec.failed_checks
                                                   else "equal") + " the reconstruction")
    if verdict.cause == "count_mismatch" and provider:
        routing = config.request.get("provider")
        ignore = routing.get("ignore") if isinstance(routing, dict) else None
        names = [*(str(x) for x in ignore if isinstance(ignore, list)), routing_name(provider)] \
            if isinstance(ignore, list) else [routing_name(provider)]
        detail += (f"; {provider} counts this answer {abs(rec.count_diff) / max(1, rec.billed_tokens or 1):.1%} "
                   f"off: another tokenizer or quantization? To route around it, in [request.provider]: "
                   f"{toml_list('ignore', names)}")
    passed = verdict.keep and not rec.truncated
    if config.api.self_hosted and passed and rec.count_diff:
        # One server, one tokenizer: a finished answer's ids are exact or not the model's (no BPE split
        # between providers to excuse a difference, and no other provider to compare with).
        passed = False
        detail += (f"; a self-hosted answer that ended must count exactly: {rec.count_diff:+d} is the chat "
                   f"template (a generation prompt or end of turn a token off the server's: [tokenizer] "
                   f"template = \"auto\" with the served model's tokenizer), or a reasoning parser rewriting the "
                   f"text (see the stream row: [api] stream = true), or another tokenizer ([tokenizer] path)")
    return SmokeRow(f"{label} tokens", passed, detail)


def stream_pair(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`body` streamed and not, greedy and seeded, so a server answers both with the same ids."""
    base = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    base.update(temperature=0, seed=0)
    return {**base, "stream": True, "stream_options": {"include_usage": True}}, base


def _stream_row(config: Config, streamed: Any, plain: Any) -> SmokeRow:
    """Streamed and non-streamed text of one greedy request: they differ where a server's reasoning
    parser rewrites the whole answer (transformers serve strips the leading space of both parts)."""
    for what, a in (("streamed", streamed), ("non-streamed", plain)):
        if isinstance(a, SmokeRow):
            return SmokeRow("stream", False, f"the {what} comparison request failed: {a.detail}")
    same = (streamed.reasoning or "", streamed.content) == (plain.reasoning or "", plain.content)
    detail = (f"greedy request streamed vs not: reasoning {streamed.reasoning or ''!r} vs {plain.reasoning or ''!r}, "
              f"content {streamed.content[:40]!r} vs {plain.content[:40]!r}")
    if same:
        return SmokeRow("stream", True, "streamed and non-streamed text equal (" + detail + ")")
    if config.api.streams:
        return SmokeRow("stream", True, detail + ": the server rewrites non-streamed text; this run streams, "
                        "so it keeps the text as generated", warning=True)
    return SmokeRow("stream", False, detail + ": the server rewrites the text of non-streamed answers (a "
                    "reasoning parser), so their ids would not be the model's: set [api] stream = true")


def _prompt_row(config: Config, label: str, rec: Any, messages: list[dict[str, Any]],
                reconstruct_fn: Callable[..., Any]) -> SmokeRow:
    """The prompt the provider ran (usage.prompt_tokens) against the prompt the run reconstructs."""
    from draftgen.core.config import KIMI_DEFAULT_SYSTEM
    if rec.prompt_diff is None:
        return SmokeRow(f"{label} prompt tokens", False,
                        "no usage.prompt_tokens in the answer: the prompt cannot be checked")
    tol = config.validation.prompt_tolerance
    detail = (f"{rec.prompt_tokens} prompt tokens rendered vs {rec.billed_prompt_tokens} in usage.prompt_tokens "
              f"(diff {rec.prompt_diff}; system turn: {config.tokenizer.system_turn_why()})")
    if abs(rec.prompt_diff) <= tol:
        return SmokeRow(f"{label} prompt tokens", True, detail)
    # Would the other default system turn explain it? Say which setting matches the provider.
    current = config.tokenizer.system_turn()
    other = None if current is not None else KIMI_DEFAULT_SYSTEM
    alt = reconstruct_fn(messages, None, system=other)
    if alt is not None and alt.prompt_tokens is not None and abs(alt.prompt_tokens - rec.billed_prompt_tokens) <= tol:
        setting = "\"none\"" if other is None else '"' + other + '"'
        detail += (f"; the provider's count matches the prompt rendered with "
                   f"{'no default system turn' if other is None else 'the Kimi default system turn'}: "
                   f"set [tokenizer] default_system = {setting}")
    elif rec.count_diff == 0:
        # The answer counts exactly, so the template's turns agree with the server's: the text encodes otherwise.
        detail += (f"; the answer counts exactly, so the chat template is not the cause: possible tokenizer "
                   f"mismatch: draftgen encodes with {_origin(reconstruct_fn, config)}, the server loads its own "
                   f"tokenizer for the model (set [tokenizer] path to the folder the server serves)")
    else:
        detail += ("; the provider ran another prompt than the one reconstructed (a different chat template, "
                   "system turn or tool declarations), so every row's prompt would differ from what produced "
                   f"its answer; or a possible tokenizer mismatch (draftgen encodes with "
                   f"{_origin(reconstruct_fn, config)})")
    return SmokeRow(f"{label} prompt tokens", False, detail)


def _origin(reconstruct_fn: Callable[..., Any], config: Config) -> str:
    """The tokenizer file the smoke test encoded with (set once the tokenizer loaded)."""
    return str(getattr(reconstruct_fn, "origin", None) or config.tokenizer.path)


async def run_smoke(config: Config, api_key: str, progress: Callable[[snap.StageProgress], None] | None = None,
                    spend: SpendLedger | None = None, settler: Settler | None = None) -> SmokeResult:
    """Run the checklist, write smoke.json, return the result (never raises for a failed check).

    The smoke requests are billed like any other: each is reserved against `max_usd` at its worst
    case, on spend.jsonl before it leaves, and booked as it ends (billing.py). `spend` is the ledger of
    a run open in this process (its reservations count, `settler` prices what is abandoned); without
    one the directory's ledger is opened here, and what is abandoned is looked up by the next run or
    `draftgen ledger`."""
    redact = Redactor(api_key, config.api.management_key())
    result = SmokeResult(fingerprint="")
    shapes: dict[str, DatasetConfig] = {}

    def add(row: SmokeRow) -> None:
        result.rows.append(SmokeRow(row.check, row.passed, redact(row.detail), row.warning))
        if progress is not None:
            progress(snap.StageProgress("smoke", state=snap.StageState.RUNNING, done=len(result.rows),
                                        total=2 + len(config.datasets) + 9 * len(shapes),
                                        checks=tuple((r.check, r.passed, r.detail) for r in result.rows)))

    tok_and_template: list[Any] = []
    _unset = object()
    # The free checks first (precheck.py): nothing is paid for while a local input is unusable.
    local_error = ""
    try:
        await asyncio.to_thread(check_tokenizer, config)
    except DraftgenError as e:
        add(SmokeRow("tokenizer", False, str(e)))
        tok_and_template.append(None)
        local_error = "not sent: the tokenizer could not be loaded (see the tokenizer row)"
    counts: dict[str, int] = {}
    for ds in config.datasets:
        try:
            counts[ds.name] = (await asyncio.to_thread(_count_prompts, ds))[0]
        except DraftgenError as e:
            add(SmokeRow(f"{ds.name}: prompts", False, str(e)))
            counts[ds.name] = 0
            local_error = local_error or f"not sent: {ds.name}'s prompt file cannot be used (see its prompts row)"
    sent: list[bool] = []  # a request left: the smoke test ran (a passing smoke.json is replaced)

    def reconstruct_fn(messages: list[dict[str, Any]], a: ChatAnswer | None, system: Any = _unset) -> Any:
        """The answer `a` reconstructed; with `a` None, only the prompt (rendered with `system`)."""
        from draftgen.core.tokens.reconstruct import reconstruct
        from draftgen.core.tokens.template import load_template
        from draftgen.core.tokens.tokenizer import load_tokenizer
        specials = config.tokenizer.prompt_specials(config.api.self_hosted)
        if not tok_and_template:
            try:
                tok = load_tokenizer(config.tokenizer.path, config.tokenizer.trust_remote_code)
                reconstruct_fn.origin = getattr(tok, "origin", tok.name)  # type: ignore[attr-defined]
                tok_and_template.append((tok, load_template(config.tokenizer.template, tok,
                                                            default_system=config.tokenizer.system_turn(),
                                                            prompt_specials=specials)))
            except DraftgenError as e:
                add(SmokeRow("tokenizer", False, str(e)))
                tok_and_template.append(None)
        if tok_and_template[0] is None:
            return None
        tok, template = tok_and_template[0]
        if a is None:
            return reconstruct(tok, load_template(config.tokenizer.template, tok, default_system=system,
                                                  prompt_specials=specials), messages, "", "")
        return reconstruct(tok, template, messages, a.reasoning, a.content, billed_tokens=a.usage.completion_tokens,
                           backend_ids=a.token_ids, truncated=a.finish_reason == "length", tool_calls=a.tool_calls,
                           count_tolerance=config.validation.count_tolerance,
                           billed_prompt_tokens=a.usage.prompt_tokens, provider=a.provider)

    async with ChatClient(config.api.base_url, api_key, concurrency=4,
                          request_timeout_s=min(config.api.request_timeout_s, 600),
                          connect_timeout_s=config.api.connect_timeout_s, referer=config.api.referer,
                          title=config.api.title) as client:
        account: AccountStatus | None = None
        unreachable = False  # the address does not answer: advice is about the network, not the config
        eng = config.engine
        rng = random.Random()
        deadline = time.monotonic() + SMOKE_RETRY_S  # one window for the whole smoke test's retries
        tries = 0
        if config.api.self_hosted:
            add(SmokeRow("key", True, "n/a (self-hosted: [api] kind = \"openai-compatible\")"))
        else:
            try:
                while True:
                    tries += 1
                    try:
                        account = await read_account(client, management_key=config.api.management_key())
                        break
                    except RequestFailed as e:
                        delay = backoff_delay(min(tries, 16), eng.backoff_base_s, eng.backoff_max_s, e.retry_after,
                                              rng)
                        if not _outage(e) or tries >= SMOKE_TRIES or time.monotonic() + delay > deadline:
                            raise
                        await asyncio.sleep(delay)
                note_key_answer(config, None)
                add(SmokeRow("key", True, f"accepted (label {redact(str(account.label or 'unlabelled'))!r})"))
                result.balance_usd = account.balance
            except RequestFailed as e:
                unreachable = e.unreachable
                note_key_answer(config, e)
                if config.api.self_hosted:
                    add(SmokeRow("key", True, f"n/a (self-hosted: GET /key answered {e.status}, so "
                                 f"{config.api.base_url} is an openai-compatible server)"))
                else:
                    add(SmokeRow("key", False, (e.message if e.unreachable else f"GET /key: {e.message}")
                                 + (f" (after {tries} tries)" if tries > 1 else "")))
            except Exception as e:  # noqa: BLE001 - any network failure is this row's failure
                add(SmokeRow("key", False, f"GET /key failed: {type(e).__name__}: {e}"))
        # The request shapes are the kind's (an openai-compatible server gets no OpenRouter-only keys).
        result.fingerprint = config.run_fingerprint()
        for ds in config.datasets:
            shapes.setdefault(config.fingerprint(ds), ds)
        if warning := config.kind_warning():
            add(SmokeRow("request keys", True, warning, warning=True))
        prices, listing_error = await fetch_prices(client, config)
        for ds in config.datasets:
            p = prices[ds.name]
            if p is not None:
                body = smoke_body(config, ds)  # the reservation is the worst case of the body sent
                add(SmokeRow(f"{ds.name}: prices", True, f"worst case {p.describe()}; at most "
                             f"${body_worst_case(p, body, ds.max_tokens):.6f} for the smoke request at "
                             f"max_tokens {body_max_tokens(body, ds.max_tokens)}"))
            else:
                need = config.budget.max_usd is not None
                why = listing_error or "the routing allows no listed provider"
                hint = ("; the address does not answer (see the key row): the prices are read from its listing "
                        "once it does" if unreachable else
                        "; max_usd needs one: set [api] prompt_price_per_mtok and completion_price_per_mtok"
                        if need else "; no max_usd, so no ceiling to keep")
                add(SmokeRow(f"{ds.name}: prices", not need, f"no price known ({why}){hint}", warning=not need))

        rd = RunDir(config.run_dir)
        on_disk = {ds.name: await asyncio.to_thread(_on_disk, rd, ds) for ds in config.datasets}
        own_spend = spend is None
        # Without GET /key the key is in doubt (its row says why), and a new ledger could not record
        # the key's usage before its first attempt (`draftgen ledger --unknown-from-key` needs it).
        ledger_error = "" if account is not None or config.api.self_hosted else \
            "not sent: GET /key failed (see the key row)"
        if spend is None and not ledger_error:
            spend = SpendLedger(rd.spend)
            opening = asyncio.ensure_future(asyncio.to_thread(_open_spend, spend, rd, on_disk,
                                                              None if account is None else account.key_usage))
            try:
                await asyncio.shield(opening)
            except asyncio.CancelledError:  # quit while the thread opens it: close it (and its lock) once open
                with contextlib.suppress(Exception):
                    await opening
                spend.close()
                raise
            except LedgerBusyError as e:
                ledger_error = f"not sent: {e}"
            except (DiskError, OSError) as e:
                ledger_error = f"not sent: the spend ledger cannot be written ({e})"

        stream_row: SmokeRow | None = None

        async def ask(fp: str, ds: DatasetConfig, body: dict[str, Any] | None = None,
                      ) -> tuple[str, dict[str, Any], ChatAnswer | SmokeRow, float]:
            body = smoke_body(config, ds) if body is None else body
            fail = functools.partial(SmokeRow, f"{ds.name}: request", False)
            if local_error or ledger_error:
                return fp, body, fail(local_error or ledger_error), 0.0
            assert spend is not None
            p = prices[ds.name]
            if p is None and config.budget.max_usd is not None:
                return fp, body, fail("not sent: max_usd is set and no price is known (see the prices row)"), 0.0
            worst = body_worst_case(p, body, ds.max_tokens) if p else 0.0
            tries = 0
            while True:
                tries += 1
                after = f" (retry {tries - 1} after an outage)" if tries > 1 else ""
                ticket, why = reserve_one(spend, config.budget.max_usd, SMOKE, f"smoke:{ds.name}", worst)
                if ticket is None:
                    return fp, body, fail(why + after), 0.0
                start = time.monotonic()
                sent.append(True)
                try:
                    answer = await client.chat(body, functools.partial(spend.generation, ticket))
                    break
                except RequestFailed as e:
                    look_up(settler, book_failure(spend, ticket, e, p, self_hosted=config.api.self_hosted))
                    delay = backoff_delay(min(tries, 16), eng.backoff_base_s, eng.backoff_max_s, e.retry_after, rng)
                    if _outage(e) and tries < SMOKE_TRIES and time.monotonic() + delay <= deadline:
                        await asyncio.sleep(delay)  # each retry goes on the ledger with its own reservation
                        continue
                    return fp, body, fail(f"{e.kind}: {e.message}"
                                          + (f" (after {tries} tries)" if tries > 1 else "")), 0.0
                except Exception as e:  # noqa: BLE001 - any failure is this row's failure
                    look_up(settler, spend.abandoned(ticket))
                    return fp, body, fail(f"{type(e).__name__}: {e}"), 0.0
                except BaseException:  # cancelled mid-request: the provider may bill it anyway
                    look_up(settler, spend.abandoned(ticket))
                    raise
            look_up(settler, book_answer(spend, ticket, answer, p))
            return fp, body, answer, time.monotonic() - start

        # One request per shape, all at once: a run's shapes differ only in their parameters.
        try:
            answers = await asyncio.gather(*(ask(fp, ds) for fp, ds in shapes.items()))
            if config.api.self_hosted and shapes and not ledger_error:
                # The same greedy request streamed and not: a parser that rewrites non-streamed text shows.
                fp, ds = next(iter(shapes.items()))
                pair = await asyncio.gather(*(ask(fp, ds, b) for b in stream_pair(smoke_body(config, ds))))
                stream_row = _stream_row(config, pair[0][2], pair[1][2])
            # The ledger is the spend (the smoke requests and abandoned attempts included).
            spent = spend.spent_usd if spend is not None and spend.is_open else \
                await asyncio.to_thread(_spent_on_disk, rd, on_disk)
        finally:
            if own_spend and spend is not None:
                spend.close()

    smoke: SmokeFigures | None = None
    if stream_row is not None:
        add(stream_row)
    for fp, body, answer, took in answers:
        ds = shapes[fp]
        if isinstance(answer, SmokeRow):
            add(answer)
            continue
        add(SmokeRow(f"{ds.name}: request", True, f"answered in {took:.2f} s "
                     f"(shape {fp}, max_tokens {body['max_tokens']})"))
        rows = await asyncio.to_thread(_answer_rows, config, ds, body, answer, reconstruct_fn)
        for row in rows:
            add(row)
        if not answer.priced:  # no usage.cost: its row says so; the projection does not take it as $0
            continue
        for other in config.datasets:
            if config.fingerprint(other) == fp:
                result.cost_per_request[other.name] = answer.usage.cost
        if answer.usage.completion_tokens and (smoke is None or answer.usage.cost > smoke.cost_usd):
            smoke = SmokeFigures(answer.usage.completion_tokens, answer.usage.cost, took)

    figures = []
    for ds in config.datasets:
        n = counts[ds.name]
        loaded = tok_and_template[0] if tok_and_template else None
        if loaded and n:
            try:
                _, flagged, first = await asyncio.to_thread(_count_prompts, ds, loaded[0].special_tokens())
                if flagged:
                    add(special_text_row(config, ds.name, flagged, first))
            except DraftgenError as e:
                add(SmokeRow(f"{ds.name}: prompts", False, str(e)))
        answers, tokens, cost = on_disk[ds.name]
        figures.append(DatasetFigures(
            name=ds.name, remaining=max(0, n - answers), max_tokens=ds.max_tokens, concurrency=ds.concurrency,
            token_budget_left=None if ds.token_budget is None else max(0, ds.token_budget - tokens),
            answers=answers, completion_tokens=tokens, cost_usd=cost, prices=prices[ds.name]))
    result.smoke_answer = smoke
    plan = forecast(figures, spent_usd=spent, max_usd=config.budget.max_usd, smoke=smoke,
                    parallel=config.engine.parallel)
    known = plan.left_usd > 0 or not any(d.answers_left for d in plan.datasets)
    if known:
        result.projected_cost_usd = plan.total_usd
        result.projection = plan
    cap = config.budget.max_usd
    need = plan.total_usd - spent if known else None
    if config.api.self_hosted:
        add(SmokeRow("balance", True, "n/a (self-hosted): no account; the run keeps going under max_usd"
                     + (f" ({usd(cap)}, tokens at [api] prices)" if cap is not None else " (none set)")))
    elif account is None:
        add(SmokeRow("balance", False, "could not read the balance (GET /key failed)"))
    elif result.balance_usd is None:
        add(SmokeRow("balance", True, f"{redact(account.balance_detail)}. A warning, not a failure: the run keeps "
                     "going under max_usd" + (f" ({usd(cap)})" if cap is not None else " (none set)"), warning=True))
    elif need is None:
        add(SmokeRow("balance", result.balance_usd > config.budget.credit_floor_usd,
                     f"{usd(result.balance_usd)} ({account.balance_source}); no projection (no answer came back)"))
    else:
        ok = result.balance_usd - config.budget.credit_floor_usd >= need
        add(SmokeRow("balance", ok, f"{usd(result.balance_usd)} ({account.balance_source}) against {usd(need)} "
                     f"to finish (projected {plan.describe()}) + floor {usd(config.budget.credit_floor_usd)}"
                     + ("" if ok else ": the run would stop at the credit floor before finishing")))

    rd.root.mkdir(parents=True, exist_ok=True)
    if not sent and last_smoke(rd, result.fingerprint, "passed") is True:
        # Refused before any request (a run holds the ledger, a local input): the test did not run.
        add(SmokeRow("smoke.json", True, f"kept the last passing smoke test in {rd.smoke_json}: this one "
                     "sent no request", warning=True))
    else:
        write_json_atomic(rd.smoke_json, result.to_dict())  # a full disk: the last smoke.json stays as it was
    if progress is not None:
        final = snap.StageState.DONE if result.passed else snap.StageState.FAILED
        progress(snap.StageProgress("smoke", state=final, done=len(result.rows),
                                    total=len(result.rows), message=result.summary(),
                                    checks=tuple((r.check, r.passed, r.detail) for r in result.rows)))
    return result


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


def print_result(result: SmokeResult) -> None:
    from rich.console import Console
    from rich.markup import escape

    from draftgen.core.checklist import checklist_table
    console = Console()
    # Details quote the upstream (answers, error bodies): "[/INST]" there is text, not rich markup.
    console.print(checklist_table("draftgen smoke test", ((r.check, r.passed, r.detail, r.warning)
                                                          for r in result.rows)))
    for name, cost in result.cost_per_request.items():
        console.print(f"cost per request ({escape(name)}): {usd(cost)}")
    if result.projection is not None:
        console.print(f"projected run cost, every dataset: {escape(result.projection.describe())}")
        for d in result.projection.datasets:
            console.print(f"  {escape(d.name)}: {d.answers_left} answers of ~{d.tokens_per_answer:.0f} tokens "
                          f"({d.basis}): {usd(d.cost_usd)} ({usd(d.low_usd)}-{usd(d.high_usd)})"
                          + (f", ~{d.time_s / 60:.0f} min" if d.time_s is not None else ""))
    console.print(("[green]PASSED[/]: " if result.passed else "[bold red]FAILED[/]: ") + escape(result.summary()))


def smoke_command(config: Config, api_key: str) -> int:
    result = runtime.run(run_smoke(config, api_key))
    print_result(result)
    return 0 if result.passed else 1
