"""``POST /v1/kernels/{id}/invoke``: one call of a kernel elite on the caller's arrays, in a sandboxed worker.

The inputs are checked against the task (names, shapes and dtypes for the given case, sizes capped)
here; the call itself goes through the runtime's pool like any evaluation (``stages="run"``): guarded
buffers, poisoned outputs, integrity checks, a wall-clock limit, and the outputs come back.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from runtime.backends import backend_for
from runtime.executors import EvalRequest, LocalPool
from runtime.settings import EvalSettings, TaskSpec
from runtime.task import KernelTask
from serving._errors import APIError
from serving._served_run import ID_PATTERN, ServedRun, candidate, open_store

__all__ = ["KernelInvoker"]


def _jsonable(a: np.ndarray) -> Any:
    """Nested lists; NaN and infinities (not JSON) become null."""
    if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all():
        return np.where(np.isfinite(a), a, None).tolist()
    return a.tolist()


class KernelInvoker:
    """Invokes the kernel elites of one run (its backend must offer stage ``run``); one call at a time, in one
    reused sandboxed worker."""

    def __init__(self, run: ServedRun, *, max_elements: int = 1 << 18, timeout_s: float = 30.0) -> None:
        self.run, self.max_elements, self.timeout_s = run, max_elements, timeout_s
        self._pool: LocalPool | None = None
        self._lock = threading.Lock()
        self._task: tuple[TaskSpec, KernelTask, EvalSettings, tuple[str, ...]] | None = None

    def _load(self) -> tuple[TaskSpec, KernelTask, EvalSettings, tuple[str, ...]]:
        if self._task is None:
            cfg = self.run.config
            spec = TaskSpec.model_validate(cfg["task"])
            settings = EvalSettings.model_validate(cfg.get("evaluation") or {})
            sandbox = settings.sandbox.model_copy(update={"timeout": min(settings.sandbox.timeout, self.timeout_s)})
            self._task = (spec, self.run.task, settings.model_copy(update={"sandbox": sandbox}), self.run.sys_path)
        return self._task

    def _case(self, task: KernelTask, case: dict[str, Any] | None) -> dict[str, int]:
        want = task.full_case()
        case = dict(case or {})
        if set(case) != set(want):
            raise APIError(400, f"case must give exactly {sorted(want)} (the {task.name} task's sizes)", param="case")
        for k, v in case.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise APIError(400, f"case.{k} must be a positive integer", param=f"case.{k}")
        if math.prod(case.values()) > self.max_elements * 64:
            raise APIError(400, f"case {case} is too large for this endpoint", param="case", code="too_large")
        return case

    def _inputs(self, task: KernelTask, case: dict[str, int], given: dict[str, Any]) -> dict[str, np.ndarray]:
        spec = task.inputs(case, np.random.default_rng(0))
        if set(given) != set(spec):
            raise APIError(400, f"inputs must be exactly {sorted(spec)} for the {task.name} task", param="inputs")
        out_elems = sum(math.prod(shape) for shape, _ in task.outputs(case).values())
        if sum(a.size for a in spec.values()) + out_elems > self.max_elements:
            raise APIError(400, f"inputs and outputs over {self.max_elements} elements", param="inputs",
                           code="too_large")
        arrays = {}
        for name, ref in spec.items():
            try:
                a = np.asarray(given[name], dtype=ref.dtype)
            except (ValueError, TypeError):
                raise APIError(400, f"inputs.{name} is not a rectangular array of numbers",
                               param=f"inputs.{name}") from None
            if a.shape != ref.shape:
                raise APIError(400, f"inputs.{name} has shape {list(a.shape)}; case {case} needs {list(ref.shape)}",
                               param=f"inputs.{name}", code="wrong_shape")
            arrays[name] = np.ascontiguousarray(a)
        return arrays

    def invoke(self, cid: str, case: dict[str, Any] | None, inputs: dict[str, Any]) -> dict[str, Any]:
        """The kernel's outputs on ``inputs``; raises :class:`APIError` for a bad request."""
        if not ID_PATTERN.match(cid):
            raise APIError(400, f"{cid!r} is not a candidate id (hex)", param="id")
        spec, task, settings, sys_path = self._load()
        if not backend_for(task).supports("run"):
            raise APIError(400, f"the {task.name} task's candidates cannot be invoked on given inputs "
                           f"(its {task.backend} backend does not run them one call at a time)", code="not_a_kernel")
        with open_store(self.run.path) as store:
            cand = candidate(store, cid)
        if str(cand.status) != "ok":
            raise APIError(409, f"candidate {cand.id[:12]} is {cand.status}, not ok", param="id")
        case_ = self._case(task, case)
        arrays = self._inputs(task, case_, inputs)
        request = EvalRequest(key=cand.id, genome=cand.genome, task=spec, settings=settings,
                              cache_dir=str(self.run.path / "cache"), sys_path=sys_path, stages="run",
                              case=case_, inputs=arrays)
        with self._lock:
            if self._pool is None:
                self._pool = LocalPool(workers=1)
            (self.run.path / "cache").mkdir(exist_ok=True)
            self._pool.submit(request)
            got = self._pool.next_result(timeout=settings.sandbox.timeout + 30)
        if got is None:
            raise APIError(504, "the kernel did not answer in time", type="server_error", code="timeout")
        result = got[1]
        if str(result.status) != "ok" or result.outputs is None:
            raise APIError(422, f"the kernel failed on these inputs ({result.status}): {result.error}",
                           code=str(result.status))
        return {
            "id": cand.id, "task": spec.name, "case": case_,
            "outputs": {k: {"shape": list(v.shape), "dtype": str(v.dtype), "data": _jsonable(v)}
                        for k, v in result.outputs.items()},
            "matches_reference": result.metrics.get("matches_reference"),
            "reference_mismatch": result.metrics.get("reference_mismatch"),
            "timings": result.timings,
        }

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None
