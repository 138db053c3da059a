"""Candidate hosts: the only processes candidate code runs in, and the clean template they are forked from.

A worker holds everything that decides fitness: inputs, expected outputs, the reference's and a rival's
results, the clock. Candidate code never runs in it. Each candidate gets a host process of its own,
forked from a :class:`HostTemplate` that the worker starts before its first evaluation (so a host
inherits no memory of any evaluation) and never reused: it exits with its candidate.

What a host can and cannot do:

- It sees the candidate's inputs and outputs through shared memory (sealed memfd arenas), nothing
  else of the worker. The worker, the template and every host are not dumpable: no process of the same
  user may read their memory through ``/proc/PID/mem``, trace them or ``process_vm_readv`` them.
- It is timed from outside: the worker reads its clock around each request, less the calibrated cost
  of one round trip, and cross-checks against the CPU time the kernel accounts to the host.
- A system-call filter (seccomp, through libseccomp) is in force before the candidate's library is
  loaded (its constructors run under it): no sockets, no ptrace or ``process_vm_*``, no signals to any
  process, no files opened for writing (so no compile cache can be replaced), no exec, no new process
  and, with ``threads: 1``, no thread; no page made executable by ``mprotect`` (code cannot be rewritten,
  e.g. the process's clock) nor mapped anonymously as code; once the library is loaded, no executable
  mapping at all. A forbidden call fails with ``EPERM``.

Protocol over a ``SOCK_SEQPACKET`` pair, one answer per request:

- ``M``, then (id, size) with a memfd: map a shared arena;
- ``B`` + pickled argument list: bind the kernel to these arguments, answer ``h`` + the handle;
- ``K`` + handles: call each in turn, answer ``d`` (handle 0 calls nothing: the round trip alone);
- ``Q``: exit. The host's first message is ``ok``, or ``E`` + why its library cannot be loaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import gc
import mmap
import os
import pickle
import signal
import socket
import statistics
import struct
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "CandidateHost",
    "HostDied",
    "HostTemplate",
    "compiled_filters",
    "filter_available",
    "load_filter",
    "make_undumpable",
]

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_CPUCLOCK_SCHED = 2
_ID = struct.Struct("<I")
_MAP = struct.Struct("<IQ")
_ARENA_BYTES = 16 << 20  # virtual: pages cost memory once written
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def make_undumpable() -> None:
    """No process of the same user may read this one's memory or trace it from now on."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def filter_available() -> bool:
    """Whether hosts run under the system-call filter (libseccomp and its bindings are installed)."""
    try:
        import pyseccomp  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


class HostDied(RuntimeError):
    """The host process ended while the worker waited on it; ``signal_name`` says how (``None``: it exited)."""

    def __init__(self, message: str, signal_name: str | None) -> None:
        super().__init__(message)
        self.signal_name = signal_name


# --- the template -----------------------------------------------------------------------------------


class HostTemplate:
    """A clean process, forked once, that forks a :class:`CandidateHost` per candidate on request.

    Start it before any evaluation: a host is a copy of the template's memory, so nothing of an
    evaluation must ever have been in it. It reaps the hosts it forked and reports how each ended.
    """

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the template: never returns
            ours.close()
            _run_child(_template_main, theirs)
        theirs.close()
        self.pid, self._sock = pid, ours

    def alive(self) -> bool:
        try:
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:
            return False

    def host(self, path: str, name: str, *, threads: int = 1, cpu_seconds: int | None = None) -> CandidateHost:
        """A new host with the kernel ``name`` of the library at ``path`` loaded.

        Raises :class:`runtime.toolchain.CompileError` when the library does not define ``name``, and
        :class:`HostDied` when the host dies loading it (a library constructor that crashes, say).
        """
        from runtime.toolchain.cc import CompileError

        lib = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # the host reaches the library through this only
        try:
            order = pickle.dumps({"name": name, "threads": threads, "cpu_seconds": cpu_seconds})
            socket.send_fds(self._sock, [b"S" + order], [lib])
        finally:
            os.close(lib)
        msg, fds, _, _ = socket.recv_fds(self._sock, 64, 1)
        if msg[:1] != b"p" or len(fds) != 1:
            raise RuntimeError(f"the host template answered {msg[:80]!r}")
        host = CandidateHost(self, _ID.unpack(msg[1:5])[0], socket.socket(fileno=fds[0]), threads)
        ready = host.receive()
        if ready != b"ok":
            host.close()
            raise CompileError(ready[1:].decode(errors="replace"))
        return host

    def forget(self, pid: int) -> None:
        """The host ``pid`` was killed: the template reaps it when it can; nobody waits."""
        self._sock.send(b"X" + _ID.pack(pid))

    def reap(self, pid: int) -> int:
        """Waits for the host ``pid`` to end; its wait status."""
        self._sock.send(b"W" + _ID.pack(pid))
        answer = self._sock.recv(64)
        return struct.unpack("<i", answer[1:5])[0] if answer[:1] == b"w" else 0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def _run_child(main: Any, *args: Any, **kwargs: Any) -> None:
    """A forked child's whole life: whatever happens, it never returns into its parent's code."""
    code = 0
    try:
        main(*args, **kwargs)
    except BaseException:  # noqa: BLE001 - the child must exit here, with the trace in the log
        import traceback

        traceback.print_exc()
        code = 70
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _close_except(*keep: int) -> None:
    """Closes every descriptor but stdin, stdout, stderr (the log) and ``keep``."""
    low = 3
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 16)


def _template_main(sock: socket.socket) -> None:
    libc = ctypes.CDLL(None)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _close_except(sock.fileno())  # the worker's connection, the timing lock, the compile cache
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    filters = compiled_filters()  # once, here: a host only loads them
    if filters is None:
        print("evoforge: libseccomp not found: candidate processes run without a system-call filter "
              "(fix: apt-get install libseccomp2)", file=sys.stderr, flush=True)  # fmt: skip
    forgotten: set[int] = set()
    gc.freeze()  # a host's collector never walks (so never copies) the pages it shares with the template
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 1)
        except OSError:
            return
        if not msg:
            return
        for pid in list(forgotten):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    continue
            forgotten.discard(pid)
        if msg[:1] == b"S":
            order = pickle.loads(msg[1:])
            host_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            pid = os.fork()
            if pid == 0:
                sock.close()
                worker_end.close()
                _run_child(_host_main, host_end, fds[0], filters, **order)
            host_end.close()
            os.close(fds[0])
            socket.send_fds(sock, [b"p" + _ID.pack(pid)], [worker_end.fileno()])
            worker_end.close()
        elif msg[:1] == b"X":  # a host the worker killed: reaped later, nobody waits for it
            forgotten.add(_ID.unpack(msg[1:5])[0])
        elif msg[:1] == b"W":
            pid = _ID.unpack(msg[1:5])[0]
            try:
                _, status = os.waitpid(pid, 0)
            except ChildProcessError:
                status = 0
            sock.send(b"w" + struct.pack("<i", status))


# --- a host, seen from the worker ---------------------------------------------------------------------


class CandidateHost:
    """One candidate's process, as the worker drives it: shared buffers, bound calls, timed requests."""

    def __init__(self, template: HostTemplate, pid: int, sock: socket.socket, threads: int) -> None:
        self.pid, self.threads_allowed = pid, threads
        self._template, self._sock = template, sock
        self._arenas: list[tuple[mmap.mmap, np.ndarray]] = []  # arena i has id i + 1 in the host
        self._current = 0  # the arena allocations come from
        self._used = 0  # bytes taken from it
        self._closed = False
        self.round_trip_s = 0.0

    # --- buffers --------------------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of shared memory (64-byte aligned, uint8), taken from the current arena (the next one, or
        a new one, when it is full). Freed together, by :meth:`release`."""
        size = (max(nbytes, 1) + 63) // 64 * 64
        while self._current < len(self._arenas) and self._used + size > self._arenas[self._current][1].size:
            self._current += 1
            self._used = 0
        if self._current == len(self._arenas):
            self._map(max(size, _ARENA_BYTES))
        view = self._arenas[self._current][1]
        block = view[self._used : self._used + nbytes]
        self._used += size
        return block

    def mark(self) -> tuple[int, int]:
        """Where allocation stands now, for :meth:`release`."""
        return self._current, self._used

    def release(self, mark: tuple[int, int]) -> None:
        """Frees everything allocated since ``mark``, for reuse (arenas stay mapped until the host ends)."""
        self._current, self._used = mark

    def _map(self, nbytes: int) -> None:
        fd = os.memfd_create("evoforge-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)  # the host cannot shrink it under the worker (SIGBUS)
            mm = mmap.mmap(fd, nbytes)
            buf_id = len(self._arenas) + 1
            try:
                self._sock.send(b"M")  # the next message carries the arena's descriptor
                socket.send_fds(self._sock, [_MAP.pack(buf_id, nbytes)], [fd])
            except OSError:
                self._died(b"")
        finally:
            os.close(fd)
        self._expect(b"k")
        self._arenas.append((mm, np.frombuffer(mm, np.uint8)))
        self._used = 0

    def _locate(self, array: np.ndarray) -> tuple[int, int]:
        addr = array.ctypes.data
        for i, (_, view) in enumerate(self._arenas):
            base = view.ctypes.data
            if base <= addr < base + max(view.size, 1):
                return i + 1, addr - base
        raise ValueError("the array is not in a shared buffer of this host")

    # --- calls ----------------------------------------------------------------------------------------

    def bind(self, args: Sequence[Any]) -> int:
        """A handle calling the kernel on ``args`` (ints, floats, arrays in this host's buffers)."""
        spec = [("p", *self._locate(a)) if isinstance(a, np.ndarray) else a for a in args]
        answer = self._request(b"B" + pickle.dumps(spec))
        if answer[:1] != b"h":
            raise TypeError(answer[1:].decode(errors="replace"))
        return _ID.unpack(answer[1:5])[0]

    def call_many(self, handles: Sequence[int]) -> tuple[float, int]:
        """Runs the kernel once per handle, in turn, in one request. Returns the seconds all took by this
        process's clock less one calibrated round trip, and the CPU nanoseconds the host used meanwhile."""
        msg = b"K" + b"".join(_ID.pack(h) for h in handles)
        cpu = self.cpu_ns
        c0 = cpu()
        t0 = time.perf_counter_ns()
        self._sock.send(msg)
        answer = self._sock.recv(64)
        t1 = time.perf_counter_ns()
        used = cpu() - c0
        if answer != b"d":
            self._died(answer)
        return max((t1 - t0) * 1e-9 - self.round_trip_s, 1e-9 * len(handles)), used

    def calibrate(self, n: int = 32) -> float:
        """Measures the round trip of a request that calls nothing (median of ``n``), subtracted from every
        timed request from now on: call it where the calls will be timed (pinned, under the lock)."""
        samples = []
        msg = b"K" + _ID.pack(0)
        for _ in range(n):
            t0 = time.perf_counter_ns()
            self._sock.send(msg)
            if self._sock.recv(64) != b"d":
                self._died(b"")
            samples.append((time.perf_counter_ns() - t0) * 1e-9)
        self.round_trip_s = statistics.median(samples)
        return self.round_trip_s

    # --- what the host does besides -------------------------------------------------------------------

    def cpu_ns(self) -> int:
        """CPU time (ns) the kernel accounts to every thread of the host so far (its own clock cannot lie)."""
        try:
            return time.clock_gettime_ns((~self.pid << 3) | _CPUCLOCK_SCHED)
        except OSError:
            self._died(b"")
            raise

    def threads(self) -> int:
        """Threads the host runs now."""
        try:
            return len(os.listdir(f"/proc/{self.pid}/task"))
        except OSError:
            return 0

    def children(self) -> list[int]:
        """Processes the host started that still run."""
        found: list[int] = []
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{self.pid}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{self.pid}/task/{tid}/children") as f:
                    found += [int(p) for p in f.read().split()]
        return found

    def close(self) -> None:
        """Ends the host (killed: it holds nothing worth a goodbye) and frees the shared memory."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self._template.forget(self.pid)
        self._sock.close()
        for mm, _ in self._arenas:
            with contextlib.suppress(BufferError):
                mm.close()
        self._arenas.clear()

    def __enter__(self) -> CandidateHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ------------------------------------------------------------------------------------

    def receive(self) -> bytes:
        try:
            answer = self._sock.recv(65536)
        except OSError:
            answer = b""
        if not answer:
            self._died(answer)
        return answer

    def _request(self, msg: bytes, expect: bytes | None = None) -> bytes:
        try:
            self._sock.send(msg)
        except OSError:
            self._died(b"")
        answer = self.receive()
        if expect is not None and answer != expect:
            raise RuntimeError(f"the candidate's process answered {answer[:80]!r}")
        return answer

    def _expect(self, what: bytes) -> None:
        answer = self.receive()
        if answer != what:
            raise RuntimeError(f"the candidate's process answered {answer[:80]!r}")

    def _died(self, answer: bytes) -> None:
        """Raises :class:`HostDied` with how the host ended (reaped by the template)."""
        if answer:
            raise RuntimeError(f"the candidate's process answered {answer[:80]!r}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)  # a host that closed its socket but lives on
        try:
            status = self._template.reap(self.pid)
        except OSError:
            status = 0
        self._closed = True
        self._sock.close()
        if os.WIFSIGNALED(status):
            name = signal.Signals(os.WTERMSIG(status)).name
            raise HostDied(f"the kernel's process was killed by {name}", name)
        raise HostDied(f"the kernel's process exited with code {os.WEXITSTATUS(status)}", None)


# --- a host, from the inside ----------------------------------------------------------------------------


def _host_main(sock: socket.socket, lib: int, filters: dict[str, bytes] | None, name: str, threads: int,
               cpu_seconds: int | None) -> None:  # fmt: skip
    """Only the kernel's library, its socket and the log (stdout, stderr) are open here."""
    gc.disable()  # short-lived: what it allocates goes with it
    libc = ctypes.CDLL(None)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _close_except(sock.fileno(), lib)
    os.environ["OMP_WAIT_POLICY"] = "passive"  # an OpenMP pool sleeps between calls, it does not spin
    os.environ["OMP_NUM_THREADS"] = str(max(1, threads))
    if cpu_seconds is not None:
        from runtime.sandbox import arm_cpu_limit

        arm_cpu_limit(cpu_seconds)
    from runtime.toolchain.cc import CompileError, load_kernel

    if filters is not None:  # before the library: its constructors are candidate code too
        load_filter(filters["one_thread" if threads <= 1 else "threads"])
    try:
        kernel = load_kernel(f"/proc/self/fd/{lib}", name)
    except CompileError as exc:
        sock.send(b"E" + str(exc).encode()[:60000])
        return
    os.close(lib)
    if filters is not None:
        load_filter(filters["no_exec"])  # from now on no page becomes executable: loaded code cannot be rewritten
    sock.send(b"ok")
    _serve(sock, kernel, libc)


def _serve(sock: socket.socket, kernel: Any, libc: Any) -> None:
    maps: dict[int, tuple[mmap.mmap, np.ndarray]] = {}
    calls: dict[int, Any] = {0: lambda: None}
    recv, send = sock.recv, sock.send
    while True:
        msg = recv(65536)
        if not msg or msg[:1] == b"Q":
            return
        op = msg[:1]
        if op == b"K":
            for (h,) in _ID.iter_unpack(msg[1:]):
                calls[h]()
            if len(msg) > 5 or msg[1:5] != b"\0\0\0\0":
                libc.fflush(None)  # what the kernel printed reaches the log now
            send(b"d")
        elif op == b"M":
            msg, fds, _, _ = socket.recv_fds(sock, 64, 1)
            buf_id, size = _MAP.unpack(msg[:12])
            mm = mmap.mmap(fds[0], size) if fds else None
            for fd in fds:
                os.close(fd)
            if mm is None:
                send(b"e" + b"no arena descriptor")
                continue
            maps[buf_id] = (mm, np.frombuffer(mm, np.uint8))
            send(b"k")
        elif op == b"B":
            try:
                spec = pickle.loads(msg[1:])
                args = [maps[a[1]][1][a[2] :] if isinstance(a, tuple) and a[:1] == ("p",) else a for a in spec]
                handle = len(calls)
                calls[handle] = kernel.bind(args)
                send(b"h" + _ID.pack(handle))
            except Exception as exc:  # noqa: BLE001 - a task's bad argument list: the worker reports it
                send(b"e" + repr(exc).encode()[:1000])


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
)  # fmt: skip
_PRCTL_DENIED = (4, 0x59616D61, 35)  # PR_SET_DUMPABLE, PR_SET_PTRACER, PR_SET_MM
_CLONE_THREAD = 0x00010000
_PROT_EXEC = 0x4
_MAP_ANONYMOUS = 0x20
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def compiled_filters() -> dict[str, bytes] | None:
    """The hosts' system-call filters as BPF programs (see the module docstring), compiled once, in the
    template: ``one_thread`` and ``threads`` (one per thread policy), and ``no_exec`` (loaded on top once
    the candidate's library is in). ``None`` without libseccomp."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError):
        return None
    eperm = sc.ERRNO(errno.EPERM)

    def base() -> Any:
        f = sc.SyscallFilter(defaction=sc.ALLOW)
        for call in _DENIED:
            with contextlib.suppress(Exception):  # a call this architecture does not have
                f.add_rule(eperm, call)
        for call in ("clone3", "openat2"):  # arguments out of a filter's reach: glibc falls back to clone
            with contextlib.suppress(Exception):
                f.add_rule(sc.ERRNO(errno.ENOSYS), call)
        f.add_rule(eperm, "prlimit64", sc.Arg(0, sc.NE, 0))  # no other process's limits
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
    no_exec = sc.SyscallFilter(defaction=sc.ALLOW)  # once the library is in: no executable mapping at all
    no_exec.add_rule(eperm, "mmap", sc.Arg(2, sc.MASKED_EQ, _PROT_EXEC, _PROT_EXEC))
    out = {}
    for key, f in (("one_thread", one_thread), ("threads", threads), ("no_exec", no_exec)):
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


def load_filter(program: bytes) -> None:
    """Puts this process (every thread it starts from now on too) under the BPF ``program``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    prog = _SockFprog(len(program) // 8, program)
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
