"""The built-in ``linear_f32`` task: the engine's linear layers as an fp32 GEMM for small batches, on AVX2 + FMA.

``y[m,n] = x[m,k] @ W[k,n] + bias[n]`` in fp32, W packed ahead of time (:func:`pack_f32`) in panels of 8
columns, each panel's k rows contiguous, so a register tile streams its columns from one place. It gives up
nothing in precision: the GEMMs of a batch of a few dozen tokens (the rows BLAS blocks poorly for) in a
kernel tuned for them and for the model's shapes. It runs on every CPU with AVX2 and FMA.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from pydantic import Field

from runtime.slots import Slot
from runtime.task import Case
from runtime.tasks._linear import Avx2LinearTask, LinearArgs

__all__ = ["LinearF32", "pack_f32", "unpack_f32"]

_X_MAX, _W_MAX = 4.0, 1.0  # inputs are drawn within these bounds
_F32 = np.float32


def pack_f32(w: np.ndarray) -> np.ndarray:
    """W[k,n] (fp32) in panels of 8 columns: shape ``(n/8, k, 8)``, ``out[j//8, kk, j%8] = W[kk, j]``."""
    w = np.ascontiguousarray(w, dtype=_F32)
    k, n = w.shape
    if n % 8:
        raise ValueError(f"n must be a multiple of 8 to pack in panels, got W of shape {w.shape}")
    return np.ascontiguousarray(w.reshape(k, n // 8, 8).transpose(1, 0, 2))


def unpack_f32(wp: np.ndarray) -> np.ndarray:
    """The inverse of :func:`pack_f32`: W[k,n] from its ``(n/8, k, 8)`` panels."""
    panels, k, _ = wp.shape
    return np.asarray(wp, dtype=_F32).transpose(1, 0, 2).reshape(k, 8 * panels)


class LinearF32Args(LinearArgs):
    task_name = "linear_f32"
    k_multiple = 8

    m: int = Field(32, ge=1, description="rows of x and y: a small batch of tokens, where BLAS blocks poorly")


class LinearF32(Avx2LinearTask):
    """fp32 GEMM + bias over packed panels of W; the template is an FMA register tile."""

    name = "linear_f32"
    description = (
        "fp32 linear layer y[m,n] = x[m,k] @ W[k,n] + bias[n]; x fp32 row-major, W packed in panels of 8 "
        "columns (W[kk,j] = wp[((j/8)*k + kk)*8 + j%8]), y fp32 row-major; any summation order (fp32 accuracy); "
        "k % 8 == 0, n % 16 == 0, any m >= 1"
    )
    signature = "void kernel(int m, int n, int k, const float *x, const float *wp, const float *bias, float *y)"
    slot = Slot("linear", cpu_flags=("avx2", "fma"), k_multiple=8, n_multiple=16, stands_in_for="linear_bf16")
    Args = LinearF32Args
    args: LinearF32Args
    isa_flags = ("-mavx2", "-mfma")
    peak_multiple = 1  # fp32 FMA itself
    panel = ("PANEL", 8, 512)
    tile_seed = {"MR": 4, "NR": 3, "KU": 2, "PANEL": 64}  # 4 rows x 3 vectors of 8 columns
    packed = ("wp",)
    block = ("c_block_floats", "fp32 outputs")
    sources = ("linear_f32_template.c", "linear_f32_naive.c")

    def slot_pack(self, w: np.ndarray) -> tuple[np.ndarray, ...]:
        return (pack_f32(w),)

    def inputs(self, case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """x within +-4, W within +-1 (given as ``w`` and packed as ``wp``), bias within +-1."""
        m, k, n = case["m"], case["k"], case["n"]
        x = rng.uniform(-_X_MAX, _X_MAX, (m, k)).astype(_F32)
        w = rng.uniform(-_W_MAX, _W_MAX, (k, n)).astype(_F32)
        bias = rng.uniform(-1.0, 1.0, n).astype(_F32)
        return {"x": x, "w": w, "wp": pack_f32(w), "bias": bias}

    def reference(self, case: Case, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        """``x @ W + bias`` summed in float64, rounded once to fp32."""
        x64, w64 = inputs["x"].astype(np.float64), inputs["w"].astype(np.float64)
        outputs["y"][...] = (x64 @ w64 + inputs["bias"].astype(np.float64)).astype(_F32)

    def tolerance(self, case: Case) -> tuple[float, float]:
        """As matmul's: against ``|x| @ |W| + |bias|`` (:meth:`error_scale`), about sqrt(k) roundings of the
        terms' size, 16 of them the margin between two honest summation orders."""
        return (16 * math.sqrt(case["k"] + 1) * 2.0**-24, 1e-30)

    def rms_tolerance(self, case: Case) -> float:
        """fp32 in any order stays near 1e-6 relative RMS; bf16 or 14-bit inputs give 1e-3 to 4e-5."""
        return 1e-5

    def error_scale(self, case: Case, inputs: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray],
                    ) -> Mapping[str, np.ndarray]:  # fmt: skip
        return {"y": np.abs(inputs["x"]) @ np.abs(inputs["w"]) + np.abs(inputs["bias"])}
