from pathlib import Path

import pytest

from draftgen.core.config import load_config
from draftgen.core.errors import ConfigError

GOOD = """
[api]
base_url = "https://openrouter.ai/api/v1"
api_key_env = "DG_TEST_KEY"
model = "moonshotai/kimi-k2.5"
request_timeout_s = 1800

[request]
temperature = 0.6
include_reasoning = true
[request.provider]
ignore = ["fireworks", "baseten"]
sort = "price"
allow_fallbacks = true
quantizations = ["int4"]

[budget]
max_usd = 90.0
credit_floor_usd = 2.0

[tokenizer]
path = "moonshotai/Kimi-K2.5"
template = "kimi-k2.5"

[output]
dir = "runs/kimi-k25"

[[datasets]]
name = "B4_mixturethoughts"
prompts = "data/B4_mixturethoughts.jsonl"
concurrency = 2000
max_tokens = 10240
token_budget = 10_000_000

[[datasets]]
name = "B8_sweagent"
prompts = "data/B8_sweagent.jsonl"
concurrency = 500
max_tokens = 16384
token_budget = 10_000_000

[extract]
model = "moonshotai/Kimi-K2.5"
backend = "specforge"
tp_size = 8
aux_layers = "eagle3"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_spec_example_loads(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.api.model == "moonshotai/kimi-k2.5"
    assert [d.name for d in cfg.datasets] == ["B4_mixturethoughts", "B8_sweagent"]
    assert cfg.datasets[0].prompts == tmp_path / "data/B4_mixturethoughts.jsonl"
    assert cfg.output.dir == tmp_path / "runs/kimi-k25"
    assert cfg.budget.max_usd == 90.0 and cfg.extract.tp_size == 8
    # The [request] table goes into every body as-is.
    body = cfg.request_body(cfg.datasets[1], [{"role": "user", "content": "hi"}])
    assert body["provider"] == {"ignore": ["fireworks", "baseten"], "sort": "price", "allow_fallbacks": True,
                                "quantizations": ["int4"]}
    assert body["include_reasoning"] is True and body["temperature"] == 0.6
    assert body["max_tokens"] == 16384 and body["model"] == "moonshotai/kimi-k2.5"
    # Different max_tokens: different request shapes, different fingerprints.
    assert cfg.fingerprint(cfg.datasets[0]) != cfg.fingerprint(cfg.datasets[1])


@pytest.mark.parametrize("edit, message", [
    (("[budget]", "[budget]\nmax_dollars = 3"), "unknown key budget.max_dollars"),
    (("concurrency = 2000", "concurrency = \"lots\""), "datasets[0].concurrency must be an integer"),
    (("concurrency = 2000", "concurrency = 0"), "concurrency must be between 1 and 100000"),
    (("max_usd = 90.0", "max_usd = -1"), "budget.max_usd must be > 0"),
    (("backend = \"specforge\"", "backend = \"vllm\""), "extract.backend must be one of 'hf', 'specforge'"),
    (("backend = \"specforge\"", "backend = \"sglang\""), 'extract.backend = "sglang" was replaced by "specforge"'),
    (("template = \"kimi-k2.5\"", "template = \"chatml\""), "tokenizer.template must be"),
    (("[output]", "[outputs]"), "unknown table or key 'outputs'"),
    (("aux_layers = \"eagle3\"", "aux_layers = [1, 2]"), "exactly 3 layer ids"),
    (("request_timeout_s = 1800", "request_timeout_s = true"), "api.request_timeout_s must be a number"),
    (("name = \"B8_sweagent\"", "name = \"B4_mixturethoughts\""), "is used twice"),
])
def test_bad_values_name_the_key_and_file(tmp_path, edit, message):
    path = write(tmp_path, GOOD.replace(*edit, 1))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert message in str(e.value)
    assert str(path) in str(e.value)


def test_missing_datasets_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="no \\[\\[datasets\\]\\]"):
        load_config(write(tmp_path, "[api]\nmodel = 'x'\n"))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[api\n"))
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="datasets\\[0\\].prompts is required"):
        load_config(write(tmp_path, "[[datasets]]\nname = 'a'\n"))


def test_api_key_from_env_and_never_in_public_dict(tmp_path, monkeypatch):
    cfg = load_config(write(tmp_path, GOOD))
    monkeypatch.delenv("DG_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"\$DG_TEST_KEY, which is not set"):
        cfg.api_key()
    monkeypatch.setenv("DG_TEST_KEY", "sk-or-v1-secretsecret")
    assert cfg.api_key() == "sk-or-v1-secretsecret"
    assert "secretsecret" not in str(cfg.public_dict())
