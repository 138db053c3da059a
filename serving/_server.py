"""``evo serve``: check what to serve (a run's engine, or a GGUF chat model), then run the app on uvicorn until
SIGTERM or Ctrl-C.

On SIGTERM the server stops accepting connections, finishes the requests in flight (up to
``drain_timeout`` seconds, well above the worst-case batch time), drains the engine's queue and
returns 0 (the exit code of ``evo serve`` after a graceful stop). Ctrl-C (SIGINT) does the same and
then exits 130, like every evo command.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from archive import FactoryDir, is_run, run_db
from serving._confined_chat import ConfinedChatServer, Engine, follow_promotions, record_swap
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
            model, engine, kernels, note = _chat_elite(run, elite)
        else:
            served = ServedRun.read(run, elite)
    if run.task_name == "chat_engine":
        log.info("serving %s", note)
        return serve_gguf(model, engine=engine, kernels=kernels, host=host, port=port, api_key_env=api_key_env,
                          limits=limits, drain_timeout=drain_timeout, follow=follow,
                          source=(str(run_dir), elite) if follow is not None else None)  # fmt: skip
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
               budgets: SchedulerConfig | None = None, drain_timeout: float = 30.0, follow: Path | None = None,
               source: tuple[str, str] | None = None) -> int:  # fmt: skip
    """Serves the chat model of the GGUF file ``path`` on the decoder engine ``engine`` (default
    :class:`runtime.decoder.engine.ChatEngine`'s) until a signal; returns the exit code. ``budgets``: the KV cache
    and waiting queue. An engine with evolved kernels (``kernels``: the sources of those ``engine.kernels`` names)
    serves from a confined process of its own (:mod:`serving._confined_chat`), and so does every engine when
    following a factory (``follow``; ``source``: the promotion served first, as ``(run_dir, elite)``).

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
    if engine.kernels or follow is not None:
        first = Engine(engine, kernels or {}, what, source)
        return _serve_confined(model, path, first, host=host, port=port, api_key=api_key, limits=limits,
                               budgets=budgets, drain_timeout=drain_timeout, follow=follow)  # fmt: skip
    app = create_chat_app(model, engine, model_ids=(path.stem, path.name), budgets=budgets, api_key=api_key,
                          limits=limits)  # fmt: skip
    _log_start(what, host, port, api_key)
    return _run(app, host, port, drain_timeout)


def _serve_confined(model: Any, path: Path, first: Engine, *, host: str, port: int, api_key: str | None,
                    limits: Limits | None, budgets: SchedulerConfig | None, drain_timeout: float,
                    follow: Path | None) -> int:  # fmt: skip
    """``first`` served by a confined child process (:class:`ConfinedChatServer`); with ``follow``, each new
    promotion of that factory swapped in (a promotion of another model is refused, and recorded so)."""
    from runtime.decoder import SchedulerConfig

    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    listener = socket.socket(infos[0][0], socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(infos[0][4])
    except OSError as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror} (choose another --port)") from None
    listener.listen(2048)
    server = ConfinedChatServer(model, (path.stem, path.name), listener, api_key=api_key, limits=limits,
                                budgets=budgets or SchedulerConfig(), drain_timeout=drain_timeout)  # fmt: skip
    server.start(first)  # the listener stays open here: each new engine's child serves on it
    _log_start(f"{first.what}, from a confined process", host, port, api_key)
    if follow is None:
        return server.run()

    def engine_of(run_dir: str, elite: str) -> Engine:
        with open_served(Path(run_dir)) as run:
            if run.task_name != "chat_engine":
                raise ServeError(f"{run_dir} is a {run.task_name} run, not a chat engine's: not swapped")
            promoted, engine, kernels, what = _chat_elite(run, elite)
        if promoted.resolve() != path.resolve():
            raise ServeError(f"{what} runs {promoted}, not the model served ({path}): not swapped")
        return Engine(engine, kernels, what, (run_dir, elite))

    poll = follow_promotions(follow, engine_of, lambda: server.serving)
    return server.run(poll, swapped=functools.partial(record_swap, follow))


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
