"""Helpers of the engine tests."""

from __future__ import annotations


def embed_sorted(model, sentences, ops, *, pack=True, batch=8):
    """Embeddings in corpus order, computed in batches of similar lengths (little padding: quick)."""
    import numpy as np

    ids = model.tokenizer.encode_batch(sentences)
    order = np.argsort([len(s) for s in ids], kind="stable")
    out = np.empty((len(ids), model.config.hidden), np.float32)
    for i in range(0, len(order), batch):
        chunk = order[i : i + batch]
        out[chunk] = model.forward([ids[j] for j in chunk], ops, pack=pack)
    return out
