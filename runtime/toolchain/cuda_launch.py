"""Launch configurations and occupancy, in pure Python (no GPU needed).

A CUDA task derives a :class:`Launch` (grid, block, dynamic shared memory) from a genome's params;
:func:`validate_launch` rejects what the driver would refuse, with the reason (the cascade turns it
into ``invalid``); :func:`occupancy` estimates resident warps per SM from ptxas' figures the way
NVIDIA's occupancy calculator does (registers allocated per warp in units of 256, shared memory in
units of 128 bytes plus a per-block reservation), from per-architecture limits.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["ARCHS", "ArchLimits", "Launch", "LaunchError", "Occupancy", "arch_limits", "occupancy", "validate_launch"]

KIB = 1024


@dataclass(frozen=True)
class ArchLimits:
    """Per-SM and per-block limits of one compute capability (CUDA C Programming Guide, table 'Technical
    Specifications per Compute Capability')."""

    name: str
    warps_per_sm: int
    blocks_per_sm: int
    smem_per_sm: int  # the largest shared-memory carveout
    smem_per_block: int  # the opt-in maximum (above 48 KiB needs cudaFuncAttributeMaxDynamicSharedMemorySize)
    smem_reserved: int = 1 * KIB  # reserved by the system per block (sm_80 on)
    regs_per_sm: int = 64 * KIB
    regs_per_thread: int = 255
    threads_per_block: int = 1024
    reg_unit: int = 256  # registers are allocated per warp in units of this
    smem_unit: int = 128


ARCHS: dict[str, ArchLimits] = {
    a.name: a
    for a in (
        ArchLimits("sm_70", 64, 32, 96 * KIB, 96 * KIB, smem_reserved=0),
        ArchLimits("sm_75", 32, 16, 64 * KIB, 64 * KIB, smem_reserved=0),
        ArchLimits("sm_80", 64, 32, 164 * KIB, 163 * KIB),
        ArchLimits("sm_86", 48, 16, 100 * KIB, 99 * KIB),
        ArchLimits("sm_87", 48, 16, 164 * KIB, 163 * KIB),
        ArchLimits("sm_89", 48, 24, 100 * KIB, 99 * KIB),
        ArchLimits("sm_90", 64, 32, 228 * KIB, 227 * KIB),
        ArchLimits("sm_100", 64, 32, 228 * KIB, 227 * KIB),
        ArchLimits("sm_120", 48, 32, 100 * KIB, 99 * KIB),
    )
}


def arch_limits(arch: str) -> ArchLimits:
    """Limits for ``sm_XY`` (a suffix like ``sm_90a`` is ignored); an unlisted newer arch gets the
    nearest older listed one."""
    m = re.fullmatch(r"sm_(\d+)[a-z]?", arch)
    if not m:
        raise ValueError(f"invalid CUDA architecture {arch!r}: use e.g. sm_80 or sm_90")
    cc = int(m.group(1))
    known = sorted((int(k[3:]), v) for k, v in ARCHS.items())
    older = [v for c, v in known if c <= cc]
    if not older:
        raise ValueError(f"CUDA architecture {arch!r} is older than the oldest supported (sm_70)")
    return older[-1]


class LaunchError(ValueError):
    """A launch configuration the GPU cannot run; the message says which limit it breaks."""


@dataclass(frozen=True)
class Launch:
    """Grid and block dimensions and dynamic shared memory (bytes) of one kernel launch."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int = 0

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]


_GRID_MAX = (2**31 - 1, 65535, 65535)
_BLOCK_MAX = (1024, 1024, 64)


def validate_launch(launch: Launch, limits: ArchLimits, *, registers: int = 0, static_smem: int = 0) -> None:
    """Raises :class:`LaunchError` when the driver would refuse ``launch`` for a kernel with these figures."""
    for what, dims, most in (("grid", launch.grid, _GRID_MAX), ("block", launch.block, _BLOCK_MAX)):
        if len(dims) != 3 or any(not isinstance(d, int) or d < 1 for d in dims):
            raise LaunchError(f"{what} {dims} must be three positive ints")
        for axis, d, m in zip("xyz", dims, most, strict=True):
            if d > m:
                raise LaunchError(f"{what}.{axis} = {d} exceeds the maximum {m}")
    if launch.threads > limits.threads_per_block:
        raise LaunchError(f"{launch.threads} threads per block exceed the maximum {limits.threads_per_block}")
    if launch.shared_bytes < 0:
        raise LaunchError(f"negative dynamic shared memory ({launch.shared_bytes} bytes)")
    smem = launch.shared_bytes + static_smem
    if smem > limits.smem_per_block:
        raise LaunchError(
            f"{smem} bytes of shared memory per block exceed {limits.name}'s maximum {limits.smem_per_block}"
        )
    if registers and _regs_per_block(registers, launch.threads, limits) > limits.regs_per_sm:
        raise LaunchError(
            f"{registers} registers x {launch.threads} threads exceed {limits.regs_per_sm} registers per SM "
            "(too many resources requested for launch)"
        )


def _regs_per_block(registers: int, threads: int, limits: ArchLimits) -> int:
    per_warp = math.ceil(registers * 32 / limits.reg_unit) * limits.reg_unit
    return per_warp * math.ceil(threads / 32)


@dataclass(frozen=True)
class Occupancy:
    """Resident blocks and warps per SM, their share of the SM's warp slots, and the binding limit."""

    blocks_per_sm: int
    warps_per_sm: int
    occupancy: float  # warps_per_sm / the SM's maximum, 0..1
    limited_by: str  # "warps", "blocks", "registers" or "shared memory" ("launch" when none fit)


def occupancy(limits: ArchLimits, threads: int, registers: int, smem_bytes: int) -> Occupancy:
    """Estimated occupancy of blocks of ``threads`` using ``registers`` per thread and ``smem_bytes`` per block."""
    warps = max(1, math.ceil(threads / 32))
    by: dict[str, float] = {
        "warps": limits.warps_per_sm // warps,
        "blocks": limits.blocks_per_sm,
    }
    if registers > 0:
        per_warp = math.ceil(registers * 32 / limits.reg_unit) * limits.reg_unit
        by["registers"] = (limits.regs_per_sm // per_warp) // warps
    if smem_bytes > 0:
        per_block = math.ceil((smem_bytes + limits.smem_reserved) / limits.smem_unit) * limits.smem_unit
        by["shared memory"] = limits.smem_per_sm // per_block
    limited_by = min(by, key=lambda k: by[k])
    blocks = int(by[limited_by])
    if blocks < 1 or threads > limits.threads_per_block:
        return Occupancy(0, 0, 0.0, "launch")
    return Occupancy(blocks, blocks * warps, blocks * warps / limits.warps_per_sm, limited_by)
