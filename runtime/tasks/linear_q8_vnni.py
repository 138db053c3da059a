"""The built-in ``linear_q8_vnni`` task: ``linear_q8`` on CPUs with AVX512_VNNI.

The arithmetic, the packing and the reference are ``linear_q8``'s (:mod:`runtime.tasks.linear_q8`: both sides in
int8 scaled per group of 32, exact int32 group sums, the groups added in fp32). Only the instructions differ:
``vpdpbusd`` adds four u8 x s8 products into int32 in one instruction, over 16 columns, where AVX2 needs
``vpsignb``, ``vpmaddubsw`` and ``vpmaddwd`` for 8. The activations' signs move onto W with a masked byte
subtraction, AVX-512 having no ``vpsignb``.
"""

from __future__ import annotations

from runtime.slots import Slot
from runtime.tasks.linear_q8 import GROUP, LinearQ8, LinearQ8Args

__all__ = ["LinearQ8Vnni"]


class LinearQ8VnniArgs(LinearQ8Args):
    task_name = "linear_q8_vnni"


class LinearQ8Vnni(LinearQ8):
    """Per-group int8 GEMM + bias on AVX512_VNNI: a ``vpdpbusd`` register tile over W's quads."""

    name = "linear_q8_vnni"
    description = LinearQ8.description.replace("for a decoder", "for a decoder on AVX512_VNNI")
    slot = Slot("decoder_linear", cpu_flags=("avx512bw", "avx512_vnni"), k_multiple=GROUP, n_multiple=16)
    Args = LinearQ8VnniArgs
    args: LinearQ8VnniArgs
    isa = "VNNI"
    lanes = 16
    isa_flags = ("-mavx512f", "-mavx512bw", "-mavx512vnni", "-mavx2", "-mfma")
    peak_multiple = 8  # vpdpbusd: 64 multiply-adds an instruction against an AVX2 FMA's 8
    registers = "2 * MR * NR + NR <= 28"  # of 32 registers: accumulators, W vectors, the quad, its size and sign
    # 4 rows x 32 columns: on a Zen 4 it ran SmolLM2's four GEMMs 1.9x (8 rows) to 2.4x (32 rows) faster than the
    # 1 x 64 tile linear_q8 seeds with (python bench/q8_tiles.py); the decoder runs this seed unless given a genome
    tile_seed = {"MR": 4, "NR": 2, "KU": 8, "PANEL": 32}
    sources = ("linear_q8_vnni_template.c", "linear_q8_naive.c")
