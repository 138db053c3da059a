"""A worker process, as the controller starts, talks to and kills it (its own side: :mod:`runtime.sandbox.worker`).

A worker is ``python -m runtime.sandbox.worker`` in its own process group (``start_new_session``), with a
scrubbed environment, a fresh temporary working directory, its stdout/stderr going to a log file (a kernel's
``printf`` cannot corrupt the protocol), and a private socket carrying length-prefixed pickles. Killing a
worker SIGKILLs its whole group, repeatedly, until the group is gone; the controller is made a child
subreaper so that orphans of a fork bomb are reaped here instead of lingering as zombies under an init that
may never reap them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from runtime import safe_pickle
from runtime.result import EvalResult
from runtime.sandbox.limits import sandbox_ids, scrubbed_env
from runtime.sandbox.processes import group_members, kill_group, owned_work_dir
from runtime.settings import SandboxSettings, TaskSpec

__all__ = ["WorkerDied", "WorkerProcess", "WorkerProfile", "WorkerTimeout"]


class WorkerDied(RuntimeError):
    """The worker process ended during an evaluation; ``signal_name`` says how (None: it exited)."""

    def __init__(self, message: str, signal_name: str | None) -> None:
        super().__init__(message)
        self.signal_name = signal_name


class WorkerTimeout(RuntimeError):
    """No answer within the wall-clock limit; the worker's process group has been killed."""


@dataclass(frozen=True)
class WorkerProfile:
    """What a worker is started with. A request needing another profile gets a fresh worker."""

    limits: SandboxSettings
    threads: int
    cache_dir: str
    lock_file: str
    cc: str
    sys_path: tuple[str, ...] = ()
    gpu: str | None = None  # CUDA_VISIBLE_DEVICES of the worker (a CUDA task's worker sees this one GPU)
    preload: tuple[TaskSpec, ...] = field(default=(), compare=False)  # tasks built and primed before the drop


_SUBREAPER_SET = False


def _become_subreaper() -> None:
    global _SUBREAPER_SET
    if _SUBREAPER_SET or not sys.platform.startswith("linux"):
        return
    PR_SET_CHILD_SUBREAPER = 36
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    _SUBREAPER_SET = True


class WorkerProcess:
    """One sandboxed worker: started on construction, answers :meth:`evaluate` until killed.

    The worker dies with the thread that started it (PR_SET_PDEATHSIG), so start it from a thread that
    lives as long as the worker should (the pool's slot threads do).
    """

    def __init__(self, profile: WorkerProfile, *, log_path: str, start_timeout: float = 120.0) -> None:
        _become_subreaper()
        self.profile = profile
        self.log_path = log_path
        ids = sandbox_ids()
        self.work_dir = owned_work_dir()
        os.makedirs(profile.cache_dir, exist_ok=True)
        if ids is not None:
            os.chown(self.work_dir, *ids)
            with contextlib.suppress(OSError):
                if os.stat(profile.cache_dir).st_uid != ids[0]:
                    os.chown(profile.cache_dir, *ids)
        with contextlib.suppress(OSError):  # keep each log under RLIMIT_FSIZE: rotate at spawn
            if os.path.getsize(log_path) > 8 * 2**20:
                os.replace(log_path, log_path + ".1")
        ours, theirs = socket.socketpair()
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "runtime.sandbox.worker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.work_dir,
                env=scrubbed_env(profile.threads, self.work_dir, profile.gpu),
                start_new_session=True,
            )
        theirs.close()
        self.pid = self.proc.pid
        self._conn = Connection(ours.detach())
        self.hardware: dict[str, Any] | None = None
        try:
            self._conn.send({"profile": profile, "ids": ids})
            ready = self._receive(start_timeout)
        except (WorkerDied, WorkerTimeout) as exc:
            raise RuntimeError(f"worker failed to start ({exc}); see {log_path}") from None
        self.hardware = ready.get("hardware")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def evaluate(self, request: Any, timeout: float) -> EvalResult:
        """Sends ``request``; the worker's result, or WorkerTimeout / WorkerDied (the worker is then dead)."""
        try:
            self._conn.send(request)
        except OSError:
            pass  # it died; _receive reports how
        return self._receive(timeout)

    def _receive(self, timeout: float) -> Any:
        try:
            ready = self._conn.poll(timeout)
            if ready:
                return safe_pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            pass
        except pickle.UnpicklingError as exc:  # what no worker of ours sends: it is killed, as a dead one
            self.kill()
            raise WorkerDied(f"the worker broke the protocol ({exc})", None) from None
        else:
            self.kill()
            raise WorkerTimeout(f"no result within the wall-clock limit of {timeout:g} s")
        self.kill()
        rc = self.proc.returncode
        if rc is not None and rc < 0:
            name = signal.Signals(-rc).name
            raise WorkerDied(f"killed by {name} ({signal.strsignal(-rc)})", name)
        raise WorkerDied(f"the worker exited with code {rc}", None)

    def log_size(self) -> int:
        try:
            return os.path.getsize(self.log_path)
        except OSError:
            return 0

    def log_since(self, offset: int, limit: int = 2000) -> str:
        """What the worker (and its kernels) printed since ``offset``, trimmed to the last ``limit`` chars."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:
            return ""
        return data[-limit:].decode(errors="replace")

    def kill(self) -> None:
        """Kills the worker's whole process group and removes its working directory."""
        if self.proc.returncode is None or group_members(self.pid):
            kill_group(self.pid, self.proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._conn.close()
        shutil.rmtree(self.work_dir, ignore_errors=True)
