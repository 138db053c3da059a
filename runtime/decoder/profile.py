"""Where a chat engine's time goes under generative load: each operator slot (every weight GEMM by its matrix, the
attention, RMSNorm, RoPE, the MLP's activation, the LM head), the rest of the forward pass, and sampling with the
scheduler around it.

:func:`profile_decoder` serves a load through the engine's own :class:`~runtime.decoder.scheduler.Scheduler` (every
request submitted at once, so the engine never waits), with every operator of its table wrapped in a timer. The
steps' forward passes are timed around ``model.forward``; what the slots do not account for inside them is the
forward pass's own numpy and Python (``forward other``: the embedding gather, residual sums, RoPE's tables, the
caches' writes); the time outside them is sampling, streaming and the scheduler's planning (``sampling and
scheduling``). A slot's share is what a faster kernel for it could save.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from runtime.decoder.generate import Decoder
from runtime.decoder.ops import DecoderOps
from runtime.decoder.sampling import SamplingParams
from runtime.decoder.scheduler import Scheduler, SchedulerConfig

__all__ = ["DecoderProfile", "profile_decoder", "timed_ops"]

MATRIX_ATTRS = {"w_qkv": "qkv", "w_o": "o", "w_gate_up": "gate_up", "w_down": "down"}
"""A layer's weight attribute -> its matrix's name (as ``--linear`` mixes name them)."""


@dataclass
class DecoderProfile:
    """Seconds spent in each part of serving ``requests`` generations (``prompt_tokens`` read, ``output_tokens``
    written, in ``steps`` engine steps)."""

    requests: int
    prompt_tokens: int
    output_tokens: int
    steps: int
    total_s: float  # from the first submission to the last token
    forward_s: float  # the steps' forward passes
    slots: dict[str, float]  # "linear qkv", ..., "lm_head", "attention", "rmsnorm", "rope", "swiglu" -> seconds

    @property
    def parts(self) -> dict[str, float]:
        """Every part's seconds: the slots, the forward pass's own rest, and everything outside it."""
        inside = sum(self.slots.values())
        return {**self.slots, "forward other": max(0.0, self.forward_s - inside),
                "sampling and scheduling": max(0.0, self.total_s - self.forward_s)}  # fmt: skip

    def shares(self) -> dict[str, float]:
        return {k: v / self.total_s if self.total_s > 0 else 0.0 for k, v in self.parts.items()}

    def table(self) -> list[tuple[str, float, float]]:
        """``(part, seconds, share)`` rows, largest first."""
        shares = self.shares()
        return sorted(((k, v, shares[k]) for k, v in self.parts.items()), key=lambda r: -r[1])

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "shares": self.shares()}


def timed_ops(ops: DecoderOps, decoder: Decoder) -> tuple[DecoderOps, dict[str, float]]:
    """``ops`` with every operator wrapped in a timer, and the seconds each part has taken so far (the ``linear``
    slot by the matrix its weight is: ``linear qkv``, ``linear o``, ``linear gate_up``, ``linear down``)."""
    seconds: dict[str, float] = {}
    matrices = {id(getattr(layer, attr)): name for layer in decoder.model.layers
                for attr, name in MATRIX_ATTRS.items()}  # fmt: skip

    def timed(name: Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                part = name(*args)
                seconds[part] = seconds.get(part, 0.0) + time.perf_counter() - t0

        return call

    def slot(label: str) -> Callable[..., str]:
        return lambda *_: label

    wrapped = {f.name: timed(slot(f.name), getattr(ops, f.name)) for f in dataclasses.fields(ops)}
    wrapped["linear"] = timed(lambda x, w, *_: f"linear {matrices.get(id(w), 'other')}", ops.linear)
    return DecoderOps(**wrapped), seconds


def profile_decoder(decoder: Decoder, prompts: Sequence[Sequence[int]], max_tokens: int,
                    config: SchedulerConfig | None = None) -> DecoderProfile:  # fmt: skip
    """Serves ``prompts`` (token ids), each to ``max_tokens`` greedy tokens (end tokens ignored, so every request
    does the same work), through ``decoder``'s engine with its operators timed; returns where the time went."""
    ops, seconds = timed_ops(decoder.ops, decoder)
    timed = Decoder(decoder.model, ops=ops, top=decoder.top)
    forward: list[float] = []
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    with Scheduler(timed, config or SchedulerConfig(), on_step=lambda n, t, s: forward.append(s)) as scheduler:
        start = time.perf_counter()
        gens = [scheduler.submit(list(p), params) for p in prompts]
        results = [g.result() for g in gens]
        total = time.perf_counter() - start
    return DecoderProfile(requests=len(prompts), prompt_tokens=sum(len(p) for p in prompts),
                          output_tokens=sum(len(r.token_ids) for r in results), steps=len(forward), total_s=total,
                          forward_s=sum(forward), slots=dict(seconds))  # fmt: skip
