"""Reading a run directory's elites as memory entries (what ``evo memory add RUN_DIR`` stores)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from archive._errors import StoreError
from archive._run import Run
from archive.memory._db import MemoryStoreError
from archive.memory._entry import MemoryEntry, summary_text
from runtime.task import TaskLoadError

__all__ = ["entries_from_run"]


def _task_info(run: Run) -> tuple[dict[str, Any], str | None, str, str]:
    """The run's task args with defaults filled in, its C signature, backend and description (raw args and
    no signature if the task cannot be built here)."""
    try:
        task = run.task
        return task.args.model_dump(mode="json"), task.signature, task.backend, task.description
    except (TaskLoadError, ValueError, TypeError):
        return run.task_args, None, "c", ""


def entries_from_run(run_dir: str | os.PathLike[str]) -> list[MemoryEntry]:
    """An ``improvement`` entry per elite of the run's archive, and one for the run's best (its confirmed leader,
    which need not lead its cell on the figures recorded during the search); its config gives the task, its
    store the hardware each was measured on."""
    path = Path(run_dir)
    try:
        view = Run.open(path)
    except StoreError as exc:
        raise MemoryStoreError(f"{path}: not a run directory ({exc})") from None
    with view:
        task = view.task_name
        task_args, signature, backend, description = _task_info(view)
        try:
            elites = view.archive().elites()
        except StoreError as exc:
            raise MemoryStoreError(f"{path}: {exc}") from None
        run = str(path.resolve())
        ids = [e.id for e in elites]
        ids += [c.id for c in view.store.best(1) if c.id not in ids]
        out = []
        for cand in view.store.get_many(ids):
            hardware = view.store.hardware(cand.hardware_id) if cand.hardware_id else None
            vs = cand.metrics.get("vs_reference")
            vs = float(vs) if vs is not None else None
            summary = summary_text(task=task, task_args=task_args, genome=cand.genome, hardware=hardware,
                                   fitness=cand.fitness, unit=cand.unit, vs_reference=vs, description=description)
            out.append(MemoryEntry(
                task=task, task_args=task_args, genome=cand.genome, backend=backend, signature=signature,
                hardware=hardware or {}, fitness=cand.fitness, unit=cand.unit, vs_reference=vs, summary=summary,
                run=run, created_at=cand.evaluated_at or 0.0,
            ))  # fmt: skip
        return out
