"""The sandbox: how a worker process is started, confined, and killed.

Controller side (:class:`WorkerProcess`): a worker is ``python -m runtime._worker`` in its own process
group (``start_new_session``), with a scrubbed environment, a fresh temporary working directory, its
stdout/stderr going to a log file (a kernel's ``printf`` cannot corrupt the protocol), and a private
socket carrying length-prefixed pickles. Killing a worker SIGKILLs its whole group, repeatedly, until
the group is gone; the controller is made a child subreaper so that orphans of a fork bomb are reaped
here instead of lingering as zombies under an init that may never reap them.

Worker side (:func:`enter_sandbox`): resource limits (RLIMIT_AS, CPU, NOFILE, FSIZE, CORE=0, NPROC),
then, when started as root (who ignores RLIMIT_NPROC), a drop to the unprivileged ``nobody`` user.
After the drop the worker reaches the compile cache only through a directory descriptor it opened
before, so the run directory may live anywhere (even under a private home directory).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pickle
import pwd
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from runtime import safe_pickle
from runtime.result import EvalResult
from runtime.settings import SandboxSettings, TaskSpec

__all__ = [
    "SANDBOX_USER",
    "WorkerDied",
    "WorkerProcess",
    "WorkerProfile",
    "WorkerTimeout",
    "arm_cpu_limit",
    "enter_sandbox",
    "group_members",
    "kill_group",
    "owned_work_dir",
    "preload_modules",
    "private_dir",
    "sandbox_ids",
    "scrubbed_env",
]

SANDBOX_USER = "nobody"
_KEPT_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sandbox_ids() -> tuple[int, int] | None:
    """``(uid, gid)`` a root-started worker drops to; ``None`` when not root (the uid is kept)."""
    if os.geteuid() != 0:
        return None
    pw = pwd.getpwnam(SANDBOX_USER)
    return pw.pw_uid, pw.pw_gid


def scrubbed_env(threads: int, work_dir: str, gpu: str | None = None) -> dict[str, str]:
    """The worker's whole environment: a few basics and thread counts, never the controller's secrets."""
    env = {k: os.environ[k] for k in _KEPT_ENV if k in os.environ}
    env.setdefault("PATH", os.defpath)
    env.setdefault("LANG", "C.UTF-8")
    n = str(threads)
    env.update(
        HOME=work_dir,
        TMPDIR=work_dir,
        OMP_NUM_THREADS=n,
        OPENBLAS_NUM_THREADS=n,
        MKL_NUM_THREADS=n,
        PYTHONPATH=_PACKAGE_ROOT,
        PYTHONDONTWRITEBYTECODE="1",
    )
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def private_dir(path: str | os.PathLike[str]) -> None:
    """Creates ``path`` (and its parents) if needed and makes it its owner's alone (0700): a run's store, config,
    logs and compile cache hold every candidate's source and figures, which the sandbox user must not read
    (the workers reach the compile cache through a descriptor opened before they drop privileges)."""
    os.makedirs(path, exist_ok=True)
    with contextlib.suppress(OSError):  # not ours to change: left as it is
        if os.stat(path).st_uid == os.geteuid():
            os.chmod(path, 0o700)


# --- worker side --------------------------------------------------------------------------------

# Imported before the privilege drop: the interpreter's own files may not be readable by the sandbox
# user (e.g. a pyenv Python under /root), so anything needed later must already be loaded.
PRELOAD = (
    "numpy.random", "numpy.linalg", "numpy.fft", "ctypes", "_ctypes", "subprocess", "tempfile", "shutil",
    "hashlib", "json", "math", "random", "bisect", "heapq", "struct", "pickle", "linecache", "tokenize",
    "errno", "signal", "resource", "fcntl", "platform", "statistics", "decimal", "fractions", "datetime",
    "functools", "itertools", "collections", "contextlib", "dataclasses", "copy", "textwrap", "re",
    "encodings.idna", "encodings.latin_1", "encodings.ascii", "unicodedata", "zlib", "binascii",
)  # fmt: skip


def preload_modules(extra: Iterable[str] = ()) -> None:
    """Imports :data:`PRELOAD` and ``extra`` (those that exist), before a drop of privileges."""
    for name in (*PRELOAD, *extra):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)



def _threads_of(uid: int) -> int:
    """Tasks (threads) whose real uid is ``uid``: what RLIMIT_NPROC counts."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            if int(status["Uid"].split()[0]) == uid:
                total += int(status["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return total


def enter_sandbox(limits: SandboxSettings, ids: tuple[int, int] | None, *, cpu_limit: bool = True) -> None:
    """Sets the resource limits (the CPU time one too, unless ``cpu_limit`` is false: a server's engine runs for
    as long as it serves), then drops to ``ids`` (when given). Irreversible."""
    mem = limits.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
    fsize = limits.max_file_mb * 2**20
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # NPROC counts every thread of the (real) user: allow max_processes more than it runs now.
    uid = ids[0] if ids else os.getuid()
    nproc = _threads_of(uid) + limits.max_processes
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if cpu_limit:
        arm_cpu_limit(limits.cpu_seconds)
    if ids is not None:
        os.setgroups([])
        os.setresgid(ids[1], ids[1], ids[1])
        os.setresuid(ids[0], ids[0], ids[0])


def arm_cpu_limit(seconds: int) -> None:
    """Soft RLIMIT_CPU = CPU used so far + ``seconds`` (SIGXCPU when hit); re-armed per evaluation."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = int(used.ru_utime + used.ru_stime) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = spent + seconds
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


# --- controller side ----------------------------------------------------------------------------


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


def process_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, process group, state) of every process (``/proc/PID/stat``)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(entry)] = (int(fields[1]), int(fields[2]), fields[0])
    return out


def group_members(pgid: int) -> list[int]:
    """Pids (zombies included) whose process group is ``pgid``."""
    return [pid for pid, (_, group, _) in process_table().items() if group == pgid]


def kill_group(pgid: int, leader: subprocess.Popen[Any] | None = None, patience: float = 10.0) -> bool:
    """SIGKILLs process group ``pgid`` until it is gone (a fork loop keeps refilling it), reaping the
    leader and any orphans that were reparented to us. True when the group is gone."""
    end = time.monotonic() + patience
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        if leader is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                leader.wait(timeout=0.01)
        me = os.getpid()
        for pid in group_members(pgid):
            if leader is not None and pid == leader.pid:
                continue
            with contextlib.suppress(ChildProcessError, OSError):
                if _ppid(pid) == me:
                    os.waitpid(pid, os.WNOHANG)
        if time.monotonic() > end:
            return False
        time.sleep(0.002)


def reap_orphans(workers: Iterable[int]) -> None:
    """Reaps this process's children that ended in the process group of one of ``workers`` (a worker leads
    its group), the worker itself excepted: the processes a candidate orphaned, reparented to this process
    (the subreaper) and killed by their worker. No other child is touched (its Popen reaps it). Reads only
    this process's own child lists: cheap enough after every evaluation."""
    groups = set(workers)
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/children") as f:
                found.update(int(p) for p in f.read().split())
    for pid in found - groups:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pgrp = int(f.read().rsplit(")", 1)[1].split()[2])
        except (OSError, ValueError, IndexError):
            continue
        if pgrp in groups:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


_WORK_DIR_PREFIX = "evoforge-worker-"


def owned_work_dir() -> str:
    """A new private temporary directory named for this process (its owner): :func:`sweep_work_dirs` removes it
    once this process is gone, even killed without removing it."""
    return tempfile.mkdtemp(prefix=f"{_WORK_DIR_PREFIX}{os.getpid()}-")


def sweep_work_dirs(tmp: str | None = None) -> list[str]:
    """Removes the workers' working directories in ``tmp`` (default: the temporary directory) whose owner, the
    process that started the worker, is gone without removing them (it was killed); returns them. A directory
    is named for its owner's pid; a live owner's, or one named otherwise, is left alone."""
    removed = []
    tmp = tmp or tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.scandir(tmp):
            owner = entry.name.removeprefix(_WORK_DIR_PREFIX).split("-", 1)[0]
            if not (entry.name.startswith(_WORK_DIR_PREFIX) and owner.isdigit()) or entry.is_symlink():
                continue
            try:
                os.kill(int(owner), 0)
            except ProcessLookupError:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
            except OSError:  # alive, as another user
                continue
    return removed


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
                [sys.executable, "-m", "runtime._worker", str(theirs.fileno())],
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
