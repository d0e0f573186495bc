"""The worker pool of a live reconstruction (core/tokens/during_run.py), which outlives its workers.

A worker that dies (kill -9, the OOM killer) breaks the whole pool: every batch in flight fails at
once. They are held, a new pool is started and they are sent again. After `max_restarts()` new pools
it gives up for the rest of the run and says so once; every batch sent after that is lost at once.
Each batch comes back to its owner through `on_landed` or `on_lost`, with the key it was sent with.

The first pool starts beside the run (`open` returns before its workers have loaded the tokenizer):
batches sent until they are ready are held like those waiting for a new pool, and a first pool whose
worker dies (or cannot start) before it is ready is replaced the same way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import concurrent.futures.process
from collections.abc import Callable
from functools import partial
from typing import Any, Generic, TypeVar

from draftgen.core.live import stage_payloads as ev
from draftgen.core.live.events import EventSink
from draftgen.core.tokens.reconstruct import Answer
from draftgen.core.tokens.workers import Results, WorkerSpec, new_pool, ping, reconstruct_batch

K = TypeVar("K")
Batch = list[Answer]
Pool = concurrent.futures.ProcessPoolExecutor


class RespawningPool(Generic[K]):
    """Sends batches of answers to worker processes and starts new workers when they die."""

    def __init__(self, spec: WorkerSpec, workers: int, *, hint: str, max_restarts: Callable[[], int],
                 on_landed: Callable[[K, Batch, Results], None],
                 on_lost: Callable[[K, Batch, BaseException], None],
                 on_give_up: Callable[[str], None], on_event: EventSink) -> None:
        self._spec = spec
        self.workers = workers
        self._hint = hint  # how to finish without it, said when it gives up
        self._max_restarts = max_restarts  # read when a pool breaks: the owner's limit may change until then
        self._landed = on_landed
        self._lost = on_lost
        self._give_up_to = on_give_up
        self._event = on_event
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: Pool | None = None
        self.inflight: set[asyncio.Future[Any]] = set()
        self.held: list[tuple[K, Batch]] = []  # batches waiting for a new pool
        self.restart: asyncio.Task[None] | None = None
        self.restarts = 0
        self._gave_up = ""  # why, once it gave up

    async def open(self) -> None:
        """Start the first pool without waiting for its workers: their processes are started (off the
        event loop) and load the tokenizer while the run's first requests go out. Batches sent until
        every worker is ready are held and sent then; a worker that dies before it is ready is replaced
        like one that dies later (`_replace`). The caller loaded the tokenizer itself first: one that
        cannot load is its clear error before anything is sent."""
        self._loop = asyncio.get_running_loop()
        pool, pings = await asyncio.to_thread(self._spawn)
        self._pool = pool  # shut down by the owner (`detach`) even if it never becomes ready
        self.restart = asyncio.ensure_future(self._until_ready(pool, pings))

    async def _until_ready(self, pool: Pool, pings: list[concurrent.futures.Future[bool]]) -> None:
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in pings), return_exceptions=True)
        if any(isinstance(r, BaseException) for r in results):  # a worker died (or could not start) first
            await self._replace(pool)
            return
        self.restart = None
        self.release_held()

    def _spawn(self) -> tuple[Pool, list[concurrent.futures.Future[bool]]]:
        """A new pool whose worker processes are started, each loading the tokenizer (blocking: call it off
        the event loop); with one ping per worker, answered once that worker is ready."""
        pool = new_pool(self._spec, self.workers)
        try:
            return pool, [pool.submit(ping) for _ in range(self.workers)]
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise

    def _new_pool(self) -> Pool:
        """A new pool whose every worker is ready (blocking: call it off the event loop)."""
        pool, pings = self._spawn()
        try:
            for fut in pings:
                fut.result()
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        return pool

    def detach(self) -> Pool | None:
        """The current pool, for its owner to shut down; nothing more is sent to it."""
        pool, self._pool = self._pool, None
        return pool

    @property
    def busy(self) -> bool:
        """Some batch is in flight, held for a new pool, or a pool is starting (the first one included)."""
        return bool(self.inflight or self.restart is not None or self.held)

    @property
    def backlog(self) -> int:
        """Batches in flight or held for a new pool."""
        return len(self.inflight) + len(self.held)

    async def wait_one(self) -> bool:
        """Wait for a pool to start or for one batch in flight to come back; False when neither is."""
        if self.restart is not None:
            await asyncio.wait({self.restart})
        elif self.inflight:
            await asyncio.wait(set(self.inflight), return_when=asyncio.FIRST_COMPLETED)
        else:
            return False
        return True

    # -- sending --------------------------------------------------------------------------------

    def send(self, key: K, batch: Batch) -> None:
        if self._gave_up:
            self._lost(key, batch, RuntimeError(self._gave_up))
            return
        pool = self._pool
        if pool is None or self.restart is not None:
            self.held.append((key, batch))  # sent when the new pool is up
            return
        assert self._loop is not None
        try:
            fut = self._loop.run_in_executor(pool, reconstruct_batch, batch)
        except concurrent.futures.process.BrokenProcessPool:  # broke before its first failed future came back
            self._broken(key, batch, pool)
            return
        except RuntimeError as e:  # shut down
            self._lost(key, batch, e)
            return
        self.inflight.add(fut)
        fut.add_done_callback(partial(self._came_back, key, batch, pool))

    def _came_back(self, key: K, batch: Batch, pool: Pool, fut: asyncio.Future[Results]) -> None:
        self.inflight.discard(fut)
        if fut.cancelled():
            self._lost(key, batch, RuntimeError("cancelled"))
            return
        exc = fut.exception()
        if isinstance(exc, concurrent.futures.process.BrokenProcessPool):
            self._broken(key, batch, pool)
            return
        if exc is not None:
            self._lost(key, batch, exc)
            return
        self._landed(key, batch, fut.result())

    def release_held(self) -> None:
        held, self.held = self.held, []
        for key, batch in held:
            self.send(key, batch)

    # -- dead workers -------------------------------------------------------------------------------

    def _broken(self, key: K, batch: Batch, pool: Pool) -> None:
        """A batch of a pool whose worker died: held for the next pool (one restart per broken pool)."""
        self.held.append((key, batch))
        if self.restart is not None:
            return
        if pool is self._pool:
            self.restart = asyncio.ensure_future(self._replace(pool))
        else:  # a late failure of a pool already replaced: straight to the new one
            self.release_held()

    async def _replace(self, broken: Pool) -> None:
        self._pool = None
        self.restarts += 1
        hint = self._hint
        try:
            await asyncio.to_thread(broken.shutdown, wait=True)  # the pool has already stopped its other workers
            await asyncio.sleep(0)  # the other batches of the broken pool come back first, to be held too
            held = sum(len(b) for _, b in self.held)
            limit = self._max_restarts()
            if self.restarts > limit:
                self._give_up(f"token reconstruction stopped: its worker processes died {self.restarts} times "
                              f"(killed, or out of memory); the answers without tokens stay in responses.jsonl: {hint}")
                return
            self._event(ev.TokensWorkerDied(restarts=self.restarts, limit=limit, in_flight=held))
            pool = await asyncio.to_thread(self._new_pool)
        except BaseException as e:  # no new pool (or cancelled): said once, the run goes on without tokens
            self._give_up(f"token reconstruction stopped: new worker processes could not start ({type(e).__name__}: "
                          f"{e}); {hint}")
            if not isinstance(e, Exception):
                raise
            return
        self._pool = pool
        self.restart = None
        self.release_held()

    def _give_up(self, message: str) -> None:
        self._gave_up = message
        self.restart = None
        self._give_up_to(message)
        self._event(ev.TokensFailed(cause=message))
        held, self.held = self.held, []
        for key, batch in held:
            self._lost(key, batch, RuntimeError(message))
