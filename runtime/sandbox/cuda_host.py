"""CUDA candidate hosts: a CUDA candidate's device code runs only in a process of its own, with its own context.

Device code can read any memory of the context it runs in. The worker's context holds the reference's
buffers, its results and (for a duel) a rival's; so a candidate never runs there. Each one gets a host
(``cuda_host.c``, built once per compiler into the compile cache, with the driver opened at run
time so that it builds without a GPU) that loads its cubin into a fresh context, keeps its buffers,
fills its inputs, launches it and times the launch between two CUDA events. The host's code is ours;
the candidate is device code only, so those events are a clock it cannot touch.

Fresh inputs: before every timed round the worker picks a seed, and both the host and the worker fill
their inputs from it with the same kernel (``cuda_fill.cu``, built to PTX): the candidate meets
values it has never seen, the reference computes on the very same ones, and every round's output is
compared with the reference's on elements chosen after it. A host is not dumpable, dies with its
worker, and runs under the ``threads`` system-call filter once its context is up.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from runtime.sandbox.filters import compiled_filters, filter_request
from runtime.sandbox.host import CandidateHost, encode_args, start_host_process
from runtime.sandbox.processes import owned_work_dir
from runtime.toolchain.cuda_launch import Launch

__all__ = ["FILL_KINDS", "CudaHost", "CudaHostLauncher", "RemoteBuffer", "build_cuda_host", "cuda_include_dir"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_HOST_SOURCE = os.path.join(_HERE, "cuda_host.c")
_FILL_SOURCE = os.path.join(_HERE, "cuda_fill.cu")
FILL_KINDS = {"float32": 0, "float16": 1, "bf16": 2}
"""What the fill kernel writes: fp32, fp16, or bf16 held as uint16 (the top half of the fp32 bits)."""


def cuda_include_dir() -> str:
    """Where ``cuda.h`` is: ``$CUDA_HOME``/``$CUDA_ROOT``, else ``/usr/local/cuda``."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_ROOT"), "/usr/local/cuda"):
        if root and os.path.isfile(os.path.join(root, "include", "cuda.h")):
            return os.path.join(root, "include")
    raise FileNotFoundError("cuda.h not found: install the CUDA toolkit's headers or set CUDA_HOME")


def build_cuda_host(cc: str, nvcc: str, cache_dir: str, work_dir: str | None = None) -> tuple[str, str]:
    """The CUDA host executable (built with ``cc`` against the toolkit's headers, no driver needed) and the
    fill module's PTX (built with ``nvcc``), in ``cache_dir`` unless they are there already."""
    from runtime.toolchain.cc import CompileError, CompilerNotFound, cache_key, compiler_version, publish, run_tool
    from runtime.toolchain.nvcc import NvccNotFound, nvcc_version, resolve_nvcc

    include = cuda_include_dir()
    with open(_HOST_SOURCE) as f:
        host_source = f.read()
    with open(_FILL_SOURCE) as f:
        fill_source = f.read()
    host_flags = ["-O2", "-std=gnu11", f"-I{include}", "-Wl,--no-as-needed", "-ldl"]
    fill_flags = ["-ptx", "-arch=compute_75"]  # the driver compiles PTX for whichever GPU it runs on
    host = os.path.join(cache_dir, f"evoforge-cuda-host-{cache_key(host_source, host_flags, compiler_version(cc))}")
    ptx = os.path.join(cache_dir, f"evoforge-fill-{cache_key(fill_source, fill_flags, nvcc_version(nvcc))}.ptx")
    if os.path.exists(host) and os.path.exists(ptx):
        return host, ptx
    tmp = tempfile.mkdtemp(prefix="cuda-host-", dir=work_dir)
    try:
        for name, text in (("host.c", host_source), ("fill.cu", fill_source)):
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        for cmd, out, final, missing in (
            ([cc, *host_flags[:3], "-o", "host", "host.c", *host_flags[3:]], "host", host,
             lambda why: CompilerNotFound(cc, why)),
            ([resolve_nvcc(nvcc), *fill_flags, "-o", "fill.ptx", "fill.cu"], "fill.ptx", ptx,
             lambda why: NvccNotFound(nvcc, why)),
        ):  # fmt: skip
            if os.path.exists(final):
                continue
            code, output = run_tool(cmd, cwd=tmp, timeout=300, not_found=missing)
            if code != 0:
                raise CompileError(f"the CUDA candidate host does not build ({cmd[0]}):\n{output}")
            publish(os.path.join(tmp, out), final, cache_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return host, ptx


class CudaHostLauncher:
    """Starts a :class:`CudaHost` per candidate (the executable and the fill PTX built on first use)."""

    def __init__(self, cc: str, nvcc: str, cache_dir: str, work_dir: str | None = None) -> None:
        self.executable, self.ptx_path = build_cuda_host(cc, nvcc, cache_dir, work_dir)
        self.out_dir = work_dir or owned_work_dir()  # swept once this process is gone
        self._spawned = 0
        with open(self.ptx_path, "rb") as f:
            self.ptx = f.read()
        exe = os.open(self.executable, os.O_RDONLY | os.O_CLOEXEC)
        self._exe = fcntl.fcntl(exe, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(exe)
        self.filters = compiled_filters()

    def host(self, cubin: str, name: str, *, cpu_seconds: int | None = None) -> CudaHost:
        """A new host with kernel ``name`` of ``cubin`` loaded in a context of its own.

        Raises :class:`runtime.toolchain.CompileError` when the driver cannot load the cubin or it defines
        no ``name``; :class:`runtime.sandbox.host.HostDied` when the host dies starting."""
        from runtime.toolchain.cc import CompileError

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds = [fcntl.fcntl(theirs.fileno(), fcntl.F_DUPFD_CLOEXEC, 10)]
        theirs.close()
        for path in (cubin, self.ptx_path):
            opened = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            fds.append(fcntl.fcntl(opened, fcntl.F_DUPFD_CLOEXEC, 10))
            os.close(opened)
        self._spawned += 1
        output = os.path.join(self.out_dir, f"cuda-host-{os.getpid()}-{self._spawned}.out")
        try:
            pid = start_host_process(self._exe, [self.executable, name, str(cpu_seconds or 0)], fds, output)
        finally:
            for fd in fds:
                os.close(fd)
        host = CudaHost(pid, ours, output)
        bpf = b"" if self.filters is None else self.filters["device"]  # the driver runs threads of its own
        host.send(filter_request(bpf))
        ready = host.receive()
        if ready[:2] != b"ok" or len(ready) != 14:
            host.close()
            raise CompileError(ready[1:].decode(errors="replace"))
        host.registers, host.static_smem, host.l2_bytes = struct.unpack("<III", ready[2:])
        return host

    def close(self) -> None:
        os.close(self._exe)


class RemoteBuffer:
    """A device buffer in a host's context, between two guard zones, with a shared staging block the same
    size in the worker (the API of :class:`runtime.toolchain.cuda_device.DeviceBuffer`)."""

    def __init__(self, host: CudaHost, buf_id: int, shape: tuple[int, ...], dtype: Any) -> None:
        self.host, self.id = host, buf_id
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.staging = host.alloc(self.nbytes)
        self._where = struct.pack("<I", buf_id) + struct.pack("<IQ", *host.locate(self.staging))

    def upload(self, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array, dtype=self.dtype).view(np.uint8).reshape(-1)
        self.staging[: data.size] = data
        self.host.expect_ok(b"U" + self._where)

    def download(self) -> np.ndarray:
        self.host.expect_ok(b"D" + self._where)
        return self.staging[: self.nbytes].view(self.dtype).reshape(self.shape).copy()

    def guards_intact(self) -> bool:
        answer = self.host.ask(b"G" + struct.pack("<I", self.id))
        return answer == b"g\x01"

    def poison(self) -> None:
        """NaN for floats (all-ones bytes are NaN in every float format), 0x5A bytes otherwise."""
        byte = 0xFF if np.issubdtype(self.dtype, np.floating) else 0x5A
        self.host.expect_ok(b"P" + struct.pack("<IB", self.id, byte))

    def fill(self, kind: int, seed: int, mean: float, std: float) -> None:
        """Fresh normal(``mean``, ``std``) values from ``seed``, written by the host's fill kernel."""
        self.host.expect_ok(b"S" + struct.pack("<IIIff", self.id, kind, seed & 0xFFFFFFFF, mean, std))

    def free(self) -> None:  # freed with the host's context
        pass


class CudaHost(CandidateHost):
    """A CUDA candidate's host, as the worker drives it: buffers, bound launches, timed launches."""

    registers = static_smem = l2_bytes = 0

    def __init__(self, pid: int, sock: socket.socket, output: str | None = None) -> None:
        super().__init__(pid, sock, output)
        self._buffers = 0

    def ask(self, msg: bytes) -> bytes:
        answer = self._request(msg)
        if answer[:1] == b"E":
            raise RuntimeError(f"the candidate's GPU process: {answer[1:].decode(errors='replace')}")
        return answer

    def expect_ok(self, msg: bytes) -> None:
        answer = self.ask(msg)
        if answer != b"k":
            raise RuntimeError(f"the candidate's GPU process answered {answer[:40]!r}")

    def locate(self, array: np.ndarray) -> tuple[int, int]:
        return self._locate(array)

    def buffer(self, shape: tuple[int, ...], dtype: Any, *, guard: int, sentinel: int) -> RemoteBuffer:
        self._buffers += 1
        b = RemoteBuffer(self, self._buffers, shape, dtype)
        self.expect_ok(b"A" + struct.pack("<IQQB", b.id, b.nbytes, guard, sentinel))
        return b

    def bind_launch(self, launch: Launch, args: Sequence[Any]) -> int:  # type: ignore[override]
        """A handle launching the kernel with ``launch`` on ``args`` (ints, floats, this host's buffers)."""
        shape = struct.pack("<7I", *launch.grid, *launch.block, launch.shared_bytes)
        args_spec = encode_args(args, lambda a: struct.pack("<I", a.id) if isinstance(a, RemoteBuffer) else None)
        answer = self.ask(b"B" + shape + args_spec)
        return struct.unpack("<I", answer[1:5])[0]

    def run(self, handle: int) -> None:
        """Launches and waits."""
        self.expect_ok(b"R" + struct.pack("<I", handle))

    def time_launch(self, handle: int, *, l2_flush: bool = False) -> float:
        """Seconds of one launch between two CUDA events recorded by the host (L2 flushed first, if asked)."""
        answer = self.ask(b"T" + struct.pack("<IB", handle, int(l2_flush)))
        if answer[:1] != b"t" or len(answer) != 5:
            raise RuntimeError(f"the candidate's GPU process answered {answer[:40]!r}")
        return struct.unpack("<f", answer[1:5])[0] * 1e-3
