"""``evo dashboard`` started for real, on a free local port."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

KEY = "dashboard-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def dashboard(run: Path, *, key: str | None = KEY) -> Iterator[str]:
    """Runs ``evo dashboard RUN`` (with ``--key-env`` when ``key``); yields its base URL once it answers."""
    port = free_port()
    env = {**os.environ, "EVO_DASHBOARD_KEY": key or ""}
    args = ["--key-env", "EVO_DASHBOARD_KEY"] if key else []
    proc = subprocess.Popen([sys.executable, "-m", "evo", "dashboard", str(run), "--port", str(port), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            try:
                with urllib.request.urlopen(url + "healthz", timeout=2) as r:
                    if json.load(r)["status"] == "ok":
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline, "the dashboard never answered"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
