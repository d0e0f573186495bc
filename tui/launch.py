"""Start the TUI: with the pipeline embedded on the app's own event loop, or attached read-only."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TextIO

from draftgen.core.config import Config
from draftgen.core.live.pipeline import Pipeline
from draftgen.core.live.summary import EXIT_ERROR, summary_lines

from draftgen.tui.app import DraftgenApp


async def run_tui(config: Config, api_key: str, *, skip_smoke: bool = False, after_run: list[str] | None = None,
                  out: TextIO = sys.stdout) -> int:
    """The app and the engine share one event loop; every panel reads the pipeline's snapshots."""
    pipeline = Pipeline(config, api_key, skip_smoke=skip_smoke)
    await pipeline.start()
    app = DraftgenApp(pipeline, title=f"draftgen · {config.run_dir.name}")

    async def generate_then() -> None:
        state = await pipeline.generate()
        # The demo chains merge and extraction after generation, as a user would press m then x.
        for stage in after_run or ():
            if pipeline.quit_requested.is_set() or state != "DONE":
                return
            await (pipeline.merge() if stage == "merge" else pipeline.extract())

    work = asyncio.create_task(generate_then())
    try:
        await app.run_async()
    finally:
        if not work.done():
            pipeline.quit(drain=False)
            try:
                await asyncio.wait_for(work, 30)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                work.cancel()
        await pipeline.close()
        # The screen is gone: say in the shell how the run ended (also after a failed smoke or an error).
        code = EXIT_ERROR if pipeline.error is not None else pipeline.exit_code
        print("\n".join(summary_lines(pipeline.snapshot(), code, config_hint=str(config.path))), file=out, flush=True)
    if pipeline.error is not None:
        raise pipeline.error  # shown in the UI's alert bar; printed again once the screen is gone
    return pipeline.exit_code


async def attach_tui(run_dir: Path) -> int:
    from draftgen.core.live.attach import AttachControls
    controls = AttachControls(run_dir)
    await controls.start()
    try:
        await DraftgenApp(controls, title=f"draftgen · {run_dir.resolve().name} (attached)").run_async()
    finally:
        await controls.close()
    return 0
