"""The pooled hidden-state writer: the same files as the old serial path, NaN/Inf found, a full disk
raised in the main thread naming the file, and the memory it holds bounded by its queue.

A fake backend stands in for the model (its rows are views of a padded batch, as a real one's are),
so these tests run `extract()` whole in well under a second each.
"""

from __future__ import annotations

import errno
import gc
import gzip
import importlib.util
import io
import json
import os
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from draftgen.core.config import Config
from draftgen.core.config_load import config_from_dict
from draftgen.core.errors import DiskError
from draftgen.core.extract import extract, layout
from draftgen.core.extract import writer as writer_mod
from draftgen.core.tokens.store import TokenWriter

HIDDEN, N_LAYERS = 32, 8


class FakeBackend:
    """Rows from a seed in each sample's first id, returned as views of one padded [B, W, ...] batch."""
    description = "fake"
    max_batch_tokens = None

    def __init__(self, dtype: torch.dtype = torch.bfloat16, max_batch_samples: int | None = None,
                 poison: dict[int, tuple[str, float]] | None = None) -> None:
        self.dtype = dtype
        self.max_batch_samples = max_batch_samples
        self.poison = poison or {}  # seed -> ("hidden" | "aux", NaN or ±Inf), put in the sample's last row
        self.on_run: list = []

    def run(self, batch: Sequence[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        for hook in self.on_run:
            hook()
        width = max(len(ids) for ids in batch)
        hidden = torch.zeros(len(batch), width, HIDDEN, dtype=self.dtype)
        aux = torch.zeros(len(batch), width, 3 * HIDDEN, dtype=self.dtype)
        for row, ids in enumerate(batch):
            h, a = rows(int(ids[0]), len(ids))
            hidden[row, : len(ids)] = h
            aux[row, : len(ids)] = a
            if int(ids[0]) in self.poison:
                which, value = self.poison[int(ids[0])]
                (hidden if which == "hidden" else aux)[row, len(ids) - 1, 3] = value
        return [(hidden[row, : len(ids)], aux[row, : len(ids)]) for row, ids in enumerate(batch)]

    def close(self) -> None:
        pass


def rows(seed: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(length, HIDDEN, generator=g), torch.randn(length, 3 * HIDDEN, generator=g)


def make_run(tmp_path: Path, n: int = 12,
             **extract_table: object) -> tuple[Config, list[tuple[np.ndarray, np.ndarray]]]:
    model = tmp_path / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"hidden_size": HIDDEN, "num_hidden_layers": N_LAYERS}))
    rng = np.random.default_rng(3)
    samples = []
    run = tmp_path / "run"
    with TokenWriter(run / "merged" / "tokens") as w:
        for k in range(n):
            length = int(rng.integers(5, 40))
            ids = rng.integers(1, 900, size=length)
            ids[0] = 1000 + k  # the fake backend's seed for this sample
            mask = (rng.random(length) < 0.5).astype(np.uint8)
            w.append(f"s{k}", ids, mask)
            samples.append((ids, mask))
    raw = {"output": {"dir": str(run)}, "datasets": [{"name": "B", "prompts": "p.jsonl"}],
           "extract": {"model": str(model), "backend": "hf", "device": "cpu", **extract_table}}
    return config_from_dict(raw, tmp_path / "draftgen.toml"), samples


def serial_bytes(ids: np.ndarray, mask: np.ndarray, hidden: torch.Tensor, aux: torch.Tensor) -> bytes:
    """The file the released serial path wrote: clones saved into a BytesIO."""
    buf = io.BytesIO()
    torch.save({"input_ids": torch.from_numpy(ids).to(torch.int64).reshape(-1).clone(),
                "loss_mask": torch.from_numpy(mask).to(torch.int64).reshape(-1).clone(),
                "hidden_state": hidden.to(torch.bfloat16).unsqueeze(0).clone(),
                "aux_hidden_state": aux.to(torch.bfloat16).unsqueeze(0).clone()}, buf)
    return buf.getvalue()


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_pooled_files_are_the_serial_files_written_off_the_main_thread(tmp_path, monkeypatch, compress, dtype):
    config, samples = make_run(tmp_path, compress=compress, batch_tokens=100)
    renamed_by: list[str] = []
    real_replace = os.replace

    def replace(src, dst):
        if ".data_" in str(src):
            renamed_by.append(threading.current_thread().name)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    stats = extract(config, backend=FakeBackend(dtype))
    root = config.run_dir / "hidden_states"
    assert stats.written == len(samples) and stats.nan_samples == 0
    assert len(renamed_by) == len(samples) and all(name.startswith("draftgen-writer") for name in renamed_by)
    total = 0
    for k, (ids, mask) in enumerate(samples):
        path = layout.sample_path(root, k, compress=compress)
        hidden, aux = rows(1000 + k, len(ids))
        want = serial_bytes(ids, mask, hidden.to(dtype), aux.to(dtype))
        got = path.read_bytes()
        total += len(got)
        assert (gzip.decompress(got) if compress else got) == want, path
        loaded, ref = layout.load_sample(path), torch.load(io.BytesIO(want), weights_only=True)
        assert loaded.keys() == ref.keys() == set(layout.KEYS)
        for key in ref:
            assert loaded[key].dtype == ref[key].dtype and torch.equal(loaded[key], ref[key]), key
    assert stats.bytes_written == total
    assert not [p for p in root.rglob(".*")], "a temporary file was left"


def test_non_finite_rows_are_found_reported_and_not_written(tmp_path):
    config, samples = make_run(tmp_path, batch_tokens=100)
    poison = {1002: ("hidden", float("nan")), 1005: ("aux", float("inf")), 1006: ("aux", float("-inf"))}
    stats = extract(config, backend=FakeBackend(torch.bfloat16, poison=poison))
    root = config.run_dir / "hidden_states"
    assert sorted(stats.nan, key=lambda e: e["index"]) == [{"index": k, "id": f"s{k}"} for k in (2, 5, 6)]
    assert stats.nan_samples == 3
    assert stats.written == len(samples) - 3
    assert {k for k in range(len(samples)) if layout.existing_sample(root, k)} == set(range(len(samples))) - {2, 5, 6}
    log = (config.run_dir / "events.log").read_text()
    assert all(f"sample {k} (id s{k}) has NaN" in log for k in (2, 5, 6))
    # The flags alone: one per sample, fetched as one tensor.
    clean = layout.SampleTensors(torch.zeros(2), torch.zeros(2), torch.ones(2, 4), torch.ones(2, 12))
    bad = layout.SampleTensors(torch.zeros(2), torch.zeros(2), torch.ones(2, 4), torch.ones(2, 12))
    bad.aux[1, 11] = float("nan")
    assert layout.finite_flags([clean, bad, clean]).tolist() == [True, False, True]


def test_a_full_disk_in_a_writer_thread_is_a_disk_error_naming_the_file(tmp_path, monkeypatch):
    """ENOSPC halfway through one file (the way tests/run/test_disk_faults.py fakes a full disk, on
    os.write): DiskError in the caller naming that file, no final or temporary file left for it,
    and every file that exists loads whole."""
    config, samples = make_run(tmp_path, batch_tokens=100)
    root = config.run_dir / "hidden_states"
    real_write = os.write
    refused: list[str] = []

    def write(fd: int, data) -> int:
        target = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.basename(target).startswith(".data_4.ckpt"):
            refused.append(target)
            if len(refused) == 1 and len(data) > 1:
                return real_write(fd, memoryview(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(DiskError) as err:
        extract(config, backend=FakeBackend())
    assert str(err.value) == f"cannot write {layout.sample_path(root, 4)}: the disk is full"
    assert refused and not layout.sample_path(root, 4).exists()
    assert not [p for p in root.rglob(".*")], "a temporary file was left"
    for path in root.rglob("*.ckpt"):
        assert set(layout.load_sample(path)) == set(layout.KEYS), path
    monkeypatch.setattr(os, "write", real_write)
    again = extract(config, backend=FakeBackend())
    assert again.written + again.skipped_existing == len(samples) and layout.sample_path(root, 4).exists()


def test_the_queue_bound_holds_and_the_producer_waits(tmp_path, monkeypatch):
    """Writes held shut: the writer takes `depth` batches, then the next forward only starts once a
    file is written; the samples alive at each forward never exceed depth x batch."""
    per_batch, depth = 3, writer_mod.DEPTH
    config, samples = make_run(tmp_path, n=per_batch * 6, batch_tokens=10_000)
    gate = threading.Event()
    real_write_sample = layout.write_sample

    def slow_write_sample(*args, **kwargs):
        gate.wait(timeout=60)  # never forever, should the test fail before opening it
        return real_write_sample(*args, **kwargs)

    monkeypatch.setattr(layout, "write_sample", slow_write_sample)
    backend = FakeBackend(max_batch_samples=per_batch)
    alive: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
    seen: list[tuple[int, bool]] = []

    def at_forward() -> None:
        gc.collect()
        seen.append((len(alive), gate.is_set()))
        if len(seen) == depth + 1:
            threading.Timer(0.3, gate.set).start()  # the producer must wait for this

    real_run = backend.run

    def run(batch):
        out = real_run(batch)
        for hidden, _ in out:
            alive.add(hidden)
        return out

    backend.on_run.append(at_forward)
    backend.run = run  # type: ignore[method-assign]
    stats = extract(config, backend=backend)
    assert stats.written == len(samples)
    assert len(seen) == 6
    assert max(count for count, _ in seen) <= depth * per_batch
    assert seen[depth] == (depth * per_batch, False), "the writer held `depth` full batches"
    assert all(opened for _, opened in seen[depth + 1:]), "a forward ran while the writer was full"


def _load_bench() -> Any:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_extract.py"
    spec = importlib.util.spec_from_file_location("draftgen_bench_extract", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmarks_gpu_hand_over_runs_the_pools_production_path(tmp_path, monkeypatch):
    """bench_extract's DeviceHandOver stands in only for the device (flags given, as the CUDA branch
    of `_stage` returns them): the pool makes no host finite pass, writes the CPU path's bytes, and
    writes nothing for a row flagged non-finite."""
    bench = _load_bench()
    batch = [layout.SampleTensors(torch.arange(n), torch.ones(n, dtype=torch.int64), *rows(n, n))
             for n in (5, 9, 7)]
    batch = [layout.SampleTensors(s.input_ids, s.loss_mask, s.hidden.to(torch.bfloat16), s.aux.to(torch.bfloat16))
             for s in batch]
    host_checks: list[str] = []
    real_flags = layout.finite_flags

    def finite_flags(samples):
        host_checks.append(threading.current_thread().name)
        return real_flags(samples)

    monkeypatch.setattr(layout, "finite_flags", finite_flags)
    _, cpu_bytes = bench.pooled_write(tmp_path / "cpu", batch, 6, False, on_device=False)
    assert [name for name in host_checks if name.startswith("draftgen-writer")], "CPU rows: checked in the pool"
    host_checks.clear()
    _, dev_bytes = bench.pooled_write(tmp_path / "dev", batch, 6, False)
    assert not [name for name in host_checks if name.startswith("draftgen-writer")], "a host pass in the pool"
    assert dev_bytes == cpu_bytes
    for k in range(6):
        assert (layout.sample_path(tmp_path / "dev", k).read_bytes()
                == layout.sample_path(tmp_path / "cpu", k).read_bytes())
    flags = bench.device_flags(batch)
    flags[id(batch[1])] = False
    pool = bench.DeviceHandOver(tmp_path / "flagged", compress=False, flags=flags)
    pool.submit([writer_mod.Item(k, f"s{k}", s) for k, s in enumerate(batch)])
    done = pool.drain()
    pool.close()
    assert [d.finite for d in done] == [True, False, True]
    assert not layout.sample_path(tmp_path / "flagged", 1).exists()
    assert layout.sample_path(tmp_path / "flagged", 2).exists()


def test_specforge_gets_the_ids_and_masks_on_the_cpu_and_gives_back_each_samples_rows() -> None:
    """SpecForge's capture only takes `.tolist()` of the ids (SGLang builds its own device input): handed CPU
    tensors, that waits for nothing on the GPU. The capture itself (the GPU) is a stand-in here."""
    from types import SimpleNamespace

    from draftgen.core.extract.specforge_backend import LocalGroup, SpecForgeBackend

    class Capture:
        def __init__(self) -> None:
            self.seen: dict[str, torch.Tensor] = {}

        def capture(self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    loss_mask: torch.Tensor) -> SimpleNamespace:
            self.seen = dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask)
            b, w = input_ids.shape
            return SimpleNamespace(hidden_states=torch.arange(b * w * 6.0).reshape(b, w, 6),
                                   last_hidden_states=torch.arange(b * w * 2.0).reshape(b, w, 2))

    backend = object.__new__(SpecForgeBackend)  # its __init__ loads SGLang on a GPU
    backend.capture, backend.group, backend.description = Capture(), LocalGroup(), "specforge test"
    rows = backend.run([np.array([5, 6, 7]), np.array([8])])
    assert all(t.device.type == "cpu" for t in backend.capture.seen.values())
    assert backend.capture.seen["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert [tuple(h.shape) for h, _ in rows] == [(3, 2), (1, 2)]
    assert [tuple(a.shape) for _, a in rows] == [(3, 6), (1, 6)]


def test_cpu_rows_need_no_copy_stream(tmp_path: Path) -> None:
    pool = writer_mod.PooledWriter(tmp_path, compress=False)
    sample = layout.SampleTensors(torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long),
                                  torch.zeros(2, 4), torch.zeros(2, 12))
    assert pool._stream_for([writer_mod.Item(0, "s0", sample)]) is None
    pool.close()
