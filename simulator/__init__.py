"""`draftgen simulate`: a local OpenRouter-compatible API with latency, a provider mix, prices,
credits, faults and every documented response as a scenario, for tests, the demo, benchmarks
and rehearsals (see server.py)."""

from draftgen.simulator.config import (
    DEFAULT_PROVIDERS,
    FAULT_KINDS,
    SimConfig,
    SimProvider,
    SimulatorError,
    parse_faults,
)
from draftgen.simulator.scenarios import SCENARIOS, parse_scenarios
from draftgen.simulator.server import SimServer
from draftgen.simulator.stats import SimStats, prompt_key

__all__ = [
    "DEFAULT_PROVIDERS", "FAULT_KINDS", "SCENARIOS", "SimConfig", "SimProvider", "SimServer", "SimStats",
    "SimulatorError", "parse_faults", "parse_scenarios", "prompt_key",
]
