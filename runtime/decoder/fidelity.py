"""How closely an engine's next-token distributions follow a reference's: the correctness gate of a decoder.

Teacher-forced: each text is tokenized once and both engines score every position of it (the logits of each
prefix, one forward pass per text over a fresh cache), so a difference early in a text never changes the inputs
after it. Per position it compares the reference's distribution ``p`` with the candidate's ``q``: whether their
most likely tokens agree (top-1), and ``KL(p || q)`` in nats (the divergence llama.cpp's perplexity tool reports
for a quantised model against its base).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from runtime.decoder.model import DecoderModel
from runtime.decoder.ops import DecoderOps

__all__ = ["Fidelity", "LogitsFn", "divergence", "fidelity", "forced_logits"]

LogitsFn = Callable[[Sequence[int]], np.ndarray]
"""An engine as the gate sees it: token ids ``[T]`` in, the logits after each prefix ``[T, vocab]`` out."""


@dataclass(frozen=True)
class Fidelity:
    """A candidate against a reference over ``positions`` teacher-forced positions: the share whose top-1 tokens
    agree, and the mean and largest KL divergence (nats) of the candidate's distribution from the reference's."""

    top1: float
    mean_kl: float
    max_kl: float
    positions: int

    def holds(self, min_top1: float, max_mean_kl: float) -> bool:
        """Whether it meets a floor: top-1 agreement at least ``min_top1``, mean KL at most ``max_mean_kl``."""
        return self.top1 >= min_top1 and self.mean_kl <= max_mean_kl

    def __str__(self) -> str:
        return f"top-1 {self.top1:.4f}, mean KL {self.mean_kl:.5f} nats (max {self.max_kl:.4f}) over {self.positions}"


def forced_logits(model: DecoderModel, ops: DecoderOps) -> LogitsFn:
    """``model`` on ``ops`` as a :data:`LogitsFn`: one forward pass of the whole text, every position's logits."""

    def logits(ids: Sequence[int]) -> np.ndarray:
        return model.forward([list(ids)], [model.new_cache(len(ids))], ops, all_logits=True)

    return logits


def divergence(reference: np.ndarray, candidate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of two logits arrays ``[T, vocab]``: ``KL(softmax(reference) || softmax(candidate))`` (nats, float64)
    and whether the two argmaxes agree."""
    a, b = np.asarray(reference, np.float64), np.asarray(candidate, np.float64)
    log_p = a - a.max(axis=-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(axis=-1, keepdims=True))
    log_q = b - b.max(axis=-1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(axis=-1, keepdims=True))
    kl = np.einsum("ij,ij->i", np.exp(log_p), log_p - log_q)
    return np.maximum(kl, 0.0), a.argmax(axis=-1) == b.argmax(axis=-1)


def fidelity(
    model: DecoderModel,
    reference: DecoderOps | LogitsFn,
    candidate: DecoderOps | LogitsFn,
    texts: Iterable[str],
) -> Fidelity:
    """``candidate`` against ``reference`` (each ``model`` on an operator table, or any :data:`LogitsFn`, e.g.
    another runtime's) over every position of ``texts``, tokenized by ``model`` (BOS first where it adds one)."""
    ref = forced_logits(model, reference) if isinstance(reference, DecoderOps) else reference
    cand = forced_logits(model, candidate) if isinstance(candidate, DecoderOps) else candidate
    kls, agree = [], []
    for text in texts:
        ids = model.tokenizer.encode(text)
        if not ids:
            continue
        kl, same = divergence(ref(ids), cand(ids))
        kls.append(kl)
        agree.append(same)
    if not kls:
        raise ValueError("no text has a token to score: give some non-empty texts")
    kl_all, agree_all = np.concatenate(kls), np.concatenate(agree)
    return Fidelity(top1=float(agree_all.mean()), mean_kl=float(kl_all.mean()), max_kl=float(kl_all.max()),
                    positions=int(kl_all.size))  # fmt: skip
