"""``evo dashboard``: the report of a run (or of a factory and its runs), live, served on this machine.

The page polls ``/api/report``; the server re-reads the run (read-only: the run's writer is never
blocked) when it recorded something new, and sends the sections. It draws at most once per
``min_interval_s``, and never more than a fifth of the time (a report of a few hundred evaluations
takes ~1.5 s to draw: then at most every 7.5 s), at a lowered priority, so that drawing takes little
from the search beside it.

With a key (``--key-env NAME``), every route but ``/login`` and ``/healthz`` needs it: an API client
sends ``Authorization: Bearer KEY``; a browser, which sends no such header when it loads a page, logs in
once on ``/login`` and then carries an HttpOnly session cookie.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from evo.report import build_report, report_marker
from evo.report.page import Report, document

__all__ = ["create_app"]

COOKIE = "evo_dashboard"

_SCRIPT = """<script>
(() => {
  let marker = document.body.dataset.marker;
  async function poll() {
    try {
      const r = await fetch("api/report?after=" + encodeURIComponent(marker), {credentials: "same-origin"});
      if (r.ok) {
        const d = await r.json();
        if (d.changed) {
          for (const s of d.sections) {
            let el = document.getElementById(s.id);
            if (!el) { el = document.createElement("section"); el.id = s.id; document.body.appendChild(el); }
            const h = document.createElement("h2"); h.textContent = s.title;
            const body = document.createElement("div"); body.className = "body"; body.innerHTML = s.body;
            el.replaceChildren(h, body);
          }
          marker = d.marker;
          document.body.dataset.marker = marker;
          document.getElementById("stamp").textContent = d.stamp;
        }
      }
    } catch (e) { /* the dashboard restarts or the network blinks: try again */ }
    setTimeout(poll, INTERVAL);
  }
  setTimeout(poll, INTERVAL);
})();
</script>"""

_LOGIN = """<!doctype html><html lang="en"><head><meta charset="utf-8"><title>evoforge dashboard: log in</title>
<style>body{font:15px system-ui,sans-serif;margin:4rem auto;max-width:28rem}input{font:inherit;padding:.3rem}</style>
</head><body><h1>evoforge dashboard</h1><p>%s</p>
<form method="post" action="login"><label>key <input type="password" name="key" autofocus></label>
<button type="submit">log in</button></form></body></html>"""


class _Reports:
    """The current report of the run (or factory): rebuilt when the run changed, at most once per ``min_interval_s``."""

    def __init__(self, run_dir: Path, min_interval_s: float) -> None:
        self.run_dir = run_dir
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()  # one build at a time (pyplot is not thread-safe)
        self._report: Report | None = None
        self._checked_at = 0.0
        self._build_s = 0.0

    def current(self) -> Report:
        with self._lock:
            wait = max(self.min_interval_s, 5 * self._build_s)
            if self._report is not None and time.monotonic() - self._checked_at < wait:
                return self._report
            if self._report is None or report_marker(self.run_dir) != self._report.marker:
                t0 = time.monotonic()
                self._report = build_report(self.run_dir)
                self._build_s = time.monotonic() - t0
            self._checked_at = time.monotonic()
            return self._report


def _marker(report: Report) -> str:
    return "-".join(str(x) for x in report.marker)


def create_app(run_dir: str | Path, *, key: str | None = None, min_interval_s: float = 2.0,
               poll_ms: int = 1500, hosts: list[str] | None = None) -> Starlette:  # fmt: skip
    """The dashboard of the run (or factory) in ``run_dir`` (a run must be there: :class:`archive.RunNotFound`).
    ``hosts``: the ``Host`` names it answers (a loopback dashboard answers only loopback names, so a web
    page cannot reach it through a rebound DNS name); ``None``: any."""
    run_dir = Path(run_dir)
    report_marker(run_dir)  # fails now, with the reason, rather than on the first page
    reports = _Reports(run_dir, min_interval_s)
    sessions: set[str] = set()
    script = _SCRIPT.replace("INTERVAL", str(int(poll_ms)))

    def authorised(request: Request) -> bool:
        if key is None:
            return True
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
            return True
        cookie = request.cookies.get(COOKIE, "")
        return any(hmac.compare_digest(cookie.encode(), s.encode()) for s in sessions)

    async def page(request: Request) -> Response:
        if not authorised(request):
            return RedirectResponse("login", status_code=303)
        report = await _in_thread(reports.current)
        body = document(report, script=script).replace("<body>", f'<body data-marker="{_marker(report)}">', 1)
        return HTMLResponse(body, headers={"cache-control": "no-store"})

    async def api_report(request: Request) -> Response:
        if not authorised(request):
            return JSONResponse({"error": "missing or wrong key: log in on /login, or send Authorization: Bearer KEY"},
                                status_code=401, headers={"www-authenticate": "Bearer"})  # fmt: skip
        report = await _in_thread(reports.current)
        marker = _marker(report)
        changed = request.query_params.get("after") != marker
        sections = [{"id": s.id, "title": s.title, "body": s.body} for s in report.sections] if changed else []
        return JSONResponse({"marker": marker, "changed": changed, "sections": sections,
                             "stamp": time.strftime("%Y-%m-%d %H:%M:%S")}, headers={"cache-control": "no-store"})

    async def login(request: Request) -> Response:
        if key is None:
            return RedirectResponse(".", status_code=303)
        if request.method == "GET":
            return HTMLResponse(_LOGIN % "This dashboard needs its key.")
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        given = (form.get("key") or [""])[0]
        if not hmac.compare_digest(given.encode(), key.encode()):
            return HTMLResponse(_LOGIN % "Wrong key: try again.", status_code=401)
        token = secrets.token_urlsafe(32)
        sessions.add(token)
        response = RedirectResponse(".", status_code=303)
        response.set_cookie(COOKIE, token, httponly=True, samesite="strict", path="/")
        return response

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=hosts)] if hosts else []
    return Starlette(routes=[
        Route("/", page), Route("/api/report", api_report), Route("/login", login, methods=["GET", "POST"]),
        Route("/healthz", healthz),
    ], middleware=middleware)  # fmt: skip


async def _in_thread(fn: Any) -> Any:
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn)


def serve(run_dir: Path, *, host: str, port: int, key: str | None) -> None:
    """Serves the dashboard until interrupted, at a lower priority than the run it watches."""
    import uvicorn

    from evo.errors import UserError

    try:  # in use, or not an address of this machine: one line now, not uvicorn's exit 3 later
        socket.create_server((host, port)).close()
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror} (choose another --port or --host)") from None
    with contextlib.suppress(OSError):
        os.nice(10)
    loopback = host in ("127.0.0.1", "localhost", "::1")
    app = create_app(run_dir, key=key, hosts=["127.0.0.1", "localhost", "::1"] if loopback else None)
    print(json.dumps({"dashboard": f"http://{host}:{port}/", "run": str(run_dir), "key": key is not None}),
          flush=True)  # fmt: skip
    uvicorn.run(app, host=host, port=port, log_level="warning")
