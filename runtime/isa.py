"""The instruction sets evoforge may use: all that this CPU has, or fewer when ``EVOFORGE_CPU_ISA`` says so.

``EVOFORGE_CPU_ISA=avx2`` makes evoforge act as a CPU with AVX2 and FMA and nothing wider (x86-64-v3, the
AMD Zen 2 / Zen 3 and Intel Haswell level): :func:`runtime.hardware.cpu_flags` and the fingerprint leave out
every AVX-512, AMX and AVX-VNNI flag, so the factory's plans, the engine's slots and the tests pick what such a
CPU runs; candidates compile with ``-march=x86-64-v3`` instead of ``-march=native``; and the libraries that
take a cap are capped (:func:`cap_libraries`: OpenBLAS, oneDNN, PyTorch's kernels, numpy's dispatch). Unset
or ``native``: everything the CPU has.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, MutableMapping

__all__ = ["ENV", "LEVELS", "IsaError", "cap_libraries", "level", "march", "masked"]

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
