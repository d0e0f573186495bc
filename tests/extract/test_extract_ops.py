"""Running extraction on real machines: the plan before any weights load, nothing to do
without a model, the free-space watch, `--shard auto`, the draft layer ids in stats.json,
[extract.sglang], and the self-check under a real 2-process torchrun on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from draftgen.core.config import Config
from draftgen.core.config_load import config_from_dict
from draftgen.core.errors import ConfigError, DraftgenError
from draftgen.core.extract import layout
from draftgen.core.extract.command import parse_shard, shard_from_env
from draftgen.core.extract.disk import DiskWatch
from draftgen.core.extract.model_info import ModelDims
from draftgen.core.extract.plan import make_plan
from draftgen.core.tokens.store import TokenWriter

N_LAYERS, HIDDEN, VOCAB = 8, 64, 500


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=N_LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def make_run(tmp_path: Path, model: str, n: int = 10, **extract_table: object) -> Config:
    rng = np.random.default_rng(3)
    run = tmp_path / "run"
    with TokenWriter(run / "merged" / "tokens") as writer:
        for k in range(n):
            length = 5 + 3 * k
            writer.append(f"s{k}", rng.integers(1, VOCAB, size=length), np.ones(length, dtype=np.uint8))
    table = {"model": model, "backend": "hf", "device": "cpu", "dtype": "float32", **extract_table}
    raw = {"output": {"dir": str(run)}, "datasets": [{"name": "B1", "prompts": "p.jsonl"}], "extract": table}
    return config_from_dict(raw, tmp_path / "draftgen.toml")


def write_config(tmp_path: Path, config: Config, model: str, extra: str = "") -> Path:
    path = tmp_path / "draftgen.toml"
    path.write_text(f'[output]\ndir = "{config.run_dir}"\n[[datasets]]\nname = "B1"\nprompts = "p.jsonl"\n'
                    f'[extract]\nmodel = "{model}"\nbackend = "hf"\ndevice = "cpu"\ndtype = "float32"\n{extra}')
    return path


# --shard auto

def test_shard_auto_reads_slurm_arrays_and_multi_node_torchrun() -> None:
    assert shard_from_env({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4"})[0] == (3, 4)
    # `sbatch --array=1-4`: ids start at 1.
    assert parse_shard("auto", {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "4",
                                "SLURM_ARRAY_TASK_MIN": "1"}) == (0, 4)
    assert parse_shard("auto", {"SLURM_ARRAY_TASK_ID": "14", "SLURM_ARRAY_TASK_COUNT": "3",
                                "SLURM_ARRAY_TASK_MIN": "10",
                                "SLURM_ARRAY_TASK_STEP": "2"}) == (2, 3)
    # One Slurm job over 3 nodes, one task each (srun --ntasks-per-node 1 torchrun --standalone ...).
    assert parse_shard("auto", {"SLURM_NODEID": "2", "SLURM_NNODES": "3", "SLURM_JOB_ID": "7"}) == (2, 3)
    torchrun = {"GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    assert parse_shard("auto", torchrun) == (1, 2)
    assert parse_shard("2/5", {}) == (2, 5)
    with pytest.raises(DraftgenError, match="is not one of 0..3"):
        parse_shard("auto", {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4"})
    with pytest.raises(DraftgenError, match="found no launcher.*pass --shard I/N"):
        parse_shard("auto", {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0"})
    with pytest.raises(DraftgenError, match="a --standalone torchrun knows no other machines"):  # node 0 of 1
        parse_shard("auto", {"GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "SLURM_NODEID": "0", "SLURM_NNODES": "1"})


def test_one_torchrun_over_several_nodes_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from draftgen.core.extract.specforge_backend import TorchrunGroup
    monkeypatch.setenv("WORLD_SIZE", "16")
    with pytest.raises(ConfigError, match=r"data parallel inside one job \(2 x TP 8\).*one torchrun --standalone"):
        TorchrunGroup(8, "k.toml")


def test_cli_shard_auto_without_a_launcher_says_so(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from draftgen.cli.main import main
    for name in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "GROUP_RANK", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert main(["extract", str(tmp_path / "none.toml"), "--shard", "auto"]) != 0
    assert "--shard auto: found no launcher" in capsys.readouterr().err


# The plan, and nothing to do without a model

def test_plan_per_shard_before_any_weights(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    from draftgen.cli.main import main
    # A model folder with only its config.json: the plan needs H, never the weights.
    bare = tmp_path / "bare-model"
    bare.mkdir()
    (bare / "config.json").write_text((model_dir / "config.json").read_text())
    config = make_run(tmp_path, str(bare))
    root = config.run_dir / "hidden_states"
    layout.sample_path(root, 0).parent.mkdir(parents=True)
    layout.sample_path(root, 0).write_bytes(b"x")  # sample 0 (shard 0 of 2) is done
    cfg_path = write_config(tmp_path, config, str(bare), "tokens_per_s = 100\n")
    assert main(["extract", str(cfg_path), "--plan", "--shard", "1/2"]) == 0
    out = capsys.readouterr().out
    plan = make_plan(config, (1, 2))
    lengths = [5 + 3 * k for k in range(10)]
    assert [(s.samples, s.done, s.todo, s.tokens_todo) for s in plan.shards] == [
        (5, 1, 4, sum(lengths[2::2])), (5, 0, 5, sum(lengths[1::2]))]
    per_token = 4 * HIDDEN * 2 + 16
    assert plan.shards[1].bytes_bf16 == sum(lengths[1::2]) * per_token + 5 * 4096
    assert "H=64" in out and "100 tok/s, extract.tokens_per_s" in out
    assert "*       1/2" in out and "        0/2" in out  # both shards, this machine's marked
    assert "shard 1/2 (*) writes" in out and "free there: enough" in out
    assert sorted(p.name for p in root.rglob("*.ckpt")) == ["data_0.ckpt"]  # nothing written


def test_nothing_to_do_exits_without_reading_the_model(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from draftgen.cli.main import main
    from draftgen.core.extract import runner
    missing = str(tmp_path / "no-such-model")
    config = make_run(tmp_path, missing, n=4)
    root = config.run_dir / "hidden_states"
    for k in range(4):
        path = layout.sample_path(root, k, compress=k % 2 == 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"done")
    from draftgen.core.tokens import identity  # the files are this merge's (a fresh folder records it first)
    merged = identity.merged_fingerprint(config.run_dir / "merged")
    identity.write_fingerprint(root / identity.HIDDEN_MERGE_FILE, merged)

    def no_model(*_a: object, **_k: object) -> None:
        raise AssertionError("the model was read although nothing is left to do")
    monkeypatch.setattr(runner, "read_model_config", no_model)
    monkeypatch.setattr(runner, "make_backend", no_model)
    cfg_path = write_config(tmp_path, config, missing)
    assert main(["extract", str(cfg_path)]) == 0
    out = capsys.readouterr().out
    assert "shard 0/1: nothing to do (4 of 4 files already written); the model is not loaded" in out
    assert "H not read" in out
    stats = runner.extract(config)  # the library path (the TUI's `x`) stops as early
    assert stats.nothing_to_do and stats.skipped_existing == 4 and stats.written == 0
    assert not (root / "stats.json").exists()


# The free-space watch

class FakeDisk:
    """Free bytes that come back after `low_calls` checks, the way an operator frees space."""

    def __init__(self, low_calls: int, low: int = 10, high: int = 1 << 50) -> None:
        self.calls = 0
        self.low_calls, self.low, self.high = low_calls, low, high

    def __call__(self, _path: Path) -> int:
        self.calls += 1
        return self.low if self.calls <= self.low_calls else self.high


def test_run_pauses_while_the_disk_is_full_then_finishes(tmp_path: Path, model_dir: Path) -> None:
    from draftgen.core.extract import extract
    config = make_run(tmp_path, str(model_dir), n=6, batch_tokens=40)
    said: list[str] = []
    disk = FakeDisk(low_calls=3)
    watch = DiskWatch(margin_bytes=1000, free_space=disk, recheck_s=0.01, say=said.append)
    stats = extract(config, disk_watch=watch)
    assert stats.written == 6 and not stats.stopped
    assert watch.pauses == 1 and disk.calls > 3
    assert len(said) == 2 and said[0].startswith("extract: paused: 10 B free") and "min_free_gb" in said[0]
    assert "again; resuming" in said[1]
    events = (config.run_dir / "events.log").read_text()
    assert "extract: paused" in events


def test_a_stop_while_paused_ends_the_run_with_every_file_whole(tmp_path: Path, model_dir: Path) -> None:
    from draftgen.core.extract import extract
    config = make_run(tmp_path, str(model_dir), n=6, batch_tokens=40)
    stop = threading.Event()
    said: list[str] = []

    def say(message: str) -> None:
        said.append(message)
        stop.set()  # the operator presses q while it waits

    watch = DiskWatch(free_space=FakeDisk(low_calls=10**9), recheck_s=0.01, say=say)
    stats = extract(config, disk_watch=watch, stop=stop)
    assert stats.stopped and stats.written == 0 and len(said) == 1
    assert not list((config.run_dir / "hidden_states").rglob("*.ckpt"))


# Records and settings

def test_stats_records_the_draft_configs_layer_ids(tmp_path: Path, model_dir: Path) -> None:
    from draftgen.core.extract import extract
    from draftgen.core.extract.runner import _draft_layer_ids
    config = make_run(tmp_path, str(model_dir), n=2)
    extract(config)
    stats = json.loads((config.run_dir / "hidden_states" / "stats.json").read_text())
    assert stats["layers"] == [1, 3, 4] and stats["draft_layer_ids"] == [1, 3, 4]  # Llama: SGLang takes them as is
    kimi = ModelDims(61, 7168, "k", architectures=("KimiK25ForConditionalGeneration",))
    assert _draft_layer_ids((1, 29, 57), kimi) == [1, 29, 57]
    assert _draft_layer_ids((2, 29, 57), kimi) == [3, 30, 58]  # SGLang's +1 only when the first id is 1
    assert _draft_layer_ids((0, 29, 57), kimi) is None


def test_sglang_table_passes_through_and_refuses_what_is_set_elsewhere(tmp_path: Path, model_dir: Path) -> None:
    from draftgen.core.extract import extract
    from draftgen.core.extract.specforge_backend import server_args
    config = make_run(tmp_path, str(model_dir), n=2, sglang={"context_length": 4096, "kv_cache_dtype": "fp8_e4m3"})
    assert config.extract.sglang == {"context_length": 4096, "kv_cache_dtype": "fp8_e4m3"}
    args = server_args(max_forward_tokens=10, max_samples=1, mem_fraction_static=0.7, attention_backend="",
                       extra=config.extract.sglang)
    assert args["context_length"] == 4096 and args["mem_fraction_static"] == 0.7
    with pytest.raises(ConfigError, match="draftgen.toml: extract.sglang must be a table"):
        make_run(tmp_path / "b", str(model_dir), n=1, sglang=3)
    bad = make_run(tmp_path / "c", str(model_dir), n=1, backend="specforge", sglang={"tp_size": 4})
    with pytest.raises(ConfigError, match="extract.sglang.tp_size cannot be set: SpecForge's capture sets it"):
        extract(bad)  # before any process group or weights


# The self-check under torchrun

DRIVER = """
import sys
import torch
from draftgen.core.extract import backend as be, selfcheck
from draftgen.core.extract.hf_backend import HFBackend

def make(cfg, dims, layers, **kw):
    # No GPU can exist here: transformers on the CPU stands in for SGLang's engine, nothing else changes.
    # SGLang would load Kimi-K2.5's own form; transformers has no such class: it loads the same weights
    # in their DeepseekV3 form, which the self-check keeps beside it as its reference.
    assert cfg.backend == "specforge" and cfg.model.endswith("kimi-k2.5-form")
    return HFBackend(cfg.model.removesuffix("-form"), layers, dtype="float32", device="cpu")

be.make_backend = selfcheck.make_backend = make
torch.set_num_threads(1)
from draftgen.cli.main import main
sys.exit(main(["extract", sys.argv[1], "--self-check", "--long-tokens", "24"]))
"""


@pytest.mark.slow
def test_self_check_runs_under_torchrun_with_two_ranks(tmp_path: Path, specforge_tree: Path) -> None:
    config = tmp_path / "tp2.toml"
    config.write_text(f'[output]\ndir = "{tmp_path / "run"}"\n[[datasets]]\nname = "B1"\nprompts = "p.jsonl"\n'
                      '[extract]\nbackend = "specforge"\ntp_size = 2\ndtype = "float32"\nmin_shm_gb = 0\n')
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GROUP_", "TORCHELASTIC"))}
    env.update(PYTHONPATH=str(specforge_tree), COLUMNS="250",
               TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", SPECFORGE_DEVICE="cpu")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(driver), str(config)], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    out = proc.stdout
    rows = out.splitlines()
    assert out.count("draftgen extract --self-check") == 1, out + proc.stderr  # one checklist: rank 0's
    family = "[kimi-k2.5 (KimiK25ForConditionalGeneration)]"  # no model configured: Kimi-K2.5's own form
    for check in ("backend starts", "mixed batch: shapes, dtypes, finite", "each sample alone == in the batch",
                  "lm_head(hidden_state) vs HF logits", "aux slices are HF hidden_states[k+1]",
                  "files read back through SpecForge's reader", "rerun skips every file"):
        line = next((x for x in rows if f"{family} {check}" in x), None)
        assert line is not None and "PASS" in line, f"{check}:\n{out}\n{proc.stderr[-3000:]}"
    # Prerequisites it can see; on this CPU box the specforge backend's GPU row fails, and only it.
    for check in ("NVIDIA driver and CUDA", "glibc", "/dev/shm", "free disk for the whole extraction"):
        assert any(check in x for x in rows), check
    failed = [x for x in rows if "FAIL" in x and "FAILED" not in x]
    assert len(failed) == 1 and "NVIDIA driver and CUDA" in failed[0] and "no GPU" in failed[0], out
    assert proc.returncode == 1
    assert not list(tmp_path.glob("draftgen-selfcheck-*"))  # rank 0's scratch folder, shared and removed


class FakeNvml:
    """A driver NVML would report on a GPU box (none exists here)."""

    def __init__(self, driver: str, cuda: int) -> None:
        self.driver, self.cuda = driver, cuda

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str: return self.driver
    def nvmlSystemGetCudaDriverVersion(self) -> int: return self.cuda
    def nvmlDeviceGetCount(self) -> int: return 8


def test_prerequisite_rows_judge_the_driver_glibc_shm_and_disk(tmp_path: Path, model_dir: Path) -> None:
    from draftgen.core.config_tables import ExtractConfig
    from draftgen.core.extract.selfcheck import add_prerequisites, glibc_version
    from draftgen.core.extract.selfcheck_rows import SelfCheckResult

    def rows(base: ExtractConfig, nvml: object, config: Config | None = None) -> dict[str, tuple[bool, str]]:
        result = SelfCheckResult()
        add_prerequisites(result, base, config, nvml)
        return {r.check: (r.passed, r.detail) for r in result.rows}

    sf = ExtractConfig(backend="specforge", min_shm_gb=0)
    old = rows(sf, FakeNvml("575.57.08", 12090))["NVIDIA driver and CUDA"]
    assert not old[0] and "driver 575.57.08 (CUDA 12.9), 8 GPU(s)" in old[1] and "R580+" in old[1]
    assert rows(sf, FakeNvml("580.65.06", 13000))["NVIDIA driver and CUDA"][0]
    none = rows(sf, object())["NVIDIA driver and CUDA"]  # NVML that cannot start: no driver
    assert not none[0] and none[1].startswith("no GPU")
    assert rows(ExtractConfig(backend="hf"), object())["NVIDIA driver and CUDA"][0]  # hf runs on a CPU
    libc = glibc_version()
    assert libc and rows(sf, object())["glibc"] == (True, f"glibc {libc}; sglang 0.5.14 ships wheels "
                                                          "for glibc 2.34+ only")
    assert not rows(ExtractConfig(backend="specforge", min_shm_gb=1e9), object())["/dev/shm"][0]
    config = make_run(tmp_path, str(model_dir), n=3)
    disk = rows(ExtractConfig(backend="hf"), object(), config)["free disk for the whole extraction"]
    assert disk[0] and "for 3 samples" in disk[1] and "(bf16)" in disk[1]


# extract.group_readable: training as another user of the group

@pytest.mark.parametrize("group_readable", [False, True])
def test_group_readable_output_is_0640_in_0750_folders_else_owner_only(tmp_path: Path, model_dir: Path,
                                                                         group_readable: bool) -> None:
    from draftgen.core.extract.runner import extract
    config = make_run(tmp_path, str(model_dir), n=3, group_readable=group_readable)
    old = os.umask(0o077)  # as `draftgen` itself runs (cli/main.py)
    try:
        stats = extract(config)
    finally:
        os.umask(old)
    assert stats.written == 3
    root = config.run_dir / "hidden_states"
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "train-command.sh")
    folders = [root, *sorted(p for p in root.rglob("*") if p.is_dir())]
    # 3 samples + stats.json, merge.json, the training configs (offline, online), provenance.json (its lock is
    # in the run directory, not in the trainer's folder)
    assert len(files) == 8
    assert not (root / ".provenance.lock").exists()
    script = (root / "train-command.sh").stat().st_mode & 0o777
    modes = {p.stat().st_mode & 0o777 for p in files}, {p.stat().st_mode & 0o777 for p in folders}
    if group_readable:
        assert modes == ({0o640}, {0o750}) and script == 0o750
        assert config.run_dir.stat().st_mode & 0o050 == 0o050  # the group can pass through the run folder
    else:
        assert modes == ({0o600}, {0o700}) and script == 0o700
