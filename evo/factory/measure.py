"""The factory's measurements of whole engines, behind the same boundary as every search's evaluations.

Each is a request to a sandboxed worker of the factory's own (:class:`runtime.executors.LocalPool`): the worker
drops privileges and holds the load, its clock and the fp32 reference, and every engine runs in a host of
its own under the system-call filter (the ``engine`` or ``chat_engine`` backend). What decides comes back over
the worker's channel, never from a process that ran an engine's kernels.

- ``profile``: where an engine's time goes (the backend's ``profile`` stage);
- ``duel``: a candidate engine against the incumbent (the backend's ``duel`` stage): both checked for
  their fidelity to the fp32 engine on held-out texts (never a search's), then
  alternating load rounds on the same new texts, the other engine stopped, pinned to the same cores,
  under the machine's timing lock. An engine that breaks a rule (under the floor, wrong under load,
  dying) loses with the reason.

An engine is ``{"run_dir": ..., "elite": ...}`` (an engine run's candidate), or ``None`` for the default
configuration. Both engines of a duel are one task: their runs' offered kernels side by side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from archive import FactoryDir
from evo.factory.config import FactoryConfig
from evo.factory.kinds import ModelKind, kind_of
from genome import Genome
from runtime.executors import EvalRequest
from runtime.result import EvalResult, Status
from runtime.sandbox.limits import private_dir
from runtime.settings import EvalSettings, SandboxSettings, TaskSpec

__all__ = ["Measurer"]

EngineRef = dict[str, Any] | None


class Measurer:
    """The factory's measurements (:meth:`profile`, :meth:`duel`), on one sandboxed worker started on first use;
    its compile cache and logs live in the factory directory."""

    def __init__(self, factory_dir: Path, config: FactoryConfig, kind: ModelKind | None = None) -> None:
        self.config, self.kind = config, kind or kind_of(config)
        files = FactoryDir(factory_dir)
        self.cache_dir, self.log_dir = files.cache_dir, files.measurement_logs
        self._pool: Any = None

    def profile(self, engine: EngineRef) -> EvalResult:
        """Where ``engine``'s time goes on the load's texts (``metrics["profile"]`` when ``ok``)."""
        spec, (genome,) = self._task([engine], duel=False)
        return self._evaluate(EvalRequest(key=f"profile-{genome.id}", genome=genome, task=spec, stages="profile",
                                          settings=self._settings(1), cache_dir=str(self.cache_dir)))  # fmt: skip

    def duel(self, candidate: EngineRef, incumbent: EngineRef) -> EvalResult:
        """``candidate`` against ``incumbent``: ``ok`` with both engines' figures (their ``rival_`` twins for the
        incumbent's; :meth:`ModelKind.figures` reads them), ``ok`` with ``rival_failed`` when the incumbent broke
        a rule, or the candidate's failure."""
        p = self.config.promote
        spec, (mine, theirs) = self._task([candidate, incumbent], duel=True)
        settings = self._settings(2 * p.rounds)
        return self._evaluate(EvalRequest(key=f"duel-{mine.id}", genome=mine, rival=theirs, task=spec, stages="duel",
                                          settings=settings, cache_dir=str(self.cache_dir)))  # fmt: skip

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # --- internals -----------------------------------------------------------------------------------

    def _task(self, engines: list[EngineRef], *, duel: bool) -> tuple[TaskSpec, list[Genome]]:
        """One engine task holding every engine's kernels, under the factory's load, and each engine's genome."""
        from archive import Run
        from runtime.task import load_task_class

        kernels: dict[str, list[dict[str, Any]]] = {}
        genomes = []
        for ref in engines:
            if ref is None:
                genomes.append(Genome(params={}))  # the default engine (its task's defaults)
                continue
            with Run.open(ref["run_dir"]) as run:
                cls = load_task_class(run.task_name)
                if run.task_name != self.kind.task:
                    raise ValueError(f"{run.path} is a {run.task_name!r} run, not a {self.kind.task} run")
                task = cls(cls.read_runs(cls.resolve_args(run.task_args, str(run.path)), Run.open))  # type: ignore[attr-defined]
                genomes.append(run.stored(ref["elite"]).genome)
            for slot in task.args.kernels:
                for kr in task.args.kernel_runs(slot):
                    kernels.setdefault(slot, []).append({**kr.model_dump(mode="json"), "follow": False})
        return TaskSpec(name=self.kind.task, args={**self.kind.measure_args(duel=duel), "kernels": kernels}), genomes

    def _settings(self, loads: int) -> EvalSettings:
        """Limits that leave room for ``loads`` load rounds (and the builds and checks around them)."""
        wall = 300.0 + 2 * loads * self.kind.load_seconds()
        sandbox = SandboxSettings(timeout=wall, cpu_seconds=int(wall * self.config.load.threads) + 60,
                                  memory_mb=self.kind.memory_mb)
        return EvalSettings(sandbox=sandbox)

    def _evaluate(self, request: EvalRequest) -> EvalResult:
        from runtime.executors import LocalPool

        if self._pool is None:
            private_dir(self.cache_dir)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._pool = LocalPool(workers=1, log_dir=str(self.log_dir))
        self._pool.submit(request)
        got = self._pool.next_result(request.settings.sandbox.timeout + 60)
        if got is None:  # the pool kills a worker past its limit and answers: this is the pool failing
            return EvalResult(status=Status.TIMEOUT, error="the measurement's worker did not answer")
        return got[1]
