"""Importing what earlier runs spooled (spool.py), before this run sends anything.

Each dataset, as it opens, appends its spooled records that are not on disk yet (by prompt id) and
fsyncs them; once every dataset is open, the spools imported whole are removed and those that stay
are named, with why (those refused unread as not the user's alone, spool.py, named as refused); each
answer imported is told to the run's owner (run_state.py `RunControl`, whose `HeldOutcome` the end
summary says).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from draftgen.core.errors import DiskError
from draftgen.core.generate.loop.dataset_run import DatasetRun
from draftgen.core.generate.loop.spool import Spool, find_spools
from draftgen.core.live.events import EventSink
from draftgen.core.live.stage_payloads import SpoolImported
from draftgen.core.rundir import RunDir, iter_jsonl


class SpoolImport:
    """The spools of earlier runs in one run directory, imported as each dataset opens."""

    def __init__(self, rundir: RunDir, on_imported: Callable[[], None], on_event: EventSink) -> None:
        self.rundir = rundir
        self._on_imported = on_imported  # an answer of an earlier run's spool imported (RunControl counts it)
        self._event = on_event
        self._spools: list[Spool] = []

    def load(self) -> None:
        """Read this run directory's spool files."""
        self._spools = find_spools(self.rundir.root)

    def import_into(self, ds: DatasetRun) -> None:
        """Append the dataset's spooled records that are not on disk yet (by prompt id), then fsync."""
        mine = [(spool, r) for spool in self._spools if not spool.problem for r in spool.records
                if r.dataset == ds.config.name]
        if not mine:
            return
        on_disk = {str(raw.get("id")) for path in (self.rundir.responses(ds.config.name),
                                                   self.rundir.failures(ds.config.name))
                   for _, raw in iter_jsonl(path)}
        assert ds.responses is not None and ds.failures is not None  # opened by RecordBook.open just before
        for spool, r in mine:
            rid = str(r.record.get("id"))
            if rid in on_disk:
                continue
            try:
                (ds.responses if r.file == "responses" else ds.failures).append_now(r.record)
            except DiskError as e:
                raise DiskError(f"{e}; the records spooled in {spool.path} stay there and the next run imports "
                                "them once there is room") from e
            on_disk.add(rid)
            if r.file == "responses":
                self._on_imported()
        for f in (ds.responses, ds.failures):
            fd = os.open(f.path, os.O_RDONLY)
            try:
                os.fsync(fd)  # on disk for good before the spool file goes
            finally:
                os.close(fd)

    def finish(self, names: set[str]) -> None:
        """Every dataset (`names`) is open: remove the spools imported whole; say which stay, and why."""
        for spool in self._spools:
            if spool.refused:
                self._event(SpoolImported(path=str(spool.path), outcome="refused", cause=spool.refused))
                continue
            others = sorted({r.dataset for r in spool.records} - names)
            if spool.problem or others:
                why = spool.problem or f"its dataset(s) {', '.join(others)} are not in this config"
                self._event(SpoolImported(path=str(spool.path), outcome="kept", cause=why))
                continue
            try:
                spool.path.unlink()
            except OSError as e:
                self._event(SpoolImported(path=str(spool.path), outcome="not_removed", cause=str(e.strerror)))
                continue
            n = sum(1 for r in spool.records if r.file == "responses")
            self._event(SpoolImported(path=str(spool.path), outcome="imported", records=len(spool.records),
                                      answers=n, run_dir=str(self.rundir.root)))
        self._spools = []
