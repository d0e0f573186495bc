"""The pooled writer: hidden-state files written by a few threads while the next forward runs.

For each batch the main thread (rank 0 of a torchrun job) does only what needs the batch's tensors
where they live: on a GPU it reduces one finite flag per sample there (one small tensor fetched)
and starts the copy of the finite rows into pinned host memory on the writer's own CUDA stream,
without waiting, so the next batch's forward on the compute stream runs while the copies do (the
rows' memory is kept from reuse until its copy is done: `record_stream`); CPU tensors go as they
are. The ids and masks stay on the CPU all along (the specforge backend hands SpecForge CPU
tensors: its `.tolist()` then waits for nothing on the GPU). The threads then check CPU rows
for NaN/Inf, serialise each file straight into its temporary file (gzip-compressed with
`compress`), fsync it and rename it (layout.write_sample).

At most `depth` batches are held: `submit` blocks while the writer is that far behind, so the host
memory it holds stays under depth x one batch. A failed write (a full disk) is raised in the main
thread, as the DiskError naming the file, by the next `submit`, `completed` or `drain`; its
temporary file is removed and no final file is left for it.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftgen.core.extract import layout

# Files in flight at once: each thread's CRC and copy run at ~1-2 GB/s, so a GPU node's ~3.5 GB/s
# disk needs several; at least 4 so that one file's fsync overlaps the others' work.
THREADS = max(4, min(8, os.cpu_count() or 4))
DEPTH = 2    # batches held: the one being written while the next is staged


@dataclass(frozen=True)
class Item:
    """One sample of a batch, as the runner hands it over."""
    index: int
    sample_id: str
    sample: layout.SampleTensors


@dataclass(frozen=True)
class Written:
    """What became of one sample: written (`nbytes` on disk) or not finite (nothing written)."""
    index: int
    sample_id: str
    tokens: int
    finite: bool
    nbytes: int = 0
    quant: tuple[tuple[float, float], ...] | None = None  # FP8 files: per slot (worst cosine, relative error)


# Writes one sample's file under a root: its size and, for FP8, its error per slot (speculators_layout.write_sample).
FileWriter = Callable[[Path, int, layout.SampleTensors], tuple[int, tuple[tuple[float, float], ...] | None]]


class _Slot:
    """One held batch: released back to the producer when the last of its files is done."""

    def __init__(self, owner: PooledWriter, count: int) -> None:
        self._owner = owner
        self._left = count
        self._lock = threading.Lock()

    def done(self, _future: Future[Written]) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._owner._slots.release()


def _stage(items: Sequence[Item], stream: Any = None,
           ) -> tuple[list[bool | None], list[layout.SampleTensors | None], Any]:
    """Flags, host tensors to save and the CUDA event they are ready at (None for CPU tensors).

    On a GPU the copies run on `stream` (the writer's copy stream; None: the current one), after
    the work already queued on the current stream (the forward that made the rows)."""
    if not items or items[0].sample.hidden.device.type != "cuda":
        return [None] * len(items), [item.sample for item in items], None
    flags = layout.finite_flags([item.sample for item in items]).tolist()
    compute = torch.cuda.current_stream()
    copy = stream if stream is not None else compute
    if copy is not compute:
        copy.wait_stream(compute)
    staged: list[layout.SampleTensors | None] = []
    with torch.cuda.stream(copy):
        for item, finite in zip(items, flags, strict=True):
            if not finite:
                staged.append(None)  # never copied: nothing of it is written
                continue
            s = item.sample
            # Pinned, so the copy runs without blocking; torch's caching host allocator reuses the blocks.
            hidden = torch.empty(s.hidden.shape, dtype=torch.bfloat16, pin_memory=True)
            aux = torch.empty(s.aux.shape, dtype=torch.bfloat16, pin_memory=True)
            hidden.copy_(s.hidden.to(torch.bfloat16), non_blocking=True)
            aux.copy_(s.aux.to(torch.bfloat16), non_blocking=True)
            if copy is not compute:  # the rows were made on the compute stream: not reused before the copy ran
                s.hidden.record_stream(copy)
                s.aux.record_stream(copy)
            staged.append(layout.SampleTensors(s.input_ids.cpu(), s.loss_mask.cpu(), hidden, aux))
        event = torch.cuda.Event()
        event.record(copy)
    return flags, staged, event


class PooledWriter:
    """Writes `layout` files for batches of samples on `threads` threads, holding at most `depth` batches.

    `write` replaces the file format (speculators_layout's, extract.format = "speculators")."""

    def __init__(self, root: Path, *, compress: bool, threads: int = THREADS, depth: int = DEPTH,
                 group_readable: bool = False, write: FileWriter | None = None) -> None:
        self.root = Path(root)
        self.compress = compress
        self.group_readable = group_readable
        self._write_file = write
        self.depth = depth
        self._slots = threading.Semaphore(depth)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="draftgen-writer")
        self._pending: deque[Future[Written]] = deque()
        self._copy_stream: Any = None  # made with the first batch from a GPU
        self.copy_on_own_stream = True  # False: on the compute stream (bench_extract.py --handover compares)

    # A class attribute: bench_extract.py's DeviceHandOver replaces it to hand rows over as a GPU does.
    _stage = staticmethod(_stage)

    def submit(self, items: Sequence[Item]) -> None:
        """Queue one batch; blocks while `depth` batches are still being written."""
        self.raise_failed()
        if not items:
            return
        self._slots.acquire()
        try:
            flags, staged, event = self._stage(items, self._stream_for(items))
        except BaseException:
            self._slots.release()
            raise
        slot = _Slot(self, len(items))
        for item, finite, sample in zip(items, flags, staged, strict=True):
            # The rows in a list the write empties: the pool's work item keeps its arguments until after the
            # slot is released (set_result runs the callbacks first), and must not keep the rows with them.
            future = self._pool.submit(self._write, item.index, item.sample_id, int(item.sample.input_ids.shape[0]),
                                       finite, [sample], event)
            future.add_done_callback(slot.done)
            self._pending.append(future)

    def _stream_for(self, items: Sequence[Item]) -> Any:
        """The writer's own CUDA stream for rows on a GPU (on their device); None for CPU rows."""
        device = items[0].sample.hidden.device
        if device.type != "cuda" or not self.copy_on_own_stream:
            return None
        if self._copy_stream is None or self._copy_stream.device != device:
            self._copy_stream = torch.cuda.Stream(device=device)
        return self._copy_stream

    def _write(self, index: int, sample_id: str, tokens: int, finite: bool | None,
               held: list[layout.SampleTensors | None], event: Any) -> Written:
        sample = held.pop()
        if finite is None:
            assert sample is not None
            finite = sample.is_finite()
        if not finite or sample is None:
            return Written(index, sample_id, tokens, finite=False)
        if event is not None:
            event.synchronize()  # the pinned copy has landed
        if self._write_file is not None:
            nbytes, quant = self._write_file(self.root, index, sample)
            return Written(index, sample_id, tokens, finite=True, nbytes=nbytes, quant=quant)
        return Written(index, sample_id, tokens, finite=True,
                       nbytes=layout.write_sample(self.root, index, sample, compress=self.compress,
                                                  group_readable=self.group_readable))

    def raise_failed(self) -> None:
        """Raise the first failure among the files in flight (a DiskError naming the file)."""
        for future in self._pending:
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def completed(self) -> list[Written]:
        """The samples done so far, in the order they were submitted; raises a failed write."""
        self.raise_failed()
        done = []
        while self._pending and self._pending[0].done():
            done.append(self._pending.popleft().result())
        return done

    def drain(self) -> list[Written]:
        """Wait for every sample submitted; return them in order (raises a failed write)."""
        done = []
        while self._pending:
            self._pending[0].exception()  # wait for it
            self.raise_failed()
            done.append(self._pending.popleft().result())
        return done

    def close(self) -> None:
        """Stop: files not started are dropped, files being written finish (each whole or removed)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
