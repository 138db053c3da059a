"""The OpenAPI document, as the server really answers.

FastAPI documents a 422 with its own validation body on every route that takes input; this server
answers validation errors 400 with OpenAI's error body (``serving._errors``), so those entries go and
each route lists its own statuses instead. The limits this server was started with (texts per
request, characters per text) are written into the schema. What the document cannot say, it says in
words: a kernel invoke's shapes depend on the run's task, and ``dimensions`` on the model served.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from serving._state import Limits

__all__ = ["install_openapi"]

_UNSTATED = (
    "\n\nRules no schema here states: a kernel invoke's `case` must give exactly the task's sizes and its"
    " `inputs` exactly the task's inputs, in the shapes those sizes imply (answered 400 otherwise);"
    " `dimensions` must be the served model's (GET /v1/models). A client that goes away before its texts"
    " reach the engine is dropped there (its request is never answered). Unknown paths answer 404 and"
    " known paths with another method 405, in the error body."
)


def install_openapi(app: FastAPI, limits: Limits, *, keyed: bool, model_ids: tuple[str, ...],
                    unstated: str = _UNSTATED) -> None:  # fmt: skip
    """Makes ``app.openapi()`` return the corrected document (built once); ``unstated`` says in words what no
    schema states."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description + unstated,
                                 routes=app.routes)  # fmt: skip
            _drop_validation_422(schema)
            _state_models(schema, model_ids)
            _state_limits(schema, limits)
            _security(schema, keyed)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]


def _operations(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(path, op) for path, ops in schema.get("paths", {}).items() for op in ops.values()]


def _drop_validation_422(schema: dict[str, Any]) -> None:
    for _, op in _operations(schema):
        r = op.get("responses", {}).get("422")
        if r and "HTTPValidationError" in str(r.get("content")):
            del op["responses"]["422"]
    components = schema.get("components", {}).get("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)


def _state_models(schema: dict[str, Any], model_ids: tuple[str, ...]) -> None:
    """Every request's ``model`` lists the served ids (others answer OpenAI's 404 model_not_found, not a 400)."""
    for body in schema.get("components", {}).get("schemas", {}).values():
        for alt in body.get("properties", {}).get("model", {}).get("anyOf", []):
            if alt.get("type") == "string":
                alt["enum"] = list(model_ids)


def _state_limits(schema: dict[str, Any], limits: Limits) -> None:
    body = schema["components"]["schemas"].get("EmbeddingRequest")
    if body is None:  # an app without the embeddings route
        return
    props = body["properties"]
    for alt in props["input"].get("anyOf", []):
        if alt.get("type") == "string":
            alt["maxLength"] = limits.max_chars
        elif alt.get("type") == "array":
            alt["minItems"], alt["maxItems"] = 1, limits.max_items
            alt["items"]["maxLength"] = limits.max_chars


def _security(schema: dict[str, Any], keyed: bool) -> None:
    """With a key: bearer auth on /admin and /v1. Without one, /v1 is open and /admin disabled: it answers
    403 to whatever it is sent (400 for a body that is not JSON, 413 for one over the limit), and the
    document says just that."""
    schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, op in _operations(schema):
        if keyed and (path.startswith("/admin") or path.startswith("/v1")):
            op["security"] = [{"bearer": []}]
            op["responses"].pop("403", None)  # admin is enabled
        elif path.startswith("/admin"):
            op["responses"] = {k: v for k, v in op["responses"].items() if k in ("400", "403", "413")}
        elif path.startswith("/v1"):
            op["responses"].pop("401", None)
