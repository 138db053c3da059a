"""Choosing the next token from the logits: greedy, or sampled with temperature, top-k and top-p.

A request with a grammar (structured output) first loses every token its grammar does not allow next. The
sampled path then applies, in this order, the temperature (logits divided by it), top-k (only the ``k``
likeliest tokens stay), top-p (only the likeliest tokens whose probabilities sum to at least ``p`` stay,
at least one), then draws from the softmax of what is left with the request's own
``numpy.random.Generator``, so a seeded request draws the same tokens whatever else runs beside it. The tokens
top-k keeps are drawn from in a fixed order (likeliest first, equal logits by id).

An engine whose LM head gives each row only its likeliest tokens and its log-sum-exp (:class:`TopLogits`)
samples from those where that is exact (:func:`top_suffices`): greedy, or top-k within them, with the
log-probabilities of the likeliest tokens. :func:`sample_top` and :func:`top_logprobs` then choose what
:func:`sample` and :func:`token_logprobs` would from the full logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from runtime.decoder.grammar import Grammar, GrammarState

__all__ = ["SamplingParams", "TopLogits", "sample", "sample_top", "token_logprobs", "top_logprobs", "top_suffices"]


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request generates: ``temperature`` 0 is greedy (``top_k``, ``top_p`` and ``seed`` then unused);
    ``top_k`` 0 keeps every token; generation ends at ``max_tokens``, at the model's end token, or where the
    text reaches one of the ``stop`` strings (which the returned text leaves out). ``ignore_eos`` never samples an
    end token, so only ``max_tokens`` or a stop string ends it (a load test's fixed output length)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k likeliest tokens'
    grammar: Grammar | None = None  # structured output: only text of this grammar is sampled

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # one stop string given bare
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens is {self.max_tokens}: ask for at least 1 token")
        if not self.temperature >= 0:
            raise ValueError(f"temperature is {self.temperature}: use 0 (greedy) or a positive number")
        if self.top_k < 0:
            raise ValueError(f"top_k is {self.top_k}: use 0 (every token) or a positive count")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p is {self.top_p}: use a probability in (0, 1]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs is {self.logprobs}: use 0 (the chosen token's) to 20 likeliest")
        if self.grammar is not None and self.ignore_eos:
            raise ValueError("ignore_eos with a response format: a structured answer ends at its end token")
        if any(not s for s in self.stop):
            raise ValueError("an empty stop string: every stop string needs at least one character")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def rng(self) -> np.random.Generator:
        """A fresh generator for one request (seeded where ``seed`` is set)."""
        return np.random.default_rng(self.seed)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
           end_ids: frozenset[int] | set[int] = frozenset(), grammar: GrammarState | None = None) -> int:  # fmt: skip
    """The next token id from ``logits`` ``[vocab]`` under ``params`` (``end_ids``: the model's end tokens, which
    ``ignore_eos`` rules out; ``grammar``: where the request's structured answer stands, moved past the token;
    ``logits`` may be changed in place)."""
    if grammar is None:
        return _choose(logits, params, rng, end_ids)
    grammar.mask(logits)
    token = _choose(logits, params, rng, end_ids)
    grammar.advance(token)
    return token


def _choose(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
            end_ids: frozenset[int] | set[int]) -> int:  # fmt: skip
    if params.ignore_eos and end_ids:
        logits[list(end_ids)] = -np.inf
    if params.greedy:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / params.temperature
    ids = np.arange(z.size)
    if 0 < params.top_k < z.size:
        ids = np.argpartition(z, -params.top_k)[-params.top_k :]
        ids = ids[np.lexsort((ids, -z[ids]))]  # likeliest first, equal logits by id: the order the draw reads
    return _draw(z[ids], ids, params, rng)


def _draw(z: np.ndarray, ids: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """A token of ``ids`` drawn from the softmax of their tempered logits ``z``, after top-p."""
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1:
        order = np.argsort(-p, kind="stable")  # likeliest first
        ids, p = ids[order], p[order]
        keep = min(int(np.searchsorted(np.cumsum(p), params.top_p)) + 1, len(ids))  # the smallest head reaching it
        ids, p = ids[:keep], p[:keep] / p[:keep].sum()
    return int(ids[min(int(np.searchsorted(np.cumsum(p), rng.random(), side="right")), len(ids) - 1)])


def token_logprobs(logits: np.ndarray, token: int, top: int = 0) -> tuple[float, tuple[tuple[int, float], ...]]:
    """``token``'s log-probability under ``logits`` ``[vocab]`` (the model's distribution: temperature 1, nothing
    masked), and the ``top`` likeliest tokens' (id, log-probability), likeliest first."""
    z = logits.astype(np.float64)
    peak = z.max()
    lse = peak + np.log(np.exp(z - peak).sum())
    best: tuple[tuple[int, float], ...] = ()
    if top:
        ids = np.argpartition(z, -top)[-top:]
        ids = ids[np.lexsort((ids, -z[ids]))]
        best = tuple((int(i), float(z[i] - lse)) for i in ids)
    return float(z[token] - lse), best


@dataclass(frozen=True)
class TopLogits:
    """What an LM head that keeps only each row's likeliest tokens gives: ``ids`` and ``values`` ``[rows, top]``
    (the ``top`` largest logits, descending; equal ones in any order) and ``lse`` ``[rows]``, the log-sum-exp of
    each row's logits over the whole vocabulary."""

    ids: np.ndarray
    values: np.ndarray
    lse: np.ndarray

    @property
    def top(self) -> int:
        return self.ids.shape[1]

    def __len__(self) -> int:
        return len(self.ids)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, float]:
        return self.ids[i], self.values[i], float(self.lse[i])


def top_suffices(params: SamplingParams, top: int, end_ids: frozenset[int] | set[int] = frozenset()) -> bool:
    """Whether a row's ``top`` likeliest tokens decide what ``params`` samples exactly: no grammar (its mask may
    rule all of them out); greedy or top-k (top-p alone reads the whole distribution), with room for the end
    tokens ``ignore_eos`` drops; log-probabilities of at most ``top`` tokens."""
    dropped = len(end_ids) if params.ignore_eos else 0
    if params.grammar is not None or (params.logprobs or 0) > top:
        return False
    if params.greedy:
        return dropped < top
    return 0 < params.top_k and params.top_k + dropped <= top


def sample_top(ids: np.ndarray, values: np.ndarray, params: SamplingParams, rng: np.random.Generator,
               end_ids: frozenset[int] | set[int] = frozenset()) -> int:  # fmt: skip
    """The token :func:`sample` would choose from the full logits, from a row's likeliest tokens ``ids`` and their
    logits ``values`` (where :func:`top_suffices` holds)."""
    ids, z = np.asarray(ids, np.int64), values.astype(np.float64)
    if params.ignore_eos and end_ids:
        keep = ~np.isin(ids, list(end_ids))
        ids, z = ids[keep], z[keep]
    order = np.lexsort((ids, -z))
    ids, z = ids[order], z[order]
    if params.greedy:
        return int(ids[0])
    k = params.top_k
    return _draw(z[:k] / params.temperature, ids[:k], params, rng)


def top_logprobs(ids: np.ndarray, values: np.ndarray, lse: float, token: int, top: int = 0,
                 ) -> tuple[float, tuple[tuple[int, float], ...]]:  # fmt: skip
    """:func:`token_logprobs` from a row's likeliest tokens and its log-sum-exp (``token`` one of ``ids``)."""
    ids = np.asarray(ids, np.int64)
    z = values.astype(np.float64)
    where = np.flatnonzero(ids == token)
    if not len(where):
        raise ValueError(f"token {token} is not among the row's {len(ids)} likeliest")
    order = np.lexsort((ids, -z))[:top]
    return float(z[where[0]] - lse), tuple((int(ids[i]), float(z[i] - lse)) for i in order)
