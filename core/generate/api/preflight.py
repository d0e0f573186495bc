"""The start-up check with causes: before a run (and its smoke gate) asks anything, GET /key with
the run's key. A refused key stops the run ("the API key … was refused (401 …)", exit 4); an
address that does not answer ("cannot connect to 127.0.0.1:18799 (connection refused)") is said at
once, and the run waits for it like any outage (its status line says WAITING and why). A missing
or broken prompt file is named when its dataset starts ("PATH: prompt file not found").

The same answer tells the server's kind (`[api] kind = "auto"` off openrouter.ai): GET /key answered
is OpenRouter (or the simulator); a 404 or 405 is a self-hosted OpenAI-compatible server.

A self-hosted server asked for its token ids is then asked which server and release it is
(`detect_server`: vLLM's GET /version, SGLang's GET /server_info or /get_server_info), so that each
request asks for the ids the way that release takes them (core/servers.py)."""

from __future__ import annotations

import aiohttp

from draftgen.core.config import Config
from draftgen.core.errors import KeyRefusedError, UnreachableError
from draftgen.core.generate.api.account import AccountStatus, read_account
from draftgen.core.generate.api.classify import AccountCondition, RequestFailed, unreachable_advice
from draftgen.core.generate.api.client import ChatClient
from draftgen.core.secrets import Redactor
from draftgen.core.server_kinds import answered_kind
from draftgen.core.servers import Server, server_from_answers


async def check_api(config: Config, api_key: str, redact: Redactor | None = None) -> AccountStatus:
    """GET /key with the run's key: the address answers and the key is accepted (`redact`: the run's)."""
    redact = redact or Redactor(api_key, config.api.management_key())
    async with ChatClient(config.api.base_url, api_key, concurrency=1,
                          connect_timeout_s=config.api.connect_timeout_s, redact=redact) as client:
        try:
            status = await read_account(client, management_key=config.api.management_key(),
                                        timeout_s=max(10.0, config.api.connect_timeout_s))
            note_key_answer(config, None)
            await detect_server(config, client)
            return status
        except RequestFailed as e:
            note_key_answer(config, e)
            if not e.unreachable:
                await detect_server(config, client)
            if e.unreachable:
                cause = redact(e.message.removeprefix("GET /key: "))
                advice = unreachable_advice(config.api.base_url, cause, config.path)
                raise UnreachableError(f"{cause}: {advice}") from None
            if e.account is AccountCondition.KEY_REFUSED:
                raise KeyRefusedError(f"the API key in ${config.api.api_key_env} was refused by "
                                      f"{config.api.base_url}/key ({redact(e.message)}): set a valid key "
                                      "(revoked or mistyped?) and run again") from None
            return AccountStatus()  # /key is odd here, but the key may still run completions
        except TimeoutError:
            cause = f"{config.api.base_url}/key did not answer"
            raise UnreachableError(f"{cause}: {unreachable_advice(config.api.base_url, cause, config.path)}") from None


# GET /key's statuses from a server that has no such endpoint (FastAPI, vLLM, SGLang, llama.cpp).
NO_KEY_ENDPOINT = frozenset({404, 405})


def note_key_answer(config: Config, e: RequestFailed | None) -> None:
    """Record what GET /key said about the server's kind (`e` None: it answered), for kind "auto", in the
    run's server profile (`ApiConfig.server`)."""
    api = config.api
    if api.server.configured is not None:
        return
    if e is None or e.status in NO_KEY_ENDPOINT:
        api.server.note_kind(answered_kind(has_key_endpoint=e is None))


# Where each server says its release: vLLM's GET /version ({"version": "0.13.0"}); SGLang has no
# /version, its server info carries "version" (/get_server_info in every release, /server_info from 0.5.x).
VERSION_PATHS = (("version", "/version"), ("server_info", "/server_info"), ("server_info", "/get_server_info"))


async def detect_server(config: Config, client: ChatClient) -> Server | None:
    """Which self-hosted server answers at [api] base_url and its release, noted in the run's server
    profile for the request bodies (core/servers.py); None, noted too, for a server that says neither
    (its ids are then asked the vLLM way, and what does not come back is counted). Asked only where ids
    are wanted."""
    api = config.api
    if not api.return_token_ids or not api.server.kind.returns_ids:
        return None
    reached, found = await ask_release(client)
    if not reached:  # nothing said: asked again by the next start (the run's, the smoke test's)
        return None
    api.server.note_release(found)
    return found


async def ask_release(client: ChatClient) -> tuple[bool, Server | None]:
    """(whether the server could be reached, the server and release it says it is: None when it names none)."""
    for what, path in VERSION_PATHS:
        try:
            answer = await client.get_json(path, at_root=True)
        except RequestFailed as e:
            if e.unreachable:
                return False, None
            continue
        except (TimeoutError, aiohttp.ClientError):  # a probe never takes the run down
            continue
        found = server_from_answers(**{what: answer})
        if found is not None:
            return True, found
    return True, None
