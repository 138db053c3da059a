"""bench/engine_vs_peers.py's own logic: the bench's length-sorted batching, the strongest-peer summary, and the
client of its HTTP contestants, against a stand-in server (no model, no peer library needed)."""

from __future__ import annotations

import socket
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import engine_vs_peers as bench  # noqa: E402
from _peers import length_sorted  # noqa: E402
from _servers import HttpServer, ServerFailed  # noqa: E402

from runtime.engine import closed_loop  # noqa: E402

pytestmark = pytest.mark.exclusive  # it measures time


def test_length_sorted_batches_longest_first_and_answers_in_order() -> None:
    texts = ["a" * n for n in (3, 40, 7, 12, 1, 25, 9)]
    batches: list[list[str]] = []

    def embed(batch: list[str]) -> np.ndarray:
        batches.append(batch)
        return np.array([[len(t), 1.0] for t in batch], np.float32)

    got = length_sorted(embed, texts, 3)
    assert [len(b) for b in batches] == [3, 3, 1]
    assert [len(t) for b in batches for t in b] == sorted((len(t) for t in texts), reverse=True)
    assert got[:, 0].tolist() == [len(t) for t in texts]  # each text's row, in the order given


def _row(name: str, throughput: float, *, ours: bool = False, cosine: float = 1.0, mode: str = "in process",
         p99: float = 100.0, bulk: float | None = None) -> dict[str, Any]:  # fmt: skip
    return {"name": name, "ours": ours, "mode": mode, "min_cosine": cosine, "throughput": throughput,
            "p99_ms": p99, "bulk": bulk}  # fmt: skip


def test_latency_percentiles_pool_every_rounds_requests() -> None:
    from runtime.engine import LoadResult

    def round_of(latencies: list[float]) -> LoadResult:
        lat = np.array(latencies)
        return LoadResult(len(lat), 1.0, len(lat), float(np.percentile(lat, 50)), float(np.percentile(lat, 99)),
                          float(lat.mean()), 0, tuple(latencies))  # fmt: skip

    # two calm rounds and one with a slow spell: the median of the per-round p99s hides the spell
    runs = [round_of([10.0] * 99 + [20.0]), round_of([10.0] * 99 + [20.0]), round_of([10.0] * 90 + [500.0] * 10)]
    fig = bench.median_figures(runs)
    assert fig["throughput"] == 100 and fig["rounds"] == [100, 100, 100]
    assert np.median([r.p99_ms for r in runs]) < 21 and fig["p99_ms"] == pytest.approx(500.0)
    assert fig["p50_ms"] == 10.0 and fig["completed"] == 300


def test_a_p99_is_worse_or_better_only_beyond_its_resampling_noise() -> None:
    """Two pools of requests from one distribution read as equal within noise whichever p99 is the higher;
    a pool whose slowest 2% are twice as slow reads as worse, and the other way round as better."""
    from runtime.engine import LoadResult

    def rounds(latencies: np.ndarray) -> list[LoadResult]:
        return [LoadResult(len(c), 1.0, len(c), float(np.percentile(c, 50)), float(np.percentile(c, 99)),
                           float(c.mean()), 0, tuple(c)) for c in np.array_split(latencies, 3)]  # fmt: skip

    rng = np.random.default_rng(1)
    same_a = bench.median_figures(rounds(rng.gamma(4.0, 10.0, 1500)), rng)
    same_b = bench.median_figures(rounds(rng.gamma(4.0, 10.0, 1500)), rng)
    slow = rng.gamma(4.0, 10.0, 1500)
    slow[np.argsort(slow)[-30:]] *= 2
    slower = bench.median_figures(rounds(slow), rng)
    verdict, (lo, hi) = bench.p99_verdict(same_a, same_b)
    assert verdict == "equal within noise" and lo < same_a["p99_ms"] - same_b["p99_ms"] < hi
    assert bench.p99_verdict(same_b, same_a)[0] == "equal within noise"
    assert bench.p99_verdict(slower, same_a)[0] == "worse" and bench.p99_verdict(same_a, slower)[0] == "better"
    low, high = bench.p99_interval(same_a)
    assert low < same_a["p99_ms"] < high
    rows = [{**slower, **_row("ours", 200.0, ours=True, p99=slower["p99_ms"])},
            {**same_a, **_row("peer", 100.0, p99=same_a["p99_ms"])}]  # fmt: skip
    v = bench.versus(rows, "throughput")
    assert v is not None and (v["ratio"], v["p99"], v["p99_ok"]) == (2.0, "worse", False)


def test_versus_takes_the_strongest_peer_above_the_cosine_floor() -> None:
    rows = [_row("ours", 300.0, ours=True, p99=90.0, bulk=600.0), _row("ours, slower", 100.0, ours=True),
            _row("fast but wrong", 900.0, cosine=0.98, bulk=900.0), _row("peer", 150.0, p99=120.0, bulk=500.0),
            _row("server", 200.0, mode="HTTP", p99=80.0)]  # fmt: skip
    v = bench.versus(rows, "throughput")
    assert v is not None
    assert (v["ours"], v["peer"], v["ratio"], v["p99_ok"]) == ("ours", "server", 1.5, False)
    assert v["to_goal"] == pytest.approx(1.0)  # the goal met exactly
    b = bench.versus(rows, "bulk")
    assert b is not None and (b["peer"], b["ratio"]) == ("peer", 1.2) and "p99_ok" not in b
    assert b["to_goal"] == pytest.approx(1.25)
    assert bench.versus(rows, "throughput", "HTTP") is None  # no figure of ours over HTTP
    rows.append(_row("ours over HTTP", 160.0, ours=True, mode="HTTP", p99=80.0))
    h = bench.versus(rows, "throughput", "HTTP")
    assert h is not None and (h["ours"], h["peer"], h["ratio"], h["p99_ok"]) == ("ours over HTTP", "server", 0.8, True)


_STAND_IN = textwrap.dedent('''
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the servers the bench drives

        def log_message(self, *args):
            pass

        def answer(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.answer(200 if self.path == "/ready" else 404, {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
            if "fail" in texts:
                return self.answer(500, {"error": "no"})
            data = [{"index": i, "embedding": [float(len(t)), 1.0]} for i, t in enumerate(texts)]
            self.answer(200, {"data": data[::-1], "model": body.get("model")})  # any order: the index says

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
''')


def _stand_in(tmp_path: Path, script: str = _STAND_IN) -> HttpServer:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "server.py").write_text(script)
    return HttpServer("stand-in", "evoforge", [sys.executable, str(tmp_path / "server.py"), str(port)], port=port,
                      ready_path="/ready", embed_path="/v1/embeddings", model="m", env={}, log=tmp_path / "log",
                      startup_s=30)  # fmt: skip


def test_http_server_embeds_in_order_and_takes_the_closed_loop(tmp_path: Path) -> None:
    server = _stand_in(tmp_path)
    try:
        texts = ["a", "bbbb", "cc", "ddddddd", "e"]
        assert server.embed(texts, batch=2)[:, 0].tolist() == [1.0, 4.0, 2.0, 7.0, 1.0]
        got = closed_loop(server.submit, texts, concurrency=2, duration_s=0.3, warmup_s=0.05)
        assert got.completed > 0 and got.refused == 0
        with server.paused():  # stopped: the request waits for it
            assert all(state in "Tt" for state in _states(server.proc.pid))
        with pytest.raises(ServerFailed, match="HTTP 500"):
            server.submit("fail").result()
    finally:
        server.close()
    assert server.proc.returncode is not None


def _states(pid: int) -> list[str]:
    return [Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]]


def test_a_server_that_exits_at_start_is_reported_with_what_it_printed(tmp_path: Path) -> None:
    with pytest.raises(ServerFailed, match="exited with 3.*no model here"):
        _stand_in(tmp_path, "import sys\nprint('no model here', flush=True)\nsys.exit(3)\n")
