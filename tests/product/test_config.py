from pathlib import Path

import pytest

from draftgen.core.config_load import load_config
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
    (("aux_layers = \"eagle3\"", "aux_layers = [2, 1]"), "strictly ascending"),
    (("aux_layers = \"eagle3\"", "aux_layers = \"dflash\""), "one of eagle3, peagle, dflash:K, dspark:K"),
    (("aux_layers = \"eagle3\"", "aux_layers = []"), "lists no layer id"),
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


MT = 'name = "B8_sweagent"'


def test_turns_and_cycles_load_with_defaults_unchanged(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    plain = cfg.datasets[0]
    assert plain.turns == "last" and plain.max_turns is None and not plain.cycles  # today's engine behaviour
    fp = cfg.fingerprint(cfg.datasets[1])
    extra = '\nturns = "all"\nmax_turns = 4\ntemperatures = [0.6, 1]\nreasoning_efforts = ["low", "high", "xhigh"]'
    cfg = load_config(write(tmp_path, GOOD.replace(MT, MT + extra)))
    ds = cfg.datasets[1]
    assert (ds.turns, ds.max_turns, ds.temperatures, ds.reasoning_efforts) == ("all", 4, [0.6, 1.0],
                                                                               ["low", "high", "xhigh"])
    assert cfg.fingerprint(ds) != fp  # the smoke test that checked the old shape does not cover the cycles


def test_cycles_give_the_ith_prompt_its_values_in_the_body(tmp_path):
    cfg = load_config(write(tmp_path, GOOD.replace("[request]", "[request]\nreasoning = { exclude = false }").replace(
        MT, MT + '\ntemperatures = [0.6, 1.0]\nreasoning_efforts = ["low", "medium", "high"]')))
    ds = cfg.datasets[1]
    msgs = [{"role": "user", "content": "hi"}]
    got = [(b["temperature"], b["reasoning"]) for b in (cfg.request_body(ds, msgs, index=i) for i in range(4))]
    assert got == [(0.6, {"exclude": False, "effort": "low"}), (1.0, {"exclude": False, "effort": "medium"}),
                   (0.6, {"exclude": False, "effort": "high"}), (1.0, {"exclude": False, "effort": "low"})]
    # No index (the fingerprint's shape, the prices' routing): the tables as written; no cycle, no change.
    assert cfg.request_body(ds, msgs)["temperature"] == 0.6 and cfg.request_body(ds, msgs)["reasoning"] == {
        "exclude": False}
    assert cfg.request_body(cfg.datasets[0], msgs, index=1) == cfg.request_body(cfg.datasets[0], msgs)


def test_cycle_index_is_the_prompt_line_and_sampling_reads_the_body_sent(tmp_path):
    from draftgen.core.config_tables import cycle_index, sampling_of
    assert [cycle_index(line) for line in (1, 2, 7)] == [0, 1, 6]
    assert sampling_of({"temperature": 0.6, "reasoning": {"effort": "high"}}) == {
        "temperature": 0.6, "reasoning_effort": "high"}
    assert sampling_of({"reasoning_effort": "low"}) == {"temperature": None, "reasoning_effort": "low"}


def test_a_self_hosted_body_carries_the_effort_as_reasoning_effort(tmp_path):
    text = GOOD.replace('base_url = "https://openrouter.ai/api/v1"', 'base_url = "http://127.0.0.1:9/v1"\n'
                        'kind = "openai-compatible"').replace("include_reasoning = true\n", "").replace(
        "[request.provider]\nignore = [\"fireworks\", \"baseten\"]\nsort = \"price\"\nallow_fallbacks = true\n"
        "quantizations = [\"int4\"]\n", "")
    cfg = load_config(write(tmp_path, text.replace(MT, MT + '\nreasoning_efforts = ["low", "high"]')))
    body = cfg.request_body(cfg.datasets[1], [], index=1)
    assert body["reasoning_effort"] == "high" and "reasoning" not in body


@pytest.mark.parametrize("extra, message", [
    ('max_turns = 0\nturns = "all"', "datasets[1].max_turns = 0 (dataset B8_sweagent): must be an integer >= 1"),
    ("max_turns = 3", "datasets[1].max_turns = 3 (dataset B8_sweagent): caps the turns asked with turns = \"all\""),
    ('turns = "every"', "datasets[1].turns must be one of 'first', 'last', 'all'"),
    ("max_turns = 2.5", "datasets[1].max_turns must be an integer"),
    ("temperatures = [0.6, 2.5]", "datasets[1].temperatures[1] = 2.5 (dataset B8_sweagent): must be between 0 and 2"),
    ("temperatures = []", "datasets[1].temperatures = [] (dataset B8_sweagent): list at least one value"),
    ('temperatures = ["hot"]', "datasets[1].temperatures[0] must be a number"),
    ('reasoning_efforts = ["high", "max!"]', "datasets[1].reasoning_efforts[1] = 'max!' (dataset B8_sweagent): must "
                                             "be one of none, minimal, low, medium, high, xhigh"),
    ("temperatures = [0.2]\nrequest = { temperature = 0.7 }",
     "datasets[1].temperatures and datasets[1].request.temperature are both set (dataset B8_sweagent)"),
    ('reasoning_efforts = ["low"]\nrequest = { reasoning = { effort = "high" } }',
     "datasets[1].reasoning_efforts and datasets[1].request.reasoning.effort are both set"),
    ('reasoning_efforts = ["low"]\nrequest = { reasoning_effort = "high" }',
     "datasets[1].reasoning_efforts and datasets[1].request.reasoning_effort are both set"),
    ('reasoning_efforts = ["low"]\nrequest = { reasoning = { max_tokens = 100 } }',
     "datasets[1].reasoning_efforts and datasets[1].request.reasoning.max_tokens are both set (dataset B8_sweagent): "
     "OpenRouter takes a reasoning effort or a reasoning budget, not both"),
])
def test_bad_turns_and_cycles_name_the_file_and_dotted_key(tmp_path, extra, message):
    path = write(tmp_path, GOOD.replace(MT, MT + "\n" + extra))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert message in str(e.value)
    assert str(e.value).startswith(f"{path}: ")


def test_a_cycle_overrides_the_top_level_request_but_not_beside_a_reasoning_budget(tmp_path):
    cfg = load_config(write(tmp_path, GOOD.replace(MT, MT + "\ntemperatures = [1.0]")))
    assert cfg.request_body(cfg.datasets[1], [], index=0)["temperature"] == 1.0  # [request] temperature = 0.6
    path = write(tmp_path, GOOD.replace("[request]", "[request]\nreasoning = { max_tokens = 100 }").replace(
        MT, MT + '\nreasoning_efforts = ["low"]'))
    with pytest.raises(ConfigError, match=r"datasets\[1\]\.reasoning_efforts and request\.reasoning\.max_tokens"):
        load_config(path)
    path = write(tmp_path, GOOD.replace("[request]", '[request]\nreasoning_effort = "low"').replace(
        MT, MT + '\nreasoning_efforts = ["high"]'))
    with pytest.raises(ConfigError, match=r"datasets\[1\]\.reasoning_efforts and request\.reasoning_effort are "
                                          r"both set .*two efforts"):
        load_config(path)
