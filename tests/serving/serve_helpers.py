"""Helpers of the serving tests: start a real `evo serve` on 127.0.0.1, call it, stop it with SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str
    key: str | None
    first_ready: int  # /ready's status right after /health first answered

    def call(self, method: str, path: str, body: Any = None, *, key: str | None | bool = True,
             raw: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
        """(status, parsed JSON or text, headers); ``key=True`` sends the server's key, a str another."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"content-type": "application/json", **(headers or {})})
        k = self.key if key is True else (key or None)
        if k:
            req.add_header("Authorization", f"Bearer {k}")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status, text, hdrs = r.status, r.read().decode(), dict(r.headers)
        except urllib.error.HTTPError as e:
            status, text, hdrs = e.code, e.read().decode(), dict(e.headers)
        try:
            return status, json.loads(text), {k.lower(): v for k, v in hdrs.items()}
        except ValueError:
            return status, text, {k.lower(): v for k, v in hdrs.items()}


def start_server(run_dir: Path | None, *args: str, key: str | None = None, env: dict[str, str] | None = None,
                 ) -> Server:  # fmt: skip
    """``evo serve`` of ``run_dir`` (``None``: give what to serve in ``args``, e.g. ``--follow DIR``), in ``env``
    (default this process's)."""
    port = free_port()
    env = {**(os.environ if env is None else env)}
    cmd = [sys.executable, "-m", "evo", "serve", *([str(run_dir)] if run_dir is not None else []), "--port",
           str(port), *args]  # fmt: skip
    if key:
        env["SERVE_KEY"] = key
        cmd += ["--api-key-env", "SERVE_KEY"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    srv = Server(proc, f"http://127.0.0.1:{port}", key, 0)
    deadline = time.time() + 60
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if srv.call("GET", "/health")[0] == 200:
                srv.first_ready = srv.call("GET", "/ready")[0]
                break
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.02)
    while time.time() < deadline and srv.call("GET", "/ready")[0] != 200:
        time.sleep(0.05)
    assert srv.call("GET", "/ready")[0] == 200, "the server never became ready"
    return srv


def stop(srv: Server) -> int:
    if srv.proc.poll() is None:
        srv.proc.send_signal(signal.SIGTERM)
    return srv.proc.wait(timeout=60)


