"""Fixtures of the engine tests: the model loaded once per session, the fixed corpus, tiny C kernels."""

from __future__ import annotations

import pytest
from model_fixtures import one_blas_thread, sentences  # noqa: F401 (fixtures)


@pytest.fixture(scope="session")
def model():
    from runtime.engine import load_model

    return load_model()


@pytest.fixture(scope="session")
def reference_embeddings(model, sentences):
    """sentence-transformers' embeddings of the corpus (torch, one thread)."""
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("sentence_transformers")
    torch.set_num_threads(1)
    ref = st.SentenceTransformer(str(model.path), device="cpu")
    return ref.encode(sentences, batch_size=8, normalize_embeddings=True, convert_to_numpy=True)

