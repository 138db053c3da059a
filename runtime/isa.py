"""The instruction sets evoforge may use: all that this CPU has, or fewer when ``EVOFORGE_CPU_ISA`` says so.

``EVOFORGE_CPU_ISA=avx2`` makes evoforge act as a CPU with AVX2 and FMA and nothing wider (x86-64-v3, the
AMD Zen 2 / Zen 3 and Intel Haswell level): :func:`runtime.hardware.cpu_flags` and the fingerprint leave out
every AVX-512, AMX and AVX-VNNI flag, so the factory's plans, the engine's slots and the tests pick what such a
CPU runs; candidates compile with ``-march=x86-64-v3`` instead of ``-march=native``; and the libraries that
take a cap are capped (:func:`cap_libraries`: OpenBLAS, oneDNN, PyTorch's kernels, numpy's dispatch). Unset
or ``native``: everything the CPU has.

Libraries with no cap of their own (ONNX Runtime's MLAS, OpenVINO's JIT kernels) read the CPU through the CPUID
instruction. Where the CPU can make CPUID fault (``cpuid_fault`` in /proc/cpuinfo), :func:`cpuid_mask_environ`
gives a process started with it a CPUID that answers as the level does (``cpuid_mask.c``, preloaded), so that
every library in it, and in its children, is capped.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, MutableMapping

__all__ = ["ENV", "LEVELS", "IsaError", "cap_libraries", "cpuid_faulting", "cpuid_mask_environ", "cpuid_mask_library",
           "cpuid_masked", "exec_masked", "carried", "level", "march", "masked"]

ENV = "EVOFORGE_CPU_ISA"

LEVELS = ("native", "avx2")
"""The values ``EVOFORGE_CPU_ISA`` takes."""

# Flags of instruction sets past x86-64-v3 (prefixes of /proc/cpuinfo names).
_PAST_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert", "vaes", "vpclmulqdq", "gfni")

# What each library reads to stay at AVX2 (set only where the user did not set them).
_CAPS = {
    "OPENBLAS_CORETYPE": "Haswell",  # numpy's and torch's OpenBLAS
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN (PyTorch, OpenVINO's CPU plugin)
    "DNNL_MAX_CPU_ISA": "AVX2",  # its older name
    "ATEN_CPU_CAPABILITY": "avx2",  # PyTorch's own vectorised kernels
}
_NUMPY2_CAP = ("NPY_DISABLE_CPU_FEATURES", "X86_V4 AVX512_ICL AVX512_SPR")  # numpy 2's AVX-512 dispatch targets


class IsaError(ValueError):
    """``EVOFORGE_CPU_ISA`` holds a value evoforge does not know."""


def level(environ: MutableMapping[str, str] | None = None) -> str:
    """The level in force: ``native`` (the default) or ``avx2``. Raises :class:`IsaError` for another value."""
    value = (environ if environ is not None else os.environ).get(ENV, "").strip().lower() or "native"
    if value not in LEVELS:
        raise IsaError(f"{ENV}={value!r} is not a level evoforge knows: use one of {', '.join(LEVELS)}")
    return value


def masked(flags: Iterable[str]) -> frozenset[str]:
    """``flags`` (a CPU's /proc/cpuinfo flags) without those the level in force leaves out."""
    if level() == "native":
        return frozenset(flags)
    return frozenset(f for f in flags if not f.startswith(_PAST_AVX2))


def march() -> str:
    """The ``-march`` that candidates compile for: this CPU, or x86-64-v3 under the AVX2 level."""
    return "-march=native" if level() == "native" else "-march=x86-64-v3"


def cap_libraries(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Under the AVX2 level, sets the variables that cap OpenBLAS, oneDNN, PyTorch and numpy at AVX2 in
    ``environ`` (``os.environ`` by default; each only where it is unset) and returns what it set. They take
    effect in processes started afterwards, and in this one for libraries not loaded yet. ONNX Runtime's
    MLAS picks its kernels from the CPU itself and has no cap."""
    env = environ if environ is not None else os.environ
    if level(env) == "native":
        return {}
    caps = dict(_CAPS)
    if _numpy_major() >= 2:  # numpy 1 names its targets otherwise, and refuses to start on a name it lacks
        caps[_NUMPY2_CAP[0]] = _NUMPY2_CAP[1]
    return {name: env.setdefault(name, value) for name, value in caps.items() if name not in env}


def _numpy_major() -> int:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("numpy").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return 0


_MASK_TRIED = "EVOFORGE_CPUID_MASK_TRIED"  # set in the process exec_masked starts again
_MASK_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpuid_mask.c")
# glibc picks its string functions from CPUID before any preloaded library runs: its own tunables cap it.
_GLIBC_HWCAPS = "glibc.cpu.hwcaps=-AVX512F,-AVX512DQ,-AVX512CD,-AVX512BW,-AVX512VL,-AVX512ER,-AVX512PF"


def cpuid_faulting(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU can make CPUID fault for a process (what :func:`cpuid_mask_environ` needs)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return "cpuid_fault" in line.split()
    except OSError:
        pass
    return False


def cpuid_mask_library(cache_dir: str | None = None, cc: str = "cc") -> str:
    """The CPUID mask (``cpuid_mask.c``) built as a shared library into ``cache_dir`` (default
    ``~/.cache/evoforge/isa``), once per source."""
    import hashlib

    with open(_MASK_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    cache = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "evoforge", "isa")
    final = os.path.join(cache, f"cpuid-mask-{digest}.so")
    if os.path.exists(final):
        return final
    os.makedirs(cache, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = os.path.join(tmp, "mask.so")
        cmd = [cc, "-O2", "-shared", "-fPIC", "-o", built, _MASK_SOURCE, "-ldl"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the CPUID mask does not build with {cc}: {done.stderr.strip()[-400:]}")
        os.replace(built, final)
    return final


def cpuid_mask_environ(environ: Mapping[str, str] | None = None, cache_dir: str | None = None) -> dict[str, str]:
    """Under the AVX2 level, on a CPU with CPUID faulting, ``environ`` (``os.environ`` by default) with the CPUID mask
    preloaded and glibc capped: a process started with it, and its children, see a CPU with AVX2 and FMA only.
    Otherwise ``environ`` unchanged (natively nothing is masked; without CPUID faulting nothing can be)."""
    env = dict(environ if environ is not None else os.environ)
    if level(env) == "native" or not cpuid_faulting() or shutil.which("cc") is None:
        return env
    lib = cpuid_mask_library(cache_dir)
    preload = env.get("LD_PRELOAD", "").split()
    env["LD_PRELOAD"] = " ".join([lib, *(p for p in preload if p != lib)])
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.cpu.hwcaps=")]
    env["GLIBC_TUNABLES"] = ":".join([*tunables, _GLIBC_HWCAPS])
    return env


def cpuid_masked() -> bool:
    """Whether this process's CPUID answers through the mask (it was started with :func:`cpuid_mask_environ`)."""
    try:
        return bool(ctypes.CDLL(None).evoforge_cpuid_masked())
    except AttributeError:
        return False


def exec_masked() -> None:
    """Under the AVX2 level, on a CPU with CPUID faulting, starts this program again in place (``os.execve``,
    same arguments) with its CPUID masked, unless it already is; otherwise returns. A script calls it first, before
    the libraries it caps load."""
    import sys

    if level() == "native" or cpuid_masked():
        return
    if os.environ.get(_MASK_TRIED):  # started again already, and the mask did not take: never loop
        print("evoforge: the CPUID mask did not take in this process (see above): libraries without a cap of "
              "their own run unmasked", file=sys.stderr, flush=True)
        return
    env = cpuid_mask_environ()
    if "LD_PRELOAD" in env and env.get("LD_PRELOAD") != os.environ.get("LD_PRELOAD"):
        env[_MASK_TRIED] = "1"
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def carried(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a child started with a scrubbed environment (an engine's host) needs of ``environ`` (``os.environ``
    by default) to run at the same level: ``EVOFORGE_CPU_ISA``, the libraries' caps, and the CPUID mask where it
    is preloaded (that library alone of ``LD_PRELOAD``, and glibc's tunables)."""
    env = environ if environ is not None else os.environ
    names = (ENV, *_CAPS, _NUMPY2_CAP[0])
    out = {name: env[name] for name in names if name in env}
    mask = [p for p in env.get("LD_PRELOAD", "").split() if os.path.basename(p).startswith("cpuid-mask-")]
    if mask:
        out["LD_PRELOAD"] = " ".join(mask)
        if "GLIBC_TUNABLES" in env:
            out["GLIBC_TUNABLES"] = env["GLIBC_TUNABLES"]
    return out
