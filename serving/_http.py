"""What every app of the server shares: bearer-key auth, hang-up detection, and the /health and /metrics routes.

Each app keeps its state at ``app.state.serving``, with an ``api_key`` (``None``: no key configured) and a
``metrics`` (anything with ``render()``).
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from serving._errors import APIError

__all__ = ["admin_auth", "hung_up", "ops_router", "user_auth"]


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _check_key(api_key: str | None, request: Request) -> None:
    token = _bearer(request)
    if token is None or not hmac.compare_digest(token.encode(), (api_key or "").encode()):
        raise APIError(
            401,
            "missing or wrong API key (send Authorization: Bearer KEY)",
            code="invalid_api_key",
            headers={"www-authenticate": "Bearer"},
        )


def user_auth(request: Request) -> None:
    """``/v1/*``: the key is required only when one is configured."""
    api_key = request.app.state.serving.api_key
    if api_key is not None:
        _check_key(api_key, request)


def admin_auth(request: Request) -> None:
    """``/admin/*``: always needs the key; refused outright when none is configured."""
    api_key = request.app.state.serving.api_key
    if api_key is None:
        raise APIError(
            403, "admin is disabled: start evo serve with --api-key-env NAME to enable it", code="admin_disabled"
        )
    _check_key(api_key, request)


async def hung_up(request: Request) -> None:
    """Returns once the client has gone away. The body is read by now, so the next message is the disconnect;
    waiting for it (rather than peeking once) keeps the server reading the socket, so a hang-up is seen
    while the request is worked on."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


ops_router = APIRouter(tags=["ops"])


@ops_router.get("/health")
async def health() -> dict[str, str]:
    """Alive (answers even while the engine loads or works)."""
    return {"status": "ok"}


@ops_router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    """Prometheus text format."""
    return Response(request.app.state.serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)
