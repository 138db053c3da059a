"""The embedded inference engine: a BERT sentence encoder (the bundled MiniLM by default) on numpy plus evolved
kernels.

Every operator is a slot (numpy, or an evolved C kernel elite), requests are batched dynamically, and
the whole configuration is a genome of the ``engine`` task (:class:`runtime.engine.task.EngineTask`).
Needs the ``engine`` extra (tokenizers, safetensors, the model package); torch is never imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.kernel_runs import KernelSource, build_ops
from runtime.engine.load import LoadResult, closed_loop
from runtime.engine.model import Model, ModelConfig, Precision, load_model
from runtime.engine.ops import SLOTS, Ops, c_slot, numpy_ops, tasks_of_slot
from runtime.engine.scheduler import Batcher, BatcherClosed, QueueFull, longest_first
from runtime.followed_runs import OpenRun, RunNotFound, RunReader

if TYPE_CHECKING:
    from runtime.engine.task import EngineTask
    from runtime.settings import CompilerSettings

__all__ = [
    "SLOTS",
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
    "build_ops",
    "c_slot",
    "closed_loop",
    "longest_first",
    "elite_task",
    "load_elite",
    "load_model",
    "numpy_ops",
    "tasks_of_slot",
]


def elite_task(
    run: RunReader, candidate_id: str, *, runs: OpenRun | None = None, model: Model | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[EngineTask, EngineConfig, CompilerSettings, str]:
    """The task, engine configuration, compiler and compile cache (the run's) of candidate ``candidate_id`` (or
    a unique prefix) of the ``engine`` run ``run`` (``archive.Run.open(dir)``). The kernels it offers
    travel in its stored arguments; ``runs`` reads them from their runs where an older run's arguments lack
    them. Raises :class:`RunNotFound` for a missing candidate, ValueError when the run is not an engine run
    or an override is not a valid setting."""
    from runtime.engine.task import EngineTask
    from runtime.settings import CompilerSettings
    from runtime.task import load_task_class

    cls = load_task_class(run.task_name)
    if not issubclass(cls, EngineTask):
        raise ValueError(f"{run.path} is a {run.task_name!r} run, not an engine run")
    task = cls(cls.read_runs(cls.resolve_args(run.task_args, str(run.path)), runs))
    if model is not None:
        task.share_model(model)
    cand = run.stored(candidate_id)
    cache_dir = Path(run.path) / "cache"
    cache_dir.mkdir(exist_ok=True)
    config = task.engine_config(cand.genome)
    if overrides:
        config = EngineConfig.model_validate({**config.model_dump(), **overrides})
    compiler = CompilerSettings.model_validate((run.config.get("evaluation") or {}).get("compiler") or {})
    return task, config, compiler, str(cache_dir)


def load_elite(
    run: RunReader, candidate_id: str, *, runs: OpenRun | None = None, model: Model | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Engine:
    """The engine of candidate ``candidate_id`` (or a unique prefix) of the ``engine`` run ``run``, ready to
    start, in this process (:func:`runtime.sandbox.hosted_engine.spawn_host` builds one in a host process instead).

    Its kernels are compiled into (or found in) the run's compile cache. Pass ``model`` to share
    already loaded weights, ``overrides`` to change fields of its :class:`EngineConfig` (e.g.
    ``{"worker_kind": "process"}``). Raises as :func:`elite_task` does.
    """
    task, config, compiler, cache_dir = elite_task(run, candidate_id, runs=runs, model=model, overrides=overrides)
    return task.build(config, compiler=compiler, cache_dir=cache_dir)
