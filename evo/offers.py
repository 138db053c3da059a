"""Offers: what the runs a task follows (an engine task's kernel runs) come to offer while a search runs.

Every :meth:`~runtime.followed_runs.FollowsRuns.offers_every_s` the search asks; what is new grows the task's
arguments. From then on every request carries the grown arguments, the run's frozen config (in the store
and ``config.yaml``) offers them to a resumed run, and the store's ``offers`` says what was offered after
how many evaluations: the run can be read, and resumed, as it went.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from archive import Run
from evo.config import RunConfig
from runtime import Task
from runtime.followed_runs import FollowsRuns

__all__ = ["Offers"]


class Offers:
    """Looks for new offers on the search's behalf, and writes what it finds into the run."""

    def __init__(self, run: Run, note: Callable[[str], None]) -> None:
        self.run, self.note = run, note
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
        got = type(task).new_offers(config.task.args, Run.open)
        if got is None:
            return None
        args, added = got
        grown = config.model_copy(update={"task": config.task.model_copy(update={"args": args})})
        self.run.record_offers(args, [{**a, "at": time.time(), "evaluations": evaluations} for a in added],
                               grown.make_task())
        for a in added:
            self.note(f"offered {a['slot']} kernel {a['id'][:12]} of {a['run_dir']} after {evaluations} evaluations")
        return grown, added
