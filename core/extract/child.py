"""An extraction in a child process: how the specforge backend runs outside torchrun (the TUI's `x`).

SGLang 0.5.14 keeps its model-parallel state in module globals (srt/distributed/parallel_state.py:
`_WORLD`, `_TP`, `_PP`, `_MOE_EP`, `_MOE_TP`, `_MOE_DP`, `_ATTN_TP`, `_ATTN_CP`, ...), and
`initialize_model_parallel` asserts `_TP is None`. SpecForge's `destroy_distributed` tears down only
its own groups and torch's default one, so a second capture in the same process trips that assert.
SGLang's own `destroy_model_parallel` + `destroy_distributed_environment` would reset those, but
not the server-args global, dp-attention's globals or the custom all-reduce buffers, and the
weights' GPU memory is only sure to go back when the process ends. So each such extraction runs in
a fresh process (spawned: CUDA must not be inherited), which ends with it.

`extract_in_child()` takes what `runner.extract()` takes: the progress callback gets the child's
StageProgress (sent over a queue), `stop` is relayed to the child (which stops after the batch in
progress, as in-process), and the child's ExtractStats is returned, or its error raised here as
the same DraftgenError class with the same message. Under torchrun every rank is already its own
process and runs once: nothing to do there.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

from draftgen.core import errors
from draftgen.core.config import Config
from draftgen.core.errors import DraftgenError
from draftgen.core.live.snapshot import StageProgress

POLL_S = 0.2


def needs_child(backend_name: str, backend: object, group: object, env: Mapping[str, str] | None = None) -> bool:
    """True for the specforge backend made here, outside torchrun (the only case that runs twice in a process)."""
    env = os.environ if env is None else env
    return backend_name == "specforge" and backend is None and group is None and "WORLD_SIZE" not in env


def _child(target: Callable[..., Any], config: Config, shard: tuple[int, int], out: Any, stop: Any,
           on_other_merge: str, validate: bool = False) -> None:
    """The child's side: the whole extraction (`target`, runner.extract: passed in, so that this module and
    the runner do not import each other), its progress and its end sent on `out`."""
    try:
        stats = target(config, shard=shard, progress=lambda p: out.put(("progress", p)), stop=stop, in_child=True,
                       on_other_merge=on_other_merge, validate=validate)
        out.put(("done", stats))
    except DraftgenError as e:
        out.put(("error", f"{type(e).__module__}:{type(e).__qualname__}", str(e)))
    except BaseException as e:  # a bug or a library's own error: said in words, the traceback on stderr
        import traceback
        traceback.print_exc()
        out.put(("error", "DraftgenError", f"extraction process failed: {type(e).__name__}: {e}"))


def _raise(kind: str, message: str) -> None:
    """The child's DraftgenError raised here as its own class (`module:name`; only draftgen's own modules are
    looked in), else as a DraftgenError with the same message."""
    module, _, name = kind.rpartition(":")
    cls: Any = DraftgenError
    if module.startswith("draftgen."):
        try:
            cls = getattr(importlib.import_module(module), name, DraftgenError)
        except ImportError:
            cls = DraftgenError
    elif not module:
        cls = getattr(errors, name, DraftgenError)
    if not (isinstance(cls, type) and issubclass(cls, DraftgenError)):
        cls = DraftgenError
    raise cls(message)


def extract_in_child(config: Config, *, shard: tuple[int, int] = (0, 1),
                     progress: Callable[[StageProgress], None] | None = None,
                     stop: threading.Event | None = None, on_other_merge: str = "refuse",
                     target: Callable[..., Any], validate: bool = False) -> Any:
    """`target(config, ...)` (runner.extract, which passes itself) in a spawned process; its ExtractStats, or
    its DraftgenError raised here."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child_stop = ctx.Event()
    proc = ctx.Process(target=_child, args=(target, config, shard, out, child_stop, on_other_merge, validate),
                       name="draftgen-extract", daemon=True)
    proc.start()
    try:
        while True:
            if stop is not None and stop.is_set():
                child_stop.set()
            try:
                msg = out.get(timeout=POLL_S)
            except queue.Empty:
                if not proc.is_alive():
                    try:  # its last words may have landed just before it ended
                        msg = out.get(timeout=POLL_S)
                    except queue.Empty:
                        raise DraftgenError(f"the extraction process ended without a result (exit code "
                                            f"{proc.exitcode}; its output above says why)") from None
                else:
                    continue
            if msg[0] == "progress":
                if progress is not None:
                    progress(msg[1])
            elif msg[0] == "done":
                return msg[1]
            else:
                _raise(msg[1], msg[2])
    finally:
        child_stop.set()  # an exception here (KeyboardInterrupt) stops the child after its batch
        proc.join(timeout=600)
        if proc.is_alive():
            proc.kill()
            proc.join()
        out.close()
