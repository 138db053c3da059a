"""The built-in ``linear_int8_avx2`` task: ``linear_int8`` on CPUs with AVX2 and no AVX512_VNNI.

The arithmetic, the packing and the reference are ``linear_int8``'s (:mod:`runtime.tasks.linear_int8`: x
quantised per row to u8 inside the kernel, W per column to s8 ahead of time, exact int32 sums, the same fp32
epilogue), so its elites answer bit for bit what a VNNI elite answers. Only the instructions differ: AVX2 has
no ``vpdpbusd``, and its ``vpmaddubsw`` adds u8 x s8 pairs into a *saturating* int16 (2 x 255 x 127 does not
fit), so the template widens both to int16 and multiplies with ``vpmaddwd``, exact in int32.
"""

from __future__ import annotations

from runtime.slots import Slot
from runtime.tasks._linear import Avx2LinearTask
from runtime.tasks.linear_int8 import LinearInt8, LinearInt8Args

__all__ = ["LinearInt8Avx2"]


class LinearInt8Avx2Args(LinearInt8Args):
    task_name = "linear_int8_avx2"
    k_multiple = 32


class LinearInt8Avx2(Avx2LinearTask, LinearInt8):
    """Dynamic-quantisation int8 GEMM + bias on AVX2: a ``vpmaddwd`` register tile over W's quads widened to
    int16, after quantising each row of x once per call."""

    name = "linear_int8_avx2"
    description = LinearInt8.description.replace("k % 64 == 0", "k % 32 == 0")
    slot = Slot("linear", cpu_flags=("avx2",), k_multiple=32, n_multiple=16, stands_in_for="linear_int8")
    Args = LinearInt8Avx2Args
    args: LinearInt8Avx2Args
    isa_flags = ("-mavx2", "-mfma", "-ffp-contract=off")
    peak_multiple = 2  # vpmaddwd: 16 multiply-adds an instruction against an AVX2 FMA's 8
    registers = "2 * MR * NR + 2 * NR <= 15"  # two accumulators and two widened B vectors per 8 columns
    panel = ("PANEL", 8, 512)
    tile_seed = {"MR": 4, "NR": 1, "KU": 2, "PANEL": 64}  # 4 rows x 8 columns
    sources = ("linear_int8_avx2_template.c", "linear_int8_naive.c")
