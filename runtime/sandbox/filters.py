"""The system-call filters (seccomp) every candidate's process runs under: compiled here, loaded here.

The BPF programs are compiled by libseccomp (its ``pyseccomp`` bindings) in the worker, once
(:func:`compiled_filters`), and are in force before any candidate code is loaded (a library's constructors
run under them): no sockets, no ptrace or ``process_vm_*``, no signals to any process, no signal-driven I/O
(``F_SETOWN``, ``F_SETSIG``, ``O_ASYNC``), no files opened for writing (so no compile cache can be
replaced), no message queues, System V IPC, page-cache eviction or residency probes (nothing a candidate
leaves behind is a message to the next, but for the timing of reads), no exec, no new process and, with
``threads: 1``, no thread; no page made executable by ``mprotect`` (code cannot be rewritten, e.g. the
process's clock), no memfd and no anonymous mapping as code; once the candidate's code is loaded, no
executable mapping at all (``no_exec``). A forbidden call fails with ``EPERM``.

Loading: a C or CUDA host (``c_host.c``, ``cuda_host.c``) loads the programs it is sent in its first
request (:func:`filter_request`); an engine's host, a Python process, loads them with :func:`load_filter`.
Without libseccomp there is no filter, and every command that runs candidates says so (:data:`UNFILTERED`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import socket
import struct
from typing import Any

__all__ = ["UNFILTERED", "compiled_filters", "filter_available", "filter_request", "load_filter"]

UNFILTERED = ("no system-call filter on this machine (libseccomp or its Python bindings, pyseccomp, do not load): "
              "candidate code runs UNFILTERED, with every system call open to it; fix: apt-get install libseccomp2 "
              "and pip install pyseccomp")  # fmt: skip


def filter_available() -> bool:
    """Whether hosts run under the system-call filter (libseccomp and its bindings are installed)."""
    try:
        import pyseccomp  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def filter_request(before: bytes, after: bytes = b"") -> bytes:
    """The first request a C or CUDA host reads: ``F``, then each BPF program with its u32 length. The host
    loads ``before`` at once, ``after`` (``b""``: none) once the candidate's code is in; two empty programs
    when this machine has no filter."""
    return b"F" + struct.pack("<I", len(before)) + before + struct.pack("<I", len(after)) + after


_PR_SET_SECCOMP = 22
_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_MODE_FILTER = 2


class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_filter(bpf: bytes) -> None:
    """Puts this process (and every thread and process it starts from now on) under a seccomp BPF program."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = _Fprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:  # fmt: skip
        raise OSError(ctypes.get_errno(), "the engine's system-call filter did not load")


_WRITE_FLAGS = (os.O_WRONLY, os.O_RDWR, os.O_CREAT, os.O_TRUNC, os.O_APPEND, getattr(os, "O_TMPFILE", 0))
_DENIED = (
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4",
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_open", "pidfd_getfd",
    "kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_send_signal",
    "execve", "execveat", "fork", "vfork", "creat", "truncate", "unlink", "unlinkat", "rename", "renameat",
    "renameat2", "link", "linkat", "symlink", "symlinkat", "mkdir", "mkdirat", "rmdir", "chmod", "fchmod",
    "fchmodat", "chown", "fchown", "lchown", "fchownat", "mknod", "mknodat", "utimensat", "utimes",
    "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "perf_event_open", "bpf",
    "shmget", "shmat", "personality", "unshare", "setns", "mount", "umount2", "pivot_root", "chroot",
    "keyctl", "add_key", "request_key", "kexec_load", "init_module", "finit_module", "delete_module",
    "memfd_secret", "name_to_handle_at", "open_by_handle_at", "sethostname", "setdomainname",
    "setpriority", "sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr", "ioprio_set",
    "setsid", "setpgid",
    "flock",  # the machine-wide timing lock opens read-only: holding it would stall every worker
    # state that outlives a candidate, or carries a message to the next one
    "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
    "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semtimedop", "semctl", "shmctl", "shmdt",
    # the page cache as a message board: evict a shared file's pages, or see without loading them which are in
    "fadvise64", "preadv2", "pwritev2", "mincore",
)  # fmt: skip
# A chat host serves on the listening socket it was handed: with no socket made or bound, listen and accept
# reach only that one (asyncio calls listen on it again).
_SERVING = ("listen", "accept", "accept4")
_MADV_COLD, _MADV_PAGEOUT = 20, 21  # evict (or age) a file mapping's pages: the page cache as a message board
# Signal-driven I/O: a process that owns a descriptor's signals runs its handler whenever the worker writes
# to it (the worker's requests, its calibration), which no clock of the worker may include.
_F_SETOWN, _F_SETSIG, _F_SETOWN_EX, _O_ASYNC = 8, 10, 15, 0o20000
_FIOASYNC, _FIOSETOWN, _SIOCSPGRP = 0x5452, 0x8901, 0x8902
_PRCTL_DENIED = (4, 0x59616D61, 35)  # PR_SET_DUMPABLE, PR_SET_PTRACER, PR_SET_MM
_CLONE_THREAD = 0x00010000
_PROT_EXEC = 0x4
_MAP_ANONYMOUS = 0x20


def compiled_filters() -> dict[str, bytes] | None:
    """The hosts' system-call filters as BPF programs (see the module docstring), compiled once, in the
    worker: ``one_thread`` and ``threads`` (one per thread policy of a kernel), ``engine`` (an engine's
    host: threads, forked workers and local socket pairs for them), ``chat`` (a chat engine's host: threads,
local socket pairs, and ``listen`` and ``accept`` on the listener it is handed), ``device`` (a CUDA host: ``threads``
    but for ``memfd_create``, which the driver may use), and ``no_exec`` (loaded on top once the
    candidate's code is in). ``None`` without libseccomp."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError):
        return None
    eperm = sc.ERRNO(errno.EPERM)

    def base(*, pairs: bool = False, memfd: bool = False, serves: bool = False) -> Any:
        f = sc.SyscallFilter(defaction=sc.ALLOW)
        for call in _DENIED if memfd else (*_DENIED, "memfd_create"):  # no code written to memory, then mapped
            if serves and call in _SERVING:
                continue
            if pairs and call == "socketpair":
                f.add_rule(eperm, call, sc.Arg(0, sc.NE, socket.AF_UNIX))  # an unnamed local pair reaches no one
                continue
            with contextlib.suppress(Exception):  # a call this architecture does not have
                f.add_rule(eperm, call)
        for call in ("clone3", "openat2"):  # arguments out of a filter's reach: glibc falls back to clone
            with contextlib.suppress(Exception):
                f.add_rule(sc.ERRNO(errno.ENOSYS), call)
        f.add_rule(eperm, "prlimit64", sc.Arg(0, sc.NE, 0))  # no other process's limits
        for advice in (_MADV_COLD, _MADV_PAGEOUT):
            f.add_rule(eperm, "madvise", sc.Arg(2, sc.EQ, advice))
        for cmd in (_F_SETOWN, _F_SETSIG, _F_SETOWN_EX):
            f.add_rule(eperm, "fcntl", sc.Arg(1, sc.EQ, cmd))
        f.add_rule(eperm, "fcntl", sc.Arg(1, sc.EQ, fcntl.F_SETFL), sc.Arg(2, sc.MASKED_EQ, _O_ASYNC, _O_ASYNC))
        for request in (_FIOASYNC, _FIOSETOWN, _SIOCSPGRP):
            f.add_rule(eperm, "ioctl", sc.Arg(1, sc.EQ, request))
        for option in _PRCTL_DENIED:
            f.add_rule(eperm, "prctl", sc.Arg(0, sc.EQ, option))
        for call in ("mprotect", "pkey_mprotect"):  # no page of code made writable, no data made code
            f.add_rule(eperm, call, sc.Arg(2, sc.MASKED_EQ, _PROT_EXEC, _PROT_EXEC))
        f.add_rule(eperm, "mmap", sc.Arg(2, sc.MASKED_EQ, _PROT_EXEC, _PROT_EXEC),
                   sc.Arg(3, sc.MASKED_EQ, _MAP_ANONYMOUS, _MAP_ANONYMOUS))  # fmt: skip
        for flag in filter(None, _WRITE_FLAGS):
            with contextlib.suppress(Exception):
                f.add_rule(eperm, "open", sc.Arg(1, sc.MASKED_EQ, flag, flag))
            f.add_rule(eperm, "openat", sc.Arg(2, sc.MASKED_EQ, flag, flag))
        return f

    one_thread = base()
    one_thread.add_rule(eperm, "clone")
    threads = base()
    threads.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))  # threads, never a process
    engine = base(pairs=True)  # an engine's host: threads and its own worker processes (clone) allowed
    chat = base(pairs=True, serves=True)  # a chat engine's host: threads, its event loop's pair, its listener
    chat.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
    device = base(memfd=True)  # a CUDA host: the driver's threads (its code is ours; the candidate's is device code)
    device.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
    no_exec = sc.SyscallFilter(defaction=sc.ALLOW)  # once the library is in: no executable mapping at all
    no_exec.add_rule(eperm, "mmap", sc.Arg(2, sc.MASKED_EQ, _PROT_EXEC, _PROT_EXEC))
    out = {}
    for key, f in (("one_thread", one_thread), ("threads", threads), ("engine", engine), ("chat", chat),
                   ("device", device), ("no_exec", no_exec)):  # fmt: skip
        r, w = os.pipe()
        try:
            f.export_bpf(os.fdopen(os.dup(w), "wb"))
            os.close(w)
            w = -1
            with os.fdopen(r, "rb") as src:
                r = -1
                out[key] = src.read()
        finally:
            for fd in (r, w):
                if fd >= 0:
                    os.close(fd)
    return out
