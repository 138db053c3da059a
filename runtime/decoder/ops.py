"""The decoder's operators as slots: the forward pass calls each through :class:`DecoderOps`.

Each slot has one calling convention, so an evolved kernel can replace its numpy default later, as the
encoder's slots (:mod:`runtime.engine.ops`) are filled. Every implementation returns a new array (or one
it owns) and leaves its inputs alone. All arithmetic is fp32.

- ``linear(x [T, in], w [in, out], b [out] | None) -> [T, out]``: every projection (fused QKV, attention
  output, fused gate and up, down).
- ``rmsnorm(x [T, H], g [H], eps) -> [T, H]``: ``x / sqrt(mean(x^2) + eps) * g``.
- ``rope(x [T, heads, d], cos [T, r/2], sin [T, r/2]) -> [T, heads, d]``: rotates the pairs ``(x[2i], x[2i+1])``
  of each head's first ``r`` dimensions by angle ``i`` (llama.cpp's layout of Q and K in a GGUF file).
- ``attention(q [N, heads, d], caches, layer, lengths, counts, window) -> [N, heads, d]``: each sequence's new
  queries over its own cache, every sequence of a forward pass in one call. ``caches[i]`` is sequence ``i``'s
  :class:`runtime.decoder.model.KVCache` (the layer's keys ``k[layer]``, ``[kv_heads, capacity, d]``, and values
  ``v[layer]``, their addresses in ``addresses[layer]``), its first ``lengths[i]`` positions filled, the last
  ``counts[i]`` of them its new queries' (one in a decode step, a prompt's chunk in prefill): rows of ``q``,
  sequence after sequence (``N = sum(counts)``). Scaled dot product attention (scale ``1 / sqrt(d)``: a model of
  another scale scales ``q``), causal: the query at position ``p`` sees the keys ``0..p``, the last ``window`` of
  them where ``window`` is not 0 (a sliding-window layer); query head ``h`` reads key-value head
  ``h // (heads / kv_heads)`` (grouped-query attention).
- ``swiglu(gu [T, 2I]) -> [T, I]``: ``silu(gate) * up`` of the fused projection (gate first).
- ``geglu(gu [T, 2I]) -> [T, I]``: ``gelu(gate) * up``, GELU's tanh approximation (Gemma's MLP).
- ``lm_head(x [T, H], w [vocab, H]) -> [T, vocab]``: the logits, ``x @ w.T`` (``w`` is the embedding matrix
  where the model ties them).
- ``lm_head_topk(x [T, H], w [vocab, H], top) -> TopLogits``: each row's ``top`` largest logits with their ids, and
  its log-sum-exp (:class:`runtime.decoder.sampling.TopLogits`), for steps whose sampling needs no more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from runtime.activations import gelu_tanh
from runtime.decoder.sampling import TopLogits

if TYPE_CHECKING:
    from runtime.decoder.model import KVCache

__all__ = ["DECODER_SLOTS", "DecoderOps", "np_attention", "np_geglu", "np_linear", "np_lm_head", "np_lm_head_topk",
           "np_rmsnorm", "np_rope", "np_swiglu", "sdpa"]  # fmt: skip

DECODER_SLOTS = ("linear", "rmsnorm", "rope", "attention", "swiglu", "geglu", "lm_head")
"""The decoder's operator slots."""


def np_linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    out = x @ w
    if b is not None:
        out += b
    return out


def np_rmsnorm(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    ms = np.einsum("ij,ij->i", x, x)[:, None] / np.float32(x.shape[-1])
    out = x / np.sqrt(ms + np.float32(eps))
    out *= g
    return out


def np_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    out = x.copy()
    r = 2 * cos.shape[-1]
    even, odd = x[..., 0:r:2], x[..., 1:r:2]
    c, s = cos[:, None, :], sin[:, None, :]
    out[..., 0:r:2] = even * c - odd * s
    out[..., 1:r:2] = even * s + odd * c
    return out


def sdpa(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, window: int = 0) -> np.ndarray:
    """Attention of ``t`` queries ``q [t, heads, d]`` at positions ``start..start+t-1`` over ``L = start + t`` keys
    ``k`` and values ``v`` (``[kv_heads, L, d]``), causal, in a window where ``window`` is not 0; one BLAS GEMM for
    the scores of every query of a head group, so a query's rounding depends on the others (not batch-invariant)."""
    t, heads, d = q.shape
    if window and start >= window:  # keys before the first query's window: no query of the chunk sees them
        first = start + 1 - window
        k, v, start = k[:, first:], v[:, first:], window - 1
    kv_heads, length, _ = k.shape
    group = heads // kv_heads
    # [heads, t, d] -> [kv_heads, group * t, d]: the query heads that share a key-value head, stacked
    qg = q.transpose(1, 0, 2).reshape(kv_heads, group * t, d)
    scores = qg @ k.transpose(0, 2, 1)  # [kv_heads, group * t, L]
    scores *= np.float32(1.0 / np.sqrt(d))
    if t > 1:  # a single query (a decode step) sees every cached key
        keys, queries = np.arange(length)[None, :], start + np.arange(t)[:, None]
        hidden = keys > queries  # [t, L]: the future
        if window:
            hidden |= keys <= queries - window
        scores.reshape(kv_heads, group, t, length)[:, :, hidden] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = scores @ v  # [kv_heads, group * t, d]
    return out.reshape(heads, t, d).transpose(1, 0, 2)


def np_attention(q: np.ndarray, caches: Sequence[KVCache], layer: int, lengths: Sequence[int], counts: Sequence[int],
                 window: int = 0) -> np.ndarray:  # fmt: skip
    out = np.empty_like(q)
    row = 0
    for cache, n, t in zip(caches, lengths, counts, strict=True):
        k, v = cache.k[layer][:, :n], cache.v[layer][:, :n]
        out[row : row + t] = sdpa(q[row : row + t], k.astype(np.float32, copy=False), v.astype(np.float32, copy=False),
                                  n - t, window)  # fmt: skip
        row += t
    return out


def np_swiglu(gu: np.ndarray) -> np.ndarray:
    half = gu.shape[-1] // 2
    gate, up = gu[:, :half], gu[:, half:]
    out = np.negative(gate)
    with np.errstate(over="ignore"):  # exp(-gate) overflows to inf for a very negative gate: silu is then -0
        np.exp(out, out=out)
    out += 1.0
    np.divide(gate, out, out=out)  # silu(gate) = gate / (1 + exp(-gate))
    out *= up
    return out


def np_geglu(gu: np.ndarray) -> np.ndarray:
    half = gu.shape[-1] // 2
    out = gelu_tanh(gu[:, :half])  # transformers' gelu_pytorch_tanh, Gemma's
    out *= gu[:, half:]
    return out


def np_lm_head(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x @ w.T


def top_of(logits: np.ndarray, top: int) -> TopLogits:
    """Each row's ``top`` largest logits (ties by id) and log-sum-exp, from the full ``logits`` ``[T, vocab]``."""
    ids = np.argpartition(-logits, top - 1, axis=1)[:, :top] if top < logits.shape[1] else np.tile(
        np.arange(logits.shape[1]), (len(logits), 1))  # fmt: skip
    values = np.take_along_axis(logits, ids, axis=1)
    order = np.lexsort((ids, -values), axis=1)
    ids, values = np.take_along_axis(ids, order, axis=1), np.take_along_axis(values, order, axis=1)
    z = logits.astype(np.float64)
    peak = z.max(axis=1)
    lse = peak + np.log(np.exp(z - peak[:, None]).sum(axis=1))
    return TopLogits(ids.astype(np.int32), values.astype(np.float32), lse.astype(np.float32))


def np_lm_head_topk(x: np.ndarray, w: np.ndarray, top: int) -> TopLogits:
    return top_of(np_lm_head(x, w), top)


@dataclass
class DecoderOps:
    """The operator table a decoder's forward pass calls (numpy defaults; see the module for the conventions)."""

    linear: Callable[[np.ndarray, np.ndarray, np.ndarray | None], np.ndarray] = np_linear
    rmsnorm: Callable[[np.ndarray, np.ndarray, float], np.ndarray] = np_rmsnorm
    rope: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray] = np_rope
    attention: Callable[[np.ndarray, Sequence[KVCache], int, Sequence[int], Sequence[int], int], np.ndarray] = (
        np_attention)  # fmt: skip
    swiglu: Callable[[np.ndarray], np.ndarray] = np_swiglu
    geglu: Callable[[np.ndarray], np.ndarray] = np_geglu
    lm_head: Callable[[np.ndarray, np.ndarray], np.ndarray] = np_lm_head
    lm_head_topk: Callable[[np.ndarray, np.ndarray, int], TopLogits] = np_lm_head_topk
