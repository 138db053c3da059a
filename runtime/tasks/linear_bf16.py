"""The built-in ``linear_bf16`` task: MiniLM's linear layers as a bf16 GEMM with fp32 accumulation.

``y[m,n] = bf16(x)[m,k] @ W[k,n] + bias[n]``: x arrives fp32 and is rounded to bf16 inside the kernel; W
arrives pre-packed (:func:`pack_bf16`) in the layout that AVX512_BF16's ``vdpbf16ps`` and AMX's
``tdpbf16ps`` consume. The engine packs its weights with :func:`pack_bf16` and checks with :func:`bf16_round`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import Field, model_validator

from genome import ChoiceParam, Genome, IntParam, ParamSpace, Pow2Param
from runtime.task import Case, Descriptor, KernelTask, TaskArgs
from runtime.tasks._common import load_c_source

__all__ = ["MINILM_SHAPES", "LinearBf16", "bf16_bits", "bf16_round", "pack_bf16", "unpack_bf16"]

MINILM_SHAPES: tuple[tuple[int, int], ...] = ((384, 1152), (384, 384), (384, 1536), (1536, 384))
"""MiniLM's ``(k, n)``: fused QKV projection, attention output, feed-forward up and down."""

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


class LinearBf16Args(TaskArgs):
    """Problem size of the timed case (MiniLM's feed-forward up-projection over a batch of tokens)."""

    m: int = Field(256, ge=1, description="rows of x and y (tokens of a batch)")
    k: int = Field(384, ge=32, description="columns of x, rows of W; a multiple of 32")
    n: int = Field(1536, ge=16, description="columns of W and y; a multiple of 16")

    @model_validator(mode="after")
    def _blocked(self) -> LinearBf16Args:
        if self.k % 32 or self.n % 16:
            raise ValueError(f"linear_bf16 needs k % 32 == 0 and n % 16 == 0, got k={self.k}, n={self.n}")
        return self


class LinearBf16(KernelTask):
    """bf16 GEMM + bias; the template is either a vdpbf16ps register tile (AVX512) or AMX tiles.

    Its elites are the engine's bf16 linear layer (``runtime.engine``).
    """

    name = "linear_bf16"
    unit = "GFLOP/s"
    description = (
        "bf16 linear layer y[m,n] = bf16(x)[m,k] @ W[k,n] + bias[n] with fp32 accumulation; x fp32 row-major "
        "(rounded to bf16 in the kernel, nearest even), W packed as bf16 pairs [k/2][n][2] "
        "(W[kk,j] = wp[((kk/2)*n + j)*2 + kk%2]), y fp32 row-major; k % 32 == 0, n % 16 == 0, any m >= 1"
    )
    signature = "void kernel(int m, int n, int k, const float *x, const uint16_t *wp, const float *bias, float *y)"
    Args = LinearBf16Args
    args: LinearBf16Args

    def space(self) -> ParamSpace:
        """ISA, the AVX512 register tile (accumulators plus the B vectors fit 32 registers) and the AMX block
        (C, A and B tiles fit the 8 tile registers)."""
        return ParamSpace(
            {
                "ISA": ChoiceParam(type="choice", values=("AVX512", "AMX")),
                "MR": IntParam(type="int", low=1, high=16),
                "NR": IntParam(type="int", low=1, high=4),
                "KU": Pow2Param(type="pow2", low=1, high=8),
                "AMX_MT": IntParam(type="int", low=1, high=2),
                "AMX_NT": IntParam(type="int", low=1, high=3),
                "AMX_PANEL": Pow2Param(type="pow2", low=32, high=512),
            },
            ["MR * NR <= 28", "MR * NR >= 4", "AMX_MT * AMX_NT + AMX_MT + AMX_NT <= 8"],
        )

    def template(self) -> str:
        return load_c_source("linear_bf16_template.c")

    def seeds(self) -> list[Genome]:
        """The scalar triple loop, and a plain AVX512 register tile (6 rows x 4 vectors)."""
        avx512 = {"ISA": "AVX512", "MR": 6, "NR": 4, "KU": 2, "AMX_MT": 2, "AMX_NT": 2, "AMX_PANEL": 64}
        return [Genome(params={}, source=load_c_source("linear_bf16_naive.c")), Genome(params=avx512)]

    def compile_flags(self) -> list[str]:
        flags = ["-mavx512bf16", "-mamx-tile", "-mamx-bf16"]
        return [*flags, "-fopenmp"] if self.args.threads > 1 else flags

    def full_case(self) -> Case:
        return {"m": self.args.m, "n": self.args.n, "k": self.args.k}

    def check_cases(self, rng: np.random.Generator) -> list[Case]:
        """Each MiniLM shape at m = 1, 7, 33 and 256 (tails of every row block), small shapes whose n leaves a
        column tail (80 = 5 x 16), and two drawn ones."""
        fixed = [(1, *MINILM_SHAPES[0]), (7, *MINILM_SHAPES[1]), (33, *MINILM_SHAPES[2]), (256, *MINILM_SHAPES[3])]
        fixed += [(7, 32, 16), (33, 64, 80), (17, 96, 208)]
        drawn = [(int(rng.integers(1, 70)), 32 * int(rng.integers(1, 9)), 16 * int(rng.integers(1, 13))) for _ in "ab"]
        return [{"m": m, "k": k, "n": n} for m, k, n in fixed + drawn]

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

    def outputs(self, case: Case) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"y": ((case["m"], case["n"]), np.dtype(np.float32))}

    def reference(self, case: Case, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        """numpy's fp32 GEMM of bf16-rounded x and the (bf16-valued) W, plus bias."""
        y = outputs["y"]
        np.matmul(bf16_round(inputs["x"]), inputs["w"], out=y)
        y += inputs["bias"]

    def kernel_args(self, case: Case, arrays: Mapping[str, np.ndarray]) -> list[Any]:
        return [case["m"], case["n"], case["k"], arrays["x"], arrays["wp"], arrays["bias"], arrays["y"]]

    def tolerance(self, case: Case) -> tuple[float, float]:
        """bf16 x bf16 products are exact in fp32, so kernel and reference differ only in summation order:
        ~sqrt(k) roundings of sums up to ~sqrt(k) * max|x| * max|w|, far below ``atol`` (2^-14 of that
        scale, 4.8e-3 at k = 384). One lost 32-wide k block, the bias, or rounding x by truncation
        instead of to nearest even each moves most outputs by more (checked in the tests)."""
        return (1e-4, float(np.sqrt(case["k"])) * _X_MAX * _W_MAX * 2.0**-14)

    def work(self, case: Case) -> float:
        return 2.0 * case["m"] * case["n"] * case["k"] / 1e9

    def descriptors(self) -> dict[str, Descriptor]:
        return {
            **super().descriptors(),
            "c_block_floats": Descriptor(
                "c_block_floats",
                "fp32 outputs accumulated per block: MR * NR * 16 (AVX512) or AMX_MT * AMX_NT * 256 (AMX)",
                lambda g, m: float(
                    g.params.get("AMX_MT", 1) * g.params.get("AMX_NT", 1) * 256
                    if g.params.get("ISA") == "AMX"
                    else g.params.get("MR", 1) * g.params.get("NR", 1) * 16
                ),
                0.0,
                1024.0,
            ),
        }
