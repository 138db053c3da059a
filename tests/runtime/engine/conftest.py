"""Fixtures of the engine tests: the model loaded once per session, the fixed corpus, tiny C kernels."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DATA = Path(__file__).resolve().parents[2] / "data"


@pytest.fixture(scope="session", autouse=True)
def one_blas_thread():
    """One BLAS thread: on a small shared machine more threads than free cores make BLAS crawl."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        yield


@pytest.fixture(scope="session")
def sentences() -> list[str]:
    return [s for s in (DATA / "sentences.txt").read_text(encoding="utf-8").splitlines() if s.strip()]


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

