"""Candidate hosts: the only processes candidate code runs in.

A worker holds everything that decides fitness: inputs, expected outputs, the reference's and a rival's
results, the clock. Candidate code never runs in it. Each candidate gets a host of its own, a fresh
executable (``runtime/host.c``, built once per compiler into the compile cache) that inherits none of
the worker's memory, loads the candidate's library, and calls its kernel on shared buffers when told
to; it is never reused (it exits with its candidate).

What a host can and cannot do:

- It sees the candidate's inputs and outputs through shared memory (sealed memfd arenas), nothing
  else of the worker. The worker and every host are not dumpable: no process of the same user may
  read their memory through ``/proc/PID/mem``, trace them or ``process_vm_readv`` them.
- It holds no descriptor but its socket, its library (until loaded) and a file of its own for what it
  prints: it closes everything else on start, so it never reaches the worker's channel to the
  controller or the worker's log. Where the kernel has Landlock, it reads files only beneath the
  system's own directories (``/usr``, ``/lib*``, ``/etc``, ``/proc``, ``/sys``, ``/dev``): no run
  directory, no worker's working directory, no other candidate's source or output.
- It is timed from outside: the worker reads its clock around each request, less the cost of one
  round trip measured on a calibration host that never loads candidate code, and cross-checks
  against the CPU time the kernel accounts to the host.
- A system-call filter (seccomp; the BPF programs are compiled by libseccomp in the worker) is in
  force before the candidate's library is loaded (its constructors run under it): no sockets, no
  ptrace or ``process_vm_*``, no signals to any process, no signal-driven I/O (``F_SETOWN``,
  ``F_SETSIG``, ``O_ASYNC``), no files opened for writing (so no compile cache can be replaced), no
  message queues, System V IPC, page-cache eviction or residency probes (nothing a candidate leaves
  behind is a message to the next, but for the timing of reads), no exec, no new
  process and, with ``threads: 1``, no thread; no page made executable by ``mprotect`` (code cannot be
  rewritten, e.g. the process's clock), no memfd and no anonymous mapping as code; once the library
  is loaded, no executable mapping at all. A forbidden call fails with ``EPERM``.

The protocol is in ``runtime/host.c``. A kernel's arguments are ints, floats and pointers into the
arenas: up to 8 floats and 16 ints or pointers.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import shutil
import signal
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from runtime.sandbox import owned_work_dir

__all__ = ["CandidateHost", "HostDied", "HostLauncher", "build_host", "compiled_filters", "encode_args",
           "confine_files", "filter_available", "forward_output", "make_undumpable", "start_host_process",
           "SYSTEM_ROOTS", "UNFILTERED"]  # fmt: skip

_PR_SET_DUMPABLE = 4
_CPUCLOCK_SCHED = 2
_ID = struct.Struct("<I")
_MAP = struct.Struct("<IQ")
_ARENA_BYTES = 16 << 20  # virtual: pages cost memory once written
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def make_undumpable() -> None:
    """No process of the same user may read this one's memory or trace it from now on."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


UNFILTERED = ("no system-call filter on this machine (libseccomp or its Python bindings, pyseccomp, do not load): "
              "candidate code runs UNFILTERED, with every system call open to it; fix: apt-get install libseccomp2 "
              "and pip install pyseccomp")


SYSTEM_ROOTS = ("/usr", "/lib", "/lib64", "/lib32", "/etc", "/proc", "/sys", "/dev")
"""What a candidate's process may read beneath (besides what its caller adds): the system's own directories."""
_LANDLOCK_READ = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read a file, read a directory


def confine_files(roots: Iterable[str] = SYSTEM_ROOTS, fds: Iterable[int] = ()) -> bool:
    """Where the kernel has Landlock, restricts this process (and what it starts) to reading files beneath
    ``roots`` and the directories open at ``fds``; nothing may be written, made or removed anywhere. Sets
    no_new_privs. ``runtime/host.c`` does the same for a C candidate's host. Returns whether it holds."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # landlock_create_ruleset: its version
    if abi < 1:
        return False
    handled = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    attr = ctypes.c_uint64(handled)
    rules = libc.syscall(444, ctypes.byref(attr), ctypes.c_size_t(8), ctypes.c_uint32(0))
    if rules < 0:
        return False

    class Beneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    try:
        opened = []
        for root in dict.fromkeys(roots):
            with contextlib.suppress(OSError):
                opened.append(os.open(root, os.O_PATH | os.O_CLOEXEC))
        for fd in [*opened, *fds]:
            rule = Beneath(_LANDLOCK_READ, fd)
            libc.syscall(445, ctypes.c_int(rules), ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0))
        for fd in opened:
            os.close(fd)
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            return False
        return libc.syscall(446, ctypes.c_int(rules), ctypes.c_uint32(0)) == 0
    finally:
        os.close(rules)


def filter_available() -> bool:
    """Whether hosts run under the system-call filter (libseccomp and its bindings are installed)."""
    try:
        import pyseccomp  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def encode_args(args: Sequence[Any], pointer: Callable[[Any], bytes | None]) -> bytes:
    """A kernel's arguments as a host reads them: u32 count, then ``p`` + ``pointer(a)`` for what ``pointer``
    places (a buffer), ``i`` + i32 for ints, ``f`` + f32 for floats."""
    spec = [struct.pack("<I", len(args))]
    for a in args:
        where = pointer(a)
        if where is not None:
            spec.append(b"p" + where)
        elif isinstance(a, (bool, int, np.integer)):
            spec.append(b"i" + struct.pack("<i", int(a)))
        elif isinstance(a, (float, np.floating)):
            spec.append(b"f" + struct.pack("<f", float(a)))
        else:
            raise TypeError(f"unsupported kernel argument type {type(a).__name__}")
    return b"".join(spec)


class HostDied(RuntimeError):
    """The host process ended while the worker waited on it; ``signal_name`` says how (``None``: it exited)."""

    def __init__(self, message: str, signal_name: str | None) -> None:
        super().__init__(message)
        self.signal_name = signal_name


# --- starting hosts -----------------------------------------------------------------------------------


_HOST_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host.c")


def build_host(cc: str, cache_dir: str, work_dir: str | None = None) -> str:
    """The host executable for compiler ``cc``, built into ``cache_dir`` unless it is there already."""
    from runtime.toolchain.cc import CompileError, CompilerNotFound, cache_key, compiler_version, publish, run_tool

    with open(_HOST_SOURCE) as f:
        source = f.read()
    flags = ["-O2", "-std=gnu11"]
    # libm stays linked: kernels built as libraries call sqrtf, expf, ... from the process they load into
    libs = ["-Wl,--no-as-needed", "-lm", "-ldl"]
    final = os.path.join(cache_dir, f"evoforge-host-{cache_key(source, [*flags, *libs], compiler_version(cc))}")
    if os.path.exists(final):
        return final
    tmp = tempfile.mkdtemp(prefix="host-", dir=work_dir)
    try:
        with open(os.path.join(tmp, "host.c"), "w") as f:
            f.write(source)
        code, output = run_tool([cc, *flags, "-o", "host", "host.c", *libs], cwd=tmp, timeout=120,
                                not_found=lambda why: CompilerNotFound(cc, why))  # fmt: skip
        if code != 0:
            raise CompileError(f"the candidate host does not build with {cc}:\n{output}")
        publish(os.path.join(tmp, "host"), final, cache_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def start_host_process(executable: int, argv: Sequence[str], fds: Sequence[int], output: str) -> int:
    """Starts ``argv`` from the executable open at descriptor ``executable``, with ``fds`` at descriptors 3, 4,
    ... (and the executable after them), stdin ``/dev/null``, and stdout and stderr appending to the file
    ``output`` of its own: a host never holds the worker's log (whose start it could overwrite) nor any other
    descriptor of the worker (the host closes every descriptor past its own on start). Returns its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    dup = os.POSIX_SPAWN_DUP2
    wrote = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    actions: list[tuple[Any, ...]] = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                                      (os.POSIX_SPAWN_OPEN, 1, output, wrote, 0o600), (dup, 1, 2)]
    actions += [(dup, fd, 3 + i) for i, fd in enumerate([*fds, executable])]
    return os.posix_spawn(f"/proc/self/fd/{3 + len(fds)}", list(argv), os.environ, file_actions=actions)


def forward_output(path: str, header: str, limit: int = 64 << 10, to: int = 1) -> None:
    """Appends what a host printed (its file ``path``, the last ``limit`` bytes) to this process's descriptor
    ``to`` (stdout: the worker's log), under ``header``, and removes the file."""
    with contextlib.suppress(OSError):
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - limit))
            data = f.read(limit)
        if data:
            cut = f"[{size - len(data)} bytes cut]\n".encode() if size > len(data) else b""
            sys.stdout.flush()
            sys.stderr.flush()
            os.write(to, f"--- {header} ---\n".encode() + cut + data + (b"" if data.endswith(b"\n") else b"\n"))
    with contextlib.suppress(OSError):
        os.unlink(path)


class HostLauncher:
    """Starts a :class:`CandidateHost` per candidate: the host executable (built on first use) and the
    system-call filters, compiled once. It also keeps a calibration host (:meth:`round_trip`), which never
    loads candidate code."""

    def __init__(self, cc: str = "cc", cache_dir: str | None = None, work_dir: str | None = None) -> None:
        self.cache_dir = cache_dir or tempfile.mkdtemp(prefix="evoforge-host-")
        self.executable = build_host(cc, self.cache_dir, work_dir)
        self.out_dir = work_dir or owned_work_dir()  # swept once this process is gone
        # Reached through a descriptor: the cache's path may be a /proc/self/fd link, which means another
        # directory in the new process. At 10 or above, so that no descriptor of the spawn overlaps another.
        exe = os.open(self.executable, os.O_RDONLY | os.O_CLOEXEC)
        self._exe = fcntl.fcntl(exe, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(exe)
        self._spawned = 0
        self._calibration: CandidateHost | None = None
        self.filters = compiled_filters()
        if self.filters is None:
            print(f"evoforge: {UNFILTERED}", file=sys.stderr, flush=True)

    def _start(self, name: str, lib: int | None, threads: int, cpu_seconds: int | None) -> CandidateHost:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock = fcntl.fcntl(theirs.fileno(), fcntl.F_DUPFD_CLOEXEC, 10)
        theirs.close()
        self._spawned += 1
        output = os.path.join(self.out_dir, f"host-{os.getpid()}-{self._spawned}.out")
        try:
            argv = [self.executable, name, str(max(1, threads)), str(cpu_seconds or 0)]
            pid = start_host_process(self._exe, argv, [sock] if lib is None else [sock, lib], output)
        finally:
            os.close(sock)
        host = CandidateHost(pid, ours, output)
        pre, post = (b"", b"") if self.filters is None else (
            self.filters["one_thread" if threads <= 1 else "threads"], self.filters["no_exec"])  # fmt: skip
        host.send(b"F" + struct.pack("<I", len(pre)) + pre + struct.pack("<I", len(post)) + post)
        ready = host.receive()
        if ready != b"ok":
            host.close()
            from runtime.toolchain.cc import CompileError

            raise CompileError(ready[1:].decode(errors="replace"))
        host.ready_cpu_ns = host.cpu_ns()
        return host

    def host(self, path: str, name: str, *, threads: int = 1, cpu_seconds: int | None = None,
             sha256: str | None = None) -> CandidateHost:  # fmt: skip
        """A new host with the kernel ``name`` of the library at ``path`` loaded, from a sealed copy whose hash
        must be ``sha256`` (what the compile step built): nothing can change what the host loads after the
        check, and a library changed since it was built is refused.

        Raises :class:`runtime.toolchain.CompileError` when the library does not load, defines no ``name`` or
        is not the one built, and :class:`HostDied` when the host dies loading it (a constructor that crashes).
        """
        from runtime.toolchain.cc import CompileError, library_sha256

        if not name:
            raise ValueError("a kernel needs a name")
        with open(path, "rb") as f:
            data = f.read()
        if sha256 is not None and library_sha256(data) != sha256:
            raise CompileError(f"the library {os.path.basename(path)} changed since it was built (sha256 "
                               f"{library_sha256(data)[:16]}, built {sha256[:16]}): refused")  # fmt: skip
        sealed = os.memfd_create("evoforge-library", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(sealed, view) :]
            fcntl.fcntl(sealed, fcntl.F_ADD_SEALS, _SEALS | fcntl.F_SEAL_WRITE)
            lib = fcntl.fcntl(sealed, fcntl.F_DUPFD_CLOEXEC, 10)  # the host reaches the library through this only
        finally:
            os.close(sealed)
        try:
            return self._start(name, lib, threads, cpu_seconds)
        finally:
            os.close(lib)

    def round_trip(self, cores: Iterable[int] | None = None) -> float:
        """Seconds of one request that calls nothing, measured on the calibration host (pinned to ``cores``):
        what a timed request costs besides its calls. No candidate's process takes part, so no candidate can
        stretch the figure that is subtracted from its timings."""
        host = self._calibration
        if host is None or host._closed:
            host = self._calibration = self._start("", None, 1, None)
        if cores is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(host.pid, set(cores))
        return host.calibrate()

    def close(self) -> None:
        """Reaps hosts that ended (each host ends with its candidate), and ends the calibration host."""
        if self._calibration is not None:
            self._calibration.close(forward=False)
            self._calibration = None
        _reap_ended()
        with contextlib.suppress(OSError):
            os.close(self._exe)


def _reap_ended() -> None:
    for pid in list(_KILLED):
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == 0:
                continue  # not ended yet
        except ChildProcessError:
            pass  # reaped elsewhere
        _KILLED.discard(pid)


_KILLED: set[int] = set()  # hosts killed but not yet reaped (they are this process's children)


# --- a host, seen from the worker ---------------------------------------------------------------------


class CandidateHost:
    """One candidate's process, as the worker drives it: shared buffers, bound calls, timed requests."""

    def __init__(self, pid: int, sock: socket.socket, output: str | None = None) -> None:
        self.pid, self._sock, self.output = pid, sock, output
        self._arenas: list[tuple[mmap.mmap, np.ndarray]] = []  # arena i has id i + 1 in the host
        self._current = 0  # the arena allocations come from
        self._used = 0  # bytes taken from it
        self._closed = False
        self.round_trip_s = 0.0
        self.ready_cpu_ns = 0  # its CPU when its library was loaded: what it ran before is its constructors'
        self.in_calls_ns = 0  # CPU it used inside the requests that called its kernel

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
        def pointer(a: Any) -> bytes | None:
            if not isinstance(a, np.ndarray):
                return None
            if not a.flags.c_contiguous:
                raise TypeError("kernel array arguments must be C-contiguous")
            return _MAP.pack(*self._locate(a))

        answer = self._request(b"B" + encode_args(args, pointer))
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
        self.in_calls_ns += used
        return max((t1 - t0) * 1e-9 - self.round_trip_s, 1e-9 * len(handles)), used

    def outside_calls_ns(self) -> int:
        """CPU the host used since it was ready outside the requests that call its kernel: its wake-ups to bind
        calls and map buffers, and whatever it ran on its own (a timer's handler that spins while other
        workers time theirs, say)."""
        return self.cpu_ns() - self.ready_cpu_ns - self.in_calls_ns

    def calibrate(self, n: int = 32) -> float:
        """Measures the round trip of a request that calls nothing (median of ``n``). Only on a calibration
        host (:meth:`HostLauncher.round_trip`): a candidate's own host could stretch it."""
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

    def close(self, *, forward: bool = True) -> None:
        """Ends the host (killed: it holds nothing worth a goodbye), frees the shared memory, and appends what
        it printed to this process's log (``forward``)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        _KILLED.add(self.pid)  # reaped later: nobody waits for it
        _reap_ended()
        self._forward(forward)
        self._sock.close()
        for mm, _ in self._arenas:
            with contextlib.suppress(BufferError):
                mm.close()
        self._arenas.clear()

    def _forward(self, forward: bool) -> None:
        if self.output is not None:
            if forward:
                forward_output(self.output, f"kernel process {self.pid}")
            else:
                with contextlib.suppress(OSError):
                    os.unlink(self.output)
            self.output = None

    def __enter__(self) -> CandidateHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ------------------------------------------------------------------------------------

    def send(self, msg: bytes) -> None:
        try:
            self._sock.send(msg)
        except OSError:
            self._died(b"")

    def receive(self) -> bytes:
        try:
            answer = self._sock.recv(65536)
        except OSError:
            answer = b""
        if not answer:
            self._died(answer)
        return answer

    def _request(self, msg: bytes) -> bytes:
        self.send(msg)
        return self.receive()

    def _expect(self, what: bytes) -> None:
        answer = self.receive()
        if answer != what:
            raise RuntimeError(f"the candidate's process answered {answer[:80]!r}")

    def _died(self, answer: bytes) -> None:
        """Raises :class:`HostDied` with how the host ended (reaped here)."""
        if answer:
            raise RuntimeError(f"the candidate's process answered {answer[:80]!r}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)  # a host that closed its socket but lives on
        try:
            _, status = os.waitpid(self.pid, 0)
        except ChildProcessError:
            status = 0
        self._closed = True
        self._sock.close()
        self._forward(True)
        if os.WIFSIGNALED(status):
            name = signal.Signals(os.WTERMSIG(status)).name
            raise HostDied(f"the kernel's process was killed by {name}", name)
        raise HostDied(f"the kernel's process exited with code {os.WEXITSTATUS(status)}", None)


# --- the system-call filter ------------------------------------------------------------------------


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
    host: threads, forked workers and local socket pairs for them), ``device`` (a CUDA host: ``threads``
    but for ``memfd_create``, which the driver may use), and ``no_exec`` (loaded on top once the
    candidate's code is in). ``None`` without libseccomp."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError):
        return None
    eperm = sc.ERRNO(errno.EPERM)

    def base(*, pairs: bool = False, memfd: bool = False) -> Any:
        f = sc.SyscallFilter(defaction=sc.ALLOW)
        for call in _DENIED if memfd else (*_DENIED, "memfd_create"):  # no code written to memory, then mapped
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
    device = base(memfd=True)  # a CUDA host: the driver's threads (its code is ours; the candidate's is device code)
    device.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
    no_exec = sc.SyscallFilter(defaction=sc.ALLOW)  # once the library is in: no executable mapping at all
    no_exec.add_rule(eperm, "mmap", sc.Arg(2, sc.MASKED_EQ, _PROT_EXEC, _PROT_EXEC))
    out = {}
    for key, f in (("one_thread", one_thread), ("threads", threads), ("engine", engine), ("device", device),
                   ("no_exec", no_exec)):
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
