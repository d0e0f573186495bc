"""extract.format = "speculators" (and dtype = "fp8") with the tiny real Llama of test_extract, read back by
speculators' released reader: hs-connectors 0.9.0's FP8Transfer / FileTransfer, speculators 0.9.0's
check_hidden_states and ArrowDataset's slicing, run from the unpacked wheels in a subprocess
(tests/speculators_read.py). Each slot is compared with transformers' own float32 forward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from draftgen.core.config import Config
from draftgen.core.errors import ConfigError
from draftgen.core.extract import extract, layout
from draftgen.core.extract import speculators_layout as speculators
from tests.extract import test_extract
from tests.extract.test_extract import HIDDEN, N_LAYERS, make_run, make_samples, token_arrays
from tests.pinned import ROOT

model_dir = test_extract.model_dir
hf_model = test_extract.hf_model

LAYERS = (1, 3, 4)  # draftgen's eagle3 default for N = 8: layer outputs, vLLM's 2, 4, 5 (then 8: pre-norm last)


def read_with_speculators(run: Path, out: Path, pythonpath: str, backend: str = "fp8") -> dict:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([pythonpath, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "speculators_read.py"), str(run), str(out), backend],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"speculators' reader refused {run}:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def float32_slots(hf_model: torch.nn.Module, ids: np.ndarray) -> torch.Tensor:
    """[T, 4, H] from transformers' float32 forward (see _slots)."""
    return _slots(hf_model, ids, LAYERS)


def total_bytes(run: Path) -> int:
    return sum(p.stat().st_size for p in (run / "hidden_states").glob("hs_*.safetensors"))


def test_fp8_files_are_what_speculators_reads_and_within_cosine_of_the_float32_forward(
        tmp_path: Path, model_dir: Path, hf_model: torch.nn.Module, speculators_pythonpath: str) -> None:
    config = make_run(tmp_path / "fp8", model_dir, format="speculators", dtype="fp8")
    stats = extract(config)
    n = len(make_samples())
    assert (stats.written, stats.format, stats.dtype) == (n, "speculators", "fp8")
    assert stats.target_layer_ids == [k + 1 for k in LAYERS] + [N_LAYERS]
    got = read_with_speculators(config.run_dir, tmp_path / "read", speculators_pythonpath)
    assert got["existing"] == list(range(n))
    worst = [1.0] * 4
    for f, (ids, _mask) in zip(got["files"], token_arrays(config), strict=True):
        t = len(ids)
        assert f["stored"] == {"token_ids": "I64", "hidden_states": "F8_E4M3", "hidden_states_scales": "F32"}
        assert json.loads(f["metadata"]["target_layer_ids"]) == stats.target_layer_ids
        assert f["metadata"]["layer_numbering"] == "vllm"
        assert f["dequantized"] == ["torch.bfloat16", [t, 4, HIDDEN]]
        assert (f["aux"], f["last"], f["ids_equal"]) == ([t, 3 * HIDDEN], [t, HIDDEN], True)
        back = torch.load(tmp_path / "read" / f"hs_{f['index']}.pt")
        ref = float32_slots(hf_model, ids)
        cos = torch.nn.functional.cosine_similarity(back, ref, dim=-1)  # [T, 4]: each token of each slot
        worst = [min(w, float(c)) for w, c in zip(worst, cos.min(dim=0).values, strict=True)]
    assert min(worst) >= 0.999, f"worst cosine per slot against the float32 forward: {worst}"
    # The last slot is the pre-norm output, not the final norm's (what SpecForge's hidden_state holds): the tiny
    # model's RMSNorm weight is 1, so the two differ by each token's scale, which cosine cannot see.
    ids0 = token_arrays(config)[0][0]
    normed = test_extract.reference(hf_model, ids0)[1][-1]
    back0 = torch.load(tmp_path / "read" / "hs_0.pt")[:, -1]
    prenorm = float32_slots(hf_model, ids0)[:, -1]
    assert float((back0 - prenorm).norm() / prenorm.norm()) < 0.05 < float((back0 - normed).norm() / normed.norm())
    # The error measured as written is in stats.json, per slot.
    on_disk = json.loads((config.run_dir / "hidden_states" / "stats.json").read_text())
    err = on_disk["fp8_error"]
    assert err["files"] == n and err["slots"] == stats.target_layer_ids
    assert all(0.999 <= c <= 1 for c in err["cosine_worst"]) and all(0 < r < 0.06 for r in err["rel_error_worst"])
    assert all(m >= w for m, w in zip(err["cosine_median"], err["cosine_worst"], strict=True))


def test_fp8_takes_at_most_055_of_the_bf16_bytes_of_the_same_set(
        tmp_path: Path, model_dir: Path, speculators_pythonpath: str) -> None:
    # Samples of 40-300 tokens: each file's ~200-byte header weighs as it does on real samples' thousands.
    rng = np.random.default_rng(7)
    samples = [(rng.integers(1, 998, size=int(rng.integers(40, 250))), np.ones(1, dtype=np.uint8)) for _ in range(6)]
    samples = [(ids, (rng.random(len(ids)) < 0.5).astype(np.uint8)) for ids, _ in samples]
    runs = {}
    for dtype in ("bfloat16", "fp8"):
        config = make_run(tmp_path / dtype, model_dir, samples, format="speculators", dtype=dtype)
        stats = extract(config)
        assert stats.bytes_written == total_bytes(config.run_dir)
        runs[dtype] = config
    bf16, fp8 = total_bytes(runs["bfloat16"].run_dir), total_bytes(runs["fp8"].run_dir)
    assert fp8 <= 0.55 * bf16, (fp8, bf16)
    # The bf16 files go through FileTransfer, the reader of speculators' default "file" backend.
    got = read_with_speculators(runs["bfloat16"].run_dir, tmp_path / "read", speculators_pythonpath, "file")
    assert {f["stored"]["hidden_states"] for f in got["files"]} == {"BF16"}


@pytest.mark.parametrize(("table", "words"), [
    ({"dtype": "fp8"}, ("extract.dtype = \"fp8\"", "SpecForge 0.2.0", "format = \"speculators\"")),
    ({"dtype": "fp8", "format": "specforge"}, ("extract.dtype = \"fp8\"", "OfflineEagle3Dataset")),
    ({"format": "speculators", "backend": "specforge"}, ("before the final norm", "backend = \"hf\"")),
    ({"format": "speculators", "compress": True}, ("extract.compress", "safetensors")),
])
def test_what_a_trainer_cannot_read_is_refused_at_config_load(tmp_path: Path, table: dict, words: tuple) -> None:
    with pytest.raises(ConfigError) as e:
        make_run(tmp_path, tmp_path / "no-model-loaded", **table)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_one_format_per_folder_and_a_restart_skips_what_is_written(tmp_path: Path, model_dir: Path) -> None:
    config = make_run(tmp_path, model_dir, format="speculators", dtype="fp8")
    (config.run_dir / "hidden_states").mkdir(parents=True)
    first = extract(config)
    assert first.written == len(make_samples())
    (config.run_dir / "hidden_states" / "hs_3.safetensors").unlink()
    again = extract(config)
    assert (again.written, again.skipped_existing) == (1, len(make_samples()) - 1)
    raw = {"output": {"dir": str(config.run_dir)}, "datasets": [{"name": "B1", "prompts": "p.jsonl"}],
           "extract": {"model": str(model_dir), "backend": "hf", "device": "cpu", "dtype": "float32"}}
    from draftgen.core.config_load import config_from_dict
    specforge: Config = config_from_dict(raw, tmp_path / "draftgen.toml")
    with pytest.raises(ConfigError, match="files of the other format"):
        extract(specforge)
    # The plan and the read-back check say so too: the plan counted every sample to do (0 done) and the check
    # passed (exit 0, every sample "without a file") on a folder extract refuses.
    import io

    from draftgen.core.extract import readback
    from draftgen.core.extract.command import plan_command
    with pytest.raises(ConfigError, match=r"holds files of the other format \(hs_"):
        plan_command(specforge, None, out=io.StringIO())
    with pytest.raises(ConfigError, match=r"holds files of the other format \(hs_"):
        readback.check_command(specforge, out=io.StringIO())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_is_hs_connectors_own(speculators_pythonpath: str, dtype: torch.dtype) -> None:
    # The same tensor through hs_connectors.fp8_utils.quantize_tensor_to_fp8 (the release) and ours (slot by slot,
    # the amax in the input's dtype): equal bytes, from a float32 forward's rows and from the writer's bf16 ones.
    torch.manual_seed(3)
    x = (torch.randn(5, 4, 16) * torch.tensor([0.01, 1.0, 30.0, 500.0])[None, :, None]).to(dtype)
    x[2] = 0  # an all-zero token: the scale's floor
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"draftgen-q-{os.getpid()}.pt"
    torch.save(x, path)
    script = ("import sys, torch; from hs_connectors.fp8_utils import quantize_tensor_to_fp8 as q; "
              "v, s = q(torch.load(sys.argv[1])); torch.save((v.view(torch.uint8), s), sys.argv[1])")
    env = {**os.environ, "PYTHONPATH": speculators_pythonpath}
    try:
        subprocess.run([sys.executable, "-c", script, str(path)], check=True, env=env, timeout=120)
        theirs, their_scale = torch.load(path)
    finally:
        path.unlink(missing_ok=True)
    ours, our_scale = speculators.quantize(x)
    assert torch.equal(ours.view(torch.uint8), theirs) and torch.equal(our_scale, their_scale)
    sample = layout.SampleTensors(torch.arange(5), torch.ones(5), x[:, 3], x[:, :3].reshape(5, 48))
    stored, errors = speculators.tensors(sample, fp8=True)  # what write_sample stores: the same bytes
    assert torch.equal(stored["hidden_states"].view(torch.uint8), theirs)
    # One scale per token over every slot: a slot 50,000x smaller than the token's largest falls to FP8's
    # subnormals, and the error measured says so; the others keep FP8's ~2-3%.
    assert errors is not None and len(errors) == 4
    assert errors[0][0] < 0.99 and errors[0][1] > 0.1
    assert all(c > 0.999 and r < 0.04 for c, r in errors[1:]), errors


def resolve_with_speculators(path: Path, pythonpath: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([pythonpath, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "speculators_train_config.py"), str(path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"speculators' TrainConfig refused {path}:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["fp8", "bfloat16"])
def test_train_command_writes_speculators_config_that_its_own_trainer_resolves_and_reads(
        tmp_path: Path, model_dir: Path, speculators_pythonpath: str, dtype: str) -> None:
    import io

    from draftgen.core.extract.handoff import train_command
    from draftgen.core.extract.speculators_handoff import CONFIG_FILE, SCRIPT_FILE
    config = make_run(tmp_path, model_dir, format="speculators", dtype=dtype)
    extract(config)  # leaves the hand-off beside the files
    hidden = config.run_dir / "hidden_states"
    (hidden / CONFIG_FILE).unlink()
    out = io.StringIO()
    assert train_command(config, out=out) == 0  # writes it again, and prints it
    printed = out.getvalue()
    assert f"speculators train --config {(hidden / CONFIG_FILE).resolve()}" in printed
    script = (hidden / SCRIPT_FILE).read_text()
    assert script.endswith(f"exec speculators train --config {(hidden / CONFIG_FILE).resolve()} \"$@\"\n")
    got = resolve_with_speculators(hidden / CONFIG_FILE, speculators_pythonpath)
    v = got["values"]
    longest = max(len(ids) for ids, _ in token_arrays(config))
    assert v["speculator_type"] == "eagle3" and v["verifier_name_or_path"] == str(model_dir)
    assert v["target_layer_ids"] == [k + 1 for k in LAYERS]  # vLLM's numbering; the trainer appends nothing
    assert v["data_path"] == str((hidden / "speculators-data").resolve())
    assert v["hidden_states_backend"] == ("fp8" if dtype == "fp8" else "file")
    assert got["transfer"] == ("FP8Transfer" if dtype == "fp8" else "FileTransfer")
    assert v["total_seq_len"] >= longest and v["on_missing"] == "warn"
    assert set(got["provenance"].values()) == {"yaml"}, got["provenance"]  # every value is ours, none a default
    assert got["backend_args"]["hidden_states_path"] == str(hidden.resolve())
    for row, (ids, mask) in zip(got["rows"], token_arrays(config), strict=True):
        assert row is not None
        assert (row["aux"], row["last"], row["dtype"]) == ([len(ids), 3 * HIDDEN], [len(ids), HIDDEN], "torch.bfloat16")
        assert row["mask"] == mask.tolist()


@pytest.mark.slow
@pytest.mark.timeout(900)  # the demo's run, then two extractions and a reference forward of its ~430 samples
async def test_the_demos_merged_set_in_speculators_fp8(tmp_path: Path, speculators_pythonpath: str) -> None:
    """The issue's bar on the demo's own merged set and model: `draftgen demo --headless`, then its merged/
    extracted again in speculators' format as fp8 and as bf16. Every fp8 file is read by FP8Transfer, passes
    check_hidden_states and ArrowDataset; each slot is within cosine 0.999 of the demo model's float32 forward;
    the fp8 files take at most 0.55x the bf16 files' bytes."""
    import io
    import shutil

    from transformers import AutoModelForCausalLM

    from draftgen.core.config_load import config_from_dict
    from draftgen.tui.demo import run_demo
    out = io.StringIO()
    assert await run_demo(tmp_path / "demo", headless=True, out=out, latency_scale=0.02) == 0, out.getvalue()[-3000:]
    model = tmp_path / "demo" / "tiny-model"
    configs = {}
    for dtype in ("fp8", "bfloat16"):
        run = tmp_path / dtype / "run"
        shutil.copytree(tmp_path / "demo" / "run" / "merged", run / "merged")
        raw = {"output": {"dir": str(run)}, "datasets": [{"name": "B1", "prompts": "p.jsonl"}],
               "extract": {"model": str(model), "backend": "hf", "device": "cpu", "format": "speculators",
                           "dtype": dtype}}
        configs[dtype] = config_from_dict(raw, tmp_path / dtype / "draftgen.toml")
        stats = extract(configs[dtype])
        assert stats.written == len(token_arrays(configs[dtype])) > 200
    fp8, bf16 = total_bytes(configs["fp8"].run_dir), total_bytes(configs["bfloat16"].run_dir)
    assert fp8 <= 0.55 * bf16, (fp8, bf16)
    got = read_with_speculators(configs["fp8"].run_dir, tmp_path / "read", speculators_pythonpath)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    layers = tuple(k - 1 for k in json.loads(got["files"][0]["metadata"]["target_layer_ids"])[:-1])
    worst = 1.0
    for f, (ids, _mask) in zip(got["files"], token_arrays(configs["fp8"]), strict=True):
        assert f["ids_equal"] and f["stored"]["hidden_states"] == "F8_E4M3"
        ref = _slots(lm, ids, layers)
        back = torch.load(tmp_path / "read" / f"hs_{f['index']}.pt")
        worst = min(worst, float(torch.nn.functional.cosine_similarity(back, ref, dim=-1).min()))
    assert worst >= 0.999, worst
    print(f"demo: {len(got['files'])} files, fp8 {fp8:,} bytes = {fp8 / bf16:.3f} x bf16 {bf16:,}; worst cosine "
          f"against the float32 forward {worst:.5f}")


def _slots(lm: torch.nn.Module, ids: np.ndarray, layers: tuple[int, ...]) -> torch.Tensor:
    """[T, k+1, H] from transformers' own forward: HF hidden_states[k + 1] for each aux layer k, then the last
    decoder layer's own output (a hook on it: before the final norm)."""
    got: dict[str, torch.Tensor] = {}
    hook = lm.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: got.__setitem__("last", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():  # the decoder alone: the demo model's logits would be [T, 163,840]
            hs = lm.model(torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return torch.stack([hs[k + 1][0] for k in layers] + [got["last"][0]], dim=1)


def test_hs_files_of_another_merge_are_refused_not_skipped(tmp_path: Path, model_dir: Path) -> None:
    # A new merge puts other samples at the old indices: hs_{i} of the old one must not be taken as done.
    from draftgen.core.extract import claim
    from draftgen.core.tokens.store import TokenWriter
    config = make_run(tmp_path, model_dir, format="speculators", dtype="fp8")
    assert extract(config).written == len(make_samples())
    tokens = config.run_dir / "merged" / "tokens"
    import shutil
    shutil.rmtree(tokens)
    with TokenWriter(tokens) as writer:
        for k, (ids, mask) in enumerate(make_samples(seed=2)):
            writer.append(f"s{k}", ids, mask)
    with pytest.raises(claim.HiddenStatesOfAnotherMerge, match="another merge"):
        extract(config)
    stats = extract(config, on_other_merge=claim.START_OVER)  # every hs_ file deleted and written again
    assert (stats.written, stats.skipped_existing) == (len(make_samples(seed=2)), 0)
    got = speculators.load_sample(config.run_dir / "hidden_states" / "hs_0.safetensors")
    assert got["token_ids"].tolist() == make_samples(seed=2)[0][0].tolist()


def test_extract_command_says_the_layers_the_command_and_the_fp8_error(tmp_path: Path, model_dir: Path) -> None:
    import io

    from draftgen.core.extract import extract_command
    config = make_run(tmp_path, model_dir, format="speculators", dtype="fp8")
    out = io.StringIO()
    assert extract_command(config, None, out=out) == 0
    text = out.getvalue()
    assert "speculators: files hs_{i}.safetensors, fp8, layers [2, 4, 5, 8] in vLLM's numbering" in text, text
    assert "train-speculators.sh" in text and f"fp8 error over {len(make_samples())} files: cosine worst 0.99" in text
    again = io.StringIO()  # every file there: the plan counts them (hs_{i}), nothing loads
    assert extract_command(config, None, out=again) == 0
    n = len(make_samples())
    assert f"nothing to do ({n} of {n} files already written); the model is not loaded" in again.getvalue()


def test_a_five_layer_set_is_written_with_its_slots_and_the_hand_off_says_eagle3_does_not_take_it(
        tmp_path: Path, model_dir: Path) -> None:
    import io

    from draftgen.core.extract.handoff import train_command
    config = make_run(tmp_path, model_dir, format="speculators", dtype="fp8", aux_layers="dflash:5")
    stats = extract(config)
    assert len(stats.layers) == 5 and stats.target_layer_ids == [k + 1 for k in stats.layers] + [N_LAYERS]
    got = speculators.load_sample(config.run_dir / "hidden_states" / "hs_0.safetensors")
    assert got["hidden_states"].shape[1:] == (6, HIDDEN)
    out = io.StringIO()
    train_command(config, out=out)
    assert "NOTE: speculator_type = eagle3 reads 3 aux layers; these files hold 5" in out.getvalue()


def test_specforges_offline_script_refuses_a_speculators_set_and_names_what_reads_it(
        tmp_path: Path, model_dir: Path) -> None:
    import io

    from draftgen.core.extract.handoff import train_command
    config = make_run(tmp_path, model_dir, samples=make_samples(n=2), format="speculators", dtype="fp8")
    from draftgen.core.extract.command import extract_command
    out = io.StringIO()
    assert extract_command(config, None, out=out) == 0
    assert "training with speculators: " in out.getvalue() and "train-command.sh" not in out.getvalue()
    hidden = (config.run_dir / "hidden_states").resolve()
    out = io.StringIO()
    assert train_command(config, out=out) == 0
    assert ("NOTE: these hidden states are speculators' hs_{i}.safetensors (extract.format = \"speculators\"): "
            "SpecForge's offline reader takes .ckpt files only and would find none") in out.getvalue()
    # train-command.sh ran `specforge train` on a folder with no .ckpt file: it says why and what to run instead.
    proc = subprocess.run(["sh", str(hidden / "train-command.sh")], capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"]})
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("train-command.sh: these hidden states are speculators' hs_{i}.safetensors")
    assert f"train with {hidden / 'train-speculators.sh'}, or SpecForge online" in proc.stderr
