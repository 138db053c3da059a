"""The embedded inference engine: the bundled MiniLM encoder on numpy plus evolved kernels.

Every operator is a slot (numpy, or an evolved C kernel elite), requests are batched dynamically, and
the whole configuration is a genome of the ``engine`` task (:class:`runtime.engine.task.EngineTask`).
Needs the ``engine`` extra (tokenizers, safetensors, the model package); torch is never imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.load import LoadResult, closed_loop
from runtime.engine.model import Model, ModelConfig, Precision, load_model
from runtime.engine.ops import SLOT_TASKS, SLOTS, Ops, c_slot, numpy_ops
from runtime.engine.runs import KernelSource, RunNotFound, StoredRun, build_ops
from runtime.engine.scheduler import Batcher, BatcherClosed, QueueFull

if TYPE_CHECKING:
    from runtime.engine.task import EngineTask
    from runtime.settings import CompilerSettings

__all__ = [
    "SLOTS",
    "SLOT_TASKS",
    "Batcher",
    "BatcherClosed",
    "Engine",
    "EngineConfig",
    "KernelSource",
    "LoadResult",
    "Model",
    "ModelConfig",
    "Ops",
    "Precision",
    "QueueFull",
    "RunNotFound",
    "StoredRun",
    "build_ops",
    "c_slot",
    "closed_loop",
    "elite_task",
    "load_elite",
    "load_model",
    "numpy_ops",
]


def elite_task(
    run_dir: str | Path, candidate_id: str, *, model: Model | None = None, overrides: Mapping[str, Any] | None = None
) -> tuple[EngineTask, EngineConfig, CompilerSettings, str]:
    """The task, engine configuration, compiler and compile cache (the run's) of candidate ``candidate_id`` (or
    a unique prefix) of an ``engine`` run. Raises :class:`RunNotFound` for a missing run or candidate,
    ValueError when the run is not an engine run or an override is not a valid setting."""
    from runtime.engine.task import EngineTask
    from runtime.task import load_task_class

    run = StoredRun(run_dir)
    cls = load_task_class(run.task.name)
    if not issubclass(cls, EngineTask):
        raise ValueError(f"{run.path} is a {run.task.name!r} run, not an engine run")
    task = cls(run.task.args)
    if model is not None:
        task.share_model(model)
    cand = run.candidate(candidate_id)
    run.cache_dir.mkdir(exist_ok=True)
    config = task.engine_config(cand.genome)
    if overrides:
        config = EngineConfig.model_validate({**config.model_dump(), **overrides})
    return task, config, run.compiler, str(run.cache_dir)


def load_elite(
    run_dir: str | Path, candidate_id: str, *, model: Model | None = None, overrides: Mapping[str, Any] | None = None
) -> Engine:
    """The engine of candidate ``candidate_id`` (or a unique prefix) of an ``engine`` run, ready to start, in
    this process (:func:`runtime.engine.hosted.spawn_host` builds one in a host process instead).

    Its kernels are compiled into (or found in) the run's compile cache. Pass ``model`` to share
    already loaded weights, ``overrides`` to change fields of its :class:`EngineConfig` (e.g.
    ``{"worker_kind": "process"}``). Raises as :func:`elite_task` does.
    """
    task, config, compiler, cache_dir = elite_task(run_dir, candidate_id, model=model, overrides=overrides)
    return task.build(config, compiler=compiler, cache_dir=cache_dir)
