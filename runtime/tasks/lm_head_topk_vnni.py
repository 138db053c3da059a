"""The built-in ``lm_head_topk_vnni`` task: ``lm_head_topk`` on CPUs with AVX512_VNNI.

The arithmetic, the reference and the judge are ``lm_head_topk``'s (:mod:`runtime.tasks.lm_head_topk`). The tile
differs: ``vpdpbusd`` adds four u8 x s8 products into int32 in one instruction, over two groups of 32 at a time
(the activations' signs moved onto the head with a masked byte subtraction), where AVX2 needs ``vpsignb``,
``vpmaddubsw`` and ``vpmaddwd`` for one group. So does the head's layout (:func:`interleave_pairs`): within each
pair of groups the 4-byte chunks alternate between the two, so that the even int32 sums of a vector are the first
group's and the odd ones the second's, and the pair's two scales (adjacent in ``w_scale``) reach their lanes in one
8-byte broadcast. The kernel lays each row of x out the same way.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from genome import Genome
from runtime.slots import Slot
from runtime.tasks.lm_head_topk import LmHeadTopk, LmHeadTopkArgs, pack_rows_q8

__all__ = ["LmHeadTopkVnni", "interleave_pairs"]


def interleave_pairs(wq: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Rows of int8 values (``[rows, k]``, ``k % 32 == 0``) with each pair of groups of 32 interleaved by 4-byte chunks:
    place ``2c + h`` of a pair's 64 bytes holds chunk ``c`` of its group ``h`` (a last, unpaired group stays as it
    is); ``inverse`` undoes it."""
    rows, k = wq.shape
    span = k // 64 * 64
    body = wq[:, :span].reshape(rows, k // 64, *((8, 2, 4) if inverse else (2, 8, 4)))
    out = wq.copy()
    out[:, :span] = body.transpose(0, 1, 3, 2, 4).reshape(rows, span)
    return out


class LmHeadTopkVnni(LmHeadTopk):
    """The q8 LM head's top list on AVX512_VNNI: a ``vpdpbusd`` tile of RB head rows by MR rows of x."""

    name = "lm_head_topk_vnni"
    description = LmHeadTopk.description.replace("in int8 with its top list", "in int8 with its top list on "
                                                 "AVX512_VNNI").replace(
        "row-major wq[vocab][k] s8", "row-major wq[vocab][k] s8 (in each pair of groups of 32, the 4-byte chunks "
        "alternate between the two: byte 4*(2c+h)+b of the pair is byte 4c+b of its group h; a last unpaired group as "
        "it is)")  # fmt: skip
    slot = Slot("lm_head", cpu_flags=("avx512bw", "avx512_vnni"), k_multiple=32)
    Args = LmHeadTopkArgs
    registers = "MR * RB + 3 * MR <= 28"  # of 32: accumulators, and each row of x's magnitudes, signs and scales

    def template(self) -> str:
        return "#define USE_VNNI 1\n" + super().template()

    def seeds(self) -> list[Genome]:
        """``lm_head_topk``'s, reading the interleaved head."""
        return [Genome(params=g.params, source=None if g.source is None else "#define USE_VNNI 1\n" + g.source)
                for g in super().seeds()]  # fmt: skip

    def slot_pack(self, w: np.ndarray) -> tuple[np.ndarray, ...]:
        """``lm_head_topk``'s packing, each row's pairs of groups interleaved (:func:`interleave_pairs`)."""
        wq, w_scale = pack_rows_q8(w)
        return interleave_pairs(wq), w_scale

    def head(self, inputs: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        return interleave_pairs(inputs["wq"], inverse=True), inputs["w_scale"]

    def compile_flags(self) -> list[str]:
        flags = ["-mavx512f", "-mavx512bw", "-mavx512vnni", "-mavx2", "-mfma"]
        return [*flags, "-fopenmp"] if self.args.threads > 1 else flags

    def ceiling(self, fma_gflops: float) -> float:
        """vpdpbusd's 64 multiply-adds an instruction against an AVX2 FMA's 8, with a conversion and an FMA for every
        16 sums: at most 8 times the fp32 FMA peak."""
        return 8 * fma_gflops * self.args.threads
