"""Process workers: the forward pass in forked child processes, one batch at a time each.

Thread workers share the interpreter, so the Python between numpy calls (a forward pass makes a few
hundred of them) runs one thread at a time; process workers do not contend for the GIL. Children are
forked from the engine once its model and kernels are loaded, so the weights are shared copy-on-write
(never written, they stay shared) and the loaded kernels need no second compile. The engine forks
them before its scheduler's threads start; other threads may exist (a server's event loop, an engine
draining after a swap), so a child runs nothing but the loop below (a pipe, numpy, the kernels) and
never a lock such a thread could have held at the fork (logging, the parent's queues).

The scheduler's worker threads stay in the parent; each hands its batch (token id arrays) to a free
child over a pipe and blocks on the answer, so ordering, bounding and futures are the scheduler's as
with thread workers.
"""

from __future__ import annotations

import multiprocessing
import queue
import signal
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

import numpy as np

__all__ = ["ProcessWorkers", "WorkerDied"]

Forward = Callable[[Sequence[np.ndarray]], np.ndarray]


class WorkerDied(RuntimeError):
    """A worker process exited while running a batch (it crashed or was killed)."""


def _serve(conn: Connection, forward: Forward, blas_threads: int) -> None:
    """The child's loop: a batch in, its embeddings (or the error's traceback) out; ``None`` ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when children stop
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=blas_threads, user_api="blas")
    while True:
        try:
            seqs = conn.recv()
        except EOFError:  # the parent is gone
            return
        if seqs is None:
            return
        try:
            conn.send(("ok", forward(seqs)))
        except Exception:  # noqa: BLE001 - the parent raises it for the batch's requests
            conn.send(("error", traceback.format_exc()))


class ProcessWorkers:
    """``count`` forked children running ``forward``; calling this runs one batch on a free child."""

    def __init__(self, forward: Forward, count: int, *, blas_threads: int = 1) -> None:
        ctx = multiprocessing.get_context("fork")
        self._free: queue.SimpleQueue[tuple[Connection, multiprocessing.process.BaseProcess]] = queue.SimpleQueue()
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._alive = 0
        try:
            for i in range(count):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_serve, args=(child, forward, blas_threads), name=f"evoforge-engine-{i}",
                                   daemon=True)
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
                self._free.put((parent, proc))
                self._alive += 1
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    @property
    def alive(self) -> int:
        """Children still serving (a dead one is not replaced: forking again from a busy server could
        inherit a lock some thread holds; the engine runs on the rest, and with none left every batch fails)."""
        return self._alive

    def __call__(self, seqs: Sequence[np.ndarray]) -> np.ndarray:
        while True:
            try:
                conn, proc = self._free.get(timeout=0.5)
                break
            except queue.Empty:
                if self._alive == 0:
                    raise WorkerDied("every engine worker process has died") from None
        try:
            conn.send(list(seqs))
            kind, value = conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
            proc.join(timeout=1.0)
            self._alive -= 1  # its pipe is not put back: later batches go to the children left
            raise WorkerDied(f"engine worker process {proc.pid} died (exit code {proc.exitcode})") from None
        self._free.put((conn, proc))
        if kind == "error":
            raise RuntimeError(f"the engine worker process failed:\n{value}")
        return value

    def close(self, timeout: float = 5.0) -> None:
        """Asks every child to stop, waits ``timeout`` s, then kills what is left."""
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs.clear()
        self._conns.clear()
