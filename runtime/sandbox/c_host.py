"""The C candidate host: its executable (``c_host.c``, built once per compiler into the compile cache) and
the launcher that starts one per candidate, under the system-call filter, and keeps a calibration host.
The host process itself, as the worker drives it, is :class:`runtime.sandbox.host.CandidateHost`."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterable

from runtime.sandbox.filters import UNFILTERED, compiled_filters, filter_request
from runtime.sandbox.host import SEALS, CandidateHost, reap_killed_hosts, start_host_process
from runtime.sandbox.processes import owned_work_dir

__all__ = ["HostLauncher", "build_host"]

_HOST_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "c_host.c")


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
        host.send(filter_request(pre, post))
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
            fcntl.fcntl(sealed, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_WRITE)
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
        reap_killed_hosts()
        with contextlib.suppress(OSError):
            os.close(self._exe)
