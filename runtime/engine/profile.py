"""Where an engine's time goes: each operator slot, each GEMM shape, the attention's batched matmuls,
tokenisation, and the Python between them.

The profile runs the engine's own forward pass, in this thread, on batches like the load's, with every
operator of its table wrapped in a timer (:func:`profile_engine`). What a slot could save is its share:
a search for a slot's kernel is worth the time the slot takes, not the slot's size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from runtime.engine.engine import Engine
from runtime.engine.ops import SLOTS, Ops

__all__ = ["Profile", "profile_engine"]


@dataclass
class Profile:
    """Seconds spent in each part of ``texts`` texts' embedding (``tokens`` tokens, ``batches`` batches)."""

    texts: int
    tokens: int
    batches: int
    total_s: float  # tokenising and every forward pass
    tokenize_s: float
    slots: dict[str, float]  # slot -> seconds (``linear`` includes the bias-free GEMM ahead of the GELU)
    gemms: dict[str, float]  # "k=384 n=1536" -> seconds of the weight GEMMs of that shape
    attention_s: float  # the attention's batched matmuls (numpy's BLAS, not a slot)
    other_s: float = field(default=0.0)  # the rest: gathers, padding, pooling, the Python in between

    def shares(self) -> dict[str, float]:
        """Each part's share of the total (slots by name, then attention, tokenize, other)."""
        parts = {**self.slots, "attention": self.attention_s, "tokenize": self.tokenize_s, "other": self.other_s}
        return {k: v / self.total_s if self.total_s > 0 else 0.0 for k, v in parts.items()}

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "shares": self.shares()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        return cls(**{k: v for k, v in d.items() if k != "shares"})

    def table(self) -> list[tuple[str, float, float]]:
        """``(part, seconds, share)`` rows, largest first."""
        shares = self.shares()
        seconds = {**self.slots, "attention": self.attention_s, "tokenize": self.tokenize_s, "other": self.other_s}
        return sorted(((k, seconds[k], shares[k]) for k in seconds), key=lambda r: -r[1])


class _Clock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, key: Callable[..., str], fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
        def timed(*args: Any) -> np.ndarray:
            t0 = time.perf_counter()
            out = fn(*args)
            name = key(*args)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            return out

        return timed


def _timed_ops(ops: Ops, clock: _Clock, gemms: _Clock) -> Ops:
    """``ops`` with every operator timed: the slots into ``clock`` by slot, the weight GEMMs into ``gemms`` by
    shape as well."""

    def gemm(slot: str, fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
        by_shape = gemms.wrap(lambda x, w, *_: f"k={w.shape[0]} n={w.shape[1]}", fn)
        return clock.wrap(lambda *_: slot, by_shape)

    timed = {slot: clock.wrap(lambda *_, s=slot: s, getattr(ops, slot)) for slot in SLOTS if slot != "linear"}
    timed["linear"] = gemm("linear", ops.linear)
    timed["matmul"] = gemm("linear", ops.matmul)  # the bias-free GEMM ahead of the fused bias + GELU
    timed["attention"] = clock.wrap(lambda *_: "attention", ops.attention)
    return replace(ops, **timed, kernels={})


def profile_engine(engine: Engine, texts: Sequence[str], *, batch: int | None = None) -> Profile:
    """The profile of ``engine`` embedding ``texts`` (in batches of ``batch``, default its ``max_batch``), run in
    this thread with its own operators and settings (packing, bucketing)."""
    clock, gemms = _Clock(), _Clock()
    timed = _timed_ops(engine.ops, clock, gemms)
    probe = Engine(engine.model, timed, engine.config)
    step = batch or engine.config.max_batch
    t0 = time.perf_counter()
    seqs = engine.model.tokenizer.encode_batch(list(texts))
    tokenize = time.perf_counter() - t0
    batches = 0
    order = np.argsort([len(s) for s in seqs], kind="stable")  # as Engine.embed batches them
    for i in range(0, len(order), step):
        probe.run_batch([seqs[j] for j in order[i : i + step]])
        batches += 1
    total = time.perf_counter() - t0
    attention = clock.seconds.pop("attention", 0.0)
    slots = {slot: clock.seconds.get(slot, 0.0) for slot in SLOTS}
    other = max(0.0, total - tokenize - attention - sum(slots.values()))
    return Profile(texts=len(seqs), tokens=int(sum(len(s) for s in seqs)), batches=batches, total_s=total,
                   tokenize_s=tokenize, slots=slots, gemms=dict(gemms.seconds), attention_s=attention,
                   other_s=other)  # fmt: skip
