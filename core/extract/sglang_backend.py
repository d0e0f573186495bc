"""The `sglang` backend: prefill only through SGLang's ModelRunner, tensor parallel, with EAGLE-3 aux capture.

NOT YET RUN ON A GPU. Written against the SGLang 0.5.x internals that SpecForge drives; SGLang
changes these internals between releases, so the first GPU run may need adjustments here.

How it drives SGLang follows SpecForge (specforge/modeling/target/eagle3_target_model.py,
`SGLangEagle3TargetModel`; the older scripts/prepare_hidden_states.py did the same through
`sglang.bench_one_batch.load_model`):
- one process per TP rank, each building a `ModelRunner(gpu_id=rank, tp_rank=rank, nccl_port=…)`
  the way `sglang.bench_one_batch` does, so SGLang sets up torch.distributed itself (SpecForge
  instead patches SGLang into the groups of its own torchrun job);
- `model.set_eagle3_layers_to_capture(layers)` with our 0-based layer-output ids, as SpecForge
  passes its `[1, N//2-1, N-4]`: SGLang adds 1 and records the input of that layer, which is the
  output of layer k (HF `hidden_states[k+1]`);
- the model's `LogitsProcessor` is wrapped so that every token's final-norm hidden state (what
  the model hands to lm_head) and the concatenated aux states are kept, as SpecForge's
  `LogitsProcessorForEAGLE3` does with `return_last_hidden_states`;
- a batch is a list of `Req`s (max_new_tokens=1) put through `ScheduleBatch.prepare_for_extend`
  and one `ModelRunner.forward` (extend = prefill, no sampling); the token pools are cleared after.

Rank 0 packs `[sum T, 4H]` (hidden | aux) into one CPU tensor per batch and sends it back; the
workers' stdout/stderr go to `hidden_states/sglang-rank{r}.log` so they never draw over the TUI.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import queue
import socket
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from draftgen.core.errors import DraftgenError
from draftgen.core.extract.model_info import ModelDims

STARTUP_TIMEOUT_S = 3600.0  # loading a 1T-parameter checkpoint over 8 GPUs takes a while


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


def _require_sglang() -> None:
    if not sglang_available():
        raise DraftgenError(
            'extract.backend = "sglang" needs SGLang, which is not installed here. On the GPU machine: '
            "pip install 'draftgen[sglang]' (see README); for a small model on CPU set extract.backend = \"hf\"")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _accepted(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The subset of `kwargs` that `fn` takes (constructor arguments come and go between SGLang releases)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


# ---------------------------------------------------------------------------------------------
# Worker side (one process per TP rank)

class _Capture(torch.nn.Module):
    """Stands in for the model's LogitsProcessor: keeps the per-token states, then defers to it."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.hidden: torch.Tensor | None = None
        self.aux: torch.Tensor | None = None

    def forward(self, input_ids: Any, hidden_states: torch.Tensor, lm_head: Any, logits_metadata: Any,
                aux_hidden_states: Any = None, *args: Any, **kwargs: Any) -> Any:
        self.hidden = hidden_states
        if isinstance(aux_hidden_states, (list, tuple)):
            aux_hidden_states_cat = torch.cat(list(aux_hidden_states), dim=-1)
        else:
            aux_hidden_states_cat = aux_hidden_states
        self.aux = aux_hidden_states_cat
        return self.inner(input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states, *args, **kwargs)


def _install_capture(model: torch.nn.Module, layers: Sequence[int]) -> _Capture:
    from sglang.srt.layers.logits_processor import LogitsProcessor

    target = model if hasattr(model, "set_eagle3_layers_to_capture") else getattr(model, "language_model", None)
    if target is None or not hasattr(target, "set_eagle3_layers_to_capture"):
        raise RuntimeError(f"{type(model).__name__} has no set_eagle3_layers_to_capture: SGLang cannot capture "
                           f"EAGLE-3 aux layers for this model")
    target.set_eagle3_layers_to_capture(list(layers))
    for name, module in list(model.named_modules()):
        if isinstance(module, LogitsProcessor):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            capture = _Capture(module)
            setattr(parent, attr, capture)
            return capture
    raise RuntimeError(f"{type(model).__name__} has no LogitsProcessor to take the hidden states from")


def _load_runner(rank: int, tp_size: int, server_kwargs: dict[str, Any], nccl_port: int) -> Any:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(**_accepted(ServerArgs, server_kwargs))
    try:
        from sglang.srt.entrypoints.engine import _set_envs_and_config
        _set_envs_and_config(server_args)  # env vars and checks SGLang's own launcher sets up
    except ImportError:
        pass
    model_config = ModelConfig.from_server_args(server_args)
    ep_size = getattr(server_args, "ep_size", 1) or 1
    runner_kwargs = dict(
        model_config=model_config, mem_fraction_static=server_args.mem_fraction_static, gpu_id=rank,
        tp_rank=rank, tp_size=tp_size, moe_ep_rank=rank // (tp_size // ep_size), moe_ep_size=ep_size,
        pp_rank=0, pp_size=1, nccl_port=nccl_port, server_args=server_args, is_draft_worker=False,
    )
    runner = ModelRunner(**_accepted(ModelRunner.__init__, runner_kwargs))
    # Recent releases leave the pools and attention backends to the caller (see bench_one_batch).
    if getattr(runner, "req_to_token_pool", None) is None and hasattr(runner, "alloc_memory_pool"):
        runner.alloc_memory_pool()
        runner.init_backends()
    from sglang.srt.utils import require_mlp_sync
    if require_mlp_sync(server_args):
        raise RuntimeError("this SGLang configuration needs MLP sync (DP attention / expert parallel), "
                           "which draftgen's prefill loop does not do; run with plain tensor parallelism")
    return runner


def _make_req(i: int, ids: list[int]) -> Any:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid=str(i), origin_input_text="", origin_input_ids=ids,
              sampling_params=SamplingParams(temperature=0, max_new_tokens=1, top_k=1))
    if hasattr(req, "set_extend_input_len"):  # newer Req
        req.full_untruncated_fill_ids = req.origin_input_ids
        req.fill_len = len(ids)
        req.logprob_start_len = -1
        req.set_extend_input_len(req.fill_len - len(req.prefix_indices))
    else:  # SGLang 0.5.x, as SpecForge sets it
        req.fill_ids = req.origin_input_ids
        req.extend_input_len = len(req.fill_ids) - len(req.prefix_indices)
        req.logprob_start_len = len(ids) - 1
    return req


def _tree_cache(runner: Any) -> Any:
    try:
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache
    except ImportError:
        return None  # older releases accept no tree cache here
    return RadixCache(CacheInitParams(disable=False, req_to_token_pool=runner.req_to_token_pool,
                                      token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
                                      page_size=runner.server_args.page_size))


@torch.inference_mode()
def _prefill(runner: Any, capture: _Capture, batch: list[list[int]]) -> torch.Tensor:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    reqs = [_make_req(i, ids) for i, ids in enumerate(batch)]
    init_kwargs = dict(reqs=reqs, req_to_token_pool=runner.req_to_token_pool,
                       token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator, tree_cache=_tree_cache(runner),
                       model_config=runner.model_config, enable_overlap=False,
                       spec_algorithm=SpeculativeAlgorithm.NONE, enable_custom_logit_processor=False)
    sched = ScheduleBatch.init_new(**_accepted(ScheduleBatch.init_new, init_kwargs))
    sched.prepare_for_extend()
    worker_batch = sched.get_model_worker_batch() if hasattr(sched, "get_model_worker_batch") else sched
    forward_batch = ForwardBatch.init_new(worker_batch, runner)
    capture.hidden = capture.aux = None
    runner.forward(forward_batch)
    if capture.hidden is None or capture.aux is None:
        raise RuntimeError("the forward pass returned no aux hidden states (EAGLE-3 capture is not active)")
    packed = torch.cat([capture.hidden, capture.aux], dim=-1).to("cpu")
    capture.hidden = capture.aux = None
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    return packed


def _rank_main(rank: int, tp_size: int, server_kwargs: dict[str, Any], nccl_port: int, layers: list[int],
               log_path: str, jobs: Any, results: Any) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        runner = _load_runner(rank, tp_size, server_kwargs, nccl_port)
        capture = _install_capture(runner.model, layers)
        pool_reqs = getattr(runner.req_to_token_pool, "size", None)
        results.put(("ready", rank, int(runner.max_total_num_tokens), pool_reqs))
        while True:
            job = jobs.get()
            if job is None:
                return
            job_id, batch = job
            packed = _prefill(runner, capture, [np.asarray(ids).tolist() for ids in batch])
            if rank == 0:  # every rank holds the full, all-reduced states; one copy is enough
                results.put(("done", job_id, packed))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


# ---------------------------------------------------------------------------------------------
# Driver side

class SglangBackend:
    def __init__(self, model: str, layers: tuple[int, int, int], *, dims: ModelDims, tp_size: int = 1,
                 dtype: str = "bfloat16", trust_remote_code: bool = False, log_dir: Path | None = None,
                 mem_fraction_static: float | None = None, worker: Callable[..., None] | None = None) -> None:
        """Start one worker process per TP rank and wait until each has loaded its part of the model.

        `worker` replaces the per-rank function (tests drive the process plumbing without a GPU).
        """
        _require_sglang()
        if tp_size < 1:
            raise DraftgenError(f"extract.tp_size must be at least 1, not {tp_size}")
        if torch.cuda.device_count() < tp_size:
            raise DraftgenError(f"extract.tp_size = {tp_size} but {torch.cuda.device_count()} CUDA device(s) are "
                                f"visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
        import torch.multiprocessing as mp

        self.hidden_size = dims.hidden_size
        self.description = f"sglang tp={tp_size} {dtype}"
        self.max_batch_tokens: int | None = None
        self.max_batch_samples: int | None = None
        log_dir = Path(log_dir or ".")
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_paths = [log_dir / f"sglang-rank{r}.log" for r in range(tp_size)]
        server_kwargs: dict[str, Any] = dict(
            model_path=model, trust_remote_code=trust_remote_code, dtype=dtype, tp_size=tp_size, pp_size=1,
            enable_return_hidden_states=True, disable_cuda_graph=True, skip_tokenizer_init=True,
        )
        if mem_fraction_static is not None:
            server_kwargs["mem_fraction_static"] = mem_fraction_static
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(tp_size)]
        port = _free_port()
        self._procs = [
            ctx.Process(target=worker or _rank_main, daemon=True, name=f"draftgen-sglang-tp{r}",
                        args=(r, tp_size, server_kwargs, port, list(layers), str(self.log_paths[r]),
                              self._jobs[r], self._results))
            for r in range(tp_size)
        ]
        for p in self._procs:
            p.start()
        self._next_job = 0
        self._broken = ""  # set once a rank failed: the TP group is gone, every later batch must fail fast
        try:
            ready = 0
            while ready < tp_size:
                msg = self._receive(STARTUP_TIMEOUT_S, "loading the model")
                if msg[0] == "ready":
                    ready += 1
                    if msg[1] == 0:
                        self.max_batch_tokens = msg[2]
                        self.max_batch_samples = msg[3]
        except BaseException:
            self.close()
            raise

    def _receive(self, timeout_s: float, doing: str) -> tuple[Any, ...]:
        waited = 0.0
        while True:
            try:
                msg = self._results.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                dead = [p for p in self._procs if not p.is_alive()]
                if dead:
                    rank = self._procs.index(dead[0])
                    self._broken = (f"sglang rank {rank} exited (code {dead[0].exitcode}) while {doing}; "
                                    f"see {self.log_paths[rank]}")
                    raise DraftgenError(self._broken) from None
                if waited >= timeout_s:
                    raise DraftgenError(f"sglang: no answer after {timeout_s:.0f} s while {doing}; "
                                        f"see {self.log_paths[0]}") from None
                continue
            if msg[0] == "error":
                last = msg[2].strip().splitlines()[-1] if msg[2].strip() else "unknown error"
                self._broken = (f"sglang rank {msg[1]} failed while {doing}: {last} "
                                f"(full traceback in {self.log_paths[msg[1]]})")
                raise DraftgenError(self._broken)
            return msg

    def run(self, batch: Sequence[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._broken:
            raise DraftgenError(f"sglang backend unusable after an earlier failure: {self._broken}")
        lengths = [len(ids) for ids in batch]
        if self.max_batch_tokens is not None and sum(lengths) > self.max_batch_tokens:
            raise DraftgenError(f"sglang: a batch of {sum(lengths)} tokens does not fit SGLang's KV pool of "
                                f"{self.max_batch_tokens} tokens; lower extract.batch_tokens")
        job_id = self._next_job
        self._next_job += 1
        payload = [np.asarray(ids, dtype=np.int64) for ids in batch]
        for jobs in self._jobs:
            jobs.put((job_id, payload))
        msg = self._receive(STARTUP_TIMEOUT_S, f"running a batch of {len(batch)} samples")
        if msg[0] != "done" or msg[1] != job_id:
            raise DraftgenError(f"sglang: unexpected answer {msg[0]!r} for batch {job_id}")
        packed: torch.Tensor = msg[2]
        h = self.hidden_size
        if packed.shape != (sum(lengths), 4 * h):
            raise DraftgenError(f"sglang returned states of shape {tuple(packed.shape)}, expected "
                                f"({sum(lengths)}, {4 * h}) = (tokens, H + 3H)")
        out = []
        for part in torch.split(packed, lengths, dim=0):
            out.append((part[:, :h], part[:, h:]))
        return out

    def close(self) -> None:
        for jobs in getattr(self, "_jobs", []):
            try:
                jobs.put(None)
            except (OSError, ValueError):
                pass
        for p in getattr(self, "_procs", []):
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        self._procs = []
