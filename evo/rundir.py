"""How ``evo`` opens and runs a run directory (:class:`archive.Run`): its config as a :class:`RunConfig`,
its executor and its archive, and the errors a user can fix as one line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from archive import (
    LAYOUT_KEY,
    Archive,
    CVTArchive,
    GridArchive,
    Run,
    RunExists,
    Store,
    StoreError,
    load_archive,
    save_layout,
)
from evo.config import ExecutionConfig, RunConfig, dump_config, parse_config
from evo.errors import UserError
from runtime import Task
from runtime.executors import ClusterUnavailable, Executor, LocalPool, MixedHardware, RayPool

if TYPE_CHECKING:
    from runtime.backends import Backend

__all__ = ["build_archive", "create_run", "frozen_config", "make_pool", "open_run"]


def create_run(path: Path, config: RunConfig) -> Run:
    """A new run of ``config`` in ``path``, writable, holding the task ``config`` built."""
    try:
        return Run.create(path, config_text=dump_config(config), task=config.make_task(), sys_path=sys.path)
    except RunExists:
        raise UserError(
            f"{path} already holds a run: pass --resume to continue it, or --run-dir to start a new one"
        ) from None
    except StoreError as exc:
        raise UserError(str(exc)) from None


def open_run(path: Path, *, writable: bool = False) -> Run:
    """The run in ``path``: to continue it (``writable``), or to read it."""
    try:
        return Run.open(path, writable=writable)
    except StoreError as exc:
        raise UserError(str(exc)) from None


def frozen_config(run: Run) -> RunConfig:
    """The config the run was started with (its user task module path restored onto sys.path)."""
    run.import_paths()
    return parse_config(yaml.safe_load(run.config_text), source=f"{run.store.path} (stored config)")


def make_pool(run: Run, workers: int, execution: ExecutionConfig | None = None, cc: str = "cc",
              backend: Backend | None = None) -> Executor:  # fmt: skip
    """The executor: a :class:`LocalPool` of ``workers`` (logging into the run's ``logs/``), or a
    :class:`RayPool` over a Ray cluster (``execution.kind: ray``), whose slots are its nodes' as the task's
    ``backend`` places them (:attr:`Backend.whole_node`: one per node unless ``workers_per_node`` says
    otherwise, every CPU reserved; :attr:`Backend.per_gpu`: a node's GPUs, one slot each)."""
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
    return LocalPool(workers=workers, log_dir=run.log_dir)


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
