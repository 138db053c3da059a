"""``POST /v1/embeddings`` (OpenAI-compatible) and ``GET /v1/models``."""

from __future__ import annotations

import asyncio
import base64
import time
import unicodedata
from concurrent.futures import Future
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from serving._errors import APIError, errors
from serving._http import hung_up
from serving._runner import BatchInfo
from serving._state import State

__all__ = ["MODEL_IDS", "model_ids", "router"]

router = APIRouter()
MODEL_ID = "all-MiniLM-L6-v2"
MODEL_IDS = (MODEL_ID, "sentence-transformers/all-MiniLM-L6-v2", "minilm", "evoforge-minilm")


def model_ids(model_dir: Path | None) -> tuple[str, ...]:
    """The ids the served model answers to: the bundled MiniLM's, or another encoder's directory name."""
    return MODEL_IDS if model_dir is None else (model_dir.name,)


Text = Annotated[str, Field(min_length=1)]


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request (token-id inputs are not supported: send text)."""

    model_config = ConfigDict(extra="forbid")

    input: Text | list[Text] = Field(description="a text or a list of texts (at most the server's limits)")
    model: str | None = Field(None, description="the served model's id or an alias (GET /v1/models); default: it")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, description="must be the served model's (GET /v1/models) if given")
    user: str | None = None


def _has_text(t: str) -> bool:
    """Whether ``t`` holds a character that is neither whitespace nor a control or format character."""
    return any(not c.isspace() and not unicodedata.category(c).startswith("C") for c in t)


def _check(body: EmbeddingRequest, state: State, dim: int) -> list[str]:
    texts = [body.input] if isinstance(body.input, str) else body.input
    lim = state.limits
    if not texts:
        raise APIError(400, "input must not be empty", param="input", code="empty_input")
    if len(texts) > lim.max_items:
        raise APIError(400, f"input has {len(texts)} items; at most {lim.max_items}", param="input",
                       code="too_many_items")
    for i, t in enumerate(texts):
        if not t:
            raise APIError(400, f"input[{i}] is an empty string", param="input", code="empty_input")
        if not _has_text(t):  # tokenised to nothing: the empty text's embedding, which "" is refused for
            raise APIError(400, f"input[{i}] holds only whitespace or control characters", param="input",
                           code="empty_input")
        if len(t) > lim.max_chars:
            raise APIError(400, f"input[{i}] has {len(t)} characters; at most {lim.max_chars}", param="input",
                           code="input_too_long")
    if body.model is not None and body.model not in state.model_ids:
        raise APIError(404, f"model {body.model!r} is not served (GET /v1/models)", param="model",
                       code="model_not_found")
    if body.dimensions is not None and body.dimensions != dim:
        raise APIError(400, f"dimensions must be {dim} (the model's)", param="dimensions")
    return texts


def _awaitable(fut: Future[Any]) -> asyncio.Future[Any]:
    """An asyncio future of ``fut`` that never cancels it (the batcher must be able to set its result)."""
    loop = asyncio.get_running_loop()
    out: asyncio.Future[Any] = loop.create_future()

    def done(f: Future[Any]) -> None:
        def settle() -> None:
            if out.done():
                return
            exc = f.exception()
            out.set_exception(exc) if exc is not None else out.set_result(f.result())

        loop.call_soon_threadsafe(settle)

    fut.add_done_callback(done)
    return out


@router.post("/v1/embeddings", tags=["embeddings"], responses=errors(400, 401, 404, 413, 429, 503))
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    """Embeds the input texts (pooled and normalised as the served model does) through the engine's batcher."""
    from runtime.engine import QueueFull, longest_first

    state: State = request.app.state.serving
    t0 = time.perf_counter()
    runner = state.served.current
    if runner is None:
        raise APIError(503, "the engine is still loading (GET /ready)", code="not_ready")
    texts = _check(body, state, runner.engine.dim)
    if state.in_flight >= state.limits.max_in_flight:
        state.metrics.rejected.labels("in_flight").inc()
        raise APIError(429, f"{state.in_flight} requests in flight (the cap): retry later", code="overloaded")
    state.in_flight += 1
    state.metrics.in_flight.inc()
    gone = asyncio.create_task(hung_up(request))
    try:
        seqs = await asyncio.to_thread(runner.engine.model.tokenizer.encode_batch, texts)
        t_tok = time.perf_counter()
        state.metrics.tokenize.observe(t_tok - t0)
        await asyncio.sleep(0)  # let a hang-up read during the tokenising land
        if gone.done():  # nobody is waiting: spare the engine
            state.metrics.rejected.labels("disconnected").inc()
            return Response(status_code=499)
        runner = state.served.current or runner  # after a swap, new texts go to the new engine
        if runner.free < len(seqs):
            state.metrics.rejected.labels("queue_full").inc()
            raise APIError(429, "the engine's queue is full: retry later", code="queue_full")
        try:
            submitted = [(0.0, Future())] * len(seqs)  # in the order of the texts, submitted longest first
            for i in longest_first([len(s) for s in seqs]):
                submitted[i] = (time.perf_counter(), runner.submit(seqs[i]))
        except QueueFull:
            state.metrics.rejected.labels("queue_full").inc()
            raise APIError(429, "the engine's queue is full: retry later", code="queue_full") from None
        results: list[tuple[np.ndarray, BatchInfo]] = await asyncio.gather(*(_awaitable(f) for _, f in submitted))
    finally:
        gone.cancel()
        state.in_flight -= 1
        state.metrics.in_flight.dec()
    queue_s = max(info.start - ts for (ts, _), (_, info) in zip(submitted, results, strict=True))
    for (ts, _), (_, info) in zip(submitted, results, strict=True):
        state.metrics.queue.observe(max(0.0, info.start - ts))
    infer_s = max(info.end - info.start for _, info in results)
    data = []
    for i, (vec, _) in enumerate(results):
        emb: Any = base64.b64encode(np.asarray(vec, "<f4").tobytes()).decode() if body.encoding_format == "base64" \
            else vec.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    tokens = int(sum(len(s) for s in seqs))
    total = time.perf_counter() - t0
    timing = {"tokenize": t_tok - t0, "queue": max(queue_s, 0.0), "inference": infer_s, "total": total}
    headers = {f"x-{k}-ms": f"{v * 1000:.3f}" for k, v in timing.items()}
    headers["server-timing"] = ", ".join(f"{k};dur={v * 1000:.3f}" for k, v in timing.items())
    headers["x-elite-id"] = runner.served.elite or "default"
    return JSONResponse({"object": "list", "data": data, "model": body.model or state.model_ids[0],
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, headers=headers)


@router.get("/v1/models", tags=["embeddings"], responses=errors(401))
async def models(request: Request) -> dict[str, Any]:
    """The served model (one id; aliases accepted by /v1/embeddings are listed in ``aliases``)."""
    state: State = request.app.state.serving
    runner = state.served.current
    served = runner.served if runner else None
    return {"object": "list", "data": [{
        "id": state.model_ids[0], "object": "model", "created": int(state.started), "owned_by": "evoforge",
        "aliases": list(state.model_ids[1:]), "dimensions": runner.engine.dim if runner else None,
        "elite": served.elite if served else None, "serving": served.note if served else "loading",
        "run_dir": str(state.served.run.path)}]}
