"""A run directory, opened once: what every part of evoforge holds of a run.

``evo run`` creates or continues one writable; the CLI's queries, the report, the dashboard, serving, the
memory's importer and the runtime (through :class:`runtime.followed_runs.RunReader`) open it read-only
(SQLite in WAL mode: a reader never blocks the run's writer, and never writes), so they can watch a run
that is still going. A process opens a run once and passes the :class:`Run` on, never its path to open
again; the run builds its task once.

The directory: ``archive.db`` (every candidate, the frozen config, the offers), ``config.yaml`` (the frozen
config for a reader), ``cache/`` (compiled candidates) and ``logs/``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import yaml

from archive._base import Archive
from archive._candidate import Candidate
from archive._errors import CandidateNotFoundError, StoreError
from archive._query import rebuild_archive
from archive._store import Store, run_db
from runtime import followed_runs as _runtime_runs
from runtime.sandbox.limits import private_dir

if TYPE_CHECKING:
    from runtime.task import Task

__all__ = ["OFFERS_KEY", "Objective", "Run", "RunExists", "RunNotFound", "pareto_front"]

OFFERS_KEY = "offers"
"""Store meta: a JSON list of what a run's task was offered while it ran (an engine task's kernels from the
kernel runs it follows), each with ``at`` (unix time) and ``evaluations`` (how many were done by then)."""

CONFIG_KEY = "config"  # store meta: the frozen config, as YAML
SYS_PATH_KEY = "sys_path"  # store meta: JSON list of the directories the run imported its task from


class RunNotFound(StoreError, _runtime_runs.RunNotFound):
    """No run in the directory, or not one written by ``evo run`` (or no such candidate in it, for
    :meth:`Run.stored`)."""


class RunExists(StoreError):
    """:meth:`Run.create` on a directory that holds a run already."""


def _config(text: str, db: Path) -> dict[str, Any]:
    """The stored config as a mapping whose ``task`` is a mapping with mapping ``args``; RunNotFound else."""
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RunNotFound(f"{db}: its stored config is not YAML ({str(exc).splitlines()[0]})") from None
    config = config if config is not None else {}
    task = config.get("task", {}) if isinstance(config, dict) else None
    if not isinstance(task, dict) or not isinstance(task.get("args", {}) or {}, dict):
        raise RunNotFound(f"{db}: its stored config is not an evo run's (expected a task: {{name, args}} mapping)")
    return config


class Run:
    """A run directory with its store open: read-only (:meth:`open`), or writable (``writable=True``, and
    :meth:`create`) for the one process that runs the search.

    Build one with :meth:`open` or :meth:`create`; it closes its store with itself."""

    def __init__(self, path: Path, store: Store, *, task: Task | None = None) -> None:
        self.path = path
        self.store = store
        self._task = task
        db = run_db(path)
        text = store.get_meta(CONFIG_KEY)
        if text is None:
            raise RunNotFound(f"{db} has no stored config: it was not written by evo run")
        self.config_text = text
        self.config: dict[str, Any] = _config(text, db)

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, writable: bool = False) -> Run:
        """The run in ``path``; :class:`RunNotFound` (with the reason) when there is none or it cannot be read.
        ``writable``: to continue it (its ``cache/`` and ``logs/`` made if missing)."""
        path = Path(path)
        db = run_db(path)
        if not db.is_file():
            raise RunNotFound(f"no run in {path} (expected {db}): check the path, or start one with evo run")
        try:
            store = Store(db, readonly=not writable)
        except StoreError as exc:
            raise RunNotFound(f"{path}: {exc}") from None
        try:
            run = cls(path, store)
        except BaseException:
            store.close()
            raise
        if writable:
            run._make_dirs()
        return run

    @classmethod
    def create(cls, path: str | os.PathLike[str], *, config_text: str, task: Task | None = None,
               sys_path: Sequence[str] = ()) -> Run:  # fmt: skip
        """A new run in ``path`` (made private to its owner), frozen with ``config_text`` (YAML); ``task``: the
        task already built from it, ``sys_path``: where its task module imports from. :class:`RunExists`
        when the directory holds a run."""
        path = Path(path)
        if run_db(path).exists():
            raise RunExists(f"{path} already holds a run")
        private_dir(path)
        # made whole under a name of this process's, then linked into place: a process killed while it creates the
        # run leaves no store without its config (which --resume could not continue), and of two creating one
        # run at once, the second gets RunExists
        staging = path / f".archive.db.{os.getpid()}"
        leftovers = (staging, *(staging.with_name(staging.name + s) for s in ("-wal", "-shm")))
        for leftover in leftovers:
            leftover.unlink(missing_ok=True)
        try:
            staged = Store(staging)
            try:
                staged.set_metas({CONFIG_KEY: config_text, SYS_PATH_KEY: json.dumps([p for p in sys_path if p])})
                staged.checkpoint()  # everything in the file itself: its WAL is not linked with it
            finally:
                staged.close()
            (path / "config.yaml").write_text(config_text)
            try:
                os.link(staging, run_db(path))
            except FileExistsError:
                raise RunExists(f"{path} already holds a run") from None
        finally:
            for leftover in leftovers:
                leftover.unlink(missing_ok=True)
        store = Store(run_db(path))
        try:
            run = cls(path, store, task=task)
        except BaseException:
            store.close()
            raise
        run._make_dirs()
        return run

    def _make_dirs(self) -> None:
        private_dir(self.path)  # a run started by an older version too
        self.cache_dir.mkdir(exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)

    # -- lifecycle ---------------------------------------------------------------------------------

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self.close()

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}{'' if self.store.readonly else ', writable=True'})"

    # -- what the run is ---------------------------------------------------------------------------

    @property
    def writable(self) -> bool:
        return not self.store.readonly

    @property
    def cache_dir(self) -> Path:
        return self.path / "cache"

    @property
    def log_dir(self) -> Path:
        return self.path / "logs"

    @property
    def name(self) -> str:
        return str(self.config.get("name") or self.path.name)

    @property
    def task_name(self) -> str:
        return str((self.config.get("task") or {}).get("name", "?"))

    @property
    def task_args(self) -> dict[str, Any]:
        return dict((self.config.get("task") or {}).get("args") or {})

    @property
    def task(self) -> Task:
        """The run's task, built once (its import paths restored): the one given to :meth:`create`, else built
        from the stored config. Raises what building it raises (:class:`runtime.task.TaskLoadError`, a
        validation error)."""
        if self._task is None:
            from runtime.task import load_task_class

            self.import_paths()
            self._task = load_task_class(self.task_name)(self.task_args)
        return self._task

    @property
    def sys_path(self) -> tuple[str, ...]:
        """The directories the run imported its task from (a user's task module beside its config)."""
        return tuple(str(p) for p in json.loads(self.store.get_meta(SYS_PATH_KEY) or "[]"))

    def import_paths(self) -> None:
        """Puts :attr:`sys_path` on ``sys.path``, so that the run's task can be loaded here."""
        for p in self.sys_path:
            if p not in sys.path:
                sys.path.append(p)

    def offers(self) -> list[dict[str, Any]]:
        """What the task was offered during the run, in order (see :data:`OFFERS_KEY`); none for most runs."""
        return list(json.loads(self.store.get_meta(OFFERS_KEY) or "[]"))

    def record_offers(self, args: dict[str, Any], added: Sequence[dict[str, Any]], task: Task) -> None:
        """Freezes the task's grown ``args`` (``task``: built from them) and appends ``added`` to the offers, in
        one transaction; ``config.yaml`` follows."""
        stored = dict(self.config)
        stored["task"] = {**(stored.get("task") or {}), "args": args}
        text = yaml.safe_dump(stored, sort_keys=False)
        self.store.set_metas({CONFIG_KEY: text, OFFERS_KEY: json.dumps(self.offers() + list(added))})
        (self.path / "config.yaml").write_text(text)
        self.config_text, self.config, self._task = text, stored, task

    # -- what it holds -----------------------------------------------------------------------------

    def archive(self) -> Archive:
        """The run's archive as it stands (its stored layout, the evaluated candidates replayed)."""
        return rebuild_archive(self.store)

    def get(self, cid: str) -> Candidate:
        """The candidate with this id or unique prefix; :class:`CandidateNotFoundError` when none (an
        ambiguous prefix raises :class:`AmbiguousIdError`)."""
        found = self.store.get(cid)
        if found is None:
            raise CandidateNotFoundError(f"no candidate {cid!r} in {self.path} (list some with: evo archive best "
                                         f"{self.path})")  # fmt: skip
        return found

    def best(self, k: int = 1) -> list[Candidate]:
        return self.store.best(k)

    def elite_ids(self, top: int) -> list[str]:
        """Ids of the ``top`` best ok candidates, best first (:meth:`Store.best`: the confirmed ones first)."""
        return [c.id for c in self.store.best(top)]

    def stored(self, cid: str) -> _runtime_runs.StoredCandidate:
        """The candidate ``cid`` (id or unique prefix) as the runtime reads it; :class:`RunNotFound` if none."""
        try:
            c = self.get(cid)
        except StoreError as exc:  # unknown, or an ambiguous prefix
            raise RunNotFound(str(exc)) from None
        return _runtime_runs.StoredCandidate(c.id, c.genome, str(c.status), c.fitness, dict(c.metrics))

    def evaluated(self) -> Iterator[Candidate]:
        return self.store.evaluated()

    def path_to(self, cid: str) -> list[Candidate]:
        """The chain from a seed to candidate ``cid``, seed first, following each step's first parent."""
        chain = [self.get(cid)]
        seen = {chain[0].id}
        while chain[-1].parents:
            parent = self.store.get_many([chain[-1].parents[0]])
            if not parent or parent[0].id in seen:
                break
            seen.add(parent[0].id)
            chain.append(parent[0])
        return chain[::-1]

    def marker(self) -> tuple[int, int, int]:
        """Changes whenever the run records something: (candidates, last evaluation, QD snapshots)."""
        return self.store.marker()

    def pareto(self, objectives: Sequence[Objective]) -> list[Candidate]:
        """The ok candidates no other ok candidate beats on every objective, best on the first one first."""
        return pareto_front([c for c in self.evaluated() if str(c.status) == "ok"], objectives)


@dataclass(frozen=True)
class Objective:
    """A metric to rank by (``fitness`` or a key of ``metrics``); ``maximise`` False: lower is better."""

    metric: str
    maximise: bool = True

    @classmethod
    def parse_list(cls, text: str) -> list[Objective]:
        """``throughput,-p99_ms``: a leading ``-`` minimises. Raises ValueError on an empty list."""
        out = []
        for part in (p.strip() for p in text.split(",")):
            if not part or part in ("-", "+"):
                raise ValueError(f"objectives {text!r}: give metric names separated by commas, e.g. throughput,-p99_ms")
            out.append(cls(part.lstrip("+-"), maximise=not part.startswith("-")))
        return out

    def raw(self, cand: Candidate) -> float | None:
        """The candidate's value of the metric (``None`` when it has none)."""
        raw = cand.fitness if self.metric == "fitness" else cand.metrics.get(self.metric)
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            return None
        return float(raw)

    def value(self, cand: Candidate) -> float | None:
        """The value to maximise: the metric's, negated when lower is better."""
        raw = self.raw(cand)
        return None if raw is None else raw if self.maximise else -raw

    def __str__(self) -> str:
        return self.metric if self.maximise else f"-{self.metric}"


def pareto_front(cands: Sequence[Candidate], objectives: Sequence[Objective]) -> list[Candidate]:
    """The non-dominated candidates among those that have every objective (maximised after the sign)."""
    scored = []
    for c in cands:
        values = [o.value(c) for o in objectives]
        if all(v is not None for v in values):
            scored.append((tuple(values), c))
    scored.sort(key=lambda s: s[0], reverse=True)
    front: list[tuple[tuple[float, ...], Candidate]] = []
    for values, c in scored:  # sorted: only an earlier one can dominate a later one
        if not any(all(f >= v for f, v in zip(fv, values, strict=True)) and fv != values for fv, _ in front):
            if not any(fv == values for fv, _ in front):
                front.append((values, c))
    return [c for _, c in front]
