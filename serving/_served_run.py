"""What serving reads of the served run directory, through the one read-only run view (archive.RunView):
its task, its engine elites, its kernels; and the error of asking it for what it does not hold."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from archive import RunView, Store, StoreError

__all__ = [
    "ID_PATTERN", "EliteNotFound", "ServeError", "candidate", "is_engine_run", "model_dir", "open_run", "open_store",
    "resolve_engine_elite", "run_task", "stored_config",
]


class ServeError(ValueError):
    """A problem with what the user asked to serve (the CLI prints it as one line, exit 2)."""


class EliteNotFound(ServeError):
    """The run holds no candidate with that id."""


ID_PATTERN = re.compile(r"^[0-9a-fA-F]{1,64}$")  # a candidate id or prefix: hex only, never a path


@contextmanager
def open_run(run_dir: Path) -> Iterator[RunView]:
    """The run, read-only (one view per call: sqlite connections stay in their thread)."""
    try:
        view = RunView(run_dir)
    except StoreError as exc:
        raise ServeError(f"{exc} (give the directory of an evo run)") from None
    with view:
        yield view


@contextmanager
def open_store(run_dir: Path) -> Iterator[Store]:
    """The run's store, read-only."""
    with open_run(run_dir) as view:
        yield view.store


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


def stored_config(run_dir: Path) -> dict[str, Any]:
    """The run's frozen config as a dict."""
    with open_run(run_dir) as view:
        return dict(view.config)


def run_task(run_dir: Path) -> str:
    return str(stored_config(run_dir)["task"]["name"])


def is_engine_run(run_dir: Path) -> bool:
    from runtime.task import load_task_class

    try:
        from runtime.engine.task import EngineTask
    except ImportError:
        return False
    return issubclass(load_task_class(run_task(run_dir)), EngineTask)


def model_dir(run_dir: Path) -> Path | None:
    """The encoder an engine run evolved engines for (its task's ``model_dir``); ``None``: the bundled one."""
    import os

    if not is_engine_run(run_dir):
        return None
    given = (stored_config(run_dir)["task"].get("args") or {}).get("model_dir")
    return Path(os.path.join(run_dir, given)) if isinstance(given, str) else None


def resolve_engine_elite(run_dir: Path, elite: str) -> tuple[str | None, str]:
    """``(full id or None for the default configuration, a note saying what is served)``.

    ``best``: the fittest ok candidate of an engine run, or the default engine configuration when the
    run is not an engine run or has no ok candidate yet. ``default``: the default configuration.
    Anything else must be an ok candidate (id or unique prefix) of an engine run.
    """
    if elite == "default":
        return None, "the default engine configuration (EngineConfig())"
    engine = is_engine_run(run_dir)
    if elite == "best":
        if not engine:
            return None, (f"the default engine configuration: {run_dir} is a {run_task(run_dir)!r} run, "
                          "not an engine run (evolve one with configs/engine_minilm.yaml)")
        with open_store(run_dir) as store:
            best = store.best(1)
        if not best:
            return None, f"the default engine configuration: {run_dir} has no ok engine candidate yet"
        return best[0].id, f"engine elite {best[0].id[:12]} (best of {run_dir}, {best[0].fitness:.1f} {best[0].unit})"
    if not ID_PATTERN.match(elite):
        raise ServeError(f"elite {elite!r} is not an id: give a hex id or prefix, 'best' or 'default'")
    if not engine:
        raise ServeError(f"{run_dir} is a {run_task(run_dir)!r} run: it holds no engine elite "
                         "(serve an engine run, or --elite best for the default configuration)")
    with open_store(run_dir) as store:
        try:
            cand = store.get(elite)
        except KeyError as exc:
            raise ServeError(str(exc.args[0] if exc.args else exc)) from None
    if cand is None:
        raise EliteNotFound(f"no candidate {elite!r} in {run_dir} (list some with: evo archive best {run_dir})")
    if str(cand.status) != "ok":
        raise ServeError(f"candidate {cand.id[:12]} is {cand.status}, not ok: serve an ok elite")
    return cand.id, f"engine elite {cand.id[:12]} of {run_dir}"
