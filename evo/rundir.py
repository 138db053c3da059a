"""A run directory holds everything of a run: ``archive.db`` (with the frozen config), the compile
cache and logs. A run can be resumed from its directory alone."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from archive import (
    LAYOUT_KEY,
    Archive,
    CVTArchive,
    GridArchive,
    RunView,
    Store,
    StoreError,
    is_run,
    load_archive,
    run_db,
    save_layout,
)
from evo.config import ExecutionConfig, RunConfig, dump_config, parse_config
from evo.errors import UserError
from runtime import Task
from runtime.executors import ClusterUnavailable, Executor, LocalPool, MixedHardware, RayPool
from runtime.sandbox.limits import private_dir

if TYPE_CHECKING:
    from runtime.backends import Backend

__all__ = ["RunDir", "build_archive"]


class RunDir:
    def __init__(self, path: Path, store: Store) -> None:
        self.path = path
        self.store = store
        private_dir(path)  # a run started by an older version too
        self.cache_dir = path / "cache"
        self.log_dir = path / "logs"
        self.cache_dir.mkdir(exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)

    @classmethod
    def create(cls, path: Path, config: RunConfig) -> RunDir:
        if run_db(path).exists():
            raise UserError(
                f"{path} already holds a run: pass --resume to continue it, or --run-dir to start a new one"
            )
        private_dir(path)
        store = Store(run_db(path))
        text = dump_config(config)
        store.set_meta("config", text)
        store.set_meta("sys_path", json.dumps([p for p in sys.path if p]))
        (path / "config.yaml").write_text(text)
        return cls(path, store)

    @classmethod
    def open(cls, path: Path, *, readonly: bool = False) -> RunDir:
        """The run in ``path``: to continue it, or (``readonly``) to read it through its :class:`RunView`."""
        if not is_run(path):
            raise UserError(f"no run in {path} (expected {run_db(path)}): check the path, or start one with evo run")
        try:
            store = RunView(path).store if readonly else Store(run_db(path))
        except StoreError as exc:
            raise UserError(str(exc)) from None
        return cls(path, store)

    def view(self) -> RunView:
        """What the run holds, read through the one run view (on this run's own store)."""
        try:
            return RunView(self.path, store=self.store)
        except StoreError as exc:
            raise UserError(str(exc)) from None

    def frozen_config(self) -> RunConfig:
        """The config the run was started with (its user task module path restored onto sys.path)."""
        view = self.view()
        view.import_paths()
        return parse_config(yaml.safe_load(view.config_text), source=f"{run_db(self.path)} (stored config)")

    def make_pool(self, workers: int, execution: ExecutionConfig | None = None, cc: str = "cc",
                  backend: Backend | None = None) -> Executor:  # fmt: skip
        """The executor: a :class:`LocalPool` of ``workers``, or a :class:`RayPool` over a Ray cluster
        (``execution.kind: ray``), whose slots are its nodes' as the task's ``backend`` places them
        (:attr:`Backend.whole_node`: one per node unless ``workers_per_node`` says otherwise, every CPU reserved;
        :attr:`Backend.per_gpu`: a node's GPUs, one slot each)."""
        if execution is not None and execution.kind == "ray":
            whole_node = backend is not None and backend.whole_node
            per_node = execution.workers_per_node or (1 if whole_node else None)
            try:
                return RayPool(execution.address, workers_per_node=per_node,
                               fingerprints=execution.fingerprints, use_head=execution.use_head,
                               cc=cc, whole_machine=whole_node,
                               gpus=backend is not None and backend.per_gpu)  # fmt: skip
            except (ClusterUnavailable, MixedHardware) as exc:
                raise UserError(str(exc)) from None
        return LocalPool(workers=workers, log_dir=self.log_dir)

    def close(self) -> None:
        self.store.close()


def build_archive(config: RunConfig, task: Task, store: Store) -> Archive:
    """The run's archive: restored from its stored layout, or created from the config and stored.

    The layout (ranges, bins, CVT centroids) is fixed when the run starts and never shifts.
    """
    if store.get_meta(LAYOUT_KEY) is not None:
        return load_archive(store)
    a = config.archive
    offered = task.descriptors()
    ranges = a.ranges or [(offered[n].low, offered[n].high) for n in a.descriptors]
    archive: GridArchive | CVTArchive
    if a.kind == "grid":
        archive = GridArchive(names=a.descriptors, bins=a.bin_list(), ranges=ranges)
    else:
        archive = CVTArchive(names=a.descriptors, ranges=ranges, cells=a.cells, seed=config.search.seed)
    save_layout(store, archive)
    return archive
