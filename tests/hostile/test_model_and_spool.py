"""Only the model asked (issue 50, point 4).

- A router or server that answers as another model (the simulator's `answer_model`): the answers are
  paid for and kept, counted (by dataset, by provider, in the errors tally and the summary), the run
  is held once most of them are, and the merge keeps none, also of records an earlier run wrote.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson

from draftgen.core.config import Config
from draftgen.core.live import snapshot as snap
from draftgen.core.live.summary import summary_lines
from draftgen.core.merge.merge import merge
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.simulator import SimConfig, SimServer
from tests.generate.test_held_answers import events_of
from tests.helpers import TEST_KEY, dataset_row, make_config, until

OTHER_MODEL = "openai/gpt-3.5-turbo"
ASKED = "moonshotai/kimi-k2.5"


async def _run_to_the_end(cfg: Config) -> tuple[snap.RunSnapshot, list[snap.Event]]:
    """A run of `cfg` that must end DONE by itself: its last snapshot and its events."""
    pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True, serve_attach=False)
    sub = pipeline.hub.subscribe(maxsize=10_000)
    await pipeline.start()
    try:
        assert await asyncio.wait_for(pipeline.generate(), 120) == snap.RunState.DONE
        return pipeline.snapshot(), events_of(sub)
    finally:
        await pipeline.close()


def _tables(**more: dict) -> dict[str, dict]:
    return {"engine": {"reconstruct": True, "workers": 1},
            "tokenizer": {"path": str(bundled_kimi_path()), "template": "kimi-k2.5"}, **more}


# ---------------------------------------------------------------------------------------------
# Only the model asked


async def test_answers_from_another_model_hold_the_run_and_merge_keeps_none(tmp_path: Path) -> None:
    """20 prompts, every answer from openai/gpt-3.5-turbo: once 10 are in the run is held, saying why;
    resumed by the user it finishes (the hold is said once), and the merge keeps none of the 20."""
    sim_cfg = SimConfig(seed=3, fixed_latency_s=0.02, mean_completion_tokens=40, answer_model=OTHER_MODEL)
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 20, "concurrency": 2}], tables=_tables())
        pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True, serve_attach=False)
        sub = pipeline.hub.subscribe(maxsize=10_000)
        await pipeline.start()
        task = asyncio.create_task(pipeline.generate())
        try:
            await until(lambda: pipeline.engine.state == snap.RunState.PAUSED, "the run to be held")
            await until(lambda: pipeline.engine.in_flight == 0, "the requests in flight to finish")
            held = pipeline.snapshot()
            assert f"came from another model than '{ASKED}'" in held.alert and OTHER_MODEL in held.alert, held.alert
            assert sim.stats.requests_total < 20 and dataset_row(pipeline.engine, "a").done < 20, "it paid on"
            pipeline.resume()
            state = await asyncio.wait_for(task, 120)
            final = pipeline.snapshot()
        finally:
            if not task.done():
                pipeline.quit(drain=False)
            await pipeline.close()
    assert state == snap.RunState.DONE
    events = events_of(sub)
    assert [e.level for e in events if e.kind == "alert" and "another model" in e.message] == ["error"]
    row = next(d for d in final.datasets if d.name == "a")
    assert row.done == 20 and row.other_model == 20
    assert dict(final.errors).get("other_model") == 20
    # Counted by provider: each answer's provider carries it as an error.
    assert sum(p.errors for p in final.provider_stats) == 20
    assert {r.kind for r in final.recent_errors} == {"other_model"}
    summary = " ".join(line.strip() for line in summary_lines(final, pipeline.exit_code))
    assert "merge leaves out those from another model" in summary and f"20 from another model than {ASKED}" \
        in summary, summary
    # Paid for and kept on disk, with the model that answered.
    lines = [orjson.loads(x) for x in RunDir(cfg.run_dir).responses("a").read_bytes().splitlines()]
    assert len(lines) == 20 and {x["model"] for x in lines} == {OTHER_MODEL}
    stats = merge(cfg)
    assert stats.samples == 0 and stats.dropped["other_model"] == 20, stats.dropped


async def test_merge_leaves_out_another_models_answers_an_earlier_run_wrote(tmp_path: Path) -> None:
    """Records written before the check (or by hand): the merge reads each line's `model`. A date suffix of
    the model asked is the same model; another model, or another release of the slug, is not."""
    async with SimServer(SimConfig(seed=4, latency_scale=0.0, mean_completion_tokens=40), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 8, "concurrency": 4}], tables=_tables())
        await _run_to_the_end(cfg)
    path = RunDir(cfg.run_dir).responses("a")
    lines = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    assert merge(cfg).samples == 8, "the model asked: every answer kept"
    models = ["MoonshotAI/Kimi-K2.5", "moonshotai/kimi-k2.5-0127", "moonshotai/kimi-k2.5:nitro", OTHER_MODEL,
              "moonshotai/kimi-k2", "moonshotai/kimi-k2.5", "someone/kimi-k2.5", 7]
    for line, model in zip(lines, models):
        line["model"] = model
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    stats = merge(cfg)
    assert stats.samples == 4 and stats.dropped["other_model"] == 4, stats.dropped
