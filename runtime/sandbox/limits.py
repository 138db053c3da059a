"""What a worker (and a server's engine host) applies to itself before any candidate is near: the limits.

:func:`enter_sandbox`: resource limits (RLIMIT_AS, CPU, NOFILE, FSIZE, CORE=0, NPROC), then, when started
as root (who ignores RLIMIT_NPROC), a drop to the unprivileged ``nobody`` user. After the drop the worker
reaches the compile cache only through a directory descriptor it opened before, so the run directory may
live anywhere (even under a private home directory). Besides: the worker's scrubbed environment
(:func:`scrubbed_env`), the modules imported before the drop (:func:`preload_modules`), run files made their
owner's alone (:func:`private_dir`), and :func:`make_undumpable`.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pwd
import resource
from collections.abc import Iterable, Iterator

from runtime import isa
from runtime.settings import SandboxSettings

__all__ = [
    "PRELOAD",
    "SANDBOX_USER",
    "arm_cpu_limit",
    "enter_sandbox",
    "make_undumpable",
    "preload_modules",
    "private_dir",
    "sandbox_ids",
    "scrubbed_env",
]

SANDBOX_USER = "nobody"
_KEPT_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above runtime/


def sandbox_ids() -> tuple[int, int] | None:
    """``(uid, gid)`` a root-started worker drops to; ``None`` when not root (the uid is kept)."""
    if os.geteuid() != 0:
        return None
    pw = pwd.getpwnam(SANDBOX_USER)
    return pw.pw_uid, pw.pw_gid


def scrubbed_env(threads: int, work_dir: str, gpu: str | None = None) -> dict[str, str]:
    """The worker's whole environment: a few basics, thread counts and the instruction-set level in force
    (:func:`runtime.isa.carried`: candidates compile, and libraries run, at it), never the controller's secrets."""
    env = {k: os.environ[k] for k in _KEPT_ENV if k in os.environ}
    env.update(isa.carried())
    env.setdefault("PATH", os.defpath)
    env.setdefault("LANG", "C.UTF-8")
    n = str(threads)
    env.update(
        HOME=work_dir,
        TMPDIR=work_dir,
        OMP_NUM_THREADS=n,
        OPENBLAS_NUM_THREADS=n,
        # OpenBLAS's threads spin for ~2^28 cycles after each call: after the reference, they took the cores
        # from the candidate timed next (2-3x slower calls). 2^4 cycles: they sleep at once.
        OPENBLAS_THREAD_TIMEOUT="4",
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
    # Buffers shared with candidate hosts are memfd files, which RLIMIT_AS bounds already: the hard limit leaves
    # them that room (file_room), and every candidate host lowers its hard limit to the soft one as it starts.
    fsize = limits.max_file_mb * 2**20
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, max(fsize, mem)))
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


_PR_SET_DUMPABLE = 4


def make_undumpable() -> None:
    """No process of the same user may read this one's memory or trace it from now on."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


@contextlib.contextmanager
def file_room(nbytes: int) -> Iterator[None]:
    """Lets this process (a worker) make a file of ``nbytes`` (a buffer it shares with a host) where its hard
    file-size limit allows, and puts the soft limit back afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft == resource.RLIM_INFINITY or nbytes <= soft:
        yield
        return
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard if hard == resource.RLIM_INFINITY else min(hard, nbytes), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def lock_file_size() -> None:
    """Makes the soft file-size limit hard, for good: a candidate host (forked from a worker) calls it first."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, soft))
