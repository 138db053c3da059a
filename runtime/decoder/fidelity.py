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

__all__ = ["DEFAULT_FLOOR", "Fidelity", "Floor", "LogitsFn", "divergence", "fidelity", "forced_logits",
           "served_divergence"]

LogitsFn = Callable[[Sequence[int]], np.ndarray]
"""An engine as the gate sees it: token ids ``[T]`` in, the logits after each prefix ``[T, vocab]`` out."""


@dataclass(frozen=True)
class Floor:
    """The least fidelity a reduced-precision engine must keep: top-1 agreement at least ``top1`` and mean KL at
    most ``mean_kl`` nats against the fp32 engine."""

    top1: float = 0.94
    mean_kl: float = 0.01


DEFAULT_FLOOR = Floor()
"""Top-1 >= 0.94 and mean KL <= 0.01 nats: what llama.cpp's own arithmetic on the same file keeps. On
SmolLM2-135M-Instruct (Q4_1) against the fp32 engine, llama.cpp measures 0.960 and 0.0039 teacher-forced on the test
sentences and the README's paragraphs (3,242 positions; its activations quantised to 8 bits per block of 32), but
0.947 and 0.0052 on the 454 positions of a factory's duel texts and 0.952 on the 1,426 of a search's
(``bench/chat_fidelity_floor.py``): top-1 over a few hundred positions moves by a point from one text set to the
next, so a floor of 0.95 failed llama.cpp itself. Mean KL is the finer measure. bf16 GEMMs 0.993 and 0.0002,
int8 GEMMs with per-token activations 0.89 and 0.030 on every matrix: that does not hold it. Alone in int8 (the
rest fp32) the QKV projection costs 0.008 nats, the attention output 0.0004, gate-up 0.004, down 0.009 and the LM
head 0.008; the attention output and gate-up in int8 give 0.952 and 0.0049."""


@dataclass(frozen=True)
class Fidelity:
    """A candidate against a reference over ``positions`` teacher-forced positions: the share whose top-1 tokens
    agree, and the mean and largest KL divergence (nats) of the candidate's distribution from the reference's."""

    top1: float
    mean_kl: float
    max_kl: float
    positions: int

    def holds(self, floor: Floor = DEFAULT_FLOOR) -> bool:
        """Whether it keeps ``floor``."""
        return self.top1 >= floor.top1 and self.mean_kl <= floor.mean_kl

    def __str__(self) -> str:
        return f"top-1 {self.top1:.4f}, mean KL {self.mean_kl:.5f} nats (max {self.max_kl:.4f}) over {self.positions}"


def forced_logits(model: DecoderModel, ops: DecoderOps) -> LogitsFn:
    """``model`` on ``ops`` as a :data:`LogitsFn`: one forward pass of the whole text, every position's logits."""

    def logits(ids: Sequence[int]) -> np.ndarray:
        return model.forward([list(ids)], [model.new_cache(len(ids))], ops, all_logits=True)

    return logits


_ROWS = 16  # rows of logits in float64 at a time: a 262,144-token vocabulary makes a row 2 MiB


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """Per row, in float64."""
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def divergence(reference: np.ndarray, candidate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of two logits arrays ``[T, vocab]``: ``KL(softmax(reference) || softmax(candidate))`` (nats, float64)
    and whether the two argmaxes agree."""
    kl = np.zeros(len(reference))
    for lo in range(0, len(reference), _ROWS):
        log_p, log_q = _log_softmax(reference[lo : lo + _ROWS]), _log_softmax(candidate[lo : lo + _ROWS])
        kl[lo : lo + _ROWS] = np.einsum("ij,ij->i", np.exp(log_p), log_p - log_q)
    return np.maximum(kl, 0.0), np.asarray(reference).argmax(axis=-1) == np.asarray(candidate).argmax(axis=-1)


def served_divergence(
    reference: np.ndarray, served: Sequence[int], reported: Sequence[Sequence[tuple[int, float]]],
    never: Iterable[int] = (),
) -> tuple[np.ndarray, np.ndarray, int]:
    """A server's greedy answer against the reference's logits ``[T, vocab]`` at the same positions (the answer
    teacher-forced through the reference): per served token, ``KL(p || q)`` (nats) over the tokens the server
    ``reported`` with their log-probabilities, and one bucket for every other token; and whether the served
    token is the reference's top-1. Merging tokens into one bucket never raises a KL, so this is a lower bound of
    the full divergence, and exact as the reported tokens hold all of ``q``. Also returns how many positions
    contradict their own report (the served token is not the likeliest the server reported there: greedy
    answers must be). Tokens in ``never`` (the end tokens of a request that ignores them) were never candidates
    for the answer: they are left out of both comparisons, not of the KL."""
    ruled_out = set(never)
    kl, contradictions = np.zeros(len(served)), 0
    for t, (token, best) in enumerate(zip(served, reported, strict=True)):
        if t % _ROWS == 0:
            log_p = _log_softmax(reference[t : t + _ROWS])
        row = log_p[t % _ROWS]
        if not best:
            contradictions += 1
            continue
        ids = np.array([i for i, _ in best], np.int64)
        lq = np.array([lp for _, lp in best], np.float64)
        if len(set(ids.tolist())) != len(ids) or (lq > 1e-6).any():
            contradictions += 1
            continue
        own = dict(best).get(int(token))
        eligible = [lp for i, lp in best if i not in ruled_out]
        if own is None or not eligible or own < max(eligible) - 1e-5:
            contradictions += 1
        p_in = np.exp(row[ids])
        q_in = np.exp(np.minimum(lq, 0.0))
        p_rest, q_rest = max(1.0 - p_in.sum(), 0.0), max(1.0 - q_in.sum(), 0.0)
        terms = p_in * (row[ids] - np.log(np.maximum(q_in, 1e-300)))
        rest = p_rest * (np.log(p_rest) - np.log(max(q_rest, 1e-12))) if p_rest > 1e-12 else 0.0
        kl[t] = max(float(terms.sum() + rest), 0.0)
    eligible = np.array(reference)  # a copy in its own type: the argmax needs no float64
    eligible[:, sorted(ruled_out)] = -np.inf
    agree = eligible.argmax(axis=-1) == np.asarray(served)
    return kl, agree, contradictions


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
