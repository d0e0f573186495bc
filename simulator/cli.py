"""`draftgen simulate`: serve the simulator until Ctrl-C (the main CLI wires these two in)."""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import signal
import sys
import time

from draftgen.simulator.config import SimConfig, SimulatorError, parse_faults
from draftgen.simulator.scenarios import BY_NAME, parse_scenarios
from draftgen.simulator.server import SimServer

# The variable the simulator reads the key it requires from (never a flag: argv is public in `ps`).
KEY_ENV = "DRAFTGEN_SIM_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=8787, help="TCP port (0: any free port; default 8787)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; the simulator has no real security)")
    p.add_argument("--seed", type=int, default=0, help="seed for answers, providers and faults (default 0)")
    p.add_argument("--faults", default="", metavar="KIND=RATE,...",
                   help="fault rates per request, e.g. 429=0.3,500=0.1,drop=0.05; kinds: 429 500 502 503 "
                        "524 drop hang truncated error200 finish_error empty_choices")
    p.add_argument("--latency-scale", type=float, default=1.0,
                   help="multiply the realistic latency (0: answer at once; default 1)")
    p.add_argument("--fixed-latency", type=float, default=None, metavar="SECONDS",
                   help="every answer takes exactly this long (overrides --latency-scale)")
    p.add_argument("--credits", type=float, default=100.0, help="credit balance in USD (default 100)")
    p.add_argument("--mean-tokens", type=int, default=1200,
                   help="mean completion tokens of an answer, reasoning included (default 1200)")
    p.add_argument("--key-env", default=KEY_ENV, metavar="NAME",
                   help=f"require the API key held in this environment variable (default {KEY_ENV}; unset or "
                        "empty: any non-empty bearer key is accepted); never printed")
    # Gone: a key in argv is in `ps` for every local user. Kept only to say so.
    p.add_argument("--key", default=None, help=argparse.SUPPRESS)
    p.add_argument("--retry-after", type=float, default=1.0, help="Retry-After seconds sent with 429s")
    p.add_argument("--hang", type=float, default=600.0, metavar="SECONDS",
                   help="how long a 'hang' fault holds the connection (default 600)")
    p.add_argument("--max-in-flight", type=int, default=None,
                   help="answer 429 above this many concurrent requests, like a provider's limit")
    p.add_argument("--tokens-drift", type=float, default=0.0,
                   help="share of answers whose billed completion_tokens is off by one")
    p.add_argument("--scenario", action="append", default=[], metavar="NAME[:KEY=VALUE...][,NAME...]",
                   help="switch scenarios on at start (repeatable), e.g. key_limit:after=30 or "
                        "rate_limited:rate=0.2:duration=60; params rate, after, duration, match and "
                        "per scenario more (docs/simulate.md); at run time: POST /_sim/scenario. "
                        f"Names: {' '.join(BY_NAME)}")
    p.add_argument("--key-limit", type=float, default=None, metavar="USD",
                   help="the key's own spending cap (GET /key data.limit); 403 once reached")
    p.add_argument("--management-key", action="append", default=None, metavar="KEY",
                   help="a key that may read GET /credits (repeatable); others get 403 there "
                        "(default: any accepted key may)")
    p.add_argument("--generation-delay", type=float, default=0.0, metavar="SECONDS",
                   help="how long after a generation ends GET /generation?id= finds it (default 0)")
    p.add_argument("--chunk-tokens", type=int, default=12, metavar="N",
                   help="tokens per SSE event of a streamed answer (default 12; OpenRouter sends a few)")
    p.add_argument("--status-every", type=float, default=10.0, metavar="SECONDS",
                   help="print a status line this often while requests come in (0: never)")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    if args.key is not None:
        raise SimulatorError(f"draftgen simulate: --key is no longer accepted (a key on the command line is "
                             f"visible to every local user in `ps`): export {args.key_env}=... instead "
                             f"(or name another variable with --key-env)")
    key = os.environ.get(args.key_env, "") or None
    return SimConfig(
        seed=args.seed, faults=parse_faults(args.faults), latency_scale=args.latency_scale,
        fixed_latency_s=args.fixed_latency, credits=args.credits, mean_completion_tokens=args.mean_tokens,
        api_key=key, retry_after_s=args.retry_after, hang_s=args.hang, max_in_flight=args.max_in_flight,
        tokens_drift=args.tokens_drift, key_limit_usd=args.key_limit,
        management_keys=tuple(args.management_key) if args.management_key else None,
        generation_delay_s=args.generation_delay, stream_chunk_tokens=args.chunk_tokens,
        scenarios={name: params for spec in args.scenario for name, params in parse_scenarios(spec).items()},
    )


def run(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C or SIGTERM; a bad flag raises SimulatorError (a DraftgenError)."""
    return asyncio.run(_serve(config_from_args(args), args.host, args.port, args.status_every))


async def _serve(cfg: SimConfig, host: str, port: int, status_every: float) -> int:
    sim = SimServer(cfg, host=host, port=port)
    try:
        await sim.start()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise SimulatorError(f"draftgen simulate: port {port} on {host} is in use; "
                                 "pick another with --port") from None
        raise SimulatorError(f"draftgen simulate: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    faults = ", ".join(f"{k}={v:g}" for k, v in cfg.faults.items()) or "none"
    latency = f"fixed {cfg.fixed_latency_s:g} s" if cfg.fixed_latency_s is not None else f"x{cfg.latency_scale:g}"
    print(f"draftgen simulate: OpenRouter-compatible API at {sim.base_url}", flush=True)
    scenarios = ", ".join(cfg.scenarios) or "none"
    print(f"  seed {cfg.seed}, faults {faults}, scenarios {scenarios}, latency {latency}, credits ${cfg.credits:g}, "
          f"mean answer {cfg.mean_completion_tokens} tokens, key {'required' if cfg.api_key else 'any'}", flush=True)
    print(f'  use it: [api] base_url = "{sim.base_url}" (any non-empty key unless ${KEY_ENV} or --key-env '
          'names one); Ctrl-C stops',
          flush=True)
    print(f"  switch scenarios at run time: POST http://{host}:{sim.port}/_sim/scenario "
          '{"name": "key_limit", "on": true}', flush=True)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"  warning: listening on {host}: anyone who can reach it can use and reconfigure it",
              file=sys.stderr, flush=True)
    try:
        last = -1
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=status_every if status_every > 0 else None)
            except TimeoutError:
                st = sim.stats
                if st.requests_total != last:
                    last = st.requests_total
                    print(_status_line(sim), flush=True)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        print(_status_line(sim), flush=True)
        await sim.close()
    return 0


def _status_line(sim: SimServer) -> str:
    st = sim.stats
    faults = sum(st.faults.values())
    return (f"{time.strftime('%H:%M:%S')} requests {st.requests_total}, in flight {st.in_flight} "
            f"(peak {st.peak_in_flight}), answers {st.answers_total}, faults {faults}, "
            f"billed ${st.billed_usd:.4f}, balance ${sim.balance:.4f}")
