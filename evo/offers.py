"""Offers: what the runs a task follows (an engine task's kernel runs) come to offer while a search runs.

Every :meth:`~runtime.followed_runs.FollowsRuns.offers_every_s` the search asks; what is new grows the task's
arguments. From then on every request carries the grown arguments, the run's frozen config (in the store
and ``config.yaml``) offers them to a resumed run, and the store's ``offers`` says what was offered after
how many evaluations: the run can be read, and resumed, as it went.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from archive import OFFERS_KEY, Store, read_run
from evo.config import RunConfig
from runtime import Task
from runtime.followed_runs import FollowsRuns

__all__ = ["Offers"]


class Offers:
    """Looks for new offers on the search's behalf, and writes what it finds into the run."""

    def __init__(self, store: Store, run_dir: Path, note: Callable[[str], None]) -> None:
        self.store, self.run_dir, self.note = store, run_dir, note
        self._due = 0.0  # monotonic time of the next look (now: a resumed run looks first)

    def look(self, config: RunConfig, task: Task, evaluations: int) -> tuple[RunConfig, list[dict[str, Any]]] | None:
        """The config grown by what is new, and one record per addition; ``None`` when the task follows no
        run, the next look is not due, or nothing is new."""
        if not isinstance(task, FollowsRuns):
            return None
        every = task.offers_every_s()
        if not every or time.monotonic() < self._due:
            return None
        self._due = time.monotonic() + every
        got = type(task).new_offers(config.task.args, read_run)
        if got is None:
            return None
        args, added = got
        grown = config.model_copy(update={"task": config.task.model_copy(update={"args": args})})
        offers = json.loads(self.store.get_meta(OFFERS_KEY) or "[]")
        offers += [{**a, "at": time.time(), "evaluations": evaluations} for a in added]
        stored = yaml.safe_load(self.store.get_meta("config") or "{}")  # as frozen, this session's budget aside
        stored["task"]["args"] = args
        text = yaml.safe_dump(stored, sort_keys=False)
        self.store.set_metas({"config": text, OFFERS_KEY: json.dumps(offers)})
        (self.run_dir / "config.yaml").write_text(text)
        for a in added:
            self.note(f"offered {a['slot']} kernel {a['id'][:12]} of {a['run_dir']} after {evaluations} evaluations")
        return grown, added
