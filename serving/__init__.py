"""Serving over HTTP (the ``serve`` extra): an evoforge run's engine elite behind an OpenAI-compatible embeddings
API, archive queries, kernel invocation, health, readiness and Prometheus metrics; or a GGUF chat model on the
decoder engine behind OpenAI's chat and completions APIs, continuously batched.

``create_app(run_dir)`` is the ASGI app; ``serve(run_dir)`` runs it on uvicorn (what ``evo serve`` does).
``create_chat_app(decoder, ...)`` and ``serve_gguf(path)`` do the same for a chat model (``evo serve --gguf``).
"""

from __future__ import annotations

from serving._runner import EliteNotFound, ServeError
from serving._state import Limits

__all__ = ["EliteNotFound", "Limits", "ServeError", "create_app", "create_chat_app", "serve", "serve_gguf"]


def __getattr__(name: str) -> object:
    # the app pulls in fastapi and the engine: imported only when asked for
    if name == "create_app":
        from serving._app import create_app

        return create_app
    if name == "create_chat_app":
        from serving._chat_app import create_chat_app

        return create_chat_app
    if name in ("serve", "serve_gguf"):
        from serving import _server

        return getattr(_server, name)
    raise AttributeError(name)
