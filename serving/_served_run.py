"""What serving holds of the served run, read once from the one :class:`archive.Run`: its config, its task,
whether it is an engine run and for which encoder, and the elite asked for; and the error of asking it
for what it does not hold. Requests that read candidates open the run's store in their own thread."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from archive import Run, Store, StoreError

if TYPE_CHECKING:
    from runtime.task import Task

__all__ = ["ID_PATTERN", "EliteNotFound", "ServeError", "ServedRun", "candidate", "ok_candidate", "open_served",
           "open_store"]


class ServeError(ValueError):
    """A problem with what the user asked to serve (the CLI prints it as one line, exit 2)."""


class EliteNotFound(ServeError):
    """The run holds no candidate with that id."""


ID_PATTERN = re.compile(r"^[0-9a-fA-F]{1,64}$")  # a candidate id or prefix: hex only, never a path


@contextmanager
def open_served(run_dir: Path) -> Iterator[Run]:
    """The run, read-only (one per call: sqlite connections stay in their thread)."""
    try:
        run = Run.open(run_dir)
    except StoreError as exc:
        raise ServeError(f"{exc} (give the directory of an evo run)") from None
    with run:
        yield run


@contextmanager
def open_store(run_dir: Path) -> Iterator[Store]:
    """The run's store, read-only."""
    with open_served(run_dir) as run:
        yield run.store


def candidate(store: Store, cid: str) -> Any:
    """The candidate with id (or unique prefix) ``cid``; a 4xx API error when ambiguous or unknown."""
    from serving._errors import APIError

    try:
        cand = store.get(cid)
    except KeyError as exc:
        raise APIError(400, str(exc.args[0] if exc.args else exc), param="id") from None
    if cand is None:
        raise APIError(404, f"no candidate {cid!r} in this run", param="id", code="elite_not_found")
    return cand


def _is_engine_task(name: str) -> bool:
    from runtime.task import load_task_class

    try:
        from runtime.engine.task import EngineTask
    except ImportError:
        return False
    return issubclass(load_task_class(name), EngineTask)


@dataclass(frozen=True)
class ServedRun:
    """The served run as read once (:meth:`read`): what the app, the kernel invoker and the archive API need of
    it, and the elite resolved (its id, ``None`` for the default engine configuration, and what is served)."""

    path: Path
    config: dict[str, Any]
    sys_path: tuple[str, ...]
    engine: bool  # an engine run (its candidates are engine configurations)
    model_dir: Path | None  # the encoder its engines are for; None: the bundled one
    elite_id: str | None
    note: str

    @property
    def task_name(self) -> str:
        return str(self.config["task"]["name"])

    @cached_property
    def task(self) -> Task:
        """The run's task, built once here (its import paths restored); raises what building it raises."""
        import sys

        from runtime.task import load_task_class

        for p in self.sys_path:  # a user's task module, as the run found it
            if p not in sys.path:
                sys.path.append(p)
        return load_task_class(self.task_name)(self.config["task"].get("args") or {})

    @classmethod
    def read(cls, run: Run, elite: str) -> ServedRun:
        """What serving holds of ``run``, with ``elite`` (``best``, ``default``, or an id or prefix of an ok
        engine candidate) resolved; :class:`ServeError` for what the user can fix.

        ``best``: the fittest ok candidate of an engine run, or the default engine configuration when the run
        is not an engine run or has no ok candidate yet."""
        engine = _is_engine_task(run.task_name)
        given = run.task_args.get("model_dir") if engine else None
        model_dir = Path(os.path.join(run.path, given)) if isinstance(given, str) else None
        eid, note = _resolve(run, engine, elite)
        return cls(run.path, dict(run.config), run.sys_path, engine, model_dir, eid, note)


def _resolve(run: Run, engine: bool, elite: str) -> tuple[str | None, str]:
    if elite == "default":
        return None, "the default engine configuration (EngineConfig())"
    if elite == "best":
        if not engine:
            return None, (f"the default engine configuration: {run.path} is a {run.task_name!r} run, "
                          "not an engine run (evolve one with configs/engine_minilm.yaml)")
        best = run.store.best(1)
        if not best:
            return None, f"the default engine configuration: {run.path} has no ok engine candidate yet"
        return best[0].id, f"engine elite {best[0].id[:12]} (best of {run.path}, {best[0].fitness:.1f} {best[0].unit})"
    if not ID_PATTERN.match(elite):
        raise ServeError(f"elite {elite!r} is not an id: give a hex id or prefix, 'best' or 'default'")
    if not engine:
        raise ServeError(f"{run.path} is a {run.task_name!r} run: it holds no engine elite "
                         "(serve an engine run, or --elite best for the default configuration)")
    cand = ok_candidate(run, elite)
    return cand.id, f"engine elite {cand.id[:12]} of {run.path}"


def ok_candidate(run: Run, elite: str) -> Any:
    """The ok candidate of ``run`` whose id is ``elite`` (or a unique prefix); :class:`ServeError` otherwise."""
    if not ID_PATTERN.match(elite):
        raise ServeError(f"elite {elite!r} is not an id: give a hex id or prefix, 'best' or 'default'")
    try:
        cand = run.store.get(elite)
    except KeyError as exc:
        raise ServeError(str(exc.args[0] if exc.args else exc)) from None
    if cand is None:
        raise EliteNotFound(f"no candidate {elite!r} in {run.path} (list some with: evo archive best {run.path})")
    if str(cand.status) != "ok":
        raise ServeError(f"candidate {cand.id[:12]} is {cand.status}, not ok: serve an ok elite")
    return cand
