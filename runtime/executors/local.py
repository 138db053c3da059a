"""``LocalPool``: the default :class:`~runtime.executors.base.Executor`, sandboxed worker processes on this machine.

One thread per worker slot takes a request, makes sure its worker is alive (spawning one lazily, or a
fresh one when the request needs another profile), sends the request and waits up to the wall-clock
limit. A timeout kills the worker's process group; a dead worker (segfault, SIGXCPU, ...) becomes a
``crash`` (or ``timeout``) result. Either way the slot starts a new worker for its next request, so a
respawn delays only that slot, and the search goes on.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from runtime.backends import Backend, backend_for
from runtime.executors.base import EvalRequest, Executor
from runtime.result import EvalResult, Status
from runtime.sandbox.processes import reap_orphans, sweep_work_dirs
from runtime.sandbox.worker_process import WorkerDied, WorkerProcess, WorkerProfile, WorkerTimeout
from runtime.task import TaskLoadError, load_task_class
from runtime.toolchain.cc import compiler_version

__all__ = ["LocalPool", "PoolEvent"]

PoolEvent = Callable[[str, dict[str, Any]], None]
"""``on_event(kind, info)``: ``worker_started``, ``worker_timeout``, ``worker_died`` (called from pool threads)."""


def request_backend(request: EvalRequest) -> Backend | None:
    """The backend of the request's task; ``None`` when the task cannot be loaded here (the worker reports it,
    with the request)."""
    try:
        return backend_for(load_task_class(request.task.name))
    except TaskLoadError:
        return None


def _gpu(request: EvalRequest, slot: int) -> str | None:
    """The GPU the worker in ``slot`` sees (the backend decides; ``None`` for CPU backends)."""
    backend = request_backend(request)
    return backend.worker_gpu(slot) if backend is not None else None


def _profile(request: EvalRequest, slot: int = 0) -> WorkerProfile:
    settings = request.settings
    return WorkerProfile(
        limits=settings.sandbox,
        threads=int(request.task.args.get("threads", 1)),
        cache_dir=os.path.abspath(request.cache_dir),
        lock_file=settings.timing.lock_file,
        cc=settings.compiler.cc,
        sys_path=tuple(os.path.abspath(p) for p in request.sys_path),
        preload=(request.task,),
        gpu=_gpu(request, slot),
    )


class LocalPool(Executor):
    """Evaluates requests in ``workers`` sandboxed processes; worker logs go to ``log_dir``."""

    def __init__(self, *, workers: int = 1, log_dir: str | None = None, on_event: PoolEvent | None = None) -> None:
        if workers < 1:
            raise ValueError("a pool needs at least one worker")
        sweep_work_dirs()  # what workers of a killed process left behind
        self.workers = workers
        self._own_log_dir = log_dir is None  # a temporary one, removed on close
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="evoforge-logs-")
        os.makedirs(self.log_dir, exist_ok=True)
        self._on_event = on_event
        self._requests: queue.Queue[EvalRequest | None] = queue.Queue()
        self._results: queue.Queue[tuple[EvalRequest, EvalResult]] = queue.Queue()
        self._procs: list[WorkerProcess | None] = [None] * workers
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closed = False
        self._threads = [
            threading.Thread(target=self._serve, args=(slot,), name=f"evoforge-pool-{slot}", daemon=True)
            for slot in range(workers)
        ]
        for t in self._threads:
            t.start()

    # --- Executor -------------------------------------------------------------------------------

    def submit(self, request: EvalRequest) -> None:
        """Queues ``request``. Raises here, in the controller: CompilerNotFound if the compiler is missing,
        UnsupportedStage if the task's backend does not offer the requested stage."""
        if self._closed:
            raise RuntimeError("the pool is closed")
        compiler_version(request.settings.compiler.cc)
        backend = request_backend(request)
        if backend is not None:
            backend.require(request.stages)
        with self._lock:
            self._in_flight += 1
        self._requests.put(request)

    def next_result(self, timeout: float | None = None) -> tuple[EvalRequest, EvalResult] | None:
        try:
            item = self._results.get(timeout=timeout)
        except queue.Empty:
            return None
        with self._lock:
            self._in_flight -= 1
        return item

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    @property
    def slots(self) -> int:
        """One per worker."""
        return self.workers

    def close(self) -> None:
        """Stops the slots and kills every worker's process group."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._requests.put(None)
        self._kill_all()  # unblocks slots waiting on a worker
        for t in self._threads:
            t.join(timeout=15)
        self._kill_all()  # a slot may have been starting one meanwhile
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def _kill_all(self) -> None:
        for slot, proc in enumerate(self._procs):
            if proc is not None:
                proc.kill()
                self._procs[slot] = None

    def worker_pids(self) -> list[int]:
        """Pids (= process group ids) of the live workers."""
        return [p.pid for p in self._procs if p is not None and p.alive]

    # --- one slot -------------------------------------------------------------------------------

    def _serve(self, slot: int) -> None:
        while True:
            request = self._requests.get()
            if request is None or self._closed:
                return
            try:
                result = self._evaluate(slot, request)
            except Exception as exc:  # noqa: BLE001 - a slot must never die with a request in flight
                result = EvalResult(status=Status.INVALID, error=f"internal error in the pool: {exc!r}")
            self._results.put((request, result))

    def _event(self, kind: str, **info: Any) -> None:
        if self._on_event is not None:
            try:
                self._on_event(kind, info)
            except Exception as exc:  # noqa: BLE001 - a progress callback cannot stop evaluation
                print(f"evoforge: on_event({kind!r}) failed: {exc!r}", file=sys.stderr)

    def _worker(self, slot: int, profile: WorkerProfile) -> WorkerProcess:
        proc = self._procs[slot]
        if proc is not None and proc.alive and proc.profile == profile:
            return proc
        if proc is not None:
            proc.kill()
        self._procs[slot] = None
        proc = WorkerProcess(profile, log_path=os.path.join(self.log_dir, f"worker-{slot}.log"))
        self._procs[slot] = proc
        self._event("worker_started", slot=slot, pid=proc.pid)
        return proc

    def _evaluate(self, slot: int, request: EvalRequest) -> EvalResult:
        try:
            proc = self._worker(slot, _profile(request, slot))
        except Exception as exc:  # noqa: BLE001
            return EvalResult(status=Status.INVALID, error=f"cannot start a worker: {exc}")
        limit = request.settings.sandbox.timeout
        log_from = proc.log_size()
        t0 = time.perf_counter()
        try:
            result = proc.evaluate(request, timeout=limit)
            reap_orphans(p.pid for p in self._procs if p is not None)  # what candidates orphaned, killed since
            return result
        except WorkerTimeout as exc:
            self._procs[slot] = None
            self._event("worker_timeout", slot=slot, pid=proc.pid, key=request.key)
            status, error = Status.TIMEOUT, str(exc)
        except WorkerDied as exc:
            self._procs[slot] = None
            self._event("worker_died", slot=slot, pid=proc.pid, key=request.key, signal=exc.signal_name)
            if exc.signal_name == "SIGXCPU":
                status, error = Status.TIMEOUT, f"CPU time limit of {request.settings.sandbox.cpu_seconds} s hit"
            else:
                status, error = Status.CRASH, str(exc)
            printed = proc.log_since(log_from).strip()
            if printed:
                error += f"\nlast output:\n{printed}"
        total = time.perf_counter() - t0
        return EvalResult(status=status, error=error, timings={"total_s": total}, hardware=proc.hardware)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
