"""The built-in ``linear_q8`` task: the decoder's weight GEMMs in int8, both sides scaled per group of 32.

Per-token int8 (``linear_int8``: one scale for a whole row of x, one for a whole column of W) loses too much on a
decoder: a few outlier channels set the scale of a whole row and the rest round to a handful of steps, and a
column's largest weight sets the steps of all its others (SmolLM2 in int8 on every matrix: top-1 0.89 against
fp32, under the floor). Here, as in llama.cpp's Q8_0 blocks, every group of 32 values along k has its own scale,
in x and in W:

* group g of row i of x [m,k]: ``amax = max |x|``, ``s = amax / 127``, ``inv = 1 / s`` (0 where amax is 0),
  ``q = clamp(rint(x * inv), -127, 127)``, rint to nearest even;
* group g of column j of W [k,n], quantised once (:func:`pack_q8`): ``w_scale[g,j] = max |W| / 127`` (1 for a
  group of zeros), ``wq = clamp(rint(W / w_scale), -127, 127)``, packed in ``linear_int8``'s quads;
* ``dot_g[i,j] = sum_{kk in g} q[i,kk] * wq[kk,j]`` exactly in int32;
* ``y[i,j] = sum_g (s_g[i] * w_scale[g,j]) * dot_g[i,j] + bias[j]`` in fp32, the groups in any order.

The integer part is exact; the fp32 sum over groups is held to fp32 accuracy (:meth:`LinearQ8.tolerance`). Its
template runs on AVX2 alone: ``vpsignb`` moves the activations' signs onto W and ``vpmaddubsw`` multiplies their
magnitudes into int16 pairs, which cannot saturate with both sides within 127.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from pydantic import Field

from runtime.slots import Slot
from runtime.task import Case
from runtime.tasks._linear import Avx2LinearTask, LinearArgs
from runtime.tasks.linear_int8 import unpack_int8

__all__ = ["GROUP", "LinearQ8", "pack_q8", "q8_linear_reference", "quantize_groups"]

GROUP = 32
"""Values of a row of x that share one scale."""

_F32 = np.float32
# SmolLM2-135M's (k, n): the fused QKV projection, the attention output, gate and up, down
DECODER_SHAPES: tuple[tuple[int, int], ...] = ((576, 960), (576, 576), (576, 3072), (1536, 576))


def quantize_groups(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [m,k] (fp32, k % 32 == 0) to ``(q int8 [m,k], s float32 [m, k/32])``, as the kernels quantise it."""
    x = np.ascontiguousarray(x, dtype=_F32)
    m, k = x.shape
    groups = x.reshape(m, k // GROUP, GROUP)
    amax = np.abs(groups).max(axis=2)
    s = amax / _F32(127)
    inv = np.zeros_like(s)
    np.divide(_F32(1), s, out=inv, where=amax > 0)
    q = np.clip(np.rint(groups * inv[:, :, None]), -127, 127).astype(np.int8)
    return q.reshape(m, k), s.astype(_F32)


def pack_q8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """W[k,n] (fp32, k % 32 == 0) quantised per group of 32 rows of each column and packed in quads:
    ``(wq int8 [k/4, n, 4], w_scale float32 [k/32, n])`` with ``wq[kk//4, j, kk%4]`` the quantised ``W[kk, j]``."""
    w = np.ascontiguousarray(w, dtype=_F32)
    k, n = w.shape
    if k % GROUP:
        raise ValueError(f"k must be a multiple of {GROUP}, got W of shape {w.shape}")
    groups = w.reshape(k // GROUP, GROUP, n)
    scale = np.abs(groups).max(axis=1) / _F32(127)
    scale[scale == 0] = _F32(1)
    wq = np.clip(np.rint(groups / scale[:, None, :]), -127, 127).astype(np.int8).reshape(k, n)
    return np.ascontiguousarray(wq.reshape(k // 4, 4, n).transpose(0, 2, 1)), scale.astype(_F32)


def _group_sums(x: np.ndarray, wq: np.ndarray, w_scale: np.ndarray, magnitude: bool) -> np.ndarray:
    """sum_g s_g * w_scale_g * dot_g in float64 (of the values' magnitudes where ``magnitude``: the error scale)."""
    q, s = quantize_groups(x)
    m, k = q.shape
    w = unpack_int8(wq).astype(np.float64).reshape(k // GROUP, GROUP, -1)
    a = q.astype(np.float64).reshape(m, k // GROUP, GROUP)
    if magnitude:
        a, w = np.abs(a), np.abs(w)
    dots = np.einsum("mgc,gcn->mgn", a, w)  # exact integers
    return np.einsum("mg,gn,mgn->mn", s.astype(np.float64), np.asarray(w_scale, np.float64), dots)


def q8_linear_reference(x: np.ndarray, wq: np.ndarray, w_scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """y [m,n] of the layer (the module docstring): exact group sums, scaled and added in float64, rounded once."""
    return (_group_sums(x, wq, w_scale, False) + np.asarray(bias, np.float64)).astype(_F32)


class LinearQ8Args(LinearArgs):
    task_name = "linear_q8"
    k_multiple = GROUP

    m: int = Field(8, ge=1, description="rows of x and y: the sequences of a decode step")
    k: int = Field(576, ge=1, description="columns of x, rows of W; a multiple of 32")
    n: int = Field(3072, ge=16, description="columns of W and y; a multiple of 16")


class LinearQ8(Avx2LinearTask):
    """int8 GEMM + bias with activations quantised per group of 32 inside the kernel; the template is an AVX2
    register tile over W's quads."""

    name = "linear_q8"
    description = (
        "int8 linear layer for a decoder (GOP/s, 2*m*n*k per call): each group of 32 values of a row of x[m,k] "
        "(fp32 row-major) quantised to s8 with s = max|x| / 127, q = clamp(rint(x * (1/s)), -127, 127) (q = 0 "
        "where max|x| = 0; round half to even); W quantised ahead of time to s8 with a scale per group of 32 rows "
        "of each column (w_scale[g*n + j]), packed in quads [k/4][n][4] (wq[((kk/4)*n + j)*4 + kk%4]); "
        "dot_g = q_g . wq_g exact in int32; y = sum_g (s_g * w_scale_g) * dot_g + bias in fp32 (groups in any "
        "order); k % 32 == 0, n % 16 == 0"
    )
    signature = "void kernel(int m, int n, int k, const float *x, const int8_t *wq, const float *w_scale, " \
                "const float *bias, float *y)"  # fmt: skip
    # the decoder's GEMMs (its linear and lm_head slots, runtime.decoder.kernels); the encoder keeps per-token int8
    slot = Slot("decoder_linear", cpu_flags=("avx2", "fma"), k_multiple=GROUP, n_multiple=16)
    Args = LinearQ8Args
    args: LinearQ8Args
    isa_flags = ("-mavx2", "-mfma")
    peak_multiple = 2  # vpmaddubsw: 32 multiply-adds an instruction, with vpmaddwd and vpsignb beside it
    registers = "2 * MR * NR + NR <= 13"  # int32 and fp32 accumulators, W vectors, the broadcast quad and its size
    panel = ("PANEL", 8, 512)
    # 1 row x 32 columns: at a decode step's 8 rows it beat 4 x 8 by about a quarter (`evo run
    # configs/linear_q8_smollm2.yaml`, 30 evaluations, Xeon); the decoder runs this seed unless given a genome
    tile_seed = {"MR": 1, "NR": 4, "KU": 8, "PANEL": 64}
    packed = ("wq", "w_scale")
    block = ("c_block_ints", "int32 sums")
    sources = ("linear_q8_template.c", "linear_q8_naive.c")

    def slot_pack(self, w: np.ndarray) -> tuple[np.ndarray, ...]:
        return pack_q8(w)

    def check_cases(self, rng: np.random.Generator) -> list[Case]:
        """The decoder's shapes at decode batches (1, 3, 8) and a prompt chunk (33), MiniLM's, small shapes with
        column tails, and two drawn ones."""
        decoder = [{"m": m, "k": k, "n": n} for k, n in DECODER_SHAPES for m in (1, 3, 8, 33)]
        return decoder + super().check_cases(rng)

    def inputs(self, case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """x within +-1 with outliers: in each row every seventh group is 40 times larger (a per-row scale would
        round the others to a few steps), one group in five is all zero, and row 2 is zero; W within +-1, every
        third group of rows 20 times larger (a per-column scale would lose the others), column 3 all zero (given
        as ``w``, quantised and packed as ``wq`` and ``w_scale``)."""
        m, k, n = case["m"], case["k"], case["n"]
        x = rng.uniform(-1.0, 1.0, (m, k)).astype(_F32)
        groups = x.reshape(m, k // GROUP, GROUP)
        groups[:, ::7] *= _F32(40.0)
        groups[:, 3::5] = 0.0
        if m > 2:
            x[2] = 0.0
        w = rng.uniform(-1.0, 1.0, (k, n)).astype(_F32)
        w.reshape(k // GROUP, GROUP, n)[::3] *= _F32(20.0)
        w[:, 3] = 0.0
        wq, w_scale = self.slot_pack(w)
        bias = rng.uniform(-1.0, 1.0, n).astype(_F32)
        return {"x": x, "w": w, "wq": wq, "w_scale": w_scale, "bias": bias}

    def reference(self, case: Case, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        """:func:`q8_linear_reference`."""
        outputs["y"][...] = q8_linear_reference(inputs["x"], inputs["wq"], inputs["w_scale"], inputs["bias"])

    def tolerance(self, case: Case) -> tuple[float, float]:
        """Against :meth:`error_scale` (each group's ``s * w_scale * |q| . |wq|`` summed, plus ``|bias|``): an fp32
        sum of k/32 terms in any order, with 16 roundings of margin. One activation value off by a step moves an
        output by ``s * |w|``, far more (checked in the tests)."""
        return (16 * (case["k"] / GROUP + 2) * 2.0**-24, 1e-30)

    def error_scale(self, case: Case, inputs: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray],
                    ) -> Mapping[str, np.ndarray]:  # fmt: skip
        return {"y": _group_sums(inputs["x"], inputs["wq"], inputs["w_scale"], True) + np.abs(inputs["bias"])}
