"""The chat model app: a GGUF decoder behind OpenAI's chat and completions APIs, with health, readiness and
metrics, the same errors, auth, body limits and graceful drain as the encoder app, and engine swaps under load
(``POST /admin/engine``)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from starlette.types import ASGIApp

from runtime.decoder import Decoder, DecoderModel, Scheduler, SchedulerConfig
from runtime.decoder.engine import ChatEngine, EngineUnfit, build, engine_threads, warm_up
from serving import _chat
from serving._errors import APIError, BodyLimit, errors, install_error_handlers
from serving._http import admin_auth, ops_router, user_auth
from serving._metrics import ChatMetrics, RequestCounter
from serving._openapi import install_openapi
from serving._state import Limits

__all__ = ["ChatState", "create_chat_app"]

log = logging.getLogger("serving")

_UNSTATED = (
    "\n\nRules no schema here states: the prompt (chat messages as the model's template renders them) and the"
    " completion share the model's context (GET /v1/models gives its length); a longer prompt answers 400"
    " (`context_length_exceeded`). A request waits while the running ones hold the KV cache budget, and is"
    " refused 429 once the waiting queue is full too. A streamed request whose client goes away is cancelled."
    " An engine swap (POST /admin/engine) lets every request in flight finish on the engine it started on."
    " Unknown paths answer 404 and known paths with another method 405, in the error body."
)


@dataclass
class ChatState:
    model: DecoderModel
    engine: ChatEngine  # what serves new requests
    scheduler: Scheduler  # its scheduler
    budgets: SchedulerConfig  # the server's KV cache budget and queue, whatever the engine
    metrics: ChatMetrics
    limits: Limits
    api_key: str | None
    model_ids: tuple[str, ...]  # the served model's id, then its aliases
    draining: list[Scheduler] = field(default_factory=list)  # engines swapped out, finishing their requests
    cache_dir: str | None = None  # where the engines' kernels compile (None: the default cache)
    started: float = field(default_factory=time.time)

    def schedulers(self) -> list[Scheduler]:
        return [self.scheduler, *self.draining]

    def held_by_draining(self) -> int:
        return sum(s.kv_used_bytes for s in list(self.draining))

    def start(self, engine: ChatEngine, decoder: Decoder) -> Scheduler:
        return Scheduler(decoder, engine.scheduler(self.budgets), on_step=self.metrics.observe_step,
                         held_elsewhere=self.held_by_draining)  # fmt: skip

    def swap(self, engine: ChatEngine) -> float:
        """Builds and warms ``engine`` beside the one serving, then sends new requests to it; the old one
        finishes what it holds (in a thread) and stops. Returns the seconds it took. Raises
        :class:`EngineUnfit` (nothing changes then)."""
        t0 = time.perf_counter()
        engine_threads(engine)  # before its kernels load (the old engine meanwhile gets these pools' sizes too)
        decoder = build(self.model, engine, cache_dir=self.cache_dir)
        warm_up(decoder)  # every kernel has run once before it serves
        scheduler = self.start(engine, decoder)
        old = self.scheduler
        self.draining.append(old)
        self.engine, self.scheduler = engine, scheduler  # a request reads the scheduler once, when it submits

        def drain() -> None:
            old.close()
            self.draining.remove(old)

        threading.Thread(target=drain, name="evoforge-drain", daemon=True).start()
        log.info("serving engine %s (swapped in %.1f s)", engine.describe(), time.perf_counter() - t0)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Finishes every request held, by every engine."""
        for s in self.schedulers():
            s.close()


def create_chat_app(model: DecoderModel, engine: ChatEngine | None = None, *, model_ids: tuple[str, ...],
                    budgets: SchedulerConfig | None = None, api_key: str | None = None,
                    limits: Limits | None = None, cache_dir: str | None = None,
                    decoder: Decoder | None = None, swaps: bool = True) -> ASGIApp:  # fmt: skip
    """The app serving ``model`` (loaded already) as ``model_ids[0]`` on ``engine`` (built here; raises
    :class:`EngineUnfit` where this machine cannot run it); its engine thread starts here, and finishes every
    request it holds when the app shuts down. ``budgets``: the KV cache and the waiting queue, kept across
    swaps (``POST /admin/engine``). ``cache_dir``: where the kernels compile (default ``~/.cache/evoforge/kernels``).
    ``decoder``: ``engine`` built already (by a sandboxed host, which loads its kernels before it serves);
    ``swaps``: whether ``POST /admin/engine`` may build another engine (a sandboxed host may not compile)."""
    engine = engine or ChatEngine()
    limits = limits or Limits()
    if decoder is None:
        engine_threads(engine)  # before any kernel loads: OpenMP reads its team's size once, when it starts
        decoder = build(model, engine, cache_dir=cache_dir)
    state = ChatState(model, engine, None, budgets or SchedulerConfig(), None, limits,  # type: ignore[arg-type]
                      api_key or None, model_ids, cache_dir=cache_dir)  # fmt: skip
    state.metrics = ChatMetrics(state.schedulers, state.budgets.kv_budget_bytes)
    state.scheduler = state.start(engine, decoder)
    swap_lock = asyncio.Lock()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(state.close)  # the requests still held finish first

    app = FastAPI(title="evoforge serving", version="0.1.0", lifespan=lifespan,
                  description=f"A chat model ({model_ids[0]}, GGUF) on evoforge's decoder engine: OpenAI-compatible "
                              "chat and text completions, streamed or not, continuously batched; health and "
                              "Prometheus metrics.")  # fmt: skip
    app.state.serving = state
    install_error_handlers(app)
    app.include_router(ops_router)

    @app.get("/ready", tags=["ops"])
    async def ready(request: Request) -> dict[str, Any]:
        """200: the model is loaded before the server listens; ``engine``: what serves new requests."""
        return {"status": "ready", "model": model_ids[0], "engine": state.engine.model_dump()}

    @app.post("/admin/engine", tags=["admin"], dependencies=[Depends(admin_auth)],
              responses=errors(400, 401, 403, 409, 413))  # fmt: skip
    async def swap_engine(body: ChatEngine) -> dict[str, Any]:
        """Builds and warms the engine ``body`` describes beside the one serving, then serves new requests on it.
        Requests in flight, streamed or not, finish on the old engine, which then stops; none fails. 400: a
        precision this CPU has no kernel for, more threads than cores, or evolved kernels not offered here; 409:
        another swap is under way, or this server runs evolved kernels in a sandbox (it may not swap)."""
        if not swaps:
            raise APIError(409, "this server runs evolved kernels in a sandbox, which may not build another engine: "
                           "restart evo serve with the engine to serve", code="swaps_off")  # fmt: skip
        if swap_lock.locked():
            raise APIError(409, "another engine swap is in progress", code="switch_in_progress")
        async with swap_lock:
            try:
                took = await asyncio.to_thread(state.swap, body)
            except EngineUnfit as exc:
                raise APIError(400, str(exc), param=exc.field) from None
        return {"status": "switched", "engine": body.model_dump(), "swap_s": round(took, 3)}

    app.include_router(_chat.router, dependencies=[Depends(user_auth)])
    install_openapi(app, limits, keyed=state.api_key is not None, model_ids=model_ids, unstated=_UNSTATED)
    return RequestCounter(
        BodyLimit(app, max_bytes=limits.max_body_bytes, timeout_s=limits.body_timeout_s), metrics=state.metrics
    )
