"""``evo serve``: check what to serve (a run's engine, or a GGUF chat model), then run the app on uvicorn until
SIGTERM or Ctrl-C.

On SIGTERM the server stops accepting connections, finishes the requests in flight (up to
``drain_timeout`` seconds, well above the worst-case batch time), drains the engine's queue and
returns 0 (the exit code of ``evo serve`` after a graceful stop). Ctrl-C (SIGINT) does the same and
then exits 130, like every evo command.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from archive import FactoryDir, is_run, run_db
from serving._runner import ServeError
from serving._served_run import ServedRun, ok_candidate, open_served
from serving._state import Limits

if TYPE_CHECKING:
    from starlette.types import ASGIApp

    from runtime.decoder import SchedulerConfig
    from runtime.decoder.engine import ChatEngine
    from runtime.engine.kernel_runs import KernelSource

__all__ = ["serve", "serve_gguf"]

log = logging.getLogger("serving")


def _check_port(host: str, port: int) -> None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ServeError(f"cannot resolve --host {host!r}: {exc.strerror}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror} (choose another --port)") from None


def serve(run_dir: str | Path | None, *, elite: str = "best", host: str = "127.0.0.1", port: int = 8000,
          api_key_env: str | None = None, limits: Limits | None = None, drain_timeout: float = 30.0,
          warmup: int = 8, follow: str | Path | None = None) -> int:
    """Serves ``run_dir`` until a signal; returns the exit code (0 after a graceful SIGTERM). With ``follow``
    (a factory directory; no ``run_dir``), serves its latest promotion and swaps to each new one.

    Raises :class:`ServeError` for what the user can fix (no run, unknown elite, missing key, busy port).
    """
    from serving._app import create_app

    if follow is not None:
        follow = Path(follow)
        factory = FactoryDir(follow)
        if not factory.exists():
            raise ServeError(f"no factory in {follow} (expected {factory.config_file}): give a factory directory")
        latest = factory.latest_promotion()
        if latest is None:
            raise ServeError(f"{follow} has promoted no engine yet: evo factory status {follow} says where it is")
        run_dir, elite = latest["run_dir"], latest["elite"]
    if run_dir is None:
        raise ServeError("give a RUN_DIR to serve, or --follow FACTORY_DIR")
    run_dir = Path(run_dir)
    if not is_run(run_dir):
        raise ServeError(f"no run in {run_dir} (expected {run_db(run_dir)}): give the directory of an evo run")
    with open_served(run_dir) as run:  # once: what is served, checked before the port is taken
        if run.task_name == "chat_engine":
            if follow is not None:
                raise ServeError(f"{follow} promoted a chat engine run: --follow serves encoder engines only")
            model, engine, kernels, note = _chat_elite(run, elite)
        else:
            served = ServedRun.read(run, elite)
    if run.task_name == "chat_engine":
        log.info("serving %s", note)
        return serve_gguf(model, engine=engine, kernels=kernels, host=host, port=port, api_key_env=api_key_env,
                          limits=limits, drain_timeout=drain_timeout)  # fmt: skip
    api_key = _api_key(api_key_env)
    _check_port(host, port)
    _log_start(served.note, host, port, api_key)
    app = create_app(served, elite=elite, api_key=api_key, limits=limits, warmup=warmup,
                     follow=Path(follow) if follow is not None else None)
    return _run(app, host, port, drain_timeout)


def _chat_elite(run: Any, elite: str) -> tuple[Path, ChatEngine, dict[str, KernelSource], str]:
    """The model of a ``chat_engine`` run, its engine ``elite`` (``best``: the fittest ok one; ``default``: evo
    serve --gguf's defaults; or an id or prefix) with the evolved kernels it names, and what it is."""
    from archive import Run
    from runtime.decoder.engine import ChatEngine
    from runtime.decoder.engine_task import ChatEngineTask
    from runtime.decoder.models import ModelNotFound, model_file
    from runtime.followed_runs import RunNotFound

    try:
        model = model_file(str(run.task_args.get("model", "smollm2")))
    except ModelNotFound as exc:
        raise ServeError(f"the chat_engine run's model: {exc}") from None
    if elite == "default":
        return model, ChatEngine(), {}, "the default chat engine"
    if elite == "best":
        best = run.store.best(1)
        if not best:
            return model, ChatEngine(), {}, f"the default chat engine: {run.path} has no ok candidate yet"
        cand, what = best[0], f"chat engine {best[0].id[:12]} (best of {run.path}, {best[0].fitness:.1f} tokens/s)"
    else:
        cand = ok_candidate(run, elite)
        what = f"chat engine {cand.id[:12]} of {run.path}"
    task = ChatEngineTask(ChatEngineTask.read_runs(ChatEngineTask.resolve_args(run.task_args, str(run.path)),
                                                   Run.open))  # fmt: skip
    try:
        engine = task.engine(cand.genome)
        return model, engine, task.kernel_sources(engine), what
    except (ValueError, RunNotFound) as exc:
        raise ServeError(f"{what}: {exc}") from None


def serve_gguf(path: str | Path, *, engine: ChatEngine | None = None, kernels: Mapping[str, KernelSource] | None = None,
               host: str = "127.0.0.1", port: int = 8000, api_key_env: str | None = None, limits: Limits | None = None,
               budgets: SchedulerConfig | None = None, drain_timeout: float = 30.0) -> int:  # fmt: skip
    """Serves the chat model of the GGUF file ``path`` on the decoder engine ``engine`` (default
    :class:`runtime.decoder.engine.ChatEngine`'s) until a signal; returns the exit code. ``budgets``: the KV cache
    and waiting queue. An engine with evolved kernels (``kernels``: the sources of those ``engine.kernels`` names)
    serves from a sandboxed process of its own (:func:`runtime.sandbox.chat_host.serve_confined`), which this one
    waits for.

    Raises :class:`ServeError` for what the user can fix (a file the decoder cannot load, a precision this CPU
    has no kernel for, missing key, busy port). The model loads before the port is taken.
    """
    try:
        from runtime.decoder import ChatTemplateError, GGUFLoadError, load_decoder
        from runtime.decoder.engine import ChatEngine, EngineUnfit
    except ImportError as exc:
        raise ServeError(f"serving a GGUF file needs the decoder extra ({exc.name} is missing): "
                         "pip install -c constraints.txt -e '.[serve,decoder]'") from None  # fmt: skip
    from serving._chat_app import create_chat_app

    path = Path(path)
    engine = engine or ChatEngine()
    api_key = _api_key(api_key_env)
    _check_port(host, port)
    try:  # a precision this CPU cannot run is refused before the model loads
        engine.check()
    except EngineUnfit as exc:
        raise ServeError(f"--{exc}") from None
    try:
        model = load_decoder(path)
    except (GGUFLoadError, ChatTemplateError) as exc:
        raise ServeError(f"--gguf: {exc}") from None
    cfg = model.config
    what = f"{path.name} ({cfg.architecture}, {cfg.layers} layers, context {cfg.context}; {engine.describe()})"
    if engine.kernels:
        return _serve_confined(model, (path.stem, path.name), engine, kernels or {}, what, host=host, port=port,
                               api_key=api_key, limits=limits, budgets=budgets, drain_timeout=drain_timeout)
    app = create_chat_app(model, engine, model_ids=(path.stem, path.name), budgets=budgets, api_key=api_key,
                          limits=limits)  # fmt: skip
    _log_start(what, host, port, api_key)
    return _run(app, host, port, drain_timeout)


def _serve_confined(model: Any, model_ids: tuple[str, ...], engine: ChatEngine, kernels: Mapping[str, KernelSource],
                    what: str, *, host: str, port: int, api_key: str | None, limits: Limits | None,
                    budgets: SchedulerConfig | None, drain_timeout: float) -> int:  # fmt: skip
    """``engine`` (with evolved kernels) served by a child process confined as the worker's chat hosts are; its
    kernels compile here first. SIGTERM (and Ctrl-C) reach it, and it drains before it exits."""
    import ctypes
    import traceback

    from runtime.decoder import SchedulerConfig
    from runtime.decoder.engine import EngineUnfit, compile_engine
    from runtime.decoder.kernels import DEFAULT_CACHE
    from runtime.sandbox.chat_host import serve_confined
    from runtime.sandbox.filters import compiled_filters
    from runtime.settings import CompilerSettings
    from runtime.toolchain.cc import CompileError, hold_libgomp

    try:
        built = compile_engine(engine, kernels, cache_dir=DEFAULT_CACHE)
    except EngineUnfit as exc:
        raise ServeError(str(exc)) from None
    except CompileError as exc:
        raise ServeError(f"the engine's kernels do not compile: {exc.stderr[:500]}") from None
    filters = compiled_filters()
    hold_libgomp()
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    listener = socket.socket(infos[0][0], socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(infos[0][4])
    except OSError as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror} (choose another --port)") from None
    listener.listen(2048)
    _log_start(f"{what}, its evolved kernels in a sandboxed process", host, port, api_key)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: it dies with this process
            serve_confined(listener, model, model_ids, engine, built, filters=filters, cache_dir=str(DEFAULT_CACHE),
                           compiler=CompilerSettings(), budgets=budgets or SchedulerConfig(), api_key=api_key,
                           limits=limits, drain_timeout=drain_timeout)  # fmt: skip
            code = 0
        except KeyboardInterrupt:
            code = 130
        except BaseException:  # noqa: BLE001 - said on stderr, then the process ends
            traceback.print_exc()
        finally:
            os._exit(code)
    listener.close()
    interrupted = []

    def forward(sig: int, _: Any) -> None:
        interrupted.append(sig)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)  # Ctrl-C reached it already; a second signal would cut its drain short

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        log.error("the sandboxed server died of signal %d", -code)
        return 1
    return 130 if signal.SIGINT in interrupted else code


def _api_key(api_key_env: str | None) -> str | None:
    if not api_key_env:
        return None
    api_key = os.environ.get(api_key_env) or None
    if api_key is None:
        raise ServeError(f"--api-key-env {api_key_env}: the variable is unset or empty "
                         "(export it, or drop the flag)")
    return api_key


def _log_start(what: str, host: str, port: int, api_key: str | None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("serving %s on http://%s:%d (docs at /docs)", what, host, port)
    if api_key is None:
        log.info("no API key: /v1 is open and /admin is disabled (use --api-key-env NAME)")
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        log.warning("listening on %s without an API key: anyone who reaches this port can use the API", host)


def _run(app: ASGIApp, host: str, port: int, drain_timeout: float) -> int:
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=drain_timeout, log_level="info",
                            access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal it stopped on once it has drained; a handler here turns a SIGTERM
    # into a normal return (exit 0). SIGINT keeps Python's handler: KeyboardInterrupt, exit 130.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    return 0
