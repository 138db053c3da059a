"""Where an engine's time goes: each operator slot, each GEMM shape, the attention's batched matmuls,
tokenisation, and the Python between them.

The profile runs the engine's own forward pass on batches like the load's, with every operator of its
table wrapped in a timer (:func:`time_forward`), in the engine's own process: a host, for an engine with
evolved kernels (:mod:`runtime.backends.engine`'s ``profile`` stage). The caller tokenises and measures
the wall time around it; the parts the host reports may not add up to more (:func:`check_forward`). What
a slot could save is its share: a search for a slot's kernel is worth the time the slot takes, not the
slot's size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from runtime.engine.engine import Engine
from runtime.engine.ops import SLOTS, Ops

__all__ = ["Profile", "assemble", "check_forward", "profile_engine", "time_forward"]


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


def time_forward(engine: Engine, seqs: Sequence[np.ndarray], batch: int | None = None) -> dict[str, Any]:
    """Runs ``seqs`` (token ids) through ``engine``'s forward pass in batches of ``batch`` (default its
    ``max_batch``), shortest first as :meth:`Engine.embed` batches them, with every operator timed; in the
    engine's own process. Returns the seconds by slot, by GEMM shape and in attention, the whole forward
    passes' (``forward_s``) and the batch count."""
    clock, gemms = _Clock(), _Clock()
    probe = Engine(engine.model, _timed_ops(engine.ops, clock, gemms), engine.config)
    step = batch or engine.config.max_batch
    order = np.argsort([len(s) for s in seqs], kind="stable")
    batches = 0
    t0 = time.perf_counter()
    for i in range(0, len(order), step):
        probe.run_batch([seqs[j] for j in order[i : i + step]])
        batches += 1
    forward = time.perf_counter() - t0
    attention = clock.seconds.pop("attention", 0.0)
    return {"slots": {slot: clock.seconds.get(slot, 0.0) for slot in SLOTS}, "gemms": dict(gemms.seconds),
            "attention_s": attention, "forward_s": forward, "batches": batches}  # fmt: skip


def assemble(seqs: Sequence[np.ndarray], tokenize_s: float, forward: dict[str, Any], wall_s: float) -> Profile:
    """The profile of ``seqs`` from what the engine's process timed inside (``forward``: :func:`time_forward`)
    and what its caller measured outside: the tokenising and the wall time of the forward passes. The total
    is the caller's; the parts are the engine's, and may not add up to more than the caller measured (an
    engine's process runs candidate code, and its own clock is no witness: see :func:`check_forward`)."""
    slots = {slot: float(forward["slots"].get(slot, 0.0)) for slot in SLOTS}
    attention = float(forward["attention_s"])
    total = tokenize_s + wall_s
    other = max(0.0, total - tokenize_s - attention - sum(slots.values()))
    return Profile(texts=len(seqs), tokens=int(sum(len(s) for s in seqs)), batches=int(forward["batches"]),
                   total_s=total, tokenize_s=tokenize_s, slots=slots,
                   gemms={str(k): float(v) for k, v in forward["gemms"].items()}, attention_s=attention,
                   other_s=other)  # fmt: skip


def check_forward(forward: dict[str, Any], wall_s: float, *, batches: int | None = None,
                  shapes: set[tuple[int, int]] | None = None, slack_s: float = 0.002) -> str | None:
    """Why the parts an engine's process reports cannot be true (``None``: they can): each a finite, non-negative
    number of seconds and no more than the forward passes' own; together no more than the wall time its caller
    measured around them; the GEMMs, each of one of the model's weight ``shapes``, no more than the linear slot
    they are part of; and as many batches as its caller sent (``batches``). What stays the engine's own account
    is how it splits that time: a process that runs candidate code can move time between its operators."""
    try:
        slots = {str(k): float(v) for k, v in forward["slots"].items()}
        gemms = {str(k): float(v) for k, v in forward["gemms"].items()}
        attention, claimed, count = float(forward["attention_s"]), float(forward["forward_s"]), forward["batches"]
    except (KeyError, TypeError, ValueError, AttributeError):
        return "its profile is not a profile"
    parts = [*slots.values(), *gemms.values(), attention]
    if not all(np.isfinite(p) and p >= 0 for p in [*parts, claimed]):
        return "its profile holds a negative or non-finite time"
    limit = wall_s * 1.02 + slack_s
    inside = sum(slots.values()) + attention
    if inside > limit or claimed > limit or any(p > claimed + slack_s for p in parts):
        return (f"its profile claims {max(inside, claimed) * 1e3:.1f} ms inside its operators, more than the "
                f"{wall_s * 1e3:.1f} ms it took")  # fmt: skip
    if sum(gemms.values()) > slots.get("linear", 0.0) * 1.02 + slack_s:
        return "its profile's GEMMs take longer than the linear slot they are part of"
    if shapes is not None:
        named = {f"k={k} n={n}" for k, n in shapes}
        if not set(gemms) <= named:
            return f"its profile names GEMMs the model does not have: {sorted(set(gemms) - named)[:3]}"
    if batches is not None and (not isinstance(count, int) or count != batches):
        return f"its profile counts {count!r} batches, where it was given {batches}"
    return None


def profile_engine(engine: Engine, texts: Sequence[str], *, batch: int | None = None) -> Profile:
    """The profile of ``engine`` embedding ``texts``, run in this thread with its own operators and settings
    (packing, bucketing): for an engine whose code is trusted (the default numpy engine)."""
    t0 = time.perf_counter()
    seqs = engine.model.tokenizer.encode_batch(list(texts))
    tokenize = time.perf_counter() - t0
    t1 = time.perf_counter()
    forward = time_forward(engine, seqs, batch)
    return assemble(seqs, tokenize, forward, time.perf_counter() - t1)
