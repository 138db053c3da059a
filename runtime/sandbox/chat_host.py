"""Chat engines in host processes: each serves the chat app (``evo serve --gguf``'s) on a loopback port, and is
measured from outside, over HTTP, on the caller's clock.

A worker never loads a chat engine's kernels itself. It compiles them into its cache
(:func:`runtime.decoder.engine.compile_engine`) and forks a template once (:class:`ChatHostTemplate`), when the
model is loaded and before anything else is (no reference logits, no answers): the template holds the model and
waits. For each engine it binds a loopback port and forks a host, which serves on that port until it is killed
and prints to a log file of its own. Hosts stay in the worker's process group and die with the template, which
dies with the worker.

A host keeps no descriptor of its parent but its listener, its log and the compile cache; is not dumpable and
dies with its parent; reads only the system's and the interpreter's files and the cache (Landlock); and loads its
kernels, each only as the build the worker compiled, under the ``chat`` system-call filter
(:func:`runtime.sandbox.filters.compiled_filters`): threads, its event loop's socket pair, and ``listen`` and
``accept`` on the listener it was handed; no new socket, no connection out, no file written, no process, no
signal. Once every kernel has run once, no executable mapping at all. Every figure is taken by the caller's
clients, and what a host generates is checked against the fp32 engine computed in the caller.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import http.client
import json
import os
import resource
import signal
import socket
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.decoder.engine import ChatEngine
from runtime.decoder.model import DecoderModel
from runtime.sandbox.filters import compiled_filters, load_filter
from runtime.sandbox.landlock import confine_to_code
from runtime.sandbox.limits import lock_file_size, make_undumpable
from runtime.settings import CompilerSettings
from runtime.toolchain.cc import compiler_version, hold_libgomp

if TYPE_CHECKING:
    from runtime.decoder import Decoder, SchedulerConfig
    from runtime.engine.kernel_runs import KernelSource
    from serving._state import Limits

__all__ = ["PROFILE_LINE", "ChatHost", "ChatHostFailed", "ChatHostTemplate", "confined_decoder", "prime_chat_host",
           "serve_confined"]

_PR_SET_PDEATHSIG = 1


class ChatHostFailed(RuntimeError):
    """A host that did not come up (its build failed, it died, or it was not ready in time); the message ends
    with its log's tail."""


@dataclass
class ChatHost:
    """One engine serving on ``127.0.0.1:port``."""

    pid: int
    port: int
    log: Path

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def tail(self, chars: int = 1500) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-chars:]
        return ""

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Returns once ``GET /ready`` answers 200; raises :class:`ChatHostFailed` if it dies or takes longer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ChatHostFailed(f"the engine's host exited before it served: {self.tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/ready")
                if conn.getresponse().status == 200:
                    return
            time.sleep(0.05)
        self.close()
        raise ChatHostFailed(f"the engine's host was not ready after {timeout:.0f} s: {self.tail()}")

    def wait_profile(self, timeout: float) -> dict[str, Any]:
        """The profile a host in profile mode printed (see :meth:`ChatHostTemplate.spawn`), once it has ended;
        raises :class:`ChatHostFailed` where it ends without one or takes longer."""
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.alive():
            self.close()
            raise ChatHostFailed(f"the engine's host did not profile its load in {timeout:.0f} s: {self.tail()}")
        with contextlib.suppress(OSError):
            for line in self.log.read_text(errors="replace").splitlines():
                if line.startswith(PROFILE_LINE):
                    try:
                        return dict(json.loads(line[len(PROFILE_LINE) :]))
                    except (ValueError, TypeError):
                        break
        raise ChatHostFailed(f"the engine's host ended without its profile: {self.tail()}")

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


class ChatHostTemplate:
    """The process hosts of ``model`` are forked from (forked from the caller here)."""

    def __init__(self, model: DecoderModel, model_id: str, *, cache_dir: str, log_dir: str) -> None:
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the template
            code = 1
            try:
                ours.close()
                _template(theirs, model, model_id, cache_dir, log_dir)
                code = 0
            except BaseException:  # noqa: BLE001 - said on stderr, then the process ends
                traceback.print_exc()
            finally:
                os._exit(code)
        theirs.close()
        self.pid, self._sock = pid, ours
        self._lines = ours.makefile("r")

    @property
    def alive(self) -> bool:
        try:
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:
            return False

    def spawn(self, engine: ChatEngine, built: Mapping[str, KernelSource], *, compiler: CompilerSettings,
              kv_budget_bytes: int, max_waiting: int = 1024,
              profile: dict[str, Any] | None = None) -> ChatHost:  # fmt: skip
        """A host serving ``engine`` on ``built`` (:func:`runtime.decoder.engine.compile_engine`'s answer: every
        library compiled into the cache already, each loaded only as that build), not yet ready (see
        :meth:`ChatHost.wait_ready`). With ``profile`` (``prompts``: token ids, ``max_tokens``), the host serves
        no port: it profiles those generations, prints its profile to its log (:data:`PROFILE_LINE`) and ends."""
        order = {"engine": engine.model_dump(), "built": {part: dataclasses.asdict(ks) for part, ks in built.items()},
                 "compiler": compiler.model_dump(mode="json"), "kv_budget_bytes": kv_budget_bytes,
                 "max_waiting": max_waiting, "profile": profile}  # fmt: skip
        self._sock.sendall((json.dumps(order) + "\n").encode())
        line = self._lines.readline()
        if not line:
            raise ChatHostFailed("the chat engines' template process is gone")
        got = json.loads(line)
        return ChatHost(got["pid"], got["port"], Path(got["log"]))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def _template(sock: socket.socket, model: DecoderModel, model_id: str, cache_dir: str, log_dir: str) -> None:
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # hosts are reaped as they die
    filters = compiled_filters()
    hold_libgomp()  # its hosts' kernels may use OpenMP, and a host may not look for the library
    lines = sock.makefile("r")
    while line := lines.readline():
        order: dict[str, Any] = json.loads(line)
        compiler_version(CompilerSettings.model_validate(order["compiler"]).cc)  # the cache key; hosts may not run it
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(256)
        port = listener.getsockname()[1]
        log = os.path.join(log_dir, f"chat-host-{os.getpid()}-{port}.log")
        pid = os.fork()
        if pid == 0:  # a host
            code = 1
            try:
                lock_file_size()
                sock.close()
                _host(listener, model, model_id, order, cache_dir, log, filters)
                code = 0
            except BaseException:  # noqa: BLE001 - said in its log, then the process ends
                traceback.print_exc()
            finally:
                os._exit(code)
        listener.close()
        sock.sendall((json.dumps({"pid": pid, "port": port, "log": log}) + "\n").encode())


def _host(listener: socket.socket, model: DecoderModel, model_id: str, order: dict[str, Any], cache_dir: str,
          log: str, filters: dict[str, bytes] | None) -> None:  # fmt: skip
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)  # it serves until its caller kills it, as a server does
    resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    from runtime.decoder import SchedulerConfig
    from runtime.engine.kernel_runs import KernelSource

    engine = ChatEngine(**order["engine"])
    built = {part: KernelSource(**{**ks, "flags": tuple(ks["flags"])}) for part, ks in order["built"].items()}
    budgets = SchedulerConfig(kv_budget_bytes=order["kv_budget_bytes"], max_waiting=order["max_waiting"])
    compiler = CompilerSettings.model_validate(order["compiler"])
    if order.get("profile"):
        listener.close()
        _profile(model, engine, built, order, filters=filters, cache_dir=cache_dir, compiler=compiler, budgets=budgets)
        return
    serve_confined(listener, model, (model_id,), engine, built, filters=filters, cache_dir=cache_dir,
                   compiler=compiler, budgets=budgets)


def confined_decoder(listener: socket.socket | None, model: DecoderModel, engine: ChatEngine,
                     built: Mapping[str, KernelSource], *, filters: dict[str, bytes] | None, cache_dir: str,
                     compiler: CompilerSettings, keep: tuple[int, ...] = ()) -> Decoder:  # fmt: skip
    """``engine`` built in this process (a fresh fork), confined as the module docstring says: every descriptor but
    the standard ones, ``listener``, the cache and ``keep`` closed; its kernels ``built`` (each compiled into
    ``cache_dir`` already) loaded under the filter (``filters``: :func:`runtime.sandbox.filters.compiled_filters`';
    ``None``: none on this machine) and run once, then no new code."""
    prefix = "/proc/self/fd/"
    cache_fd = int(cache_dir[len(prefix) :].split("/")[0]) if cache_dir.startswith(prefix) else None
    kept = {0, 1, 2, cache_fd, listener.fileno() if listener is not None else None, *keep}
    for fd in sorted(int(f) for f in os.listdir("/proc/self/fd")):  # nothing of the parent's: its lock, its pipes
        if fd not in kept:
            with contextlib.suppress(OSError):
                os.close(fd)
    make_undumpable()
    from runtime.decoder.engine import build, engine_threads, warm_up

    confine_to_code(cache_dir)
    if filters is not None:
        load_filter(filters["chat"])
    engine_threads(engine)  # before any kernel loads: OpenMP reads its team's size once
    decoder = build(model, engine, built=built, cache_dir=cache_dir, compiler=compiler)
    warm_up(decoder)  # every kernel has run once: lazy binding done
    if filters is not None:
        load_filter(filters["no_exec"])
    return decoder


def serve_confined(listener: socket.socket, model: DecoderModel, model_ids: tuple[str, ...], engine: ChatEngine,
                   built: Mapping[str, KernelSource], *, filters: dict[str, bytes] | None, cache_dir: str,
                   compiler: CompilerSettings, budgets: SchedulerConfig, api_key: str | None = None,
                   limits: Limits | None = None, drain_timeout: float | None = None,
                   ready_fd: int | None = None) -> None:  # fmt: skip
    """Serves ``engine`` on ``listener`` in this process (a fresh fork) until SIGTERM or SIGINT, then drains:
    built by :func:`confined_decoder`; writes ``R`` to ``ready_fd`` once it serves. Engine swaps
    (``POST /admin/engine``) are refused: they would compile."""
    import threading

    import uvicorn

    from serving._chat_app import create_chat_app

    decoder = confined_decoder(listener, model, engine, built, filters=filters, cache_dir=cache_dir,
                               compiler=compiler, keep=(ready_fd,) if ready_fd is not None else ())  # fmt: skip
    app = create_chat_app(model, engine, decoder=decoder, model_ids=model_ids, budgets=budgets, api_key=api_key,
                          limits=limits, swaps=False)  # fmt: skip
    config = uvicorn.Config(app, fd=listener.fileno(), log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=drain_timeout)  # fmt: skip
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal it stopped on to itself once drained, which the filter refuses (no signal to
    # any process, its own included): it drains on SIGTERM or SIGINT here, and returns
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, functools.partial(_hand_over, server))
    if ready_fd is not None:

        def say_ready() -> None:
            while not server.started and not server.should_exit:
                time.sleep(0.01)
            with contextlib.suppress(OSError):
                os.write(ready_fd, b"R" if server.started else b"X")
                os.close(ready_fd)

        threading.Thread(target=say_ready, name="evoforge-ready", daemon=True).start()
    server.run()


HANDOVER_S = 5.0
"""How long a draining host waits, at most, for the connections it accepted to send their first request."""


def _hand_over(server: Any, sig: int, frame: Any) -> None:
    """SIGTERM or SIGINT: stop accepting, wait until every connection accepted here has sent its first request
    (at most :data:`HANDOVER_S`), then drain. The listener is shared with the next engine's process, which takes
    every new connection from now on. uvicorn's drain closes each connection with no request in progress, and one
    accepted just before whose client had not sent its request yet (a loaded machine leaves the client's thread
    waiting) would be reset."""
    import asyncio
    import threading

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not serving yet: nothing was accepted
        server.handle_exit(sig, frame)
        return
    loop.call_soon_threadsafe(lambda: [s.close() for s in server.servers])

    def drain_once_asked() -> None:
        deadline = time.monotonic() + HANDOVER_S
        time.sleep(0.05)  # what the loop accepted before it closed gets its protocol
        while time.monotonic() < deadline and _unasked(server):
            time.sleep(0.01)
        server.handle_exit(sig, frame)

    threading.Thread(target=drain_once_asked, name="evoforge-handover", daemon=True).start()


def _unasked(server: Any) -> bool:
    """Whether a connection of ``server`` has not sent a request yet (uvicorn's protocols: no ``cycle``)."""
    for _ in range(10):  # the loop's thread may change the set meanwhile
        try:
            return any(getattr(c, "cycle", True) is None for c in list(server.server_state.connections))
        except RuntimeError:
            continue
    return False


PROFILE_LINE = "EVOFORGE-PROFILE "
"""How a host in profile mode starts the line of its log that holds its profile (JSON)."""


def _profile(model: DecoderModel, engine: ChatEngine, built: Mapping[str, KernelSource], order: dict[str, Any], *,
             filters: dict[str, bytes] | None, cache_dir: str, compiler: CompilerSettings,
             budgets: SchedulerConfig) -> None:  # fmt: skip
    """Profile mode: ``order["profile"]``'s prompts served through the engine's own scheduler with every operator
    timed (:func:`runtime.decoder.profile.profile_decoder`), the profile printed as one line, then the process
    ends. Its figures are its own account: they steer only where a factory searches next."""
    from runtime.decoder.profile import profile_decoder

    decoder = confined_decoder(None, model, engine, built, filters=filters, cache_dir=cache_dir, compiler=compiler)
    asked = order["profile"]
    found = profile_decoder(decoder, asked["prompts"], asked["max_tokens"], engine.scheduler(budgets))
    sys.stdout.write(PROFILE_LINE + json.dumps(found.to_dict()) + "\n")
    sys.stdout.flush()


def prime_chat_host(model: DecoderModel, model_id: str) -> None:
    """Loads, in this process, every module and file a host will use, while they can still be read (a worker
    calls this before it drops its privileges; its hosts are forked from it later): the chat app served once on
    uvicorn, one streamed request answered, and the C sources of every decoder slot's kernels."""
    import threading

    import uvicorn

    from runtime.decoder import SchedulerConfig
    from runtime.decoder.chat_load import chat
    from runtime.decoder.kernels import PRECISIONS, DecoderKernelError, linear_task
    from runtime.sandbox.limits import preload_modules
    from runtime.task import load_task_class
    from serving._chat_app import create_chat_app

    preload_modules(("importlib.readers", "importlib.resources.readers", "threadpoolctl"))
    names = ["attention_decode", "rmsnorm"]
    for p in PRECISIONS:
        with contextlib.suppress(DecoderKernelError):
            names.append(linear_task(p))
    for name in names:
        for genome in load_task_class(name)().seeds():
            with contextlib.suppress(Exception):
                load_task_class(name)().render(genome)
    app = create_chat_app(model, ChatEngine(slots="numpy", threads=1), model_ids=(model_id,),
                          budgets=SchedulerConfig(kv_budget_bytes=256 << 20))  # fmt: skip
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    server = uvicorn.Server(uvicorn.Config(app, fd=listener.fileno(), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        chat(listener.getsockname()[1], "Hello", 2)
    finally:
        server.should_exit = True
        thread.join(30)
        listener.close()
