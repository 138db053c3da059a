"""The built-in ``linear_int8_avx2`` task: ``linear_int8`` on CPUs with AVX2 and no AVX512_VNNI.

The arithmetic and the reference are ``linear_int8``'s (:mod:`runtime.tasks.linear_int8`: x quantised per row to
u8 inside the kernel, W per column to s8 ahead of time, exact int32 sums, the same fp32 epilogue), so its elites
answer bit for bit what a VNNI elite answers. The instructions and W's layout differ. AVX2 has no ``vpdpbusd``,
and its ``vpmaddubsw`` adds u8 x s8 pairs into a *saturating* int16 (2 x 255 x 127 does not fit), so the template
widens both to int16 and multiplies with ``vpmaddwd``, exact in int32. W comes in panels of 8 columns whose k
rows are contiguous (:func:`pack_int8_panels`): ``linear_int8``'s quads put a column block's successive k steps
``4 n`` bytes apart (BENCHMARKS.md, "The int8 AVX2 tile on panels": ``bench/engine_linear_slot.py``). The weights
stay 8-bit: a decoder's one-token GEMV reads every weight from memory once per token, and int16 would double that.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from genome import Genome
from runtime.slots import Slot
from runtime.task import Case
from runtime.tasks._linear import Avx2LinearTask
from runtime.tasks.linear_int8 import LinearInt8, LinearInt8Args, int8_linear_reference, pack_int8

__all__ = ["LinearInt8Avx2", "pack_int8_panels", "panels_to_quads", "quads_to_panels"]


def quads_to_panels(wq: np.ndarray) -> np.ndarray:
    """``linear_int8``'s quads ``[k/4, n, 4]`` as this task's panels ``[n/8, k/4, 8, 4]`` (s8):
    ``wp[j//8, kk//4, j%8, kk%4]`` is ``W[kk, j]``."""
    quads, n, _ = wq.shape
    if n % 8:
        raise ValueError(f"n must be a multiple of 8 to pack in panels of 8 columns, got {n}")
    return np.ascontiguousarray(np.asarray(wq, np.int8).reshape(quads, n // 8, 8, 4).transpose(1, 0, 2, 3))


def panels_to_quads(wp: np.ndarray) -> np.ndarray:
    """The inverse of :func:`quads_to_panels`."""
    panels, quads = wp.shape[:2]
    return np.ascontiguousarray(np.asarray(wp, np.int8).transpose(1, 0, 2, 3).reshape(quads, panels * 8, 4))


def pack_int8_panels(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W[k,n] (fp32) quantised per column exactly as :func:`runtime.tasks.linear_int8.pack_int8`, laid out in
    panels (:func:`quads_to_panels`): ``(wp int8 [n/8, k/4, 8, 4], w_scale float32 [n], w_colsum int32 [n])``."""
    wq, scale, colsum = pack_int8(w)
    return quads_to_panels(wq), scale, colsum


class LinearInt8Avx2Args(LinearInt8Args):
    task_name = "linear_int8_avx2"
    k_multiple = 32


class LinearInt8Avx2(Avx2LinearTask, LinearInt8):
    """Dynamic-quantisation int8 GEMM + bias on AVX2: a ``vpmaddwd`` register tile over W's panels, after
    quantising each row of x once per call."""

    name = "linear_int8_avx2"
    description = (
        LinearInt8.description.replace("k % 64 == 0", "k % 32 == 0")
        .replace("packed in quads [k/4][n][4] (wq[((kk/4)*n + j)*4 + kk%4])",
                 "packed in panels of 8 columns [n/8][k/4][8][4] (wp[(((j/8)*(k/4) + kk/4)*8 + j%8)*4 + kk%4])")
        .replace("sum_k wq;", "sum_k wp;")
        .replace("acc = q @ wq", "acc = q @ wp")
    )
    signature = (
        "void kernel(int m, int n, int k, const float *x, const int8_t *wp, const float *w_scale, "
        "const int32_t *w_colsum, const float *bias, float *y)"
    )
    slot = Slot("linear", cpu_flags=("avx2",), k_multiple=32, n_multiple=16, stands_in_for="linear_int8")
    Args = LinearInt8Avx2Args
    args: LinearInt8Avx2Args
    isa_flags = ("-mavx2", "-mfma", "-ffp-contract=off")
    peak_multiple = 2  # vpmaddwd: 16 multiply-adds an instruction against an AVX2 FMA's 8
    registers = "2 * MR * NR + 2 * NR <= 15"  # two accumulators and two widened B vectors per 8 columns
    panel = ("PANEL", 8, 512)
    tile_seed = {"MR": 4, "NR": 1, "KU": 2, "PANEL": 64}  # 4 rows x 8 columns
    packed = ("wp", "w_scale", "w_colsum")
    sources = ("linear_int8_avx2_template.c", "linear_int8_naive.c")

    def seeds(self) -> list[Genome]:
        """``linear_int8``'s scalar loops reading W where the panels put it, and a plain register tile."""
        naive, tile = super().seeds()
        panels = "#define W_AT(kk, j) wq[((((long)(j) / 8) * (k / 4) + (kk) / 4) * 8 + (j) % 8) * 4 + (kk) % 4]\n"
        return [Genome(params={}, source=panels + (naive.source or "")), tile]

    def slot_pack(self, w: np.ndarray) -> tuple[np.ndarray, ...]:
        return pack_int8_panels(w)

    def inputs(self, case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """``linear_int8``'s inputs, W also laid out in this task's panels (``wp``)."""
        arrays = super().inputs(case, rng)
        arrays["wp"] = quads_to_panels(arrays["wq"])
        return arrays

    def reference(self, case: Case, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        """``linear_int8``'s reference on the weights the kernel gets: the panels, read back as quads."""
        outputs["y"][...] = int8_linear_reference(inputs["x"], panels_to_quads(inputs["wp"]), inputs["w_scale"],
                                                  inputs["w_colsum"], inputs["bias"])  # fmt: skip
