"""The control endpoints (no auth: loopback only, for tests and rehearsals in another process).

- `GET /_sim/stats[?prompts=0]`: SimStats, plus `balance`, `account` and the scenarios on.
- `GET /_sim/config`; `POST /_sim/config`: a JSON patch of SimConfig fields, plus `balance` (set
  the remaining credit) and `add_credits` (USD to add), e.g. `{"key_limit_usd": 50}` raises a
  key's cap.
- `GET /_sim/sent`: the latest chat requests as received (`SimServer.sent`: seq, messages,
  prompt_tokens), kept with `sent_log_size` > 0.
- `GET /_sim/scenario`: the scenarios on, and every known one with its status and description.
- `POST /_sim/scenario`: `{"name": "key_limit", "on": true, "params": {"after": 5}}`;
  `{"name": ..., "on": false}`; `{"clear": true}` switches every scenario off.
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson
from aiohttp import web

from draftgen.simulator import responses
from draftgen.simulator.account import Account
from draftgen.simulator.config import SimConfig, SimulatorError
from draftgen.simulator.scenarios import SCENARIOS, Scenarios
from draftgen.simulator.stats import Sent, SimStats


class _Sim(Protocol):
    """What the control endpoints read and change of one simulator (server.py `SimServer`, which adds
    these routes: this module stays below it)."""

    scenarios: Scenarios
    account: Account

    @property
    def config(self) -> SimConfig: ...
    @property
    def stats(self) -> SimStats: ...
    @property
    def sent(self) -> tuple[Sent, ...]: ...
    @property
    def balance(self) -> float: ...
    def update(self, **changes: Any) -> SimConfig: ...
    def set_balance(self, usd: float) -> None: ...
    def scenario(self, name: str, on: bool = True, **params: Any) -> None: ...


def add_routes(app: web.Application, sim: _Sim) -> None:
    control = _Control(sim)
    app.router.add_get("/_sim/stats", control.stats)
    app.router.add_get("/_sim/config", control.get_config)
    app.router.add_get("/_sim/sent", control.get_sent)
    app.router.add_post("/_sim/config", control.post_config)
    app.router.add_get("/_sim/scenario", control.get_scenario)
    app.router.add_post("/_sim/scenario", control.post_scenario)


class _Control:
    """The handlers of the control endpoints, on one simulator."""

    def __init__(self, sim: _Sim) -> None:
        self.sim = sim

    async def stats(self, request: web.Request) -> web.Response:
        sim = self.sim
        prompts = request.query.get("prompts", "1") not in ("0", "false", "no")
        data = sim.stats.to_json(prompts=prompts)
        data["balance"] = sim.balance
        data["account"] = sim.account.to_json()
        data["scenarios_on"] = sim.scenarios.to_json()
        return responses.json_response(data)

    async def get_sent(self, request: web.Request) -> web.Response:
        return responses.json_response([s.to_json() for s in self.sim.sent])

    async def get_config(self, request: web.Request) -> web.Response:
        return responses.json_response(self.sim.config.to_json())

    async def post_config(self, request: web.Request) -> web.Response:
        sim = self.sim
        patch = await _json_object(request, "POST /_sim/config", "SimConfig fields")
        if isinstance(patch, web.Response):
            return patch
        try:
            balance = patch.pop("balance", None)
            add = patch.pop("add_credits", None)
            if "providers" in patch:
                patch["providers"] = tuple(patch["providers"])
            if patch:
                sim.update(**patch)
            if balance is not None:
                sim.set_balance(float(balance))
            if add is not None:
                sim.update(credits=sim.config.credits + float(add))
        except (SimulatorError, TypeError, ValueError) as exc:
            return responses.error(400, str(exc))
        return responses.json_response(sim.config.to_json())

    async def get_scenario(self, request: web.Request) -> web.Response:
        return responses.json_response({
            "on": self.sim.scenarios.to_json(),
            "known": [{"name": s.name, "status": s.status, "class": s.klass, "sends": s.sends} for s in SCENARIOS],
        })

    async def post_scenario(self, request: web.Request) -> web.Response:
        sim = self.sim
        cmd = await _json_object(request, "POST /_sim/scenario", '{"name": ..., "on": true, "params": {...}}')
        if isinstance(cmd, web.Response):
            return cmd
        try:
            if cmd.get("clear"):
                sim.scenarios.clear()
            elif "name" in cmd:
                params = cmd.get("params") or {}
                if not isinstance(params, dict):
                    raise SimulatorError("POST /_sim/scenario: params must be a JSON object")
                sim.scenario(str(cmd["name"]), cmd.get("on", True) is not False, **params)
            else:
                raise SimulatorError('POST /_sim/scenario: give "name" (and "on", "params") or "clear"')
        except SimulatorError as exc:
            return responses.error(400, str(exc))
        return responses.json_response({"on": sim.scenarios.to_json()})


async def _json_object(request: web.Request, what: str, shape: str) -> dict[str, Any] | web.Response:
    try:
        data = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return responses.error(400, f"{what}: body is not JSON")
    if not isinstance(data, dict):
        return responses.error(400, f"{what}: body must be a JSON object of {shape}")
    return data
