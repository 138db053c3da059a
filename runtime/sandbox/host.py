"""Candidate hosts: the only processes candidate code runs in, as the worker starts and drives them.

A worker holds everything that decides fitness: inputs, expected outputs, the reference's and a rival's
results, the clock. Candidate code never runs in it. Each candidate gets a host of its own, a fresh
executable (a C candidate's: ``c_host.c``, see :mod:`runtime.sandbox.c_host`; a CUDA candidate's:
``cuda_host.c``, see :mod:`runtime.sandbox.cuda_host`), built once per compiler into the compile cache,
that inherits none of the worker's memory, loads the candidate's code, and calls its kernel on shared
buffers when told to; it is never reused (it exits with its candidate).

What a host can and cannot do:

- It sees the candidate's inputs and outputs through shared memory (sealed memfd arenas), nothing
  else of the worker. The worker and every host are not dumpable: no process of the same user may
  read their memory through ``/proc/PID/mem``, trace them or ``process_vm_readv`` them.
- It holds no descriptor but its socket, its library (until loaded) and a file of its own for what it
  prints: it closes everything else on start, so it never reaches the worker's channel to the
  controller or the worker's log. Where the kernel has Landlock (:mod:`runtime.sandbox.landlock`), it
  reads files only beneath the system's own directories (``/usr``, ``/lib*``, ``/etc``, ``/proc``,
  ``/sys``, ``/dev``): no run directory, no worker's working directory, no other candidate's source or
  output.
- It is timed from outside: the worker reads its clock around each request, less the cost of one
  round trip measured on a calibration host that never loads candidate code, and cross-checks
  against the CPU time the kernel accounts to the host.
- A system-call filter (:mod:`runtime.sandbox.filters`) is in force before the candidate's library is
  loaded (its constructors run under it); once the library is loaded, no executable mapping at all.

The C host's protocol is in ``c_host.c``. A kernel's arguments are ints, floats and pointers into the
arenas: up to 8 floats and 16 ints or pointers.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import signal
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from runtime.sandbox.limits import file_room

__all__ = ["SEALS", "CandidateHost", "HostDied", "encode_args", "forward_output", "reap_killed_hosts",
           "start_host_process"]  # fmt: skip

_CPUCLOCK_SCHED = 2
_ID = struct.Struct("<I")
_MAP = struct.Struct("<IQ")
_ARENA_BYTES = 16 << 20  # virtual: pages cost memory once written
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""The seals of every memfd a host is given: it cannot shrink it under the worker (SIGBUS), grow it, or unseal it."""


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
                                      (os.POSIX_SPAWN_OPEN, 1, output, wrote, 0o600), (dup, 1, 2)]  # fmt: skip
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


def reap_killed_hosts() -> None:
    """Reaps the hosts this process killed that have ended since (each host ends with its candidate)."""
    for pid in list(_KILLED):
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == 0:
                continue  # not ended yet
        except ChildProcessError:
            pass  # reaped elsewhere
        _KILLED.discard(pid)


_KILLED: set[int] = set()  # hosts killed but not yet reaped (they are this process's children)


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
        self.requests = 0  # requests it answered (binds, buffers, calls): each wakes it up outside its calls

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
            with file_room(nbytes):
                os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)  # the host cannot shrink it under the worker (SIGBUS)
            mm = mmap.mmap(fd, nbytes)
            buf_id = len(self._arenas) + 1
            self.requests += 1
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
        self.requests += 1
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
        reap_killed_hosts()
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
        self.requests += 1
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
