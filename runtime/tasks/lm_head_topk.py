"""The built-in ``lm_head_topk`` task: a decoder's LM head in q8, fused with the choice of its ``top`` likeliest tokens.

A decode step needs of the logits ``x [m,k] @ W.T`` (W the head, ``[vocab, k]``) only what the sampler reads: the
likeliest tokens (greedy, top-k sampling, the log-probabilities a request asks for) and each row's log-sum-exp
(a log-probability's normaliser). The kernel never writes the ``[m, vocab]`` logits: it keeps, per row, the ``top``
largest logits with their token ids, and the log-sum-exp over every token.

The arithmetic is ``linear_q8``'s (:mod:`runtime.tasks.linear_q8`), W's groups of 32 running along each token's row:

* x: each group of 32 values of a row quantised with its own scale (:func:`~runtime.tasks.linear_q8.quantize_groups`);
* W (:func:`pack_rows_q8`, once): ``wq int8 [vocab, k]``, ``w_scale [vocab, k/32]`` (``max |W| / 127`` of the group,
  1 for a group of zeros);
* ``logit[i,v] = sum_g (s_g[i] * w_scale[v,g]) * dot_g[i,v]``, ``dot_g`` exact in int32, the groups added in fp32;
* outputs per row i: ``values[i, 0:top]`` the ``top`` largest logits in descending order, ``ids[i, 0:top]`` their
  tokens (equal logits in any order), ``lse[i] = log(sum_v exp(logit[i,v]))``.

Checked (:meth:`LmHeadTopk.judge`): the values against the exact top values (a sorted list moves by no more than
its largest element's error), every id's own exact logit against the value returned for it, ids distinct and in
range, and the log-sum-exp within fp32 rounding of its terms plus ``1e-4``. So a returned list is a true top list
up to the tolerance, whichever of two near-equal tokens it keeps. The template runs on AVX2 and FMA alone; its
sibling ``lm_head_topk_vnni`` runs the same arithmetic on AVX512_VNNI.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, ClassVar

import numpy as np
from pydantic import Field, model_validator

from genome import Genome, IntParam, ParamSpace, Pow2Param
from runtime.slots import Slot, SlotTask
from runtime.task import Case, Descriptor, TaskArgs
from runtime.tasks._common import load_c_source
from runtime.tasks.linear_q8 import GROUP, quantize_groups

__all__ = ["HEAD_TASKS", "LSE_ATOL", "LmHeadTopk", "exact_logits", "head_task", "head_tasks", "pack_rows_q8"]

_F32 = np.float32
LSE_ATOL = 1e-4
"""Nats a kernel's log-sum-exp may be off beyond its terms' own error: an fp32 sum of tens of thousands of terms and
a vectorised ``exp``."""


_HEAD_ROWS = 8192  # head rows at a time: Gemma 3's 262,144-row head in float64 whole takes 1.25 GiB


def pack_rows_q8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The head ``w [vocab, k]`` (fp32, ``k % 32 == 0``) in int8 per group of 32 values of each row:
    ``(wq int8 [vocab, k], w_scale float32 [vocab, k/32])``."""
    w = np.ascontiguousarray(w, dtype=_F32)
    vocab, k = w.shape
    if k % GROUP:
        raise ValueError(f"k must be a multiple of {GROUP}, got a head of shape {w.shape}")
    wq, scale = np.empty((vocab, k), np.int8), np.empty((vocab, k // GROUP), _F32)
    for lo in range(0, vocab, _HEAD_ROWS):  # a block's temporaries at a time, not a whole head's
        groups = w[lo : lo + _HEAD_ROWS].reshape(-1, k // GROUP, GROUP)
        s = np.abs(groups).max(axis=2) / _F32(127)
        s[s == 0] = _F32(1)
        scale[lo : lo + _HEAD_ROWS] = s
        wq[lo : lo + _HEAD_ROWS] = np.clip(np.rint(groups / s[:, :, None]), -127, 127).reshape(-1, k)
    return wq, scale


def exact_logits(x: np.ndarray, wq: np.ndarray, w_scale: np.ndarray, magnitude: bool = False) -> np.ndarray:
    """The logits ``[m, vocab]`` in float64 (of the values' magnitudes where ``magnitude``: the error scale). Each
    dequantised value ``q * s`` is exact in float64, and so nearly is each product: one BLAS GEMM."""
    q, s = quantize_groups(x)
    m, k = q.shape
    a = (q.astype(np.float64).reshape(m, k // GROUP, GROUP) * s.astype(np.float64)[:, :, None]).reshape(m, k)
    a = np.abs(a) if magnitude else a
    out = np.empty((m, len(wq)))
    for lo in range(0, len(wq), _HEAD_ROWS):  # the head in float64 whole would take 1.25 GiB at Gemma 3's size
        w = wq[lo : lo + _HEAD_ROWS].astype(np.float64).reshape(-1, k // GROUP, GROUP)
        w = (w * w_scale[lo : lo + _HEAD_ROWS].astype(np.float64)[:, :, None]).reshape(-1, k)
        out[:, lo : lo + _HEAD_ROWS] = a @ (np.abs(w) if magnitude else w).T
    return out


HEAD_TASKS = ("lm_head_topk_vnni", "lm_head_topk")
"""The tasks of the LM head's top list, the engine's default first where the CPU runs it: the VNNI seed ran Gemma 3's
head (8 rows of 640 x 262,144) in 12.0 ms on a Zen 4 where the AVX2 seed took 15.5 (``python bench/lm_head_topk.py
--model gemma3``)."""


def head_tasks(flags: Collection[str]) -> list[str]:
    """The top-list tasks a CPU with ``flags`` runs, the engine's default first (each is a search of a factory's
    plan: which tile wins on a CPU is measured, not assumed)."""
    from runtime.task import load_task_class

    return [name for name in HEAD_TASKS if not load_task_class(name).slot.missing(flags)]  # type: ignore[union-attr]


def head_task(flags: Collection[str]) -> str | None:
    """The top-list task an engine runs by default on a CPU with ``flags`` (``None``: none)."""
    return next(iter(head_tasks(flags)), None)


def _lse(logits: np.ndarray) -> np.ndarray:
    peak = logits.max(axis=1)
    return peak + np.log(np.exp(logits - peak[:, None]).sum(axis=1))


class LmHeadTopkArgs(TaskArgs):
    """Shape of the timed case: SmolLM2-135M's head (576 x 49,152) at a decode step of 8 sequences."""

    m: int = Field(8, ge=1, description="rows of x: the sequences of a decode step")
    k: int = Field(576, ge=32, description="the hidden size; a multiple of 32")
    vocab: int = Field(49152, ge=1, description="rows of the head: the vocabulary")
    top: int = Field(64, ge=1, le=256, description="likeliest tokens kept per row")

    @model_validator(mode="after")
    def _shape(self) -> LmHeadTopkArgs:
        if self.k % GROUP:
            raise ValueError(f"lm_head_topk needs k % {GROUP} == 0, got k={self.k}")
        if self.top > self.vocab:
            raise ValueError(f"top {self.top} is over the vocabulary of {self.vocab}")
        return self


class LmHeadTopk(SlotTask):
    """The q8 LM head and its top list per row; the template is an AVX2 tile of RB head rows by MR rows of x over a
    block of the vocabulary, whose logits then feed the running top list and log-sum-exp."""

    name = "lm_head_topk"
    unit = "GOP/s"
    description = (
        "a decoder's LM head in int8 with its top list (GOP/s, 2*m*vocab*k per call): each group of 32 values of a "
        "row of x[m,k] (fp32 row-major) quantised to s8 with s = max|x| / 127, q = clamp(rint(x * (1/s)), -127, 127) "
        "(q = 0 where max|x| = 0; round half to even); the head quantised ahead of time, row-major wq[vocab][k] s8 "
        "with w_scale[v*(k/32) + g] per group of 32 of each row; logit[i][v] = sum_g (s_g * w_scale[v][g]) * dot_g "
        "(dot_g exact in int32, groups added in fp32 in any order); per row i: values[i*top + 0..top) the top "
        "largest logits in descending order, ids[i*top + ...] their token ids (ties in any order), lse[i] = "
        "log(sum_v exp(logit[i][v])); k % 32 == 0, top <= vocab"
    )
    signature = ("void kernel(int m, int vocab, int k, int top, const float *x, const int8_t *wq, "
                 "const float *w_scale, int32_t *ids, float *values, float *lse)")  # fmt: skip
    slot = Slot("lm_head", cpu_flags=("avx2", "fma"), k_multiple=GROUP, stands_in_for="lm_head_topk_vnni")
    Args = LmHeadTopkArgs
    args: LmHeadTopkArgs
    judged = ("ids",)

    registers: ClassVar[str] = "MR * RB + 2 * MR <= 14"  # accumulators, and each row of x's values and magnitudes

    def space(self) -> ParamSpace:
        """The tile (its accumulators and what it keeps of each row of x fit the vector registers:
        :attr:`registers`), the vocabulary block and the unroll over groups."""
        return ParamSpace(
            {
                "MR": IntParam(type="int", low=1, high=4),
                "RB": IntParam(type="int", low=1, high=8),
                "BLOCK": Pow2Param(type="pow2", low=32, high=1024),
                "GU": Pow2Param(type="pow2", low=1, high=4),
            },
            [self.registers],
        )

    def template(self) -> str:
        return load_c_source("lm_head_topk_template.c")

    def seeds(self) -> list[Genome]:
        """The scalar loops, and a modest tile (the decoder's default)."""
        return [Genome(params={}, source=load_c_source("lm_head_topk_naive.c")),
                Genome(params={"MR": 1, "RB": 8, "BLOCK": 256, "GU": 1})]  # fmt: skip

    def compile_flags(self) -> list[str]:
        flags = ["-mavx2", "-mfma"]
        return [*flags, "-fopenmp"] if self.args.threads > 1 else flags

    def ceiling(self, fma_gflops: float) -> float:
        """vpmaddubsw's 32 multiply-adds an instruction, with vpmaddwd and a conversion beside it: at most twice the
        fp32 FMA peak."""
        return 2 * fma_gflops * self.args.threads

    def full_case(self) -> Case:
        a = self.args
        return {"m": a.m, "k": a.k, "vocab": a.vocab, "top": a.top}

    def check_cases(self, rng: np.random.Generator) -> list[Case]:
        """Decode batches (1, 3, 8) and a prompt's last rows (17) over vocabularies with tails of every block, a
        list as long as the vocabulary, and two drawn cases."""
        fixed = [(1, 64, 300, 1), (3, 96, 1000, 5), (8, 576, 4099, 64), (17, 64, 777, 40), (2, 32, 50, 50),
                 (8, 640, 2053, 20), (5, 128, 65, 64)]  # fmt: skip
        drawn = [(int(rng.integers(1, 12)), GROUP * int(rng.integers(1, 9)), int(rng.integers(100, 3000)),
                  int(rng.integers(1, 65))) for _ in "ab"]  # fmt: skip
        return [{"m": m, "k": k, "vocab": v, "top": t} for m, k, v, t in fixed + drawn]

    def inputs(self, case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """x like a final norm's output (with outlier groups); a head within +-0.1 (every third group larger), where
        one token's row repeats another's (two equal logits on every row: a tie at some place of the list) and one
        is all zero; given packed, as ``wq`` and ``w_scale`` only (the kernel reads nothing else of it, and an fp32
        copy beside each packed one would take 640 MiB at Gemma 3's size)."""
        m, k, vocab = case["m"], case["k"], case["vocab"]
        x = rng.standard_normal((m, k)).astype(_F32)
        x.reshape(m, k // GROUP, GROUP)[:, ::5] *= _F32(8.0)
        w = rng.random((vocab, k), dtype=_F32) * _F32(0.2) - _F32(0.1)  # drawn in fp32: no float64 head
        w.reshape(vocab, k // GROUP, GROUP)[:, ::3] *= _F32(4.0)
        if vocab > 2:
            w[vocab // 2] = w[1]
            w[vocab - 1] = 0.0
        wq, w_scale = self.slot_pack(w)
        return {"x": x, "wq": wq, "w_scale": w_scale}

    def outputs(self, case: Case) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        m, top = case["m"], case["top"]
        return {"ids": ((m, top), np.dtype(np.int32)), "values": ((m, top), np.dtype(np.float32)),
                "lse": ((m,), np.dtype(np.float32))}  # fmt: skip

    def reference(self, case: Case, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        """The exact logits (:func:`exact_logits`), their top list (ties by id) and log-sum-exp, rounded once."""
        logits = exact_logits(inputs["x"], *self.head(inputs))
        order = np.argsort(-logits, axis=1, kind="stable")[:, : case["top"]]
        outputs["ids"][...] = order
        outputs["values"][...] = np.take_along_axis(logits, order, axis=1)
        outputs["lse"][...] = _lse(logits)

    def tolerance(self, case: Case) -> tuple[float, float]:
        """linear_q8's: an fp32 sum of k/32 terms in any order, 16 roundings of margin, against the row's error
        scale (:meth:`error_scale`)."""
        return (16 * (case["k"] / GROUP + 2) * 2.0**-24, 1e-30)

    def _row_scale(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        return exact_logits(inputs["x"], *self.head(inputs), magnitude=True).max(axis=1)

    def error_scale(self, case: Case, inputs: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray],
                    ) -> Mapping[str, np.ndarray]:  # fmt: skip
        """Each row's largest error scale (a sorted list's place moves by at most the largest error of its
        elements); the log-sum-exp's also allows :data:`LSE_ATOL`."""
        rtol, _ = self.tolerance(case)
        row = self._row_scale(inputs)
        return {"values": np.broadcast_to(row[:, None], (case["m"], case["top"])), "lse": row + LSE_ATOL / rtol}

    def judge(self, case: Case, inputs: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray],
              got: Mapping[str, np.ndarray]) -> str | None:  # fmt: skip
        """The ids: in range, distinct in each row, and each one's exact logit within the tolerance of the value
        returned beside it."""
        ids, values = got["ids"], got["values"]
        if ((ids < 0) | (ids >= case["vocab"])).any():
            i, j = np.argwhere((ids < 0) | (ids >= case["vocab"]))[0]
            return f"id {int(ids[i, j])} at row {i}, place {j} is outside the vocabulary of {case['vocab']}"
        for i, row in enumerate(ids):
            if len(np.unique(row)) != len(row):
                return f"row {i} names a token twice in its top list"
        logits = exact_logits(inputs["x"], *self.head(inputs))
        own = np.take_along_axis(logits, ids.astype(np.int64), axis=1)
        rtol, atol = self.tolerance(case)
        bound = atol + rtol * self._row_scale(inputs)[:, None]
        with np.errstate(invalid="ignore"):
            bad = ~(np.abs(own - values.astype(np.float64)) <= bound)
        if bad.any():
            i, j = np.argwhere(bad)[0]
            return (f"token {int(ids[i, j])} at row {i}, place {j} has logit {own[i, j]:.7g}, not the "
                    f"{values[i, j]:.7g} returned beside it")  # fmt: skip
        return None

    def head(self, inputs: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """The head as :func:`pack_rows_q8` lays it out (``wq``, ``w_scale``), from the kernel's inputs."""
        return inputs["wq"], inputs["w_scale"]

    def slot_pack(self, w: np.ndarray) -> tuple[np.ndarray, ...]:
        """The head ``[vocab, k]`` (the model's own layout, not a GEMM's ``[k, n]``)."""
        return pack_rows_q8(w)

    def slot_args(self, operands: Mapping[str, Any], out: np.ndarray) -> list[Any]:
        x, (wq, w_scale) = operands["x"], operands["packed"]
        return [x.shape[0], wq.shape[0], x.shape[1], int(operands["top"]), x, wq, w_scale, operands["ids"], out,
                operands["lse"]]  # fmt: skip

    def kernel_args(self, case: Case, arrays: Mapping[str, np.ndarray]) -> list[Any]:
        return [case["m"], case["vocab"], case["k"], case["top"], arrays["x"], arrays["wq"], arrays["w_scale"],
                arrays["ids"], arrays["values"], arrays["lse"]]  # fmt: skip

    def work(self, case: Case) -> float:
        """GOP of int8 multiply-adds: 2 m vocab k."""
        return 2.0 * case["m"] * case["vocab"] * case["k"] / 1e9

    def descriptors(self) -> dict[str, Descriptor]:
        return {
            **super().descriptors(),
            "tile": Descriptor("tile", "MR * RB: logits a tile computes at once",
                               lambda g, m: float(g.params.get("MR", 1) * g.params.get("RB", 1)), 0.0, 32.0),
        }  # fmt: skip
