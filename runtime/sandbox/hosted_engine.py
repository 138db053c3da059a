"""Engines in host processes, as the worker (or a server) drives them.

:class:`HostedEngine` is an :class:`Engine` whose forward passes run in a host process
(:mod:`runtime.sandbox.engine_host`): tokenising, batching, the load and every clock stay here; the host runs
the batches it is given, with the candidate's kernels. :class:`EngineTemplate` is the process hosts are
forked from in a worker; :func:`spawn_host` starts one from a fresh interpreter (a server's).

The host's processes stay in the caller's process group. :func:`frozen` stops processes (SIGSTOP) while
another engine is measured, so an engine cannot use the machine while its rival or the reference runs.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import asdict
from typing import Any

import numpy as np

from runtime import isa
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.kernel_runs import KernelSource
from runtime.engine.model import Model
from runtime.engine.ops import Ops
from runtime.followed_runs import OpenRun, RunReader
from runtime.sandbox.engine_wire import FrameError, decode_result, encode_batch, read_frame, write_frame
from runtime.sandbox.host import HostDied, forward_output
from runtime.sandbox.processes import owned_work_dir, process_table, sweep_work_dirs
from runtime.settings import CompilerSettings

__all__ = ["EngineBuildFailed", "EngineProcess", "EngineTemplate", "HostedEngine", "frozen", "process_tree",
           "spawn_elite", "spawn_host"]  # fmt: skip

_READY_S = 300.0  # a build compiles nothing (the worker did): loading the kernels takes seconds at most


class EngineBuildFailed(RuntimeError):
    """The host could not build the engine (a kernel library without its function, say)."""


# --- processes -----------------------------------------------------------------------------------------


def _tail(path: str | None, limit: int = 1500) -> str:
    """The last ``limit`` characters a host printed (its file ``path``)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


def process_tree(root: int, table: Mapping[int, tuple[int, int, str]] | None = None) -> list[int]:
    """``root`` and its descendants (those still parented within the tree)."""
    table = process_table() if table is None else table
    if root not in table:
        return []
    found, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, (ppid, _, _) in table.items() if ppid in frontier and pid not in found]
        found += frontier
    return found


def group_except(trees: Iterable[int] = (), pids: Iterable[int] = ()) -> list[int]:
    """Processes of this process's group other than this one, ``pids`` and the trees of ``trees``: another
    engine's processes, and any an engine orphaned (they cannot leave the group)."""
    table = process_table()
    pgrp, me = os.getpgrp(), os.getpid()
    spared = {me, *pids}
    for pid in trees:
        spared.update(process_tree(pid, table))
    return [pid for pid, (_, g, state) in table.items() if g == pgrp and pid not in spared and state != "Z"]


def beside(own: int, live: Iterable[int], templates: Iterable[int]) -> list[int]:
    """The processes to stop while the host ``own`` is measured: the trees of the other ``live`` hosts, and, in
    a worker (which leads its process group, which no host may leave), every process of the group a host
    orphaned; never a template hosts are forked from."""
    if os.getpgrp() == os.getpid():
        return group_except([own], templates)
    return [pid for host in live if host != own for pid in process_tree(host)]


@contextlib.contextmanager
def frozen(select: Callable[[], list[int]]) -> Iterator[list[int]]:
    """Stops (SIGSTOP) the processes ``select`` names, again until no new one appears (one may fork meanwhile),
    waits until each is stopped, and continues them all on exit."""
    stopped: list[int] = []
    for _ in range(20):
        new = [pid for pid in select() if pid not in stopped]
        if not new:
            break
        for pid in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        table = process_table()
        if all(table.get(pid, (0, 0, "T"))[2] in "TtZX" for pid in stopped):
            break
        time.sleep(0.001)
    try:
        yield stopped
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def pin(pids: Iterable[int], cores: set[int]) -> None:
    """Every thread of ``pids`` on ``cores`` (their new threads and processes inherit it)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), cores)


def statm_mb(pids: Sequence[int], shared_bytes: int) -> float:
    """Resident memory (MB) of ``pids``: the first whole, each other one less ``shared_bytes`` (the weights
    its process shares with the first, copy-on-write). A host is not dumpable, so its proportional set size
    cannot be read from outside; ``statm`` can."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0.0
    for i, pid in enumerate(pids):
        try:
            with open(f"/proc/{pid}/statm") as f:
                resident = int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
        total += resident if i == 0 else max(0, resident - shared_bytes)
    return total / 2**20


# --- one host ----------------------------------------------------------------------------------------------


class EngineProcess:
    """An engine's host process: batches in, embeddings out (thread-safe); see :mod:`runtime.sandbox.engine_host`."""

    def __init__(self, pid: int, sock: socket.socket, status: Callable[[int], dict[str, Any]] | None = None,
                 popen: subprocess.Popen[bytes] | None = None, output: str | None = None,
                 forward_to: int = 1) -> None:  # fmt: skip
        self.pid, self._sock, self._status, self._popen = pid, sock, status, popen
        self.output, self._forward_to = output, forward_to  # the file it prints to, forwarded here when it ends
        self.dim = 0
        self._pending: dict[int, Future[np.ndarray]] = {}
        self._control: queue.SimpleQueue[tuple[bytes, bytes]] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._send = threading.Lock()
        self._ask = threading.Lock()
        self._dead: HostDied | None = None
        self._closed = False
        self.started = False
        self._reader = threading.Thread(target=self._read, name=f"evoforge-engine-host-{pid}", daemon=True)
        self._reader.start()

    # --- the conversation ---------------------------------------------------------------------------

    def _read(self) -> None:
        why = ""
        while True:
            try:
                frame = read_frame(self._sock)
            except (OSError, FrameError) as exc:
                frame, why = None, str(exc)
            if frame is None:
                break
            kind, payload = frame
            if kind in (b"O", b"X"):
                try:
                    if kind == b"O":
                        batch_id, out = decode_result(payload, self.dim)
                    else:
                        batch_id = int.from_bytes(payload[:8], "little")
                except FrameError as exc:
                    why = f"it broke the protocol: {exc}"
                    break
                fut = self._pending.pop(batch_id, None)
                if fut is None:
                    why = "it answered a batch it was not given"
                    break
                if kind == b"O":
                    fut.set_result(out)
                else:
                    fut.set_exception(RuntimeError(f"the engine failed:\n{payload[8:].decode(errors='replace')}"))
            else:
                self._control.put((kind, payload))
        self._die(why)

    def _die(self, why: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)  # one that broke the protocol, or closed its socket but lives on
        how = self._ended()
        if self._closed:
            message, name = "the engine's process was closed", None
        elif how.get("signal"):
            name = how["signal"]
            message = f"the engine's process was killed by {name}"
        else:
            message, name = f"the engine's process exited with code {how.get('code')}", None
        if why:
            message += f" ({why})"
        printed = _tail(self.output)
        if printed:
            message += f"; its output:\n{printed}"
        self._dead = HostDied(message, name)
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(self._dead)
        self._pending.clear()
        self._control.put((b"", b""))

    def _ended(self) -> dict[str, Any]:
        if self._popen is not None:
            rc = self._popen.wait()
            return {"signal": signal.Signals(-rc).name if rc < 0 else None, "code": rc if rc >= 0 else None}
        if self._status is not None:
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                return self._status(self.pid)
        return {}

    def _post(self, kind: bytes, payload: bytes = b"") -> None:
        if self._dead is not None:
            raise self._dead
        try:
            with self._send:
                write_frame(self._sock, kind, payload)
        except OSError:
            self._reader.join(5.0)
            raise self._dead or HostDied("the engine's process closed its socket", None) from None

    def _answer(self, want: bytes, timeout: float | None = None) -> bytes:
        try:
            kind, payload = self._control.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise HostDied(f"the engine's process did not answer within {timeout:g} s", None) from None
        if kind == b"":
            self._control.put((b"", b""))
            assert self._dead is not None
            raise self._dead
        if kind == b"E" and want == b"R":
            raise EngineBuildFailed(payload.decode(errors="replace"))
        if kind != want:
            self.close()
            raise HostDied(f"the engine's process answered {kind!r} instead of {want!r}", None)
        return payload

    def ready(self, timeout: float = _READY_S) -> int:
        """Waits until the engine is built; returns its embeddings' dimension."""
        info = json.loads(self._answer(b"R", timeout))
        dim = info.get("dim")
        if not isinstance(dim, int) or not 0 < dim <= 1 << 16:
            self.close()
            raise HostDied(f"the engine's process gave {dim!r} as its dimension", None)
        self.dim = dim
        return dim

    def forward(self, seqs: Sequence[np.ndarray]) -> np.ndarray:
        """Embeddings of a batch of token id arrays, run in the host."""
        fut: Future[np.ndarray] = Future()
        batch_id = next(self._ids)
        self._pending[batch_id] = fut
        try:
            self._post(b"B", encode_batch(batch_id, seqs))
        except BaseException:
            self._pending.pop(batch_id, None)
            raise
        out = fut.result()
        if out.shape[0] != len(seqs):
            raise HostDied(f"the engine's process answered {out.shape[0]} embeddings for {len(seqs)} texts", None)
        return out

    def profile(self, seqs: Sequence[np.ndarray], batch: int = 0, timeout: float = _READY_S) -> dict[str, Any]:
        """The operators' times of ``seqs``' forward passes in batches of ``batch`` (0: the engine's
        ``max_batch``), as the host measured them (:func:`runtime.engine.profile.time_forward`); not started."""
        with self._ask:
            self._post(b"P", encode_batch(batch, seqs))
            payload = self._answer(b"P", timeout)
        try:
            answer = json.loads(payload)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise HostDied("the engine's process answered a profile that is not JSON", None)
        if "error" in answer:
            raise RuntimeError(f"the engine failed:\n{answer['error']}")
        return answer

    def start(self) -> dict[str, Any]:
        """Starts the host's workers; returns ``workers``, ``blas_threads`` and ``kind`` as they run."""
        with self._ask:
            self._post(b"S")
            info = json.loads(self._answer(b"S"))
        self.started = True
        return {k: info.get(k) for k in ("workers", "blas_threads", "kind")}

    def stop(self) -> None:
        """Stops the host's workers once the batches in flight are done."""
        with self._ask:
            self._post(b"T")
            self._answer(b"T")
        self.started = False

    @property
    def alive(self) -> bool:
        return self._dead is None and not self._closed

    def tree(self) -> list[int]:
        """The host and the processes it started."""
        return process_tree(self.pid)

    def close(self) -> None:
        """Kills the host and every process it started."""
        if self._closed:
            return
        self._closed = True
        for _ in range(3):  # a process may fork while its parent is killed
            pids = self.tree()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._reader.join(5.0)
        self._sock.close()
        if self.output is not None:
            forward_output(self.output, f"engine process {self.pid}", to=self._forward_to)
            self.output = None


# --- the engine, as its caller sees it -------------------------------------------------------------------


class HostedEngine(Engine):
    """An :class:`Engine` (same API) whose batches run in ``process``; ``model`` is only for tokenising."""

    def __init__(self, model: Model, config: EngineConfig, process: EngineProcess) -> None:
        super().__init__(model, Ops(), config)
        self.process = process

    def run_batch(self, seqs: Sequence[np.ndarray]) -> np.ndarray:
        return self.process.forward(seqs)

    def start_workers(self, *, restore_blas: bool = True) -> Callable[[Sequence[np.ndarray]], np.ndarray]:
        info = self.process.start()
        self.threads = (int(info["workers"] or 1), int(info["blas_threads"] or 1))
        self.worker_kind = info["kind"] or self.config.worker_kind
        return self.run_batch

    @property
    def worker_pids(self) -> list[int]:
        return self.process.tree()

    def stop(self) -> None:
        super().stop()
        if self.process.started and self.process.alive:
            self.process.stop()

    def close(self) -> None:
        with contextlib.suppress(HostDied):
            self.stop()
        self.process.close()


# --- where hosts come from ---------------------------------------------------------------------------------


class EngineTemplate:
    """A process forked from this one that forks a host per engine (:func:`runtime.sandbox.engine_host.template_main`).

    Fork it before anything a candidate must not see exists in this process (the reference embeddings,
    the expected outputs): a worker does so right after entering its sandbox. ``keep``: descriptors the
    hosts need (the compile cache's)."""

    def __init__(self, model: Model, keep: Iterable[int] = ()) -> None:
        from runtime.sandbox.engine_host import template_main

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                template_main(theirs, model, parent, set(keep))
            finally:
                os._exit(1)
        theirs.close()
        self.pid, self.model, self._sock = pid, model, ours
        self._lock = threading.Lock()

    def _ask(self, request: dict[str, Any], fds: Sequence[int] = ()) -> dict[str, Any]:
        with self._lock:
            try:
                socket.send_fds(self._sock, [json.dumps(request).encode()], list(fds))
                answer = self._sock.recv(1 << 16)
            except OSError:
                answer = b""
        if not answer:
            raise RuntimeError("the engines' template process has ended: restart the worker")
        out: dict[str, Any] = json.loads(answer)
        return out

    def status(self, pid: int) -> dict[str, Any]:
        return self._ask({"status": pid})

    def spawn(self, config: EngineConfig, kernels: Mapping[str, KernelSource], *, compiler: CompilerSettings,
              cache_dir: str, cpu_seconds: int | None = None) -> HostedEngine:  # fmt: skip
        """A host building ``config`` with ``kernels`` (compiled into ``cache_dir`` already), once it is ready.

        Raises :class:`EngineBuildFailed` when a kernel does not load, :class:`HostDied` when the host dies."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            request = {"config": config.model_dump(mode="json"), "kernels": {s: asdict(k) for s, k in kernels.items()},
                       "compiler": compiler.model_dump(mode="json"), "cache_dir": cache_dir,
                       "cpu_seconds": cpu_seconds}  # fmt: skip
            answer = self._ask(request, [theirs.fileno()])
        finally:
            theirs.close()
        process = EngineProcess(int(answer["pid"]), ours, status=self.status, output=answer.get("output"))
        try:
            process.ready()
        except BaseException:
            process.close()
            raise
        return HostedEngine(self.model, config, process)

    @property
    def alive(self) -> bool:
        try:
            return os.waitpid(self.pid, os.WNOHANG)[0] == 0
        except ChildProcessError:
            return False

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        self._sock.close()


_OUT_DIR: str | None = None  # where this process's hosts print (swept once this process is gone)


def spawn_host(model: Model, config: EngineConfig, spec: Mapping[str, Any],
               env: Mapping[str, str] | None = None, python: str | None = None) -> HostedEngine:  # fmt: skip
    """A host started from a fresh interpreter building ``spec`` (:func:`runtime.sandbox.engine_host.main`; its
    ``config`` is set from ``config``). Its environment is ``env`` (default: this process's ``PATH``, ``HOME``,
    locale, ``PYTHONPATH``, offline and thread settings, and its instruction-set level (:func:`runtime.isa.carried`),
    nothing else: no key), and its interpreter ``python`` (default: this one's; another venv's with evoforge
    installed, say). It inherits no descriptor but
    its socket and the spec's pipe, drops to the sandbox user, and prints to a file of its own, forwarded to
    this process's stderr when it ends."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if env is None:
        env = {k: v for k, v in os.environ.items()
               if k in ("PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
               or k.endswith("_NUM_THREADS")}  # fmt: skip
        env.update(isa.carried())
    global _OUT_DIR
    if _OUT_DIR is None or not os.path.isdir(_OUT_DIR):
        sweep_work_dirs()  # what servers killed earlier left
        _OUT_DIR = owned_work_dir()
    fd, output = tempfile.mkstemp(prefix="engine-host-", suffix=".out", dir=_OUT_DIR)
    try:
        popen = subprocess.Popen(
            [python or sys.executable, "-m", "runtime.sandbox.engine_host", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.PIPE, stdout=fd, stderr=subprocess.STDOUT, env=dict(env),
        )  # fmt: skip
    finally:
        theirs.close()
        os.close(fd)
    try:  # the spec on stdin: an engine task's arguments carry its kernels' sources, too long for argv
        assert popen.stdin is not None
        with popen.stdin:
            popen.stdin.write(json.dumps({**spec, "config": config.model_dump(mode="json")}).encode())
    except BrokenPipeError:
        pass  # the host died at once: ready() below reports it
    process = EngineProcess(popen.pid, ours, popen=popen, output=output, forward_to=2)
    try:
        process.ready()
    except BaseException:
        process.close()
        raise
    return HostedEngine(model, config, process)


def spawn_elite(run: RunReader, candidate_id: str | None, model: Model, *, runs: OpenRun | None = None,
                overrides: Mapping[str, Any] | None = None, python: str | None = None) -> HostedEngine:  # fmt: skip
    """The engine of candidate ``candidate_id`` of the engine run ``run`` (``None``: the default configuration), in
    a host started by :func:`spawn_host`: its kernels compiled there (as the sandbox user) and each loaded only as
    the library the candidate was measured with. Raises as :func:`runtime.engine.elite_task` does, and
    :class:`EngineBuildFailed` when it cannot be built."""
    from runtime.engine import elite_task

    if candidate_id is None:
        config = EngineConfig.model_validate(dict(overrides or {}))
        return spawn_host(model, config, {"model_dir": str(model.path)}, python=python)
    task, config, compiler, cache_dir = elite_task(run, candidate_id, runs=runs, model=model, overrides=overrides)
    stored = run.stored(candidate_id)
    measured = stored.metrics.get("kernel_sha256")  # the libraries it was measured with
    if isinstance(measured, dict):  # a slot whose kernel an override changed has no measured build to hold to
        own = task.engine_config(stored.genome).kernels
        measured = {slot: sha for slot, sha in measured.items() if config.kernels.get(slot) == own.get(slot)}
    spec = {"task": {"name": task.name, "args": task.args.model_dump(mode="json")}, "model_dir": str(model.path),
            "compiler": compiler.model_dump(mode="json"), "cache_dir": cache_dir,
            "kernel_sha256": measured if isinstance(measured, dict) else None}  # fmt: skip
    return spawn_host(model, config, spec, python=python)
