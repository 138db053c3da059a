"""The ASGI app: routes, auth, health, readiness, metrics, admin, and the engine's lifecycle."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp

from serving import _archive_api, _embeddings
from serving._embeddings import model_ids
from serving._errors import APIError, BodyLimit, errors, install_error_handlers
from serving._http import admin_auth, ops_router, user_auth
from serving._kernels import KernelInvoker
from serving._metrics import Metrics, RequestCounter
from serving._openapi import install_openapi
from serving._runner import EliteNotFound, ServedEngine, ServeError
from serving._served_run import ServedRun, open_served
from serving._state import Limits, State

__all__ = ["create_app"]

log = logging.getLogger("serving")


class SwitchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=64, pattern=r"\S",
                    description="an engine elite id or prefix of the served run, 'best' or 'default'")


def _routes(app: FastAPI) -> None:
    swap_lock = asyncio.Lock()

    @app.get("/ready", tags=["ops"], responses=errors(503))
    async def ready(request: Request) -> Any:
        """200 once the engine is loaded and warmed, 503 before."""
        state: State = request.app.state.serving
        runner = state.served.current
        if runner is None:
            msg = f"loading failed: {state.load_error}" if state.load_error else "the engine is loading"
            return APIError(503, msg, code="not_ready").response()
        return {"status": "ready", "elite": runner.served.elite, "serving": runner.served.note}

    @app.post("/admin/elite", tags=["admin"], dependencies=[Depends(admin_auth)],
              responses=errors(400, 401, 403, 404, 409, 413))
    async def switch(body: SwitchRequest, request: Request) -> JSONResponse:
        """Loads and warms another engine elite, then serves it; requests in flight finish on the old one."""
        state: State = request.app.state.serving
        if swap_lock.locked():
            raise APIError(409, "another switch is in progress", code="switch_in_progress")
        async with swap_lock:
            try:
                served = await asyncio.to_thread(state.served.switch, body.id.strip())
            except EliteNotFound as exc:
                raise APIError(404, str(exc), param="id", code="elite_not_found") from None
            except ServeError as exc:
                raise APIError(400, str(exc), param="id") from None
        return JSONResponse({"status": "switched", "elite": served.elite, "serving": served.note})


def create_app(run: str | Path | ServedRun, *, elite: str = "best", api_key: str | None = None,
               limits: Limits | None = None, warmup: int = 8, follow: Path | None = None) -> ASGIApp:
    """The serving app for ``run`` (a run directory, or the served run as read already: :meth:`ServedRun.read`);
    the engine (``elite``) loads in the background at start-up. With ``follow`` (a factory directory), it
    then swaps to each engine the factory promotes."""
    if not isinstance(run, ServedRun):
        with open_served(Path(run)) as opened:
            run = ServedRun.read(opened, elite)
    run_dir = run.path
    limits = limits or Limits()
    metrics = Metrics()
    state = State(served=ServedEngine(run, metrics, warmup=warmup),
                  kernels=KernelInvoker(run, max_elements=limits.max_kernel_elements,
                                        timeout_s=limits.kernel_timeout_s),
                  metrics=metrics, limits=limits, api_key=api_key or None, elite=elite,
                  model_ids=model_ids(run.model_dir))

    def load() -> None:
        try:
            state.served.switch(state.elite)
        except Exception as exc:  # noqa: BLE001 - /ready says why; the process stays up for diagnosis
            state.load_error = f"{type(exc).__name__}: {exc}"
            log.exception("cannot load the engine")

    follower = None
    if follow is not None:
        from serving._follow import Follower

        follower = Follower(state.served, follow, {"run_dir": str(run_dir), "elite": elite})

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        threading.Thread(target=load, name="evoforge-load", daemon=True).start()
        if follower is not None:
            follower.start()
        yield
        if follower is not None:
            follower.stop()
        await asyncio.to_thread(state.served.close)  # finishes every queued text
        await asyncio.to_thread(state.kernels.close)

    app = FastAPI(title="evoforge serving", version="0.1.0", lifespan=lifespan,
                  description="An engine elite of an evoforge run: OpenAI-compatible embeddings, archive queries, "
                              "kernel invocation, health and Prometheus metrics.")
    app.state.serving = state
    install_error_handlers(app)
    app.include_router(ops_router)
    _routes(app)
    app.include_router(_embeddings.router, dependencies=[Depends(user_auth)])
    app.include_router(_archive_api.router, dependencies=[Depends(user_auth)])
    install_openapi(app, limits, keyed=state.api_key is not None, model_ids=state.model_ids)
    return RequestCounter(BodyLimit(app, max_bytes=limits.max_body_bytes, timeout_s=limits.body_timeout_s),
                          metrics=metrics)
