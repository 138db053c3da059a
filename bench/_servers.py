"""The HTTP contestants of ``bench/engine_vs_peers.py``: ``evo serve`` and Infinity (``infinity-emb``), each a
server process on a free loopback port, under the same closed-loop load as the in-process contestants.

The load's clients call :meth:`HttpServer.submit`, which posts one text (OpenAI's embeddings request) on a
keep-alive connection of the client's thread and returns the answered future. A server started while the
bench is pinned inherits its cores; :meth:`HttpServer.paused` stops it (SIGSTOP) while others are measured.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from runtime.sandbox.hosted_engine import frozen, process_tree

__all__ = ["EVO_SERVE", "INFINITY", "HttpServer", "ServerFailed", "evo_serve", "infinity"]

EVO_SERVE = "evoforge engine (evo serve, HTTP)"
INFINITY = {"torch": "infinity (torch, HTTP)", "optimum": "infinity (optimum: ONNX Runtime, HTTP)"}

_TIMEOUT_S = 60.0  # one request at most


class ServerFailed(RuntimeError):
    """A server did not start, died, or answered a request with an error."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HttpServer:
    """A server process answering ``POST embed_path`` with OpenAI-shaped embeddings; ready once ``GET
    ready_path`` answers 200."""

    def __init__(self, name: str, library: str, cmd: list[str], *, port: int, ready_path: str, embed_path: str,
                 model: str | None, env: dict[str, str], log: Path, startup_s: float = 300.0) -> None:  # fmt: skip
        self.name, self.library, self.port = name, library, port
        self.embed_path, self.model, self.log = embed_path, model, log
        self._local = threading.local()
        self._conns: list[http.client.HTTPConnection] = []
        with open(log, "wb") as out:  # its own session: the whole group goes on close
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)  # fmt: skip
        try:
            self._wait_ready(ready_path, startup_s)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"{self.name} exited with {self.proc.returncode}: {self.tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                try:
                    conn.request("GET", path)
                    if conn.getresponse().status == 200:
                        return
                finally:
                    conn.close()
            time.sleep(0.25)
        raise ServerFailed(f"{self.name} not ready after {timeout:g} s: {self.tail()}")

    def tail(self, limit: int = 600) -> str:
        """The last ``limit`` characters the server printed."""
        with contextlib.suppress(OSError):
            return " | ".join(self.log.read_text(errors="replace")[-limit:].strip().splitlines())
        return ""

    def _post(self, payload: Any) -> bytes:
        body = json.dumps({"input": payload, **({"model": self.model} if self.model else {})}).encode()
        for attempt in (0, 1):  # a keep-alive connection the server closed is opened again, once
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=_TIMEOUT_S)
                self._conns.append(conn)
            try:
                conn.request("POST", self.embed_path, body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                self._local.conn = None
                if attempt or self.proc.poll() is not None:
                    raise ServerFailed(f"{self.name}: {type(exc).__name__}: {exc}; {self.tail()}") from exc
                continue
            if resp.status != 200:
                raise ServerFailed(f"{self.name}: HTTP {resp.status}: {data[:200].decode(errors='replace')}")
            return data
        raise AssertionError("unreachable")

    def submit(self, text: str) -> Future[bytes]:
        """Posts ``text`` and waits for the answer (the load's client is this thread); its future is done."""
        fut: Future[bytes] = Future()
        try:
            fut.set_result(self._post(text))
        except Exception as exc:  # noqa: BLE001 - the client's result() raises it
            fut.set_exception(exc)
        return fut

    def embed(self, texts: Sequence[str], batch: int = 32) -> np.ndarray:
        """Embeddings of ``texts``, ``batch`` to a request, in order."""
        out = []
        for i in range(0, len(texts), batch):
            data = json.loads(self._post(list(texts[i : i + batch])))["data"]
            out += [d["embedding"] for d in sorted(data, key=lambda d: d["index"])]
        return np.asarray(out, np.float32)

    def disconnect(self) -> None:
        """Closes the clients' connections (after a round: its threads are gone)."""
        for conn in self._conns:
            conn.close()
        self._conns.clear()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The server's processes stopped (SIGSTOP) meanwhile, so that it cannot use the cores."""
        with frozen(lambda: process_tree(self.proc.pid)):
            yield

    def close(self) -> None:
        """Stops the server's process group: SIGTERM (a server drains), SIGKILL to what is left after 30 s."""
        self.disconnect()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _env(threads: int, **extra: str) -> dict[str, str]:
    """This process's environment (the CPU caps included) with the thread counts of one server."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", **extra}  # fmt: skip


def evo_serve(run_dir: Path, elite: str, *, threads: int, log_dir: Path, python: str | None = None) -> HttpServer:
    """``evo serve`` on the run's ``elite``, on the interpreter ``python`` (default: this one)."""
    port = _free_port()
    cmd = [python or sys.executable, "-m", "evo", "serve", str(run_dir), "--elite", elite, "--host", "127.0.0.1",
           "--port", str(port), "--max-in-flight", "1024"]  # fmt: skip
    return HttpServer(EVO_SERVE, "evoforge", cmd, port=port, ready_path="/ready", embed_path="/v1/embeddings",
                      model=None, env=_env(threads), log=log_dir / "evo-serve.log")


def infinity(model_dir: Path, engine: str, *, threads: int, batch: int, log_dir: Path) -> HttpServer:
    """Infinity serving the model directory offline on ``engine`` (``torch``, its default, or ``optimum``: ONNX
    Runtime), with its length-sorted dynamic batching, ``batch`` at most; telemetry off."""
    name = INFINITY[engine]
    needs = {"torch": "sentence_transformers", "optimum": "optimum.onnxruntime"}[engine]
    for module in ("infinity_emb", needs):
        if _missing(module):
            hint = " (the optimum-onnx package; it pins an optimum older than the OpenVINO peers need)" \
                if engine == "optimum" else ": pip install -c constraints.txt -e '.[peers]'"  # fmt: skip
            raise ServerFailed(f"not installed ({module}){hint}")
    port = _free_port()
    cmd = [sys.executable, "-m", "infinity_emb.cli", "v2", "--model-id", str(model_dir), "--served-model-name",
           "minilm", "--engine", engine, "--device", "cpu", "--batch-size", str(batch), "--no-bettertransformer",
           "--no-model-warmup", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]  # fmt: skip
    return HttpServer(name, "onnxruntime" if engine == "optimum" else "torch", cmd, port=port, ready_path="/health",
                      embed_path="/embeddings", model="minilm", env=_env(threads, DO_NOT_TRACK="1"),
                      log=log_dir / f"infinity-{engine}.log")  # fmt: skip


def _missing(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is None
    except ImportError:  # its parent package is missing
        return True
