"""Render every view of the TUI to SVG in screenshots/ from deterministic data (tests/fixtures.py).

    python scripts/make_screenshots.py [OUT_DIR]

The real app runs headless on a fake control surface; event times are shown in UTC and rich's
random class names are fixed, so the files only change when the screens do.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from pathlib import Path

os.environ["TZ"] = "UTC"
time.tzset()

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fixtures import VIEWS, View  # noqa: E402


async def shoot(view: View, out: Path) -> Path:
    app, _ = view.app()
    async with app.run_test(size=view.size) as pilot:
        await view.settle(pilot)
        path = out / f"{view.name}.svg"
        svg = app.export_screenshot(title=f"draftgen: {view.caption}")
        # rich names its CSS classes with a random number: a fixed one keeps unchanged screens unchanged.
        svg = re.sub(r"\bterminal-\d+-", f"terminal-{view.name.replace('_', '-')}-", svg)
        path.write_text(svg, encoding="utf-8")
    return path


async def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for view in VIEWS:
        print(await shoot(view, out))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "screenshots")))
