"""The chat_engine task: engines searched under streaming load, each served in a host and measured over HTTP by the
worker's clients; what a host serves is checked against the fp32 engine, and its numerics against the floor."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from gguf_models import Shape, train_vocabulary, write_random_gguf

pytest.importorskip("uvicorn")
pytestmark = pytest.mark.xdist_group("chat-engine")


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory, sentences: list[str]) -> Path:
    root = tmp_path_factory.mktemp("chat-engine")
    return write_random_gguf(root / "tiny-chat.gguf", train_vocabulary(sentences), shape=Shape(context=512))


def _args(model: Path, **more: object) -> dict[str, object]:
    return {"model": str(model), "threads": 2, "streams": 2, "requests": 2, "prompt_tokens": [8, 40],
            "max_tokens": 12, "check_texts": 2, "verified": 2, **more}  # fmt: skip


def test_a_chat_engine_search_measures_each_engine_as_served(tiny_chat: Path, tmp_path: Path) -> None:
    """`evo run` of a chat_engine config: the seeds and a random engine are served, loaded and verified; the best
    is confirmed; every figure is there with its unit, and the winner renders as the settings /admin/engine takes."""
    config = {"task": {"name": "chat_engine", "args": _args(tiny_chat)},
              "search": {"workers": 1, "initial_random": 1, "confirm": {"repeats": 1}}, "budget": {"max_evals": 3},
              "archive": {"descriptors": ["itl_p99_ms", "memory_mb"], "bins": [3, 3],
                          "ranges": [[0, 1000], [0, 4096]]},
              "memory": {"enabled": False}}  # fmt: skip
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "evo", "run", str(path), "--run-dir", str(run)], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = subprocess.run([sys.executable, "-m", "evo", "archive", "best", str(run), "--json"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    best = json.loads(out.stdout)
    assert best and best[0]["status"] == "ok" and best[0]["unit"] == "tokens/s" and best[0]["fitness"] > 0, best
    m = best[0]["metrics"]
    for key in ("tokens_per_s", "ttft_p99_ms", "itl_p99_ms", "memory_mb", "vs_reference", "top1", "verified_top1"):
        assert key in m, key
    assert m["tokens"] == m["requests"] * 12 and m["requests"] == 4  # every answer ran to max_tokens
    assert m["memory_mb"] > 0 and m["verified_answers"] == 2 and m["verified_top1"] >= 0.85
    assert "confirmed" in m
    shown = subprocess.run([sys.executable, "-m", "evo", "archive", "show", str(run), best[0]["id"][:12]],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "linear:" in shown.stdout and "kv_dtype:" in shown.stdout


def _backend_and_task(model: Path, tmp_path: Path, **args: object):
    from runtime.backends.chat_engine import ChatEngineBackend, ChatEngineProgram
    from runtime.decoder.engine_task import ChatEngineTask

    task = ChatEngineTask(_args(model, **args))
    backend = ChatEngineBackend()
    ctx = SimpleNamespace(cache_dir=str(tmp_path / "cache"), work_dir=str(tmp_path))
    return backend, task, ctx, ChatEngineProgram


def test_an_engine_under_the_fidelity_floor_is_wrong(tiny_chat: Path, tmp_path: Path) -> None:
    """The q8 engine's numerics are not the fp32 engine's: under a floor of exact agreement it is wrong, above a
    loose one it passes; the default engine holds any floor."""
    from runtime.backends.base import Failure
    from runtime.decoder.engine import ChatEngine
    from runtime.decoder.engine_task import runnable_precisions
    from runtime.result import Status

    precision = "q8" if "q8" in runnable_precisions() else "int8"
    for floor, fails in (({"top1_floor": 1.0, "kl_floor": 0.0}, True), ({"top1_floor": 0.5, "kl_floor": 1.0}, False)):
        backend, task, ctx, Program = _backend_and_task(tiny_chat, tmp_path, **floor)
        program = Program(task, None, ChatEngine(linear=precision, threads=1), None, ctx, backend)
        if fails:
            with pytest.raises(Failure) as caught:
                program.check(1)
            assert caught.value.status == Status.WRONG and "floor" in str(caught.value)
        else:
            assert program.check(1)["mean_kl"] > 0
    exact = Program(task, None, ChatEngine(threads=1), None, ctx, backend).check(1)
    assert exact["top1"] == 1.0 and exact["mean_kl"] < 1e-6


class _Forger(BaseHTTPRequestHandler):
    """A server that streams a chat answer it did not compute: the same words every time (``text``, as the tiny
    model's tokens ``ids``), listing the tokens ``listed`` and claiming the usage ``claimed``."""

    text = "the the the the the the"
    ids: list[int] = []
    listed: list[int] = []
    claimed = 0

    def do_POST(self) -> None:  # noqa: N802 - the handler's protocol
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        entries = [{"id": i, "token": "", "logprob": -1.0, "bytes": [], "top_logprobs": []} for i in self.listed]
        event = {"choices": [{"index": 0, "delta": {"content": self.text}, "logprobs": {"content": entries}}]}
        self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        usage = {"prompt_tokens": 9, "completion_tokens": self.claimed, "total_tokens": 9 + self.claimed}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def forger() -> Iterator[tuple[int, type[_Forger]]]:
    handler = type("Forger", (_Forger,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], handler
    server.shutdown()


def test_a_host_that_serves_other_tokens_or_miscounts_them_is_wrong(tiny_chat: Path, tmp_path: Path,
                                                                       forger) -> None:  # fmt: skip
    """Answers checked after the load: canned words are not the fp32 engine's top-1 tokens, and a usage that
    claims more tokens than were sent is caught; both are wrong, whatever figures the load gave."""
    from runtime.backends.base import Failure
    from runtime.backends.chat_engine import Measured
    from runtime.decoder.chat_load import run_load
    from runtime.result import Status

    port, handler = forger
    backend, task, ctx, Program = _backend_and_task(tiny_chat, tmp_path, top1_floor=0.5)
    program = Program(task, None, None, None, ctx, backend)
    handler.ids = task.model().tokenizer.encode(handler.text, add_bos=False)
    n = len(handler.ids)
    for listed, claimed, says in ((handler.ids, n, "top-1"), (handler.ids, 3 * n, "disagree"),
                                  (handler.ids[::-1] + [0], n + 1, "disagree")):  # fmt: skip
        handler.listed, handler.claimed = listed, claimed
        load = run_load(port, task.prompts(1)[:4], 2, 12, ids=True)
        with pytest.raises(Failure) as caught:
            program._verify(Measured(load, 1.0))
        assert caught.value.status == Status.WRONG and says in str(caught.value), str(caught.value)


def test_a_host_killed_under_load_is_a_crash_and_the_next_one_serves(tiny_chat: Path, tmp_path: Path) -> None:
    """kill -9 of an engine's host while its load runs: the evaluation ends ``crash`` naming it, and the template
    still serves the next engine."""
    import os
    import signal
    import time

    from runtime.backends.base import Failure
    from runtime.backends.chat_engine import measure
    from runtime.decoder.engine import ChatEngine
    from runtime.result import Status

    backend, task, ctx, _ = _backend_and_task(tiny_chat, tmp_path, streams=2, requests=8, max_tokens=200)
    (tmp_path / "cache").mkdir()
    host = backend.serve(task, ChatEngine(slots="numpy", threads=1), ctx)
    killer = threading.Timer(0.5, lambda: os.kill(host.pid, signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(Failure) as caught:
            measure(host, task, set(os.sched_getaffinity(0)))
        assert caught.value.status == Status.CRASH and "died" in str(caught.value), str(caught.value)
        again = backend.serve(task, ChatEngine(slots="numpy", threads=1), ctx)
        t0 = time.perf_counter()
        assert measure(again, task, set(os.sched_getaffinity(0))).load.tokens == 2 * 8 * 200
        assert time.perf_counter() - t0 < 120
        backend.release(again)
    finally:
        killer.cancel()
        for template in backend._templates.values():
            template.close()
