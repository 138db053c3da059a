"""The served API says what it does: its OpenAPI document lists every status the server answers, with its
error body and the constraints it enforces, and schemathesis (every check, against a live `evo serve`)
finds nothing the document could have said."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from serve_helpers import KEY, Server, start_server, stop

pytest.importorskip("schemathesis")
pytestmark = pytest.mark.slow

# What OpenAPI cannot express, the test is told (the document says it in words): a kernel invoke's
# `case` and `inputs` must fit the run's task (schema-valid bodies mostly get 400), and `dimensions` must be
# the served model's.
_CONFIG = """\
[checks]
positive_data_acceptance.expected-statuses = [200, 401, 403, 404]

[[operations]]
include-path = "/v1/kernels/{id}/invoke"
checks.positive_data_acceptance.expected-statuses = [200, 400, 404, 409, 422]

[[operations]]
include-path = "/v1/embeddings"
checks.positive_data_acceptance.expected-statuses = [200, 400, 429]

[[operations]]
include-path = "/admin/elite"
checks.positive_data_acceptance.expected-statuses = [200, 400, 403, 404, 409]
"""


# A chat server answers a schema-valid body 400 where the model's context or n cannot take it, and 429 when full.
_CHAT_CONFIG = """\
[checks]
positive_data_acceptance.expected-statuses = [200, 400, 401, 404, 429]
"""


def _schemathesis(srv: Server, tmp_path: Path, examples: int, config_text: str = _CONFIG,
                  exclude: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:  # fmt: skip
    config = tmp_path / "schemathesis.toml"
    config.write_text(config_text)
    cli = shutil.which("schemathesis", path=os.path.dirname(sys.executable)) or "schemathesis"
    cmd = [cli, "--config-file", str(config), "run", f"{srv.url}/openapi.json", "--checks", "all",
           "--max-examples", str(examples), "--seed", "1", "--request-timeout", "60", "--no-color",
           "--suppress-health-check", "all"]  # fmt: skip
    if srv.key:
        cmd += ["--header", f"Authorization: Bearer {KEY}"]
    for path in exclude:
        cmd += ["--exclude-path", path]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)


@pytest.mark.parametrize(("run", "key"), [("engine", KEY), ("matmul", None)])
def test_schemathesis_finds_nothing_the_document_could_say(runs, run, key, tmp_path) -> None:
    """A server of its own: schemathesis may switch its engine (/admin/elite) and fill its queue."""
    srv = start_server(runs[run], key=key)
    try:
        done = _schemathesis(srv, tmp_path, examples=8)
    finally:
        stop(srv)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_schemathesis_finds_nothing_the_chat_document_could_say(tmp_path) -> None:
    """`evo serve --gguf` of a tiny random chat model: typed bodies (`stream: 0` is no boolean), each streamed
    event as the document states it. Engine swaps (each builds kernels) are test_chat's swap tests."""
    from gguf_models import train_vocabulary, write_random_gguf

    lines = [s for s in (Path(__file__).parents[1] / "data" / "sentences.txt").read_text().splitlines() if s.strip()]
    model = write_random_gguf(tmp_path / "tiny-chat.gguf", train_vocabulary(lines))
    srv = start_server(None, "--gguf", str(model), key=KEY)
    try:
        done = _schemathesis(srv, tmp_path, examples=8, config_text=_CHAT_CONFIG, exclude=("/admin/engine",))
    finally:
        stop(srv)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_the_document_lists_every_status_with_the_error_body(matmul_server: Server) -> None:
    status, doc, _ = matmul_server.call("GET", "/openapi.json")
    assert status == 200
    ops = {(m.upper(), p): op for p, methods in doc["paths"].items() for m, op in methods.items()}
    expect = {
        ("POST", "/v1/embeddings"): {"200", "400", "404", "413", "429", "503"},  # no key: no 401
        ("POST", "/admin/elite"): {"400", "403", "413"},  # no key: admin is disabled, and says so
        ("POST", "/v1/kernels/{id}/invoke"): {"200", "400", "404", "409", "413", "422", "504"},
        ("GET", "/v1/elites"): {"200", "400"},
        ("GET", "/ready"): {"200", "503"},
    }
    for key, statuses in expect.items():
        assert set(ops[key]["responses"]) == statuses, key
        assert "security" not in ops[key]
        for code in statuses - {"200"}:
            ref = ops[key]["responses"][code]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorResponse")
    assert "HTTPValidationError" not in str(doc)  # validation errors are 400s in the error body, not 422s
    body = doc["components"]["schemas"]["EmbeddingRequest"]["properties"]["input"]["anyOf"]
    text, texts = (next(a for a in body if a["type"] == t) for t in ("string", "array"))
    assert text["minLength"] == 1 and text["maxLength"] == 16384
    assert (texts["minItems"], texts["maxItems"], texts["items"]["minLength"]) == (1, 256, 1)
    assert "a kernel invoke's `case`" in doc["info"]["description"]  # what no schema here states, in words


def test_a_keyed_server_documents_its_bearer_auth(engine_server: Server) -> None:
    doc = engine_server.call("GET", "/openapi.json")[1]
    admin, embed = doc["paths"]["/admin/elite"]["post"], doc["paths"]["/v1/embeddings"]["post"]
    assert set(admin["responses"]) == {"200", "400", "401", "404", "409", "413"}
    assert "401" in embed["responses"] and admin["security"] == embed["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"]
