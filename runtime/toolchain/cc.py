"""The C toolchain: compile rendered source to a shared library (cached by content), load it with ctypes.

The cache key is sha256(source, flags, compiler version), so the same candidate compiled with the same
compiler is never compiled twice, by any worker. Workers compile in parallel: each writes to a private
temporary file and renames it into the cache, so a reader never sees a half-written library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime import isa
from runtime.settings import CompilerSettings

__all__ = [
    "CKernel",
    "CompileError",
    "CompileResult",
    "CompilerNotFound",
    "cache_key",
    "publish",
    "compile_source",
    "compiler_version",
    "hold_libgomp",
    "load_kernel",
]

_STDERR_LIMIT = 4000  # characters of compiler output kept in a CompileError


class CompilerNotFound(RuntimeError):
    """The configured C compiler cannot be run."""

    def __init__(self, cc: str, detail: str = "") -> None:
        self.cc = cc
        extra = f" ({detail})" if detail else ""
        super().__init__(
            f"C compiler {cc!r} not found{extra}: install gcc (e.g. `apt-get install gcc`) "
            "or set evaluation.compiler.cc in the config"
        )


class CompileError(RuntimeError):
    """The compiler rejected the source; ``stderr`` holds its (trimmed) message."""

    def __init__(self, stderr: str) -> None:
        self.stderr = _trim(stderr)
        super().__init__(self.stderr)


def _trim(text: str, limit: int = _STDERR_LIMIT) -> str:
    text = text.strip()
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - limit} characters cut] ...\n{text[-half:]}"


@functools.cache
def compiler_version(cc: str) -> str:
    """First line of ``cc --version`` (cached per process); raises :class:`CompilerNotFound`."""
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
        raise CompilerNotFound(cc, exc.strerror or "") from None
    except subprocess.TimeoutExpired:
        raise CompilerNotFound(cc, "`--version` did not answer in 30 s") from None
    if out.returncode != 0:
        raise CompilerNotFound(cc, f"`{cc} --version` exited with {out.returncode}")
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[0] if lines else cc


def cache_key(source: str, flags: Sequence[str], version: str) -> str:
    """sha256 of (source, flags, compiler version): the name of the cached library."""
    h = hashlib.sha256()
    for part in (version, "\0".join(flags), source):
        h.update(part.encode())
        h.update(b"\0\1\0")
    return h.hexdigest()


@dataclass(frozen=True)
class CompileResult:
    path: str  # the shared library in the cache
    cached: bool  # True when no compiler ran
    seconds: float  # wall time spent compiling (0 for a cache hit)
    sha256: str = ""  # of the library's bytes, as found in the cache: what its loader checks before loading


def library_sha256(data: bytes) -> str:
    """The hash a library is known by: results carry it, and a loader checks it before loading."""
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return library_sha256(f.read())


def compile_source(
    source: str,
    *,
    compiler: CompilerSettings,
    extra_flags: Sequence[str] = (),
    cache_dir: str,
    work_dir: str | None = None,
) -> CompileResult:
    """Compiles ``source`` into ``cache_dir/<key>.so`` unless it is there already.

    ``work_dir`` holds the compiler's input and output before the atomic rename into the cache.
    Raises :class:`CompileError` (with the compiler's message) or :class:`CompilerNotFound`.
    """
    own = [isa.march() if f == "-march=native" else f for f in compiler.flags]  # EVOFORGE_CPU_ISA's level
    flags = [*own, *extra_flags, "-shared", "-fPIC"]
    key = cache_key(source, flags, compiler_version(compiler.cc))
    final = os.path.join(cache_dir, f"{key}.so")
    if os.path.exists(final):
        return CompileResult(final, True, 0.0, _file_sha256(final))
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="cc-", dir=work_dir)
    try:
        src, out = os.path.join(tmp, "kernel.c"), os.path.join(tmp, "kernel.so")
        with open(src, "w") as f:
            f.write(source)
        # Relative names keep temporary paths out of error messages; diagnostics flags change no code.
        quiet = ["-fdiagnostics-color=never", "-fno-diagnostics-show-caret"]
        _run_compiler([compiler.cc, *flags, *quiet, "-o", "kernel.so", "kernel.c"], compiler, cwd=tmp)
        digest = _file_sha256(out)
        publish(out, final, cache_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return CompileResult(final, False, time.perf_counter() - t0, digest)


def run_tool(
    cmd: list[str],
    *,
    cwd: str,
    timeout: float,
    not_found: Callable[[str], Exception],
    env: dict[str, str] | None = None,
) -> tuple[int, str]:
    """Runs a compiler (cc, nvcc) in ``cwd``: ``(exit code, output)``. Past ``timeout`` its whole process
    tree is killed (CompileError); a missing executable raises ``not_found(reason)``."""
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except (FileNotFoundError, PermissionError) as exc:
        raise not_found(exc.strerror or "") from None
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        proc.communicate()
        raise CompileError(f"{os.path.basename(cmd[0])} did not finish within {timeout:g} s") from None
    return proc.returncode, output


def _run_compiler(cmd: list[str], compiler: CompilerSettings, cwd: str) -> None:
    code, output = run_tool(cmd, cwd=cwd, timeout=compiler.timeout,
                            not_found=lambda why: CompilerNotFound(compiler.cc, why))
    if code != 0:
        raise CompileError(output or f"{compiler.cc} exited with {code}")


def _kill_tree(pid: int) -> None:
    """SIGKILLs ``pid`` and its descendants (cc1, as, ld), which share the worker's process group."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def publish(built: str, final: str, cache_dir: str) -> None:
    """Moves ``built`` to ``final`` atomically, copying first when they are on different filesystems."""
    try:
        os.replace(built, final)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    fd, staging = tempfile.mkstemp(prefix=".tmp-", suffix=".so", dir=cache_dir)
    try:
        with os.fdopen(fd, "wb") as dst, open(built, "rb") as src:
            shutil.copyfileobj(src, dst)
        os.replace(staging, final)
    except BaseException:
        if os.path.exists(staging):
            os.unlink(staging)
        raise


_LIBGOMP: ctypes.CDLL | None = None


def hold_libgomp() -> None:
    """Keeps libgomp loaded for the life of the process: OpenMP's pooled threads outlive every parallel
    region, and if the last kernel using OpenMP took libgomp with it when unloaded, the process would
    crash at exit running unmapped code. (Finding it may run the compiler: a process that will not be allowed to
    calls this first.)"""
    global _LIBGOMP
    if _LIBGOMP is None:
        _LIBGOMP = ctypes.CDLL(ctypes.util.find_library("gomp") or "libgomp.so.1", mode=ctypes.RTLD_GLOBAL)


class CKernel:
    """A kernel function loaded from a shared library; call :meth:`bind` once per argument list."""

    def __init__(self, path: str, name: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            self.openmp = b"libgomp" in f.read()  # linked against GNU OpenMP
        if self.openmp:
            hold_libgomp()
        self._lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        try:
            self._fn = getattr(self._lib, name)
        except AttributeError:
            self.close()
            raise CompileError(f"the library defines no function {name!r}") from None
        self._fn.restype = None

    def bind(self, args: Sequence[Any]) -> Callable[[], None]:
        """A zero-argument callable running the kernel on ``args`` (ints, floats, numpy arrays).

        Conversion happens here, once, so the callable is as cheap as a ctypes call can be.
        """
        converted = [_c_arg(a) for a in args]
        types, values = [t for t, _ in converted], [v for _, v in converted]
        self._fn.argtypes = types
        fn = self._fn
        return functools.partial(fn, *values)

    def caller(self, args: Sequence[Any]) -> Callable[..., None]:
        """The kernel with its C types fixed once, from the kinds of ``args`` (as :meth:`bind` takes them): it is
        then called with ints, floats and arrays' addresses (``a.ctypes.data``) in their places. For a hot loop,
        where :meth:`bind`'s conversions take longer than a small kernel runs. Valid until :meth:`close`."""
        proto = ctypes.CFUNCTYPE(None, *(_c_arg(a)[0] for a in args))
        return proto(ctypes.cast(self._fn, ctypes.c_void_p).value)

    def close(self) -> None:
        """Unloads the library (the long-lived worker would otherwise accumulate every candidate)."""
        lib, self._lib = self._lib, None
        if lib is not None:
            import _ctypes

            _ctypes.dlclose(lib._handle)


def _c_arg(a: Any) -> tuple[type, Any]:
    """A kernel argument's C type and value: an array (C-contiguous) as its address, an int, a float."""
    if isinstance(a, np.ndarray):
        if not a.flags.c_contiguous:
            raise TypeError("kernel array arguments must be C-contiguous")
        return ctypes.c_void_p, ctypes.c_void_p(a.ctypes.data)
    if isinstance(a, (bool, int, np.integer)):
        return ctypes.c_int, ctypes.c_int(int(a))
    if isinstance(a, (float, np.floating)):
        return ctypes.c_float, ctypes.c_float(float(a))
    raise TypeError(f"unsupported kernel argument type {type(a).__name__}")


def load_kernel(path: str, name: str) -> CKernel:
    return CKernel(path, name)
