"""The built-in ``linear_bf16`` task: MiniLM's linear layers as a bf16 GEMM with fp32 accumulation.

``y[m,n] = bf16(x)[m,k] @ W[k,n] + bias[n]``: x arrives fp32 and is rounded to bf16 inside the kernel; W
arrives pre-packed (:func:`pack_bf16`) in the layout that AVX512_BF16's ``vdpbf16ps`` and AMX's
``tdpbf16ps`` consume. The engine packs its weights with :func:`pack_bf16` and checks with :func:`bf16_round`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from runtime.slots import Slot
from runtime.task import Case
from runtime.tasks._linear import MINILM_SHAPES, LinearArgs, LinearTask

__all__ = ["MINILM_SHAPES", "LinearBf16", "bf16_bits", "bf16_round", "pack_bf16", "unpack_bf16"]

_X_MAX, _W_MAX = 4.0, 1.0  # inputs are drawn within these bounds (the tolerance scales with them)


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns (uint16), rounding to nearest even; NaN stays a (quiet) NaN."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(np.isnan(a), np.uint32(0x7FC0), rounded).astype(np.uint16)


def bf16_round(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to the nearest bf16 (ties to even), as fp32."""
    return (bf16_bits(a).astype(np.uint32) << np.uint32(16)).view(np.float32)


def pack_bf16(w: np.ndarray) -> np.ndarray:
    """W[k,n] (fp32) as bf16 in VNNI pairs: shape ``(k/2, n, 2)``, ``out[kk//2, j, kk%2] = bf16(W[kk, j])``."""
    k, n = w.shape
    if k % 2:
        raise ValueError(f"k must be even to pack in pairs, got W of shape {w.shape}")
    return np.ascontiguousarray(bf16_bits(w).reshape(k // 2, 2, n).transpose(0, 2, 1))


def unpack_bf16(wp: np.ndarray, k: int, n: int) -> np.ndarray:
    """The inverse of :func:`pack_bf16`: W[k,n] as fp32 (exactly the bf16 values)."""
    bits = np.asarray(wp, dtype=np.uint16).reshape(k // 2, n, 2).transpose(0, 2, 1).reshape(k, n)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


class LinearBf16Args(LinearArgs):
    task_name = "linear_bf16"
    k_multiple = 32


class LinearBf16(LinearTask):
    """bf16 GEMM + bias; the template is either a vdpbf16ps register tile (AVX512) or AMX tiles.

    Its elites are the engine's bf16 linear layer (``runtime.engine``).
    """

    name = "linear_bf16"
    description = (
        "bf16 linear layer y[m,n] = bf16(x)[m,k] @ W[k,n] + bias[n] with fp32 accumulation; x fp32 row-major "
        "(rounded to bf16 in the kernel, nearest even), W packed as bf16 pairs [k/2][n][2] "
        "(W[kk,j] = wp[((kk/2)*n + j)*2 + kk%2]), y fp32 row-major; k % 32 == 0, n % 16 == 0, any m >= 1"
    )
    signature = "void kernel(int m, int n, int k, const float *x, const uint16_t *wp, const float *bias, float *y)"
    slot = Slot("linear", cpu_flags=("avx512_bf16",), k_multiple=32, n_multiple=16)
    Args = LinearBf16Args
    args: LinearBf16Args
    isa = "AVX512"
    isa_flags = ("-mavx512bf16", "-mamx-tile", "-mamx-bf16")
    peak_multiple = 16  # AMX-BF16: 1024 flops a cycle against AVX-512 FMA's 64
    panel = ("AMX_PANEL", 32, 512)
    tile_seed = {"ISA": "AVX512", "MR": 6, "NR": 4, "KU": 2, "AMX_MT": 2, "AMX_NT": 2, "AMX_PANEL": 64}  # 6 x 4 vectors
    packed = ("wp",)
    block = ("c_block_floats", "fp32 outputs")
    sources = ("linear_bf16_template.c", "linear_bf16_naive.c")

    def slot_pack(self, w: np.ndarray) -> tuple[np.ndarray, ...]:
        return (pack_bf16(w),)

    def inputs(self, case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """x within +-4 with every 5th value an exact bf16 rounding tie (so ties-to-even is checked), W within
        +-1 already bf16 (``w``, what the reference multiplies; the kernel gets it packed as ``wp``)."""
        m, k, n = case["m"], case["k"], case["n"]
        x = rng.uniform(-_X_MAX, _X_MAX, (m, k)).astype(np.float32)
        bits = x.reshape(-1).view(np.uint32)
        bits[::5] = (bits[::5] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)
        w = bf16_round(rng.uniform(-_W_MAX, _W_MAX, (k, n)).astype(np.float32))
        bias = rng.uniform(-1.0, 1.0, n).astype(np.float32)
        return {"x": x, "w": w, "wp": pack_bf16(w), "bias": bias}

    def reference(self, case: Case, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        """numpy's fp32 GEMM of bf16-rounded x and the (bf16-valued) W, plus bias."""
        y = outputs["y"]
        np.matmul(bf16_round(inputs["x"]), inputs["w"], out=y)
        y += inputs["bias"]

    def tolerance(self, case: Case) -> tuple[float, float]:
        """bf16 x bf16 products are exact in fp32, so kernel and reference differ only in summation order:
        ~sqrt(k) roundings of sums up to ~sqrt(k) * max|x| * max|w|, far below ``atol`` (2^-14 of that
        scale, 4.8e-3 at k = 384). One lost 32-wide k block, the bias, or rounding x by truncation
        instead of to nearest even each moves most outputs by more (checked in the tests)."""
        return (1e-4, float(np.sqrt(case["k"])) * _X_MAX * _W_MAX * 2.0**-14)
