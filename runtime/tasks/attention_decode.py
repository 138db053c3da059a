"""The built-in ``attention_decode`` task: the decoder's attention over its KV caches (its ``attention`` slot,
:mod:`runtime.decoder.ops`), grouped-query heads, fp32, for a batch of sequences at different lengths. The timed
case is a decode step (one new query per sequence); the same kernel takes a prompt's chunk (several new queries
of a sequence), so a query's output is the same whichever way its prompt was cut into chunks.

Each sequence's cache is its own array in the engine. The kernel takes one base pointer for the keys and one
for the values, and each sequence's offsets from them (in elements), its filled length, its new queries and its
capacity: in the engine the base is the first sequence's cache; here, one buffer holds every sequence's cache,
the positions past each length filled with NaN, so a kernel that reads past a sequence's keys fails the check.

**Batch invariance is checked bit for bit.** A check case with a chunk (``queries`` > 1) appends a twin
sequence for each of the chunk's queries: a copy of the cache through that query, the query alone. Each twin's
output must equal its query's in the chunk exactly (:meth:`AttentionDecode.twin_rows`): a kernel whose rounding
depends on the tile, the chunk or the batch around a query fails, as it would change a request's greedy tokens
with the load on the server.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from genome import ChoiceParam, Genome, ParamSpace, Pow2Param, render_source
from runtime.slots import Slot, SlotTask
from runtime.task import Case, Descriptor, TaskArgs
from runtime.tasks._common import load_c_source

__all__ = ["AttentionDecode", "AttentionDecodeF16", "cache_layout"]


class AttentionDecodeArgs(TaskArgs):
    """Shape of the timed case (default: SmolLM2-135M's heads, 8 sequences with up to 512 cached positions)."""

    batch: int = Field(8, ge=1, description="sequences decoding together")
    heads: int = Field(9, ge=1, description="query heads")
    kv_heads: int = Field(3, ge=1, description="key-value heads (heads is a multiple of it)")
    head_dim: int = Field(64, ge=1, description="dimensions per head")
    length: int = Field(512, ge=1, description="cached positions of the longest sequence (the others hold fewer)")
    cache: Literal["fp32", "f16"] = Field("fp32", description="the KV cache's type (the arithmetic is fp32)")
    queries: int = Field(1, ge=1, description="new queries of every other sequence, from the first (1: a decode "
                                              "step; more: a prompt's chunk beside the decoding sequences)")
    window: int = Field(0, ge=0, description="keys each query sees, its own the last (0: all: a global layer)")

    @model_validator(mode="after")
    def _grouped(self) -> AttentionDecodeArgs:
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        return self


def cache_layout(case: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each sequence's filled length, capacity and new queries for ``case`` (deterministic, so the work of a case
    is known): lengths spread from ``length`` down to about half of it, capacities 0 to 16 positions more; every
    other sequence from the first brings ``queries`` new queries (as many as it holds), the others one. Where
    the first brings more than one, a twin sequence follows the case's for each of them (:func:`twins`)."""
    batch, length, queries = case["batch"], case["length"], case.get("queries", 1)
    lengths = np.array([max(1, length - (b * length) // (2 * batch)) for b in range(batch)], np.int32)
    counts = np.where(np.arange(batch) % 2 == 0, np.minimum(queries, lengths), 1).astype(np.int32)
    twin_lengths = lengths[0] - counts[0] + 1 + np.arange(counts[0] if counts[0] > 1 else 0, dtype=np.int32)
    lengths = np.concatenate((lengths, twin_lengths))
    counts = np.concatenate((counts, np.ones(len(twin_lengths), np.int32)))
    return lengths, lengths + np.int32(8) * (np.arange(len(lengths), dtype=np.int32) % 3), counts


def twins(case: Case) -> list[tuple[int, int]]:
    """The query rows the check requires to be bit for bit equal: the first sequence's chunk's ``j``-th query, and
    the ``j``-th twin sequence's only one (the same query over a copy of the same cache, alone)."""
    _, _, counts = cache_layout(case)
    chunk = int(counts[0]) if counts[0] > 1 else 0
    first_twin = int(counts[: case["batch"]].sum())
    return [(j, first_twin + j) for j in range(chunk)]


class AttentionDecode(SlotTask):
    """Attention over per-sequence caches; the template varies vector width, keys per block, queries per tile, how
    scores are summed, how their exponentials are taken and how the values are summed."""

    name = "attention_decode"
    unit = "GB/s"
    description = ("fp32 attention of each sequence's new queries (one in a decode step) over its KV cache, "
                   "grouped-query heads, a batch of sequences at different lengths, batch-invariant bit for bit")
    signature = ("void kernel(int batch, int heads, int kv_heads, int d, int window, const float *q, "
                 "const kv_t *k, const kv_t *v, const long *k_off, const long *v_off, const int *length, "
                 "const int *count, const int *capacity, float *out) "
                 "/* kv_t: float, or _Float16 where KV_F16 is defined (cache: f16) */")  # fmt: skip
    slot = Slot("attention")
    Args = AttentionDecodeArgs
    args: AttentionDecodeArgs

    def space(self) -> ParamSpace:
        return ParamSpace(
            {
                "VEC": Pow2Param(type="pow2", low=4, high=16),
                "KBLOCK": Pow2Param(type="pow2", low=4, high=128),
                "QTILE": Pow2Param(type="pow2", low=1, high=8),
                "SCORES": ChoiceParam(type="choice", values=("DOT", "KEYS")),
                "EXP": ChoiceParam(type="choice", values=("LIBM", "POLY")),
                "VALUES": ChoiceParam(type="choice", values=("AXPY", "ROWS")),
            },
            # KEYS scores VEC keys at a time: a block of fewer would score keys only to drop them
            ["SCORES == 'DOT' or KBLOCK >= VEC"],
        )

    def template(self) -> str:
        return load_c_source("attention_decode_template.c")

    def seeds(self) -> list[Genome]:
        """The naive three-pass kernel, and a modest template point (the engine's default)."""
        return [Genome(params={}, source=load_c_source("attention_decode_naive.c")),
                Genome(params={"VEC": 8, "KBLOCK": 32, "QTILE": 4, "SCORES": "DOT", "EXP": "LIBM",
                                "VALUES": "AXPY"})]  # fmt: skip

    def render(self, genome: Genome) -> str:
        """The genome's source with its params and the cache's type (``KV_F16`` or ``KV_FP32`` defined)."""
        return render_source({**genome.params, "KV": self.args.cache.upper()}, genome.source or self.template())

    def compile_flags(self) -> list[str]:
        return ["-fopenmp"] if self.args.threads > 1 else []

    def full_case(self) -> Case:
        a = self.args
        return {"batch": a.batch, "heads": a.heads, "kv_heads": a.kv_heads, "d": a.head_dim, "length": a.length,
                "queries": a.queries, "window": a.window}

    def check_cases(self, rng: np.random.Generator) -> list[Case]:
        """One sequence of one position; groups of 1 (no GQA) to 20 (more than a kernel may hold at once); head
        sizes no vector divides; prompts' chunks (with their twins) of 2 to 40 queries, in global and
        sliding-window layers; and two drawn."""
        fixed = [(1, 1, 1, 8, 1, 1, 0), (2, 4, 4, 16, 5, 3, 0), (3, 6, 2, 33, 70, 1, 0), (5, 12, 1, 64, 129, 1, 16),
                 (4, 9, 3, 64, 200, 17, 0), (3, 20, 1, 32, 90, 40, 0), (2, 8, 2, 64, 100, 24, 33)]
        drawn = [(int(rng.integers(1, 9)), 2 * int(g), 2, int(rng.integers(1, 130)), int(rng.integers(1, 300)),
                  int(rng.integers(1, 20)), int(rng.choice([0, 0, rng.integers(1, 64)])))
                 for g in rng.integers(1, 5, size=2)]  # fmt: skip
        return [{"batch": b, "heads": h, "kv_heads": kv, "d": d, "length": n, "queries": t, "window": w}
                for b, h, kv, d, n, t, w in fixed + drawn]

    def inputs(self, case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Queries and keys as a trained model's (scores spanning several units), values standard normal, the cache
        in its type; every position past a sequence's length is NaN. Each twin holds a copy of the first
        sequence's cache through its query, and that query."""
        b, h, kv, d = case["batch"], case["heads"], case["kv_heads"], case["d"]
        lengths, caps, counts = cache_layout(case)
        sizes = kv * caps.astype(np.int64) * d
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        dtype = np.float16 if self.args.cache == "f16" else np.float32
        k = np.full(int(sizes.sum()), np.nan, dtype)
        v = np.full(int(sizes.sum()), np.nan, dtype)

        def cache(store: np.ndarray, i: int) -> np.ndarray:
            return store[offsets[i] : offsets[i] + sizes[i]].reshape(kv, caps[i], d)

        for i in range(b):
            for store in (k, v):
                cache(store, i)[:, : lengths[i]] = rng.standard_normal((kv, lengths[i], d), dtype=np.float32)
        q = rng.standard_normal((int(counts.sum()), h, d), dtype=np.float32) * np.float32(2.0)
        for j, (row, twin) in enumerate(twins(case)):
            for store in (k, v):
                cache(store, b + j)[:, : lengths[b + j]] = cache(store, 0)[:, : lengths[b + j]]
            q[twin] = q[row]
        return {"q": q, "k": k, "v": v, "k_off": offsets, "v_off": offsets.copy(), "length": lengths,
                "count": counts, "capacity": caps}  # fmt: skip

    def outputs(self, case: Case) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"out": ((int(cache_layout(case)[2].sum()), case["heads"], case["d"]), np.dtype(np.float32))}

    def reference(self, case: Case, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        """The decoder's numpy attention (its default for the slot), one sequence at a time."""
        from runtime.decoder.ops import sdpa

        kv, d, row = case["kv_heads"], case["d"], 0
        for i, (n, t, cap) in enumerate(zip(inputs["length"], inputs["count"], inputs["capacity"], strict=True)):
            size = kv * int(cap) * d
            k = inputs["k"][inputs["k_off"][i] : inputs["k_off"][i] + size].reshape(kv, cap, d)[:, :n]
            v = inputs["v"][inputs["v_off"][i] : inputs["v_off"][i] + size].reshape(kv, cap, d)[:, :n]
            outputs["out"][row : row + t] = sdpa(inputs["q"][row : row + t], k.astype(np.float32),
                                                 v.astype(np.float32), int(n - t), case["window"])  # fmt: skip
            row += t

    def twin_rows(self, case: Case) -> dict[str, list[tuple[int, int]]]:
        """Each chunk query's row and its twin's (:func:`twins`): equal bit for bit."""
        return {"out": twins(case)}

    def slot_args(self, operands: Mapping[str, Any], out: np.ndarray) -> list[Any]:
        """``operands``: ``q`` [new queries, heads, d], ``kv_heads``, ``window``, the first cache's keys and values
        (``k``, ``v``), each cache's offsets from them, lengths, new queries and capacities, as
        :func:`runtime.decoder.kernels.c_attention` passes them."""
        q = operands["q"]
        b, h, d = len(operands["length"]), q.shape[1], q.shape[2]
        return [b, h, int(operands["kv_heads"]), d, int(operands["window"]), q, operands["k"], operands["v"],
                operands["k_off"], operands["v_off"], operands["length"], operands["count"], operands["capacity"],
                out]  # fmt: skip

    def kernel_args(self, case: Case, arrays: Mapping[str, np.ndarray]) -> list[Any]:
        return [len(arrays["length"]), case["heads"], case["kv_heads"], case["d"], case["window"], arrays["q"],
                arrays["k"], arrays["v"], arrays["k_off"], arrays["v_off"], arrays["length"], arrays["count"],
                arrays["capacity"], arrays["out"]]  # fmt: skip

    def tolerance(self, case: Case) -> tuple[float, float]:
        """A weighted mean of standard normal values: fp32 sums over up to a few hundred positions."""
        return (1e-4, 1e-5 * max(1.0, case["length"] ** 0.5))

    def work(self, case: Case) -> float:
        """Bytes of keys and values read (the queries and outputs stay in cache)."""
        lengths, _, counts = cache_layout(case)
        if case.get("window"):
            lengths = np.minimum(lengths, case["window"] + counts - 1)
        itemsize = 2 if self.args.cache == "f16" else 4
        return float(lengths.sum()) * case["kv_heads"] * case["d"] * 2 * itemsize / 1e9

    def descriptors(self) -> dict[str, Descriptor]:
        return {
            **super().descriptors(),
            "key_block": Descriptor("key_block", "KBLOCK: keys scored before each softmax update",
                                    lambda g, m: float(g.params.get("KBLOCK", 1)), 0.0, 128.0),  # fmt: skip
        }


class AttentionDecodeF16Args(AttentionDecodeArgs):
    cache: Literal["fp32", "f16"] = Field("f16", description="the KV cache's type (the arithmetic is fp32)")


class AttentionDecodeF16(AttentionDecode):
    """``attention_decode`` over an f16 KV cache: the same task under its own name, so that a factory searches the
    kernels of both cache types side by side, each in a run of its own."""

    name = "attention_decode_f16"
    description = AttentionDecode.description.replace("over its KV cache", "over its f16 KV cache")
    Args = AttentionDecodeF16Args
    args: AttentionDecodeF16Args
