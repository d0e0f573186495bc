"""`draftgen extract --self-check`: extraction's smoke test, for the GPU box before hours of 8-GPU time.

On tiny random models of the target's families, built here (a Llama with head_dim 128, a
DeepseekV3-style MoE with MLA like Kimi-K2.5's language model, and, for the specforge backend,
Kimi-K2.5's own form: the class SGLang 0.5.14 registers for it, `KimiK25ForConditionalGeneration`
(sglang/srt/models/kimi_k25.py, configured by its `KimiK25Config`: `text_config` a DeepseekV3
config, `vision_config` the MoonViT tower), with Kimi's router settings, its language weights under
`language_model.` and a vision tower SGLang builds beside them), through the configured backend
and the real runner, it checks (the hf backend: Llama and DeepseekV3, transformers having no Kimi
class; specforge: the configured model's family only, since SGLang sets up its model-parallel state
once per process):

1. the backend starts;
2. a mixed batch with one long sample (`--long-tokens`, 16,384 by default) gives the right
   shapes and dtypes, all finite;
3. each sample run alone equals the same sample inside the batch (padding leaks nowhere);
4. `lm_head(hidden_state)` agrees with transformers' own logits (the Kimi form: its DeepseekV3
   language model with the same weights), by thresholds chosen by dtype (selfcheck_rows.THRESHOLDS): float32
   mean cosine >= 0.99, argmax >= 98 %; bfloat16 looser, since SGLang's fused kernels and
   transformers' eager ones round differently on nearly flat random logits;
5. aux slice j matches HF `hidden_states[k_j + 1]` clearly better (float32: 2x, bfloat16: 1.5x
   closer) than `[k_j]` or `[k_j + 2]`: the layer convention, SGLang's +1 rule included;
6. the files the runner writes read back through SpecForge's own loader and EAGLE-3 normaliser
   (draftgen's copy of them, said so, where specforge is not installed) and equal the states;
7. peak memory during the long sample (on a GPU `torch.cuda.max_memory_allocated`, on a CPU the
   process's RSS) and /dev/shm, extrapolated to the configured model's H and batch_tokens; on a GPU
   with a configured run it must fit what the GPU plan leaves outside SGLang's static share
   (selfcheck_rows.memory_verdict), elsewhere it is shown, not judged;
8. a rerun skips every file, and the backend leaves no process or process group behind.

Before them, the prerequisites this machine shows: the NVIDIA driver and CUDA (the pinned set is
CUDA 13: driver R580 or newer), glibc (SGLang 0.5.14's wheels need 2.34+), /dev/shm, and free disk
for the whole configured extraction.

Under torchrun every rank runs the same forwards; rank 0 makes the scratch folder and the tiny
models in it (shared with the other ranks by path: the ranks of one job share a machine), compares
and prints. The tiny models are built by tiny_models.py; the rows and the checks that judge the
states and files are selfcheck_rows.py's.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from draftgen.core.config import Config
from draftgen.core.config_load import config_from_dict
from draftgen.core.config_tables import ExtractConfig
from draftgen.core.extract.backend import make_backend
from draftgen.core.extract.model_info import ModelDims, read_model_dims, resolve_aux_layers
from draftgen.core.extract.selfcheck_rows import Peak, SelfCheckResult, check_files, check_states, memory_verdict
from draftgen.core.extract.tiny_models import FAMILIES, VOCAB, families_for, kimi_form, tiny_configs
from draftgen.core.units import fmt_bytes

DEFAULT_LONG_TOKENS = 16_384
SHORT_LENGTHS = (300, 64, 17, 3)  # the rest of the mixed batch, cut to below the long sample
KIMI_HIDDEN = 7168    # extrapolation target when no model is configured
MIN_DRIVER = 580      # CUDA 13 (torch 2.11.0's default wheels, the gpu extra's) needs driver R580+
MIN_GLIBC = (2, 34)   # sglang 0.5.14 ships manylinux_2_34 wheels only


def _samples(long_tokens: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    lengths = [long_tokens] + [min(n, max(long_tokens - 1, 1)) for n in SHORT_LENGTHS]
    out = []
    for n in lengths:
        ids = rng.integers(3, VOCAB - 1, size=n).astype(np.int64)  # never pad/bos/eos or Kimi's media placeholder
        mask = (rng.random(n) < 0.5).astype(np.uint8)
        out.append((ids, mask))
    return out


def _make_run(root: Path, name: str, model_dir: Path, samples: list[tuple[np.ndarray, np.ndarray]],
              base: ExtractConfig, config_path: Path) -> Config:
    from draftgen.core.tokens.store import TokenWriter
    run = root / f"run-{name.split()[0]}"
    with TokenWriter(run / "merged" / "tokens") as writer:
        for k, (ids, mask) in enumerate(samples):
            writer.append(f"selfcheck-{k}", ids, mask)
    table = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    table.update(model=str(model_dir), aux_layers="eagle3",
                 batch_tokens=sum(len(ids) for ids, _ in samples) * len(samples))
    raw = {"output": {"dir": str(run)}, "datasets": [{"name": "selfcheck", "prompts": "p.jsonl"}], "extract": table}
    return config_from_dict(raw, config_path)


def activation_allowance(config: Config | None) -> int | None:
    """What the configured run's GPU plan leaves the forward outside SGLang's static share; None without one."""
    if config is None or config.extract.backend != "specforge":
        return None
    from draftgen.core.errors import DraftgenError
    from draftgen.core.extract.gpu_plan import RUNTIME_BYTES
    from draftgen.core.extract.plan import make_plan
    try:
        gpu = make_plan(config, (0, 1)).gpu
    except DraftgenError:
        return None
    if gpu is None or not gpu.cards or gpu.refusal:
        return None
    return int((1 - gpu.fraction) * gpu.usable_bytes) - RUNTIME_BYTES


def _check_model(result: SelfCheckResult, name: str, hf_config: Any, work: Path, base: ExtractConfig,
                 config_path: Path, long_tokens: int, target_hidden: int, group: Any,
                 allowance: int | None = None) -> None:
    from transformers import AutoModelForCausalLM

    from draftgen.core.extract.runner import extract
    label = f"[{name}]"
    model_dir = work / name.split()[0]
    ref = None
    if group.writer:
        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(hf_config).eval()
        ref.save_pretrained(model_dir)
    if name == FAMILIES[2]:  # the backend loads Kimi's own form; the reference stays transformers' DeepseekV3
        hf_dir = model_dir
        model_dir = work / "kimi-k2.5-form"
        if group.writer:
            kimi_form(hf_dir, model_dir)
    group.share(lambda: None)  # every rank waits for the weights on disk
    samples = _samples(long_tokens, seed=1)
    # One rank writes the run's tokens; the others get its config (a folder they all see).
    config = group.share(lambda: _make_run(work, name, model_dir, samples, base, config_path))
    cfg = config.extract
    dims = read_model_dims(str(model_dir))
    layers = resolve_aux_layers("eagle3", dims)
    ids_list = [ids for ids, _ in samples]

    started = time.monotonic()
    backend = make_backend(cfg, dims, layers, group=group, max_forward_tokens=len(samples) * long_tokens,
                           max_samples=len(samples), config_path=config_path)
    if group.writer:  # one checklist, rank 0's
        result.add(f"{label} backend starts", True, f"{backend.description} in {time.monotonic() - started:.1f}s")
    device = "cuda" if torch.cuda.is_available() and cfg.device != "cpu" else "cpu"
    try:
        peak = Peak(device)
        with peak.watch():  # first, so that on a CPU the process has not grown for something else already
            alone_out = [backend.run([ids_list[0]])]
        batch_out = backend.run(ids_list)
        alone_out += [backend.run([ids]) for ids in ids_list[1:]]
        if group.writer:
            check_states(result, label, samples, batch_out, [o[0] for o in alone_out], dims, layers, ref, device,
                     batch_out[0][0].dtype)
            ref = None
            passed, detail = memory_verdict(peak.mem, long_tokens, dims.hidden_size, target_hidden,
                                            max(base.batch_tokens, long_tokens), device, allowance)
            result.add(f"{label} peak memory, long sample", passed,
                       f"{detail}; /dev/shm grew {fmt_bytes(max(peak.shm, 0))}")
        stats = extract(config, backend=backend, group=group)
        if group.writer:
            check_files(result, label, config, samples, batch_out, stats)
        again = extract(config, backend=backend, group=group)
        if group.writer:
            result.add(f"{label} rerun skips every file", again.written == 0 and again.skipped_existing == len(samples),
                       f"{again.skipped_existing}/{len(samples)} skipped, {again.written} written")
    finally:
        backend.close()


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split("."):
        digits = "".join(c for c in p if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def gpu_prerequisites(nvml: Any = None) -> tuple[str | None, str | None, int]:
    """(driver version, CUDA version the driver supports, GPU count) from NVML; (None, None, 0) without one."""
    try:
        if nvml is None:
            nvml = importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception:  # no nvidia-ml-py, no driver, no device
        return None, None, 0
    try:
        driver = nvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        cuda = int(nvml.nvmlSystemGetCudaDriverVersion())
        return driver, f"{cuda // 1000}.{cuda % 1000 // 10}", int(nvml.nvmlDeviceGetCount())
    except Exception:
        return None, None, 0
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def glibc_version() -> str | None:
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION") or ""  # "glibc 2.35"
    except (ValueError, OSError, AttributeError):
        text = ""
    if text.startswith("glibc "):
        return text.split()[1]
    lib, version = platform.libc_ver()
    return version if lib == "glibc" and version else None


def add_prerequisites(result: SelfCheckResult, base: ExtractConfig, config: Config | None, nvml: Any = None) -> None:
    """Rows for what this machine shows before anything runs; for `hf` they inform, for `specforge` they must hold."""
    needs_gpu = base.backend == "specforge"
    driver, cuda, gpus = gpu_prerequisites(nvml)
    torch_cuda = torch.version.cuda or "none (CPU build)"
    if driver is None:
        result.add("NVIDIA driver and CUDA", not needs_gpu,
                   f"no GPU (NVML finds no driver or device); torch {torch.__version__} built for CUDA {torch_cuda}"
                   + ("; the specforge backend needs CUDA GPUs" if needs_gpu else ""))
    else:
        major = _version(driver)[:1] or (0,)
        ok = major[0] >= MIN_DRIVER or not needs_gpu
        result.add("NVIDIA driver and CUDA", ok,
                   f"driver {driver} (CUDA {cuda}), {gpus} GPU(s); torch built for CUDA {torch_cuda}; the gpu extra's "
                   f"torch needs CUDA 13: driver R{MIN_DRIVER}+")
    libc = glibc_version()
    libc_ok = libc is not None and _version(libc)[:2] >= MIN_GLIBC
    result.add("glibc", libc_ok or not needs_gpu,
               f"glibc {libc or 'not found (musl?)'}; sglang 0.5.14 ships wheels for glibc "
               f"{'.'.join(map(str, MIN_GLIBC))}+ only")
    try:
        shm = shutil.disk_usage("/dev/shm")
        shm_text = f"{fmt_bytes(shm.free)} free of {fmt_bytes(shm.total)}"
        shm_ok = shm.free >= base.min_shm_gb * 2**30
    except OSError as e:
        shm_text, shm_ok = f"cannot read /dev/shm: {e.strerror}", base.min_shm_gb <= 0
    result.add("/dev/shm", shm_ok or not needs_gpu,
               f"{shm_text}; extract.min_shm_gb = {base.min_shm_gb:g} (NCCL; Docker: --shm-size=32g or --ipc=host)")
    if config is None:
        return
    from draftgen.core.errors import DraftgenError
    from draftgen.core.extract.plan import make_plan
    try:
        plan = make_plan(config, (0, 1))
    except DraftgenError as e:
        result.add("free disk for the whole extraction", True, f"no plan yet: {e}")
        return
    need = sum(s.bytes_gz if plan.compress else s.bytes_bf16 for s in plan.shards)
    result.add("free disk for the whole extraction", need <= plan.free_bytes,
               f"{fmt_bytes(need)} for {plan.this.todo:,} samples ({plan.this.tokens_todo:,} tokens) still to do "
               f"({'gz estimate' if plan.compress else 'bf16'}); {fmt_bytes(plan.free_bytes)} free in {plan.root}")


def run_self_check(base: ExtractConfig, *, long_tokens: int = DEFAULT_LONG_TOKENS, target_hidden: int | None = None,
                   config_path: Path = Path("selfcheck.toml"), work_dir: Path | None = None,
                   families: tuple[str, ...] | None = None, config: Config | None = None,
                   nvml: Any = None) -> SelfCheckResult:
    """Run the checklist with `base`'s backend settings (its model only sizes the extrapolation).

    `config`, when given, is the configured run: the prerequisite rows check free disk for it.
    """
    from draftgen.core.extract.runner import make_group
    result = SelfCheckResult()
    started = time.monotonic()
    target: ModelDims | None = None
    if base.model:
        try:
            target = read_model_dims(base.model, trust_remote_code=base.trust_remote_code)
        except Exception:  # the extrapolation is a courtesy; the checks do not need the big model
            target = None
    if target_hidden is None:
        target_hidden = target.hidden_size if target else KIMI_HIDDEN
    if families is None:
        families = families_for(base.backend, target)
    import psutil
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    group = make_group(base, config_path)
    allowance = None
    if group.writer:
        add_prerequisites(result, base, config, nvml)
        allowance = activation_allowance(config) if torch.cuda.is_available() else None
    tmp = None
    try:
        work = work_dir
        if work is None:
            # Rank 0 makes it and tells the others: a folder per rank would leave them without the models.
            tmp = group.share(lambda: tempfile.mkdtemp(prefix="draftgen-selfcheck-"))
            work = Path(tmp)
        for name, hf_config in tiny_configs(max(2 * long_tokens, 4096), base.tp_size).items():
            if families is not None and name not in families:
                continue
            _check_model(result, name, hf_config, work, base, config_path, long_tokens, target_hidden, group,
                         allowance)
        group.share(lambda: None)  # nobody reads the scratch folder any more
    finally:
        group.close()
        if tmp is not None and group.writer:
            shutil.rmtree(tmp, ignore_errors=True)
    if group.writer:
        children = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
        result.add("workers exit", not children,
                   f"{base.backend}: process group closed, {len(children)} child processes left"
                   + (f" ({', '.join(str(c.pid) for c in children)})" if children else ""))
    result.elapsed_s = time.monotonic() - started
    return result


def print_result(result: SelfCheckResult, out: TextIO | None = None) -> None:
    from rich.console import Console

    from draftgen.core.checklist import checklist_table
    console = Console(file=out, width=160) if out is not None else Console()
    console.print(checklist_table("draftgen extract --self-check",
                                  ((r.check, r.passed, r.detail) for r in result.rows)))
    failed = sum(not r.passed for r in result.rows)
    console.print(("[green]PASSED[/]" if result.passed else f"[bold red]FAILED[/] ({failed} checks)")
                  + f" in {result.elapsed_s:.1f}s")
