"""The built-in ``lm_head_topk_vnni`` task: ``lm_head_topk`` on CPUs with AVX512_VNNI.

The arithmetic, the packing, the reference and the judge are ``lm_head_topk``'s (:mod:`runtime.tasks.lm_head_topk`).
Only the tile differs: ``vpdpbusd`` adds four u8 x s8 products into int32 in one instruction, over two groups of 32
at a time (the activations' signs moved onto the head with a masked byte subtraction), where AVX2 needs
``vpsignb``, ``vpmaddubsw`` and ``vpmaddwd`` for one group.
"""

from __future__ import annotations

from genome import IntParam, ParamSpace, Pow2Param
from runtime.slots import Slot
from runtime.tasks.lm_head_topk import LmHeadTopk, LmHeadTopkArgs

__all__ = ["LmHeadTopkVnni"]


class LmHeadTopkVnni(LmHeadTopk):
    """The q8 LM head's top list on AVX512_VNNI: a ``vpdpbusd`` tile of RB head rows by MR rows of x."""

    name = "lm_head_topk_vnni"
    description = LmHeadTopk.description.replace("in int8 with its top list", "in int8 with its top list on "
                                                 "AVX512_VNNI")  # fmt: skip
    slot = Slot("lm_head", cpu_flags=("avx512bw", "avx512_vnni"), k_multiple=32)
    Args = LmHeadTopkArgs

    def space(self) -> ParamSpace:
        """The tile (its accumulators and each x row's magnitudes, signs and scales fit 32 registers), the vocabulary
        block and the unroll over pairs of groups."""
        return ParamSpace(
            {
                "MR": IntParam(type="int", low=1, high=4),
                "RB": IntParam(type="int", low=1, high=8),
                "BLOCK": Pow2Param(type="pow2", low=32, high=1024),
                "GU": Pow2Param(type="pow2", low=1, high=4),
            },
            ["MR * RB + 3 * MR <= 28"],
        )

    def template(self) -> str:
        return "#define USE_VNNI 1\n" + super().template()

    def compile_flags(self) -> list[str]:
        flags = ["-mavx512f", "-mavx512bw", "-mavx512vnni", "-mavx2", "-mfma"]
        return [*flags, "-fopenmp"] if self.args.threads > 1 else flags

    def ceiling(self, fma_gflops: float) -> float:
        """vpdpbusd's 64 multiply-adds an instruction against an AVX2 FMA's 8, with a conversion and an FMA for every
        16 sums: at most 8 times the fp32 FMA peak."""
        return 8 * fma_gflops * self.args.threads
