"""The chat model app: a GGUF decoder behind OpenAI's chat and completions APIs, with health, readiness and
metrics, the same errors, auth, body limits and graceful drain as the encoder app."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from starlette.types import ASGIApp

from runtime.decoder import Decoder, Scheduler, SchedulerConfig
from serving import _chat
from serving._errors import BodyLimit, install_error_handlers
from serving._http import ops_router, user_auth
from serving._metrics import ChatMetrics, RequestCounter
from serving._openapi import install_openapi
from serving._state import Limits

__all__ = ["ChatState", "create_chat_app"]

_UNSTATED = (
    "\n\nRules no schema here states: the prompt (chat messages as the model's template renders them) and the"
    " completion share the model's context (GET /v1/models gives its length); a longer prompt answers 400"
    " (`context_length_exceeded`). A request waits while the running ones hold the KV cache budget, and is"
    " refused 429 once the waiting queue is full too. A streamed request whose client goes away is cancelled."
    " Unknown paths answer 404 and known paths with another method 405, in the error body."
)


@dataclass
class ChatState:
    scheduler: Scheduler
    metrics: ChatMetrics
    limits: Limits
    api_key: str | None
    model_ids: tuple[str, ...]  # the served model's id, then its aliases
    started: float = field(default_factory=time.time)


def create_chat_app(decoder: Decoder, *, model_ids: tuple[str, ...], config: SchedulerConfig | None = None,
                    api_key: str | None = None, limits: Limits | None = None,
                    engine: dict[str, str] | None = None) -> ASGIApp:  # fmt: skip
    """The app serving ``decoder`` (loaded already) as ``model_ids[0]``; its engine thread starts here, and
    finishes every request it holds when the app shuts down. ``engine`` names what runs its slots (``/ready``
    says it: e.g. ``{"linear": "int8", "slots": "c", "kv_dtype": "f16"}``)."""
    limits = limits or Limits()
    scheduler = Scheduler(decoder, config, on_step=lambda *step: metrics.observe_step(*step))
    metrics = ChatMetrics(scheduler)
    state = ChatState(scheduler, metrics, limits, api_key or None, model_ids)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(scheduler.close)  # the requests still held finish first

    app = FastAPI(title="evoforge serving", version="0.1.0", lifespan=lifespan,
                  description=f"A chat model ({model_ids[0]}, GGUF) on evoforge's decoder engine: OpenAI-compatible "
                              "chat and text completions, streamed or not, continuously batched; health and "
                              "Prometheus metrics.")  # fmt: skip
    app.state.serving = state
    install_error_handlers(app)
    app.include_router(ops_router)

    @app.get("/ready", tags=["ops"])
    async def ready(request: Request) -> dict[str, Any]:
        """200: the model is loaded before the server listens; ``engine``: what runs its slots."""
        return {"status": "ready", "model": model_ids[0], "engine": engine or {}}

    app.include_router(_chat.router, dependencies=[Depends(user_auth)])
    install_openapi(app, limits, keyed=state.api_key is not None, model_ids=model_ids, unstated=_UNSTATED)
    return RequestCounter(
        BodyLimit(app, max_bytes=limits.max_body_bytes, timeout_s=limits.body_timeout_s), metrics=metrics
    )
