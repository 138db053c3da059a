"""Serving an evoforge run over HTTP: the engine elite behind an OpenAI-compatible embeddings API,
archive queries, kernel invocation, health, readiness and Prometheus metrics (the ``serve`` extra).

``create_app(run_dir)`` is the ASGI app; ``serve(run_dir)`` runs it on uvicorn (what ``evo serve`` does).
"""

from __future__ import annotations

from serving._runner import EliteNotFound, ServeError
from serving._state import Limits

__all__ = ["EliteNotFound", "Limits", "ServeError", "create_app", "serve"]


def __getattr__(name: str) -> object:
    # the app pulls in fastapi and the engine: imported only when asked for
    if name == "create_app":
        from serving._app import create_app

        return create_app
    if name == "serve":
        from serving._server import serve

        return serve
    raise AttributeError(name)
