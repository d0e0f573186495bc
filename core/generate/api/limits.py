"""The open-file limit: each connection in flight is a socket, so 2,000 in flight need 2,000+ fds."""

from __future__ import annotations

import gc
import resource

from draftgen.core.errors import DraftgenError

# Files the process holds besides its sockets: output files, the tokenizer, workers' pipes, the TUI.
FD_HEADROOM = 256


def ensure_open_files(concurrency: int) -> int:
    """Raise the soft RLIMIT_NOFILE to fit `concurrency` connections; refuse clearly if it cannot."""
    need = concurrency + FD_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise DraftgenError(
                f"a concurrency of {concurrency} needs {need} open files, but this shell allows at most "
                f"{hard} (ulimit -Hn). Raise the hard limit (e.g. `ulimit -n {need}` as root, or "
                f"LimitNOFILE / /etc/security/limits.conf) or lower the datasets' concurrency.")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        soft = need
    return soft


# Tracked containers (frames, futures, dicts, records) one request in flight keeps alive: the young
# generation is sized so that these alone never trigger a collection (each would traverse them all).
# Counted at 2,000 in flight against the simulator (gc.get_objects(0) as a young collection began):
# ~88 a request, aiohttp's included (8 coroutines, 10 lists, 10 closure cells, 8 bound methods...);
# at 64 one such collection came in every 10,000-request run, 35-160 ms of CPU with the loop stalled.
GC_OBJECTS_PER_REQUEST = 128


def tune_gc(concurrency: int = 0) -> None:
    """Keep collector pauses short and rare with thousands of requests in flight: what exists before
    the run (modules, config, the UI) is frozen out of every collection, and the young generation
    holds the objects of `concurrency` requests in flight, so young collections come only when
    garbage accumulates (at 10,000 they traversed the live requests every ~150 answers, ~12% of the
    engine's CPU at 2,000 in flight) and the full ones (which stalled the loop for 100+ ms) rarely."""
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, 10_000, GC_OBJECTS_PER_REQUEST * concurrency), max(gen1, 20), max(gen2, 50))
