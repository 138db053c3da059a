"""The CUDA compile step: nvcc -> cubin (cached by content), with ptxas' resource report.

This module needs nvcc only, never pycuda or a GPU, so compile-only checks run anywhere the CUDA
toolkit is installed. Loading and running a cubin is :mod:`runtime.toolchain.cuda_device` (pycuda).

The cache key is the C toolchain's: sha256(source, flags, compiler version). Next to each cached
``<key>.cubin`` sits ``<key>.json``, ptxas' report, so a cache hit still has its registers and spills.
Both are published with the C toolchain's atomic rename (report first), so a reader never sees half.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from runtime.settings import CudaSettings
from runtime.toolchain.cc import CompileError, CompilerNotFound, cache_key, publish, run_tool

__all__ = [
    "CudaCompileResult",
    "NvccNotFound",
    "PtxasInfo",
    "compile_cuda",
    "nvcc_flags",
    "nvcc_version",
    "parse_ptxas",
    "resolve_nvcc",
]

DEFAULT_ARCH = "sm_80"  # without a GPU to ask (compile-only checks): Ampere, the oldest arch the templates target


class NvccNotFound(CompilerNotFound):
    """nvcc (the CUDA toolkit) cannot be run."""

    def __init__(self, nvcc: str, detail: str = "") -> None:
        self.cc = nvcc
        extra = f" ({detail})" if detail else ""
        RuntimeError.__init__(
            self,
            f"nvcc {nvcc!r} not found{extra}: install the CUDA toolkit, put its bin/ on PATH "
            "or set evaluation.cuda.nvcc in the config",
        )


def resolve_nvcc(nvcc: str) -> str:
    """The nvcc to run: ``nvcc`` as given when it is a path or on PATH, else under $CUDA_HOME or /usr/local/cuda."""
    if os.sep in nvcc or shutil.which(nvcc):
        return nvcc
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", nvcc), os.X_OK):
            return os.path.join(root, "bin", nvcc)
    return nvcc


@functools.cache
def nvcc_version(nvcc: str) -> str:
    """nvcc's version line (``Build cuda_13.0.r13.0/...``), cached per process; raises :class:`NvccNotFound`."""
    path = resolve_nvcc(nvcc)
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
        raise NvccNotFound(nvcc, exc.strerror or "") from None
    except subprocess.TimeoutExpired:
        raise NvccNotFound(nvcc, "`--version` did not answer in 60 s") from None
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise NvccNotFound(nvcc, f"`{path} --version` exited with {out.returncode}")
    return lines[-1]  # the first line names the driver, the last the exact build


@dataclass(frozen=True)
class PtxasInfo:
    """ptxas' report for the kernel: what limits occupancy, and whether registers spill."""

    arch: str
    registers: int
    smem_bytes: int  # static shared memory per block
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    cmem_bytes: int = 0

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes

    def metrics(self) -> dict[str, Any]:
        """The figures as result metrics (usable as descriptors)."""
        return {
            "registers": self.registers,
            "smem_static_bytes": self.smem_bytes,
            "stack_bytes": self.stack_bytes,
            "spill_bytes": self.spill_bytes,
            "arch": self.arch,
        }


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_CMEM = re.compile(r"(\d+) bytes cmem\[0\]")


def parse_ptxas(text: str, kernel: str) -> PtxasInfo:
    """Figures for entry ``kernel`` from ``nvcc -Xptxas -v`` output; ``ValueError`` when it is not there."""
    blocks: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            current = blocks.setdefault(m.group(1), {"arch": m.group(2)})
        elif current is None:
            continue
        elif m := _PROPS.search(line):
            current.update(stack=int(m.group(1)), st=int(m.group(2)), ld=int(m.group(3)))
        elif m := _USED.search(line):
            current["registers"] = int(m.group(1))
            current["smem"] = int(s.group(1)) if (s := _SMEM.search(line)) else 0
            current["cmem"] = int(c.group(1)) if (c := _CMEM.search(line)) else 0
            current = None  # the "Used" line closes an entry's report
    found = blocks.get(kernel)
    if found is None or "registers" not in found:
        names = ", ".join(sorted(blocks)) or "none"
        raise ValueError(f'ptxas reported no entry function {kernel!r} (found: {names}); is it extern "C"?')
    return PtxasInfo(
        arch=found["arch"],
        registers=found["registers"],
        smem_bytes=found["smem"],
        stack_bytes=found.get("stack", 0),
        spill_store_bytes=found.get("st", 0),
        spill_load_bytes=found.get("ld", 0),
        cmem_bytes=found["cmem"],
    )


@dataclass(frozen=True)
class CudaCompileResult:
    path: str  # the cubin in the cache
    info: PtxasInfo
    cached: bool
    seconds: float


def nvcc_flags(settings: CudaSettings, arch: str, extra_flags: Sequence[str] = ()) -> list[str]:
    """The whole nvcc command line but for files: target, optimisation, the task's defines, -Xptxas -v."""
    if not re.fullmatch(r"sm_\d+[a-z]?", arch):
        raise ValueError(f"invalid CUDA architecture {arch!r}: use e.g. sm_80 or sm_90")
    fast = ["--use_fast_math"] if settings.fast_math else []
    return ["-cubin", f"-arch={arch}", *settings.flags, *fast, *extra_flags, "-Xptxas", "-v"]


def compile_cuda(
    source: str,
    *,
    settings: CudaSettings,
    arch: str,
    kernel: str,
    extra_flags: Sequence[str] = (),
    cache_dir: str,
    work_dir: str | None = None,
) -> CudaCompileResult:
    """Compiles ``source`` to ``cache_dir/<key>.cubin`` (and its report) unless cached.

    Raises :class:`CompileError` (nvcc's message, or ptxas naming no ``kernel``) or :class:`NvccNotFound`.
    """
    flags = nvcc_flags(settings, arch, extra_flags)
    key = cache_key(source, flags, nvcc_version(settings.nvcc))
    final, report = os.path.join(cache_dir, f"{key}.cubin"), os.path.join(cache_dir, f"{key}.json")
    if os.path.exists(final) and os.path.exists(report):
        with open(report) as f:
            return CudaCompileResult(final, PtxasInfo(**json.load(f)), True, 0.0)
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="nvcc-", dir=work_dir)
    try:
        with open(os.path.join(tmp, "kernel.cu"), "w") as f:
            f.write(source)
        output = _run_nvcc([resolve_nvcc(settings.nvcc), *flags, "-o", "kernel.cubin", "kernel.cu"], settings, tmp)
        try:
            info = parse_ptxas(output, kernel)
        except ValueError as exc:
            raise CompileError(str(exc)) from None
        with open(os.path.join(tmp, "kernel.json"), "w") as f:
            json.dump(asdict(info), f)
        publish(os.path.join(tmp, "kernel.json"), report, cache_dir)
        publish(os.path.join(tmp, "kernel.cubin"), final, cache_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return CudaCompileResult(final, info, False, time.perf_counter() - t0)


def _run_nvcc(cmd: list[str], settings: CudaSettings, cwd: str) -> str:
    """Runs nvcc in ``cwd`` (its own temporaries go there too); returns its output (ptxas' report)."""
    code, output = run_tool(cmd, cwd=cwd, timeout=settings.timeout, env={**os.environ, "TMPDIR": cwd},
                            not_found=lambda why: NvccNotFound(settings.nvcc, why))
    if code != 0:
        kept = [ln for ln in output.splitlines() if not ln.startswith("ptxas info")]  # the errors, not the report
        raise CompileError("\n".join(kept) or f"nvcc exited with {code}")
    return output
