"""`evo serve` end to end: real runs, real servers on 127.0.0.1, the official openai client."""

from __future__ import annotations

import base64
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from serve_helpers import KEY, Server, start_server, stop

pytestmark = pytest.mark.slow

TEXTS = ["the quick brown fox jumps over the lazy dog", "evolution makes kernels faster", "hello",
         "a longer sentence about serving an engine elite over http with dynamic batching " * 3]
LONG = ["a long text to keep the engine busy for a while " * 12] * 16


def _best_ids(run, k: int) -> list[str]:
    from archive import Store

    with Store(run, readonly=True) as s:
        return [c.id for c in s.best(k)]


def _best(run) -> str:
    from archive import Store

    s = Store(run, readonly=True)
    try:
        return s.best(1)[0].id
    finally:
        s.close()


def test_ready_is_503_until_warm(engine_server: Server) -> None:
    assert engine_server.first_ready == 503
    status, body, _ = engine_server.call("GET", "/ready")
    assert status == 200 and body["status"] == "ready"


def test_openai_client_equals_the_engine(engine_server: Server, runs) -> None:
    openai = pytest.importorskip("openai")
    from archive import Run
    from runtime.engine import load_elite

    client = openai.OpenAI(base_url=engine_server.url + "/v1", api_key=KEY, max_retries=0)
    got = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)  # the client asks for base64
    flt = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS, encoding_format="float")
    with Run.open(runs["engine"]) as run:
        engine = load_elite(run, engine_server.call("GET", "/ready")[1]["elite"])
    try:
        want = engine.embed(TEXTS)
        tokens = sum(len(engine.model.tokenizer.encode(t)) for t in TEXTS)
    finally:
        engine.close()
    for resp in (got, flt):
        vecs = np.array([d.embedding for d in sorted(resp.data, key=lambda d: d.index)], np.float32)
        np.testing.assert_allclose(vecs, want, atol=2e-5)
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == tokens
    one = client.embeddings.create(model="minilm", input="hello")
    np.testing.assert_allclose(one.data[0].embedding, want[2], atol=2e-5)


def test_base64_is_little_endian_float32(engine_server: Server) -> None:
    _, f, h = engine_server.call("POST", "/v1/embeddings", {"input": TEXTS[:2]})
    _, b, _ = engine_server.call("POST", "/v1/embeddings", {"input": TEXTS[:2], "encoding_format": "base64"})
    for df, db in zip(f["data"], b["data"], strict=True):
        dec = np.frombuffer(base64.b64decode(db["embedding"]), "<f4")
        np.testing.assert_allclose(dec, df["embedding"], atol=1e-6)
    for k in ("x-queue-ms", "x-inference-ms", "x-total-ms", "server-timing"):
        assert k in h


BAD = [
    ("malformed json", "POST", "/v1/embeddings", b"{not json", 400),
    ("wrong type", "POST", "/v1/embeddings", {"input": 5}, 400),
    ("token arrays", "POST", "/v1/embeddings", {"input": [[1, 2, 3]]}, 400),
    ("empty list", "POST", "/v1/embeddings", {"input": []}, 400),
    ("empty string", "POST", "/v1/embeddings", {"input": ""}, 400),
    ("whitespace only", "POST", "/v1/embeddings", {"input": ["a", " \t\n "]}, 400),
    ("control characters only", "POST", "/v1/embeddings", {"input": "\u0000\u0007\u200b\u001b"}, 400),
    ("too many items", "POST", "/v1/embeddings", {"input": ["a"] * 257}, 400),
    ("oversized string", "POST", "/v1/embeddings", {"input": "a" * 20000}, 400),
    ("unknown model", "POST", "/v1/embeddings", {"input": "a", "model": "gpt-9"}, 404),
    ("bad encoding", "POST", "/v1/embeddings", {"input": "a", "encoding_format": "hex"}, 400),
    ("unknown key", "POST", "/v1/embeddings", {"input": "a", "bogus": 1}, 400),
    ("wrong dimensions", "POST", "/v1/embeddings", {"input": "a", "dimensions": 7}, 400),
    ("unknown route", "GET", "/v1/nothing", None, 404),
    ("wrong method", "GET", "/v1/embeddings", None, 405),
    ("unknown elite", "GET", "/v1/elites/ffffffffffff", None, 404),
    ("non-hex id", "GET", "/v1/elites/xyz!", None, 400),
    ("path in id", "GET", "/v1/elites/..%2F..%2Fetc%2Fpasswd", None, 404),
    ("bad status", "GET", "/v1/elites?status=great", None, 400),
    ("bad top", "GET", "/v1/elites?top=0", None, 400),
    ("invoke unknown elite", "POST", "/v1/kernels/ffffffffffff/invoke", {"case": {}, "inputs": {}}, 404),
]


@pytest.mark.parametrize("what,method,path,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_4xx_json_error(matmul_server: Server, what, method, path, body, status) -> None:
    raw = body if isinstance(body, bytes) else None
    got, payload, _ = matmul_server.call(method, path, None if raw else body, raw=raw)
    assert got == status, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_body_over_the_limit_gets_413_before_it_is_read(matmul_server: Server) -> None:
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(matmul_server.url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000000\r\n\r\n{")
        chunks = []
        while chunk := s.recv(65536):  # the server closes the connection after its answer
            chunks.append(chunk)
        reply = b"".join(chunks).decode()
    assert reply.startswith("HTTP/1.1 413") and "request_too_large" in reply


def test_kernel_invoke_bad_shapes_and_cases(matmul_server: Server, runs) -> None:
    best = _best(runs["matmul"])[:12]
    A, B = [[1.0, 2.0], [3.0, 4.0]], [[1.0], [2.0]]
    for case, inputs, param in [
        ({"m": 2, "n": 1, "k": 3}, {"A": A, "B": B}, "inputs.A"),  # wrong shape
        ({"m": 2, "n": 1}, {"A": A, "B": B}, "case"),  # missing size
        ({"m": 2, "n": 1, "k": 2}, {"A": A}, "inputs"),  # missing input
        ({"m": 2, "n": 1, "k": 2}, {"A": [[1, 2], [3]], "B": B}, "inputs.A"),  # ragged
        ({"m": 5000, "n": 5000, "k": 2}, {"A": A, "B": B}, "case"),  # too large
    ]:
        status, body, _ = matmul_server.call("POST", f"/v1/kernels/{best}/invoke", {"case": case, "inputs": inputs})
        assert status == 400 and body["error"]["param"] == param, body


def test_kernel_invoke_runs_the_elite_in_the_sandbox(matmul_server: Server, runs) -> None:
    rng = np.random.default_rng(0)
    A, B = rng.standard_normal((3, 5), np.float32), rng.standard_normal((5, 4), np.float32)
    best = _best(runs["matmul"])
    req = {"case": {"m": 3, "n": 4, "k": 5}, "inputs": {"A": A.tolist(), "B": B.tolist()}}
    status, body, _ = matmul_server.call("POST", f"/v1/kernels/{best[:10]}/invoke", req)
    assert status == 200, body
    assert body["id"] == best and body["matches_reference"] is True
    np.testing.assert_allclose(np.array(body["outputs"]["C"]["data"], np.float32), A @ B, rtol=1e-4, atol=1e-5)


def test_elites_endpoints(matmul_server: Server, runs) -> None:
    status, body, _ = matmul_server.call("GET", "/v1/elites?top=2&task=matmul")
    assert status == 200 and body["task"] == "matmul" and 1 <= len(body["data"]) <= 2
    assert [d["id"] for d in body["data"]] == _best_ids(runs["matmul"], len(body["data"]))  # the run's ranking
    assert matmul_server.call("GET", "/v1/elites?task=softmax")[1]["data"] == []
    status, one, _ = matmul_server.call("GET", f"/v1/elites/{body['data'][0]['id'][:8]}")
    assert status == 200 and "void" in one["source"] and isinstance(one["lineage"], list)
    assert {"params", "metrics", "fitness", "status"} <= set(one)


def test_auth(engine_server: Server, matmul_server: Server) -> None:
    assert engine_server.call("GET", "/v1/models", key=False)[0] == 401
    assert engine_server.call("GET", "/v1/models", key="wrong")[0] == 401
    assert engine_server.call("GET", "/v1/models")[0] == 200
    assert engine_server.call("POST", "/admin/elite", {"id": "best"}, key="wrong")[0] == 401
    for path in ("/health", "/ready", "/metrics"):
        assert engine_server.call("GET", path, key=False)[0] == 200
    # no key configured: /v1 is open, admin is refused outright
    assert matmul_server.call("GET", "/v1/models")[0] == 200
    status, body, _ = matmul_server.call("POST", "/admin/elite", {"id": "best"}, key="anything")
    assert status == 403 and body["error"]["code"] == "admin_disabled"
    assert matmul_server.call("GET", "/docs")[0] == 200 and matmul_server.call("GET", "/openapi.json")[0] == 200


def _engine_hosts(srv: Server) -> list[int]:
    import os

    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f, open(f"/proc/{entry}/cmdline", "rb") as c:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                    cmd = c.read()
            except OSError:
                continue
            if ppid == srv.proc.pid and b"runtime.sandbox.engine_host" in cmd:
                found.append(int(entry))
    return found


def test_a_body_shorter_than_its_content_length_gets_408_and_the_connection_closed(matmul_server: Server) -> None:
    import socket
    import time
    from urllib.parse import urlsplit

    u = urlsplit(matmul_server.url)
    t0 = time.monotonic()
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"input\": ")
        chunks = []
        while chunk := s.recv(65536):  # the server answers, then closes the connection
            chunks.append(chunk)
    reply = b"".join(chunks).decode()
    assert reply.startswith("HTTP/1.1 408") and "request_timeout" in reply, reply
    assert time.monotonic() - t0 < 20  # the fixture's body timeout, not a client's patience


def test_the_served_engines_kernels_run_in_a_filtered_process_without_the_key(engine_server: Server) -> None:
    """The key stays in the HTTP process: the engine's host is a fresh interpreter with none of its memory
    or environment, under the system-call filter."""
    from runtime.sandbox.filters import filter_available

    hosts = _engine_hosts(engine_server)
    assert hosts
    for host in hosts:
        with open(f"/proc/{host}/environ", "rb") as f:
            environ = f.read()
        with open(f"/proc/{host}/cmdline", "rb") as f:
            cmdline = f.read()
        assert KEY.encode() not in environ and KEY.encode() not in cmdline and b"SERVE_KEY" not in environ
        with open(f"/proc/{host}/status") as f:
            status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
        if filter_available():
            assert status["Seccomp"].strip() == "2" and status["NoNewPrivs"].strip() == "1"
        if os.geteuid() == 0:  # the sandbox user: no key of the server's environment, no memory of it, no root
            assert status["Uid"].split()[0] != "0" and status["CapEff"].strip("0\n ") == ""
    assert engine_server.call("POST", "/v1/embeddings", {"input": ["still served"]})[0] == 200


def _counter(srv: Server, line_start: str) -> float:
    text = srv.call("GET", "/metrics")[1]
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_start))


def test_metrics_move(engine_server: Server) -> None:
    key = 'evoforge_requests_total{method="POST",route="/v1/embeddings",status="200"}'
    before, batches = _counter(engine_server, key), _counter(engine_server, "evoforge_batch_size_count")
    engine_server.call("POST", "/v1/embeddings", {"input": TEXTS})
    assert _counter(engine_server, key) == before + 1
    assert _counter(engine_server, "evoforge_batch_size_count") > batches
    text = engine_server.call("GET", "/metrics")[1]
    for name in ("evoforge_queue_seconds", "evoforge_tokenize_seconds", "evoforge_inference_seconds",
                 "evoforge_batch_tokens", "evoforge_queue_depth"):
        assert name in text


def test_a_request_whose_client_went_away_never_reaches_the_engine(engine_server: Server) -> None:
    """The client sends a request heavy to tokenise and hangs up at once. The server finds nobody waiting,
    either while it still reads the body (the request ends there) or once the texts are tokenised
    (counted as dropped, ``disconnected``): not one of its texts reaches a batch."""
    import json
    import socket
    from urllib.parse import urlsplit

    dropped = 'evoforge_rejected_total{reason="disconnected"}'
    before, texts = _counter(engine_server, dropped), _counter(engine_server, "evoforge_batch_size_sum")
    body = json.dumps({"input": ["words to tokenise " * 800] * 200}).encode()  # 200 texts of 14 kB
    u = urlsplit(engine_server.url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    # the request ends without its texts: an engine embedding 200 long texts would have counted them
    deadline = time.monotonic() + 60
    while _counter(engine_server, "evoforge_in_flight_requests") != 0:
        assert time.monotonic() < deadline, "the request of a client that went away never ended"
        time.sleep(0.2)
    assert _counter(engine_server, "evoforge_batch_size_sum") == texts  # not one of its texts was embedded
    assert _counter(engine_server, dropped) in (before, before + 1)
    assert engine_server.call("POST", "/v1/embeddings", {"input": ["still served"]})[0] == 200


def test_overflow_gets_429(engine_server: Server) -> None:
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda _: engine_server.call("POST", "/v1/embeddings", {"input": LONG}), range(16)))
    statuses = [g[0] for g in got]
    assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses, statuses
    assert all(g[1]["error"]["type"] == "rate_limit_error" for g in got if g[0] == 429)


def test_bounded_load_has_zero_errors(engine_server: Server) -> None:
    # 4 closed-loop clients (the fixture caps in-flight requests at 6), 80 requests: every one must succeed
    def one(i: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        status, body, _ = engine_server.call("POST", "/v1/embeddings", {"input": TEXTS[i % len(TEXTS)]})
        assert status != 200 or len(body["data"]) == 1
        return status, time.perf_counter() - t0

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, range(80)))
    assert [st for st, _ in got] == [200] * 80
    latencies = sorted(dt for _, dt in got)
    assert latencies[-1] < 30.0  # bounded: nothing hangs


def test_admin_switch_under_load_loses_nothing(engine_server: Server, runs) -> None:
    from archive import Store

    s = Store(runs["engine"], readonly=True)
    ids = [c.id for c in s.best(5)]
    s.close()
    other = ids[1] if len(ids) > 1 else "default"
    stop_at = time.time() + 60
    results: list[tuple[int, str]] = []
    done = threading.Event()

    def client() -> None:
        while not done.is_set() and time.time() < stop_at:
            status, _, h = engine_server.call("POST", "/v1/embeddings", {"input": TEXTS})
            results.append((status, h.get("x-elite-id", "")))

    threads = [threading.Thread(target=client) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    status, body, _ = engine_server.call("POST", "/admin/elite", {"id": other})
    assert status == 200, body
    time.sleep(0.3)
    assert engine_server.call("POST", "/admin/elite", {"id": "best"})[0] == 200
    time.sleep(0.3)
    done.set()
    for t in threads:
        t.join()
    assert results and all(st == 200 for st, _ in results), [r for r in results if r[0] != 200]
    seen = {e for _, e in results}
    assert len(seen) >= 2, seen  # requests were served by both engines
    assert engine_server.call("POST", "/admin/elite", {"id": "ffffffffffff"})[0] == 404


def test_sigterm_drains_in_flight_then_exits_0(runs) -> None:
    srv = start_server(runs["matmul"])
    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(srv.call, "POST", "/v1/embeddings", {"input": LONG[:8]}) for _ in range(3)]
        time.sleep(0.3)  # they are in flight
        code = stop(srv)
        got = [f.result() for f in futs]
    assert code == 0
    assert [g[0] for g in got] == [200] * 3
    assert all(len(g[1]["data"]) == 8 for g in got)
