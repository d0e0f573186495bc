"""The `specforge` backend: SpecForge's offline capture (SGLang underneath), tensor parallel under torchrun.

SpecForge ships the one maintained SGLang capture for offline EAGLE-3 data
(`specforge.offline_capture`, used by its own scripts/prepare_hidden_states.py) and keeps it working
against one pinned SGLang release. draftgen drives that library and keeps its own resume,
sharding, atomic files, NaN/Inf handling, disk and /dev/shm checks and progress (runner.py).

Pinned in the `gpu` extra (pyproject.toml): specforge 0.2.0, which pins sglang 0.5.14,
torch 2.11.0 and transformers 5.8.1. Every SpecForge and SGLang name used here is checked
against those releases' source by tests/extract/test_specforge_contract.py, without a GPU.

How the library is driven (specforge/offline_capture/sglang.py and sglang_backend/capture.py):
- `specforge.distributed.init_distributed(timeout=, tp_size=)` makes the TP group from torchrun's
  environment (one process per GPU; every rank must run the same forwards);
- `load_offline_eagle3_capture(model, torch_dtype=, trust_remote_code=, **server_args)` builds
  SGLang's ModelRunner with `chunked_prefill_size=-1` (SpecForge fixes it: a sample is one
  forward, it cannot be chunked) and our memory settings as extra ServerArgs; `torch_dtype` goes
  to `ServerArgs.dtype`, a string there ("bfloat16"), so we pass the string;
- `set_capture_layers(ids, capture_method="eagle3")` hands the ids to the model's
  `set_eagle3_layers_to_capture`, any number of ids (see model_info.sglang_capture_ids for SGLang's +1 rule);
- `capture(input_ids=, attention_mask=, loss_mask=)` takes [B, W] tensors and returns
  `hidden_states` [B, W, K·H] (the K aux layers, ascending) and `last_hidden_states` [B, W, H]
  (after the final norm; SpecForge's logits processor skips lm_head). It makes one request per
  row from the whole row (the attention mask is not used to trim it) and concatenates the rows
  on a new batch dim, so rows must have one width: we right-pad (padding.right_pad) and cut each sample
  back to its own length. Padding comes after a sample's tokens, so under causal attention it
  changes none of that sample's rows (the self-check verifies sample-alone == sample-in-batch).
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from draftgen.core.errors import ConfigError, DraftgenError
from draftgen.core.extract.gpu_plan import kv_page_size, kv_pool_tokens  # the GPU plan sizes the same KV pool
from draftgen.core.quoting import sh_path
from draftgen.core.units import fmt_bytes

DIST_TIMEOUT_MIN = 120  # loading a 1T-parameter checkpoint can keep some ranks waiting a long time
SHM_PATH = Path("/dev/shm")
GPU_EXTRA = "draftgen[gpu]"

T = TypeVar("T")


def _missing(e: ModuleNotFoundError) -> DraftgenError:
    return DraftgenError(
        f'extract.backend = "specforge" needs SpecForge and SGLang ({e.name} is not installed here). On the GPU '
        f"machine: pip install -e '.[gpu]' (pins specforge, sglang, torch; see docs/gpu-extraction.md); for a "
        f'small model on CPU set extract.backend = "hf"')


def check_shm(min_gb: float, path: Path = SHM_PATH) -> int:
    """Fail now, with the fix, when /dev/shm is smaller than `min_gb`; return its free bytes.

    NCCL keeps its intra-node buffers there; Docker gives containers 64 MB unless told otherwise,
    and NCCL then fails in the middle of the first collective, after the weights have loaded.
    """
    need = int(min_gb * 2**30)
    try:
        usage = shutil.disk_usage(path)
    except OSError as e:
        if need <= 0:
            return 0
        raise DraftgenError(f"{path}: cannot read its size ({e.strerror}); NCCL needs a shared-memory "
                            f"filesystem there (set extract.min_shm_gb = 0 to skip this check)") from None
    if usage.free < need:
        raise DraftgenError(
            f"{path}: {fmt_bytes(usage.free)} free of {fmt_bytes(usage.total)}, but extraction with "
            f"tensor parallelism needs at least {min_gb:g} GiB there (extract.min_shm_gb) for NCCL. In Docker "
            f"start the container with --shm-size=32g (or --ipc=host); elsewhere remount: "
            f"mount -o remount,size=32G {path}")
    return usage.free


class LocalGroup:
    """A single process: it plans, runs and writes."""
    rank = 0
    size = 1
    writer = True

    def share(self, make: Callable[[], T]) -> T:
        return make()

    def close(self) -> None:
        pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TorchrunGroup:
    """This process's place in a torchrun job (one per GPU), through SpecForge's process groups.

    Rank 0 plans (which files are missing, disk and /dev/shm checks) and writes; every rank runs
    every forward, since each holds 1/TP of the weights. Without torchrun and with tp_size 1 it
    sets up a one-process group itself, so a single GPU needs no launcher.
    """

    def __init__(self, tp_size: int, config_path: object = "config") -> None:
        world = os.environ.get("WORLD_SIZE")
        if world is None and tp_size != 1:
            raise ConfigError(
                f"{config_path}: extract.tp_size = {tp_size} needs one process per GPU: start it as "
                f"`torchrun --nproc_per_node {tp_size} --no-python draftgen extract {sh_path(str(config_path))}` "
                f"(see docs/gpu-extraction.md)")
        if world is not None and int(world) > tp_size and int(world) % tp_size == 0:
            raise ConfigError(
                f"{config_path}: torchrun started {world} processes for extract.tp_size = {tp_size}: that is data "
                f"parallel inside one job ({int(world) // tp_size} x TP {tp_size}), which draftgen does not run. Start "
                f"one torchrun --standalone --nproc_per_node {tp_size} per machine and split the work with --shard "
                f"i/N, or --shard auto under Slurm (see docs/gpu-extraction.md)")
        if world is not None and int(world) != tp_size:
            raise ConfigError(
                f"{config_path}: extract.tp_size = {tp_size} but torchrun started {world} processes; use "
                f"--nproc_per_node {tp_size} on each machine (one torchrun per machine, --shard i/N across machines)")
        try:
            from specforge.distributed import init_distributed
        except ModuleNotFoundError as e:
            raise _missing(e) from None
        import torch.distributed as dist
        if world is None:  # one GPU without torchrun: the environment torchrun would have set
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(_free_port()))
        init_distributed(timeout=DIST_TIMEOUT_MIN, tp_size=tp_size)
        self._dist = dist
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.writer = self.rank == 0

    def share(self, make: Callable[[], T]) -> T:
        """`make()` on rank 0, its result on every rank; a DraftgenError there stops every rank with its message."""
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", make())
            except DraftgenError as e:
                box[0] = ("error", str(e))
        self._dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise DraftgenError(value if self.rank == 0 else f"rank 0 stopped the run: {value}")
        return value

    def close(self) -> None:
        from specforge.distributed import destroy_distributed
        destroy_distributed()


# ServerArgs SpecForge's OfflineSGLangCaptureBackend.build sets itself: passing one again is a
# duplicate keyword (a TypeError after the job started). The contract test checks this set.
SPECFORGE_SETS = frozenset({"model_path", "trust_remote_code", "dtype", "enable_return_hidden_states",
                            "disable_cuda_graph", "chunked_prefill_size", "tp_size", "pp_size"})
# ServerArgs draftgen sets from [extract] or from the plan, and where to change them instead.
DRAFTGEN_SETS = {"mem_fraction_static": "extract.mem_fraction_static",
                 "attention_backend": "extract.attention_backend",
                 "max_running_requests": "the plan (extract.batch_tokens)",
                 "max_total_tokens": "the plan (extract.batch_tokens)"}


def check_sglang_table(table: dict[str, Any], config_path: object = "config",
                       fields: set[str] | None = None) -> None:
    """Refuse [extract.sglang] keys SpecForge or draftgen already set, and (given `fields`) unknown ones."""
    for key in sorted(table):
        if key in SPECFORGE_SETS:
            raise ConfigError(f"{config_path}: extract.sglang.{key} cannot be set: SpecForge's capture sets it "
                              f"itself (remove it from [extract.sglang])")
        if key in DRAFTGEN_SETS:
            raise ConfigError(f"{config_path}: extract.sglang.{key} is set by draftgen from {DRAFTGEN_SETS[key]}; "
                              f"remove it from [extract.sglang]")
        if fields is not None and key not in fields:
            close = sorted(f for f in fields if key.replace("-", "_") == f or key in f)[:3]
            raise ConfigError(f"{config_path}: extract.sglang.{key} is not a field of SGLang's ServerArgs"
                              + (f" (did you mean {', '.join(close)}?)" if close else "")
                              + "; see python -m sglang.launch_server --help")


def server_arg_fields() -> set[str] | None:
    """ServerArgs' field names from the installed SGLang; None where it is not installed."""
    try:
        import dataclasses

        from sglang.srt.server_args import ServerArgs
    except Exception:  # not installed, or its GPU kernels fail to import: the load reports that
        return None
    return {f.name for f in dataclasses.fields(ServerArgs)}


def server_args(*, max_forward_tokens: int, max_samples: int, mem_fraction_static: float,
                attention_backend: str, extra: dict[str, Any] | None = None,
                config_path: object = "config") -> dict[str, Any]:
    """SGLang ServerArgs that SpecForge passes through: memory for exactly the largest planned forward.

    `max_total_tokens` sizes the KV pool: one forward's tokens, plus a page per sample (each sample's
    tokens are rounded up to whole pages of `kv_page_size`), plus a little slack; `max_running_requests`
    sizes the request pool; everything else of `mem_fraction_static` is weights, and the rest of the GPU
    is left to activations and the captured states. `extra` is [extract.sglang], checked by
    check_sglang_table.
    """
    page = kv_page_size(attention_backend, extra)
    args: dict[str, Any] = {
        "mem_fraction_static": mem_fraction_static,
        "max_running_requests": max(1, max_samples),
        "max_total_tokens": kv_pool_tokens(max_forward_tokens, max_samples, page),
    }
    if attention_backend:
        args["attention_backend"] = attention_backend
    if extra:
        check_sglang_table(extra, config_path)
        args.update(extra)
    return args


class SpecForgeBackend:
    def __init__(self, model: str, capture_ids: list[int], *, group: TorchrunGroup | LocalGroup,
                 dtype: str = "bfloat16", trust_remote_code: bool = False, max_forward_tokens: int,
                 max_samples: int, mem_fraction_static: float = 0.8, attention_backend: str = "",
                 sglang_args: dict[str, Any] | None = None, config_path: object = "config") -> None:
        if not torch.cuda.is_available():
            raise DraftgenError('extract.backend = "specforge" needs a CUDA GPU and none is visible here; '
                                'on a CPU use extract.backend = "hf"')
        try:
            from specforge.offline_capture import load_offline_eagle3_capture
        except ModuleNotFoundError as e:
            raise _missing(e) from None
        self.group = group
        check_sglang_table(sglang_args or {}, config_path, server_arg_fields())  # before the weights load
        self.capture = load_offline_eagle3_capture(
            model, torch_dtype=dtype, trust_remote_code=trust_remote_code,
            **server_args(max_forward_tokens=max_forward_tokens, max_samples=max_samples,
                          mem_fraction_static=mem_fraction_static, attention_backend=attention_backend,
                          extra=sglang_args, config_path=config_path))
        self.capture.set_capture_layers(capture_ids, capture_method="eagle3")
        self.description = f"specforge/sglang tp{group.size} {dtype}"
        self.max_batch_tokens: int | None = max_forward_tokens
        self.max_batch_samples: int | None = max_samples

    def run(self, batch: Sequence[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every rank runs the forward; only the writer gets the states (others get []), left on the GPU:
        the pooled writer reduces their finite flags there and copies them into pinned host memory on
        its own stream (core/extract/writer.py), so the next forward is not held up by the copy."""
        from draftgen.core.extract.padding import right_pad
        input_ids, attention_mask, lengths = right_pad(batch)
        width = input_ids.shape[1]
        # CPU tensors: SpecForge only takes `.tolist()` of the ids (SGLang builds its own device input) and
        # hands the rows back; on the GPU that `.tolist()` would wait for the previous batch's copies.
        out = self.capture.capture(input_ids=input_ids, attention_mask=attention_mask, loss_mask=attention_mask)
        aux, hidden = out.hidden_states, out.last_hidden_states
        if tuple(aux.shape[:2]) != (len(batch), width) or tuple(hidden.shape[:2]) != (len(batch), width):
            raise DraftgenError(f"{self.description}: SpecForge returned aux {tuple(aux.shape)} and hidden "
                                f"{tuple(hidden.shape)} for a [{len(batch)}, {width}] batch")
        if not self.group.writer:
            return []
        return [(hidden[row, :n], aux[row, :n]) for row, n in enumerate(lengths)]

    def close(self) -> None:
        self.capture = None
        torch.cuda.empty_cache()
