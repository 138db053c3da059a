"""The built-in ``linear_int8`` task: MiniLM's linear layers as a dynamically quantised int8 GEMM.

x arrives fp32 and is quantised inside the kernel, one row (token) at a time, to u8 with a per-row scale and
zero point (asymmetric); W is quantised ahead of time (:func:`pack_int8`) to s8 with one scale per output
column (symmetric) and packed in the layout of AVX512_VNNI's ``vpdpbusd`` and AMX's ``tdpbusd``. The products
are summed exactly in int32, then the zero point is taken out and the result scaled back to fp32.

Exact semantics, all in fp32 arithmetic with every operation rounded on its own (no fused multiply-add):

* row i of x [m,k]: ``lo = min(0, min_j x[i,j])``, ``hi = max(0, max_j x[i,j])``, ``s = (hi - lo) / 255``
  (``s = 1`` when that is 0), ``inv = 1 / s``, ``z = (int) rint(-lo * inv)`` (in [0, 255]) and
  ``q[i,j] = clamp((int) rint(x[i,j] * inv) + z, 0, 255)``; ``rint`` rounds half to even (``np.rint``,
  ``_mm512_cvtps_epi32`` under the default MXCSR) and ``z`` is added as an integer after it;
* column j of W [k,n]: ``w_scale[j] = max_k |W[k,j]| / 127`` (1 for an all-zero column),
  ``wq[k,j] = clamp(rint(W[k,j] / w_scale[j]), -127, 127)``, ``w_colsum[j] = sum_k wq[k,j]``;
* ``acc[i,j] = sum_k q[i,k] * wq[k,j]`` (exact in int32), ``d = acc[i,j] - z[i] * w_colsum[j]`` (exact too) and
  ``y[i,j] = ((float) d * (s[i] * w_scale[j])) + bias[j]``: the two scales multiplied first, then d times
  that, then the bias added.

The engine packs its weights with :func:`pack_int8`; :func:`int8_linear_reference` is the numpy statement.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from runtime.slots import Slot
from runtime.task import Case
from runtime.tasks._linear import LinearArgs, LinearTask

__all__ = ["LinearInt8", "int8_linear_reference", "pack_int8", "quantize_rows", "unpack_int8"]

_X_MAX, _W_MAX = 4.0, 1.0  # inputs are drawn within these bounds (the tolerance scales with them)
_F32 = np.float32


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-row asymmetric u8 quantisation of x [m,k] (fp32): ``(q uint8 [m,k], s float32 [m], z int32 [m])``,
    exactly as the kernels do it (see the module docstring)."""
    x = np.ascontiguousarray(x, dtype=_F32)
    lo = np.minimum(x.min(axis=1), _F32(0))
    hi = np.maximum(x.max(axis=1), _F32(0))
    s = (hi - lo) / _F32(255)
    s[s == 0] = _F32(1)
    inv = _F32(1) / s
    z = np.rint(-lo * inv).astype(np.int32)
    q = np.clip(np.rint(x * inv[:, None]).astype(np.int32) + z[:, None], 0, 255).astype(np.uint8)
    return q, s.astype(_F32), z


def pack_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W[k,n] (fp32) quantised per column (symmetric s8) and packed in VNNI quads:
    ``(wq int8 [k/4, n, 4], w_scale float32 [n], w_colsum int32 [n])`` with ``wq[kk//4, j, kk%4]`` the
    quantised ``W[kk, j]``."""
    w = np.ascontiguousarray(w, dtype=_F32)
    k, n = w.shape
    if k % 4:
        raise ValueError(f"k must be a multiple of 4 to pack in quads, got W of shape {w.shape}")
    scale = np.abs(w).max(axis=0) / _F32(127)
    scale[scale == 0] = _F32(1)
    wq = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    colsum = wq.sum(axis=0, dtype=np.int64).astype(np.int32)
    return np.ascontiguousarray(wq.reshape(k // 4, 4, n).transpose(0, 2, 1)), scale.astype(_F32), colsum


def unpack_int8(wq: np.ndarray) -> np.ndarray:
    """The inverse of :func:`pack_int8`'s packing: the int8 matrix [k,n] from its ``[k/4, n, 4]`` quads."""
    quads, n, _ = wq.shape
    return np.asarray(wq, dtype=np.int8).transpose(0, 2, 1).reshape(4 * quads, n)


def int8_linear_reference(
    x: np.ndarray, wq: np.ndarray, w_scale: np.ndarray, w_colsum: np.ndarray, bias: np.ndarray
) -> np.ndarray:
    """y [m,n] (fp32) of the int8 linear layer, in exactly the kernels' arithmetic (the module docstring).

    The integer sums go through a float64 matmul, which is exact here: every partial sum is an integer below
    255 * 127 * k, far under 2^53.
    """
    q, s, z = quantize_rows(x)
    acc = np.rint(q.astype(np.float64) @ unpack_int8(wq).astype(np.float64)).astype(np.int64)
    d = acc - z.astype(np.int64)[:, None] * np.asarray(w_colsum, np.int64)[None, :]
    scale = s[:, None] * np.asarray(w_scale, _F32)[None, :]
    y = d.astype(_F32) * scale
    y += np.asarray(bias, _F32)
    return y


class LinearInt8Args(LinearArgs):
    task_name = "linear_int8"
    k_multiple = 64


class LinearInt8(LinearTask):
    """Dynamic-quantisation int8 GEMM + bias; the template is either a vpdpbusd register tile (AVX512_VNNI)
    or AMX tdpbusd tiles, after quantising each row of x once per call."""

    name = "linear_int8"
    description = (
        "int8 linear layer with dynamic quantisation (GOP/s of int8 ops counted like GFLOP: 2*m*n*k per call): "
        "each row of x[m,k] (fp32 row-major) quantised to u8 with s = (max(0,max x) - min(0,min x)) / 255 "
        "(1 if 0), z = rint(-lo/s), q = clamp(rint(x*(1/s)) + z, 0, 255) (round half to even); W quantised per "
        "column to s8 ahead of time, packed in quads [k/4][n][4] (wq[((kk/4)*n + j)*4 + kk%4]) with w_scale[n] "
        "and w_colsum[n] = sum_k wq; acc = q @ wq exact in int32; y = (float)(acc - z*w_colsum) * (s*w_scale) "
        "+ bias in that order, no FMA; k % 64 == 0, n % 16 == 0, any m >= 1"
    )
    signature = (
        "void kernel(int m, int n, int k, const float *x, const int8_t *wq, const float *w_scale, "
        "const int32_t *w_colsum, const float *bias, float *y)"
    )
    slot = Slot("linear", cpu_flags=("avx512_vnni",), k_multiple=64, n_multiple=16)
    Args = LinearInt8Args
    args: LinearInt8Args
    isa = "VNNI"
    # the ISA extensions, and no contraction into FMAs (the semantics round every product on its own)
    isa_flags = ("-mavx512vnni", "-mamx-tile", "-mamx-int8", "-ffp-contract=off")
    peak_multiple = 32  # AMX-INT8: 2048 ops a cycle against AVX-512 FMA's 64
    panel = ("PANEL", 16, 512)  # rows quantised at a time
    tile_seed = {"ISA": "VNNI", "MR": 8, "NR": 2, "KU": 2, "AMX_MT": 2, "AMX_NT": 2, "PANEL": 64}  # 8 x 2 vectors
    packed = ("wq", "w_scale", "w_colsum")
    block = ("c_block_ints", "int32 sums")
    sources = ("linear_int8_template.c", "linear_int8_naive.c")

    def slot_pack(self, w: np.ndarray) -> tuple[np.ndarray, ...]:
        return pack_int8(w)

    def inputs(self, case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """x within +-4 where, of every 7 rows from the second, one is all positive, one all negative (so lo or
        hi is the clamp to 0), one is all zero (s == 0), one constant, and one a row of exact rounding ties
        (lo = -127/32, hi = 4 make s = 1/32 exactly, the other values are (i + 1/2)/32); W within +-1 with
        column 3 all zero, given as ``w`` (fp32) and quantised and packed (``wq``, ``w_scale``, ``w_colsum``)."""
        m, k, n = case["m"], case["k"], case["n"]
        x = rng.uniform(-_X_MAX, _X_MAX, (m, k)).astype(_F32)
        kind = np.arange(m) % 7
        x[kind == 1] = np.abs(x[kind == 1])
        x[kind == 2] = -np.abs(x[kind == 2])
        x[kind == 3] = 0.0
        x[kind == 4] = _F32(1.25)
        ties = x[kind == 5]
        ties[:] = (rng.integers(-127, 127, ties.shape) + 0.5) / 32
        ties[:, :2] = (-127 / 32, 4.0)
        x[kind == 5] = ties
        w = rng.uniform(-_W_MAX, _W_MAX, (k, n)).astype(_F32)
        w[:, 3] = 0.0
        wq, w_scale, w_colsum = pack_int8(w)
        bias = rng.uniform(-1.0, 1.0, n).astype(_F32)
        return {"x": x, "w": w, "wq": wq, "w_scale": w_scale, "w_colsum": w_colsum, "bias": bias}

    def reference(self, case: Case, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        """:func:`int8_linear_reference` (quantise x, exact integer GEMM, the fixed fp32 epilogue)."""
        outputs["y"][...] = int8_linear_reference(
            inputs["x"], inputs["wq"], inputs["w_scale"], inputs["w_colsum"], inputs["bias"]
        )

    def tolerance(self, case: Case) -> tuple[float, float]:
        """The integer part is exact and every float operation is fixed in kind and order, so a correct kernel
        matches the reference bit for bit; the tolerance leaves an ulp or so (2^-20 relative, and 2^-20 of the
        output scale sqrt(k) * max|x| * max|w| absolute, 7.5e-5 at k = 384). One u8 of x off by one step
        moves a whole row of y by s * |W| (up to ~0.03), and a lost zero-point correction, bias or 64-wide
        k block moves most outputs by far more (checked in the tests)."""
        return (2.0**-20, float(np.sqrt(case["k"])) * _X_MAX * _W_MAX * 2.0**-20)
