"""What the ``linear_bf16`` and ``linear_int8`` tasks share: the engine's GEMM + bias, ``y[m,n] = x[m,k] @ W[k,n]
+ bias[n]`` with W packed ahead of time, in a template that is either an AVX512 register tile or AMX tiles.

A subclass says what differs: its ISA and flags, the k block it takes, how W is packed (the arrays the
kernel gets in W's place), its inputs, reference and tolerance. The cases checked, the genome's
shape, the descriptors and the way the engine's ``linear`` slot calls the kernels are the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
from pydantic import Field, model_validator

from genome import ChoiceParam, Genome, IntParam, ParamSpace, Pow2Param
from runtime.slots import SlotTask
from runtime.task import Case, Descriptor, KernelTask, TaskArgs
from runtime.tasks._common import load_c_source

__all__ = ["MINILM_SHAPES", "Avx2LinearTask", "LinearArgs", "LinearTask"]

MINILM_SHAPES: tuple[tuple[int, int], ...] = ((384, 1152), (384, 384), (384, 1536), (1536, 384))
"""MiniLM's ``(k, n)``: fused QKV projection, attention output, feed-forward up and down."""


class LinearArgs(TaskArgs):
    """Problem size of the timed case (MiniLM's feed-forward up-projection over a batch of tokens)."""

    task_name: ClassVar[str] = "linear"
    k_multiple: ClassVar[int] = 1

    m: int = Field(256, ge=1, description="rows of x and y (tokens of a batch)")
    k: int = Field(384, ge=1, description="columns of x, rows of W; a multiple of the task's k block (32 or 64)")
    n: int = Field(1536, ge=16, description="columns of W and y; a multiple of 16")

    @model_validator(mode="after")
    def _blocked(self) -> LinearArgs:
        if self.k % self.k_multiple or self.n % 16:
            raise ValueError(f"{self.task_name} needs k % {self.k_multiple} == 0 and n % 16 == 0, "
                             f"got k={self.k}, n={self.n}")  # fmt: skip
        return self


class LinearTask(SlotTask):
    """A packed-weight GEMM + bias (see the module docstring); subclasses fill in the class attributes."""

    unit = "GFLOP/s"
    isa: ClassVar[str]  # the register-tile ISA's name in the genome ("AVX512", "VNNI")
    isa_flags: ClassVar[tuple[str, ...]]
    panel: ClassVar[tuple[str, int, int]]  # the gene of the rows handled per panel: (name, low, high)
    tile_seed: ClassVar[dict[str, Any]]  # the plain register-tile seed's params
    packed: ClassVar[tuple[str, ...]]  # the input arrays the kernel gets in W's place, in order
    block: ClassVar[tuple[str, str]]  # (name, what it counts) of the accumulator-block descriptor
    sources: ClassVar[tuple[str, str]]  # (template, naive seed) C files
    peak_multiple: ClassVar[int]  # its widest instructions' flops per cycle over fp32 FMA's (AMX's, at most)
    args: LinearArgs

    def ceiling(self, fma_gflops: float) -> float:
        """No more than the fastest matrix instructions of the type: ``peak_multiple`` times the fp32 FMA peak."""
        return fma_gflops * self.args.threads * self.peak_multiple

    def space(self) -> ParamSpace:
        """ISA, the register tile (accumulators plus the B vectors fit 32 registers), the AMX block (C, A and B
        tiles fit the 8 tile registers) and the panel."""
        name, low, high = self.panel
        return ParamSpace(
            {
                "ISA": ChoiceParam(type="choice", values=(self.isa, "AMX")),
                "MR": IntParam(type="int", low=1, high=16),
                "NR": IntParam(type="int", low=1, high=4),
                "KU": Pow2Param(type="pow2", low=1, high=8),
                "AMX_MT": IntParam(type="int", low=1, high=2),
                "AMX_NT": IntParam(type="int", low=1, high=3),
                name: Pow2Param(type="pow2", low=low, high=high),
            },
            ["MR * NR <= 28", "MR * NR >= 4", "AMX_MT * AMX_NT + AMX_MT + AMX_NT <= 8"],
        )

    def template(self) -> str:
        return load_c_source(self.sources[0])

    def seeds(self) -> list[Genome]:
        """The scalar loops, and a plain register tile."""
        return [Genome(params={}, source=load_c_source(self.sources[1])), Genome(params=dict(self.tile_seed))]

    def compile_flags(self) -> list[str]:
        return [*self.isa_flags, "-fopenmp"] if self.args.threads > 1 else list(self.isa_flags)

    def full_case(self) -> Case:
        return {"m": self.args.m, "n": self.args.n, "k": self.args.k}

    def check_cases(self, rng: np.random.Generator) -> list[Case]:
        """Each MiniLM shape at m = 1, 7, 33 and 256 (tails of every row block), small shapes whose n leaves a
        column tail (80 = 5 x 16), and two drawn ones; every k a multiple of the task's block."""
        kb = self.args.k_multiple
        fixed = [(m, k, n) for k, n in MINILM_SHAPES for m in (1, 7, 33, 256)]
        fixed += [(7, kb, 16), (33, 2 * kb, 80), (17, 3 * kb, 208)]
        drawn = [(int(rng.integers(1, 70)), kb * int(rng.integers(1, 448 // kb + 1)), 16 * int(rng.integers(1, 13)))
                 for _ in "ab"]  # fmt: skip
        return [{"m": m, "k": k, "n": n} for m, k, n in fixed + drawn]

    def outputs(self, case: Case) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"y": ((case["m"], case["n"]), np.dtype(np.float32))}

    def kernel_args(self, case: Case, arrays: Mapping[str, np.ndarray]) -> list[Any]:
        packed = [arrays[name] for name in self.packed]
        return [case["m"], case["n"], case["k"], arrays["x"], *packed, arrays["bias"], arrays["y"]]

    def slot_args(self, operands: Mapping[str, Any], out: np.ndarray) -> list[Any]:
        x, packed = operands["x"], operands["packed"]
        return [x.shape[0], out.shape[1], x.shape[1], x, *packed, operands["bias"], out]

    def work(self, case: Case) -> float:
        """GFLOP (or GOP of int8 multiply-adds, counted alike): 2 m n k."""
        return 2.0 * case["m"] * case["n"] * case["k"] / 1e9

    def descriptors(self) -> dict[str, Descriptor]:
        name, what = self.block
        return {
            **super().descriptors(),
            name: Descriptor(
                name,
                f"{what} accumulated per block: MR * NR * 16 ({self.isa}) or AMX_MT * AMX_NT * 256 (AMX)",
                lambda g, m: float(
                    g.params.get("AMX_MT", 1) * g.params.get("AMX_NT", 1) * 256
                    if g.params.get("ISA") == "AMX"
                    else g.params.get("MR", 1) * g.params.get("NR", 1) * 16
                ),
                0.0,
                1024.0,
            ),
        }


class Avx2LinearTask(LinearTask):
    """A linear task whose template is an AVX2 register tile: 8 columns a vector and 16 vector registers, no
    AMX. It runs on every x86-64 CPU of the last decade (AMD Zen 2 and 3 have no AVX-512), and is the
    sibling of an AVX-512 task of the same slot. The genome is the tile and the panel."""

    isa = "AVX2"
    registers: ClassVar[str] = "MR * NR + NR <= 14"  # the tile's accumulators and B vectors in 16 registers
    lanes: ClassVar[int] = 8  # columns a vector (a sibling of this genome on AVX-512 vectors has 16)

    def space(self) -> ParamSpace:
        """The register tile (its accumulators, B vectors and broadcast A fit 16 registers: :attr:`registers`),
        the unroll over k and the panel."""
        name, low, high = self.panel
        return ParamSpace(
            {
                "MR": IntParam(type="int", low=1, high=8),
                "NR": IntParam(type="int", low=1, high=4),
                "KU": Pow2Param(type="pow2", low=1, high=8),
                name: Pow2Param(type="pow2", low=low, high=high),
            },
            [self.registers, "MR * NR >= 2"],
        )

    def descriptors(self) -> dict[str, Descriptor]:
        name, what, lanes = *self.block, self.lanes
        return {
            **KernelTask.descriptors(self),
            name: Descriptor(name, f"{what} accumulated per block: MR * NR * {lanes}",
                             lambda g, m: float(g.params.get("MR", 1) * g.params.get("NR", 1) * lanes), 0.0,
                             32.0 * lanes),
        }  # fmt: skip
