"""The hardware fingerprint attached to every result: which CPU, compiler and BLAS produced a number.

Fitness values are only comparable between equal fingerprints; the memory of discoveries uses
``fingerprint()["id"]`` to tell "measured here" from "measured elsewhere".
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from typing import Any

import numpy as np

from runtime import isa

__all__ = ["RELEVANT_CPU_FLAGS", "cpu_flags", "fingerprint", "l2_cache_bytes"]

RELEVANT_CPU_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "amx_tile", "neon", "asimd", "sve",
)  # fmt: skip


def _cpuinfo() -> tuple[str, list[str]]:
    model, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "cpu model") and model in ("", platform.machine()):
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = sorted(set(value.split()))
    except OSError:
        pass
    return model, flags


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (``/proc/cpuinfo``), e.g. ``avx512_bf16``, less those ``EVOFORGE_CPU_ISA`` masks
    (:mod:`runtime.isa`); empty where they cannot be read."""
    return isa.masked(_cpuinfo()[1])


@functools.cache
def l2_cache_bytes(default: int = 1 << 20) -> int:
    """The size of one core's L2 cache (Linux's ``/sys/devices/system/cpu/cpu0/cache``); ``default`` where it
    cannot be read (another OS, a confined process)."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in sorted(os.listdir(root)):
            d = os.path.join(root, index)
            with open(os.path.join(d, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(d, "type")) as f:
                kind = f.read().strip()
            if level == "2" and kind in ("Unified", "Data"):
                with open(os.path.join(d, "size")) as f:
                    size = f.read().strip().upper()
                scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
                return int(size.rstrip("KM")) * scale
    except (OSError, ValueError):
        pass
    return default


def _blas() -> dict[str, Any]:
    try:
        from threadpoolctl import threadpool_info  # optional

        return {"libraries": [
            {k: d.get(k) for k in ("internal_api", "version", "threading_layer", "architecture")}
            for d in threadpool_info() if d.get("user_api") == "blas"
        ]}  # fmt: skip
    except ImportError:
        pass
    try:
        deps = np.show_config(mode="dicts").get("Build Dependencies", {})  # type: ignore[union-attr]
        blas = deps.get("blas", {})
        return {"libraries": [{"name": blas.get("name"), "version": blas.get("version")}]}
    except Exception:  # noqa: BLE001 - the build info format is not a contract of numpy
        return {}


@functools.cache
def fingerprint(cc: str = "cc") -> dict[str, Any]:
    """CPU model and flags, core counts, compiler, numpy and BLAS, OS; ``id`` hashes all of it."""
    from runtime.toolchain.cc import CompilerNotFound, compiler_version

    model, flags = _cpuinfo()
    flags = sorted(isa.masked(flags))
    try:
        compiler: str | None = compiler_version(cc)
    except CompilerNotFound:
        compiler = None
    info: dict[str, Any] = {
        "cpu_model": model,
        "machine": platform.machine(),
        "cpu_flags": [f for f in RELEVANT_CPU_FLAGS if f in flags],
        "cpu_flags_sha256": hashlib.sha256(" ".join(flags).encode()).hexdigest()[:16],
        "cores": os.cpu_count(),
        "cores_allowed": len(os.sched_getaffinity(0)),
        "compiler": compiler,
        "numpy": np.__version__,
        "blas": _blas(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }
    if isa.level() != "native":  # acting as a CPU with fewer instruction sets: not this CPU's figures
        info["isa"] = isa.level()
    info["id"] = hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:16]
    return info
