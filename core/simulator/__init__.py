"""`draftgen simulate`: a local OpenRouter-compatible API with latency, a provider mix, credits
and faults, for tests, the demo, benchmarks and rehearsals (see server.py)."""

from draftgen.core.simulator.config import DEFAULT_PROVIDERS, FAULT_KINDS, SimConfig, SimProvider, SimulatorError, parse_faults
from draftgen.core.simulator.server import SimServer
from draftgen.core.simulator.stats import SimStats, prompt_key

__all__ = [
    "DEFAULT_PROVIDERS", "FAULT_KINDS", "SimConfig", "SimProvider", "SimServer", "SimStats",
    "SimulatorError", "parse_faults", "prompt_key",
]
