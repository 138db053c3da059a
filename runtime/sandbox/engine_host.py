"""Inside an engine's host process: the only process an engine candidate's kernels run in.

A worker never loads an engine candidate itself. It asks a template process (:func:`template_main`,
forked from the worker once, before anything worth stealing exists in the worker: the model and the
kernel sources are loaded, the reference embeddings are not) to fork a host per engine. A server
starts a fresh interpreter instead (``python -m runtime.sandbox.engine_host``), whose environment holds no key.

A host:

- keeps no descriptor of its parent but its own socket and the compile cache (not the timing lock, not
  the worker's pipe to the controller), and prints to a file of its own, never the worker's log;
- is not dumpable, dies with its parent, and stays in the worker's process group (it may not leave
  it), so killing the worker's group kills every process an engine started;
- runs the kernels under the ``engine`` system-call filter (:func:`runtime.sandbox.filters.compiled_filters`),
  loaded before the first kernel library: threads and its own worker processes are allowed, sockets
  (but an unnamed local pair for its workers), signals, exec, writes to files and new code are not;
  once the kernels are loaded and have run once, no executable mapping at all;
- answers over :mod:`runtime.sandbox.engine_wire`: ``B`` a batch of token ids, answered ``O`` (embeddings) or
  ``X`` (the error); ``P`` sequences to profile in batches (answered ``P`` with the operators' times,
  JSON); ``S`` starts its workers (answered ``S`` with what runs); ``T`` stops them once the batches in
  flight are done; ``Q`` or a closed socket ends it.

Batching, tokenising and every clock stay with the caller.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import resource
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.engine.profile import time_forward
from runtime.sandbox.engine_wire import decode_batch, encode_result, read_frame, write_frame
from runtime.sandbox.filters import compiled_filters, load_filter
from runtime.sandbox.landlock import confine_to_code
from runtime.sandbox.limits import lock_file_size

if TYPE_CHECKING:
    from runtime.engine.engine import Engine
    from runtime.engine.model import Model

__all__ = ["serve", "template_main"]

_PR_SET_PDEATHSIG = 1
_WARM_IDS = np.array([101, 102], np.int32)  # [CLS] [SEP]


def _close_fds_except(keep: set[int]) -> None:
    for fd in sorted(int(f) for f in os.listdir("/proc/self/fd")):
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def _die_with_parent(parent: int) -> None:
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)


def _cache_fd(cache_dir: str) -> int | None:
    prefix = "/proc/self/fd/"
    return int(cache_dir[len(prefix) :].split("/")[0]) if cache_dir.startswith(prefix) else None


# --- the host ---------------------------------------------------------------------------------------


def _load(build: Callable[[], Engine], filters: dict[str, bytes] | None, cache_dir: str | None) -> Engine:
    """The engine, its kernels loaded with its files confined and under the filter, and run once, then no new
    code. Files: read-only, beneath the system's directories, the interpreter's and the compile cache: no run
    directory, no worker's working directory, no other candidate's source or output."""
    confine_to_code(cache_dir)
    if filters is not None:
        load_filter(filters["engine"])
    engine = build()
    engine.run_batch([_WARM_IDS])  # first calls: lazy symbol binding, packed weights
    import threadpoolctl  # noqa: F401 - what starting the workers imports, before no new code may load

    if filters is not None:
        load_filter(filters["no_exec"])
    return engine


def serve(sock: socket.socket, engine: Engine) -> None:
    """Answers the caller until it says ``Q`` or closes the socket; never returns."""
    send = threading.Lock()

    def reply(kind: bytes, payload: bytes = b"") -> None:
        with send, contextlib.suppress(OSError):
            write_frame(sock, kind, payload)

    def run(forward: Callable[[list[np.ndarray]], np.ndarray], batch_id: int, seqs: list[np.ndarray]) -> None:
        try:
            out = forward(seqs)
        except BaseException:  # noqa: BLE001 - the caller fails the batch's requests with it
            reply(b"X", batch_id.to_bytes(8, "little") + traceback.format_exc()[-4000:].encode())
            return
        reply(b"O", encode_result(batch_id, out))

    pool: ThreadPoolExecutor | None = None
    forward: Callable[[list[np.ndarray]], np.ndarray] = engine.run_batch
    while True:
        try:
            frame = read_frame(sock)
        except (OSError, ValueError):
            frame = None
        if frame is None or frame[0] == b"Q":
            os._exit(0)
        kind, payload = frame
        if kind == b"B":
            batch_id, seqs = decode_batch(payload)
            if pool is None:  # not started: checks, one batch at a time
                run(forward, batch_id, seqs)
            else:
                pool.submit(run, forward, batch_id, seqs)
        elif kind == b"P" and pool is None:  # a profile: the batches' forward passes, every operator timed
            step, seqs = decode_batch(payload)
            try:
                answer = time_forward(engine, seqs, step or None)
            except BaseException:  # noqa: BLE001 - the caller fails the profile with it
                answer = {"error": traceback.format_exc()[-4000:]}
            reply(b"P", json.dumps(answer).encode())
        elif kind == b"S" and pool is None:
            started = engine.start_workers()
            forward = started  # type: ignore[assignment]
            workers, blas = engine.threads or (1, 1)
            pool = ThreadPoolExecutor(workers, thread_name_prefix="evoforge-engine")
            reply(b"S", json.dumps({"workers": workers, "blas_threads": blas, "kind": engine.worker_kind,
                                    "pids": engine.worker_pids}).encode())  # fmt: skip
        elif kind == b"T":
            if pool is not None:
                pool.shutdown(wait=True)
                pool = None
                engine.stop()
                forward = engine.run_batch
            reply(b"T")


def _host_main(conn_fd: int, parent: int | None, build: Callable[[], Engine], filters: dict[str, bytes] | None,
               keep: set[int], cache_dir: str | None) -> None:  # fmt: skip
    _close_fds_except({0, 1, 2, conn_fd, *keep})
    if parent is not None:
        _die_with_parent(parent)
    sock = socket.socket(fileno=conn_fd)
    try:
        engine = _load(build, filters, cache_dir)
    except BaseException as exc:  # noqa: BLE001 - a kernel that does not load is the candidate's failure
        from runtime.toolchain.cc import CompileError

        why = exc.stderr if isinstance(exc, CompileError) else traceback.format_exc()[-4000:]
        with contextlib.suppress(OSError):
            write_frame(sock, b"E", why.encode())
        os._exit(0)
    write_frame(sock, b"R", json.dumps({"dim": engine.dim}).encode())
    serve(sock, engine)


# --- the template a worker forks hosts from ---------------------------------------------------------


def template_main(sock: socket.socket, model: Model, parent: int, keep: set[int]) -> None:
    """The template's loop (in a process just forked from a worker): each request forks a host building
    one engine of ``model``. A request is JSON (``config``, ``kernels``: slot -> kernel source, ``compiler``,
    ``cache_dir``, ``cpu_seconds``) with the host's socket attached; the answer is the host's pid and the file
    it prints to (in the template's working directory: the worker's). A request
    ``{"status": pid}`` answers how that host ended (``signal`` name or exit ``code``). Never returns."""
    from runtime.engine.engine import Engine, EngineConfig
    from runtime.engine.kernel_runs import KernelSource, build_ops
    from runtime.settings import CompilerSettings
    from runtime.toolchain.cc import compiler_version

    _close_fds_except({0, 1, 2, sock.fileno(), *keep})
    _die_with_parent(parent)
    filters = compiled_filters()
    models: dict[str, Model] = {}  # each precision's weights, rounded once here and shared by every host
    ended: dict[int, int] = {}
    me = os.getpid()
    while True:
        with contextlib.suppress(ChildProcessError):
            while (found := os.waitpid(-1, os.WNOHANG))[0]:
                ended[found[0]] = found[1]
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 1)
        except OSError:
            os._exit(0)
        if not msg:
            os._exit(0)
        req: dict[str, Any] = json.loads(msg)
        if "status" in req:
            sock.send(json.dumps(_ended(int(req["status"]), ended)).encode())
            continue
        config = EngineConfig.model_validate(req["config"])
        kernels = {slot: KernelSource(**ks) for slot, ks in req["kernels"].items()}
        compiler = CompilerSettings.model_validate(req["compiler"])
        compiler_version(compiler.cc)  # the cache key needs it; the host may not run the compiler
        cache_dir = req["cache_dir"]
        cache_fd = _cache_fd(cache_dir)
        if config.precision not in models:
            models[config.precision] = model.with_precision(config.precision)
        build = functools.partial(Engine, models[config.precision], config=config)
        ops = functools.partial(build_ops, kernels, compiler=compiler, cache_dir=cache_dir)
        output = os.path.abspath(f"engine-host-{me}-{len(ended)}-{os.urandom(4).hex()}.out")
        pid = os.fork()
        if pid == 0:
            try:
                lock_file_size()
                _print_to(output)
                if req.get("cpu_seconds"):
                    resource.setrlimit(resource.RLIMIT_CPU, (int(req["cpu_seconds"]),) * 2)
                _host_main(fds[0], me, lambda: build(ops=ops()), filters,  # noqa: B023 - called right here
                           {cache_fd} if cache_fd is not None else set(), cache_dir)  # fmt: skip
            except BaseException:  # noqa: BLE001 - into the worker's log
                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(1)
        os.close(fds[0])
        sock.send(json.dumps({"pid": pid, "output": output}).encode())


def _lengths(seqs: list[np.ndarray]) -> np.ndarray:
    return np.array([len(s) for s in seqs], np.float32)


def prime_engine_process() -> None:
    """Imports what an engine's process runs later (this loop, threadpoolctl) and makes one round trip
    through a process worker: call it before a drop of privileges, after which the interpreter's own files may
    not be readable."""
    import threadpoolctl  # noqa: F401

    from runtime.engine.workers import ProcessWorkers
    from runtime.sandbox.limits import preload_modules

    preload_modules()
    workers = ProcessWorkers(_lengths, 1)
    try:
        workers([np.zeros(3, np.int32)])
    finally:
        workers.close()


def _print_to(path: str) -> None:
    """What this process prints goes to a file of its own (created here), not the worker's log: a kernel could
    rewrite a log it shares."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _ended(pid: int, ended: dict[int, int]) -> dict[str, Any]:
    with contextlib.suppress(ChildProcessError):
        ended.setdefault(pid, os.waitpid(pid, 0)[1])
    status = ended.pop(pid, 0)
    return {"signal": signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status) else None,
            "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}  # fmt: skip


# --- a host started on its own (a server's) ---------------------------------------------------------


def main(argv: list[str]) -> int:
    """``python -m runtime.sandbox.engine_host FD`` with a JSON spec on stdin: builds the engine it describes and
    answers on descriptor FD. The spec holds ``config`` (an :class:`EngineConfig`), ``model_dir``, and for
    evolved kernels ``task`` (the engine task's name and resolved args: the kernels travel in them),
    ``compiler``, ``cache_dir`` and ``kernel_sha256`` (slot -> the library each kernel must load as: the
    build that was measured). Nothing is read from a run.

    As a worker does, it reads what it needs (the model, the compile cache's descriptor), then enters the
    sandbox: resource limits (no CPU time limit: it serves for as long as its server does) and, started as
    root, the unprivileged user, so that nothing it runs can read its server's memory or environment (the
    serve key) or any file of the machine's; it compiles its kernels as that user, then loads them under
    the filter."""
    from runtime.engine.engine import Engine, EngineConfig
    from runtime.engine.model import load_model
    from runtime.engine.ops import numpy_ops
    from runtime.sandbox.limits import enter_sandbox, make_undumpable, sandbox_ids
    from runtime.settings import CompilerSettings, SandboxSettings
    from runtime.task import load_task_class

    conn_fd, spec = int(argv[0]), json.loads(sys.stdin.read())
    make_undumpable()
    # Not PDEATHSIG: it fires when the thread that started this process ends (a server builds engines in
    # short-lived threads). The socket closing when the server dies ends this host just as well.
    model = load_model(spec.get("model_dir"))
    config = EngineConfig.model_validate(spec.get("config") or {})
    task = None
    keep: set[int] = set()
    if spec.get("task"):
        task = load_task_class(spec["task"]["name"])(spec["task"]["args"])
        task.share_model(model)  # type: ignore[attr-defined]
        compiler = CompilerSettings.model_validate(spec.get("compiler") or {})
        cache_fd = os.open(spec["cache_dir"], os.O_RDONLY | os.O_DIRECTORY)  # its path may be closed to us later
        keep.add(cache_fd)
        cache_dir = f"/proc/self/fd/{cache_fd}"
    filters = compiled_filters()
    prime_engine_process()
    enter_sandbox(SandboxSettings(), sandbox_ids(), cpu_limit=False)
    make_undumpable()  # a change of credentials resets it
    build: Callable[[], Engine]
    if task is not None:
        try:
            task.compile_kernels(config, compiler=compiler, cache_dir=cache_dir)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - reported as the build's failure; before the filter: no exec after
            error = traceback.format_exc()[-4000:]
            with contextlib.closing(socket.socket(fileno=conn_fd)) as sock:
                write_frame(sock, b"E", error.encode())
            return 0
        built = spec.get("kernel_sha256") or None
        build = lambda: task.build(config, compiler=compiler, cache_dir=cache_dir, built=built)  # type: ignore[attr-defined]  # noqa: E731
    else:
        build = lambda: Engine(model, numpy_ops(), config)  # noqa: E731
    _host_main(conn_fd, None, build, filters, keep, cache_dir if task is not None else None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
