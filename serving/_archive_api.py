"""Archive queries (``/v1/elites``) and kernel invocation (``/v1/kernels/{id}/invoke``) on the served run."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from runtime.result import Status
from serving._errors import APIError, errors
from serving._served_run import ID_PATTERN, candidate, open_store
from serving._state import State

__all__ = ["router"]

router = APIRouter(tags=["archive"])
_ID = Path(description="a candidate id or unique prefix (hex)", pattern=ID_PATTERN.pattern)
StatusName = Literal[tuple(str(s) for s in Status)]  # type: ignore[valid-type]


def _summary(c: Any) -> dict[str, Any]:
    d = c.to_dict()
    return {k: d.get(k) for k in ("id", "status", "fitness", "unit", "metrics", "params", "descriptors",
                                  "operator", "parents", "error", "timings", "created_at", "evaluated_at")}


def _elites(state: State, task: str | None, top: int, status: str) -> dict[str, Any]:
    run_task = state.served.run.task_name
    if task is not None and task != run_task:
        return {"object": "list", "task": run_task, "data": []}
    with open_store(state.served.run.path) as store:
        cands = store.best(top) if status == "ok" else store.by_status(status, top)
    return {"object": "list", "task": run_task, "data": [_summary(c) for c in cands]}


@router.get("/v1/elites", responses=errors(400, 401))
async def elites(request: Request, task: str | None = Query(None, max_length=200, description="only this task"),
                 top: int = Query(10, ge=1, le=1000), status: Annotated[StatusName, Query()] = "ok") -> dict[str, Any]:
    """The run's candidates: with ``status=ok`` (default) the fittest first, otherwise the newest first."""
    return await asyncio.to_thread(_elites, request.app.state.serving, task, top, status)


def _elite(state: State, cid: str) -> dict[str, Any]:
    run = state.served.run
    with open_store(run.path) as store:
        cand = candidate(store, cid)
        lineage = [{"id": a.id, "operator": a.operator, "status": str(a.status), "fitness": a.fitness}
                   for a in store.lineage(cand.id)[1:]]
    try:
        source: str | None = run.task.render(cand.genome)
    except Exception:  # noqa: BLE001 - a task that cannot be loaded here still has its stored record
        source = cand.source
    return {**_summary(cand), "task": run.task_name, "source": source, "lineage": lineage}


@router.get("/v1/elites/{id}", responses=errors(400, 401, 404))
async def elite(request: Request, id: str = _ID) -> dict[str, Any]:
    """One candidate: params, rendered source, metrics and lineage (nearest ancestors first)."""
    if not ID_PATTERN.match(id):
        raise APIError(400, f"{id!r} is not a candidate id (hex)", param="id")
    return await asyncio.to_thread(_elite, request.app.state.serving, id)


class InvokeRequest(BaseModel):
    """The case's sizes (the task's ``full_case`` keys, e.g. m, n, k) and its inputs as nested JSON arrays."""

    model_config = ConfigDict(extra="forbid")

    case: dict[str, int] = Field(description="the task's sizes, e.g. {\"m\": 2, \"n\": 2, \"k\": 3}")
    inputs: dict[str, Any] = Field(description="input name -> nested array, e.g. {\"A\": [[1, 2, 3], [4, 5, 6]]}")


@router.post("/v1/kernels/{id}/invoke", responses=errors(400, 401, 404, 409, 413, 422, 504))
async def invoke(body: InvokeRequest, request: Request, id: str = _ID) -> dict[str, Any]:
    """Runs kernel elite ``id`` once on the inputs in a sandboxed worker and returns its outputs (and
    whether they match the task's reference within its tolerance)."""
    state: State = request.app.state.serving
    return await asyncio.to_thread(state.kernels.invoke, id, body.case, body.inputs)
