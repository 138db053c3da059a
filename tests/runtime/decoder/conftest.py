"""Fixtures of the decoder tests: tiny random decoders written as GGUF files, each with transformers' model and
tokenizer loaded from the same file as the reference; SmolLM2-135M-Instruct where its package is installed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from gguf_models import Vocabulary, make_hf_model, smollm2_file, train_spm_vocabulary, train_vocabulary, write_gguf
from model_fixtures import one_blas_thread, sentences  # noqa: F401 (fixtures)


@pytest.fixture(scope="session")
def vocabulary(sentences: list[str]) -> Vocabulary:
    return train_vocabulary(sentences)


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the decoder tests' kernels compile, once per session."""
    return tmp_path_factory.mktemp("decoder-kernels")


@pytest.fixture(scope="session")
def spm_vocabulary(sentences: list[str]) -> Vocabulary:
    return train_spm_vocabulary(sentences)


@dataclass
class Tiny:
    """A tiny decoder's GGUF file, the engine's decoder of it, and transformers' model and tokenizer of it."""

    path: Path
    decoder: Any  # runtime.decoder.Decoder
    reference: Any  # transformers' model loaded from the file
    reference_tokenizer: Any


# (architecture, matrix type, tied embeddings, add BOS): Llama as it is written untied in F32, tied in Q8_0,
# Qwen2 (biases on Q, K and V; Q and K stored for the half-split RoPE), and Gemma 3 (its SentencePiece
# tokenizer, QK and post norms, GeGLU, sliding-window layers)
TINY_CASES = {"llama-f32": ("llama", "F32", False, True), "llama-q8_0": ("llama", "Q8_0", True, False),
              "qwen2-f32": ("qwen2", "F32", True, False), "gemma3-f32": ("gemma3", "F32", True, True)}  # fmt: skip


def build_tiny(root: Path, vocabulary: Vocabulary, case: str) -> Tiny:
    """The tiny decoder of ``case`` with ``vocabulary`` (a SentencePiece one for Gemma 3)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF file
    from runtime.decoder import Decoder

    torch.set_num_threads(1)
    arch, qtype, tied, add_bos = TINY_CASES[case]
    hf = make_hf_model(arch, len(vocabulary.tokens), tied=tied)
    path = write_gguf(root / f"{case}.gguf", hf, vocabulary, arch=arch, qtype=qtype, add_bos=add_bos)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(root), gguf_file=path.name,
                                                                  dtype=torch.float32).eval()  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(root), gguf_file=path.name)
    return Tiny(path, Decoder.load(path), reference, tokenizer)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, vocabulary: Vocabulary,
                spm_vocabulary: Vocabulary) -> Callable[[str], Tiny]:  # fmt: skip
    """Each tiny case, built once on first use."""
    built: dict[str, Tiny] = {}

    def get(case: str) -> Tiny:
        if case not in built:
            words = spm_vocabulary if TINY_CASES[case][0] == "gemma3" else vocabulary
            built[case] = build_tiny(tmp_path_factory.mktemp(case), words, case)
        return built[case]

    return get


@pytest.fixture(params=list(TINY_CASES))
def tiny(request: pytest.FixtureRequest, tiny_models: Callable[[str], Tiny]) -> Tiny:
    return tiny_models(request.param)


@pytest.fixture
def llama(tiny_models: Callable[[str], Tiny]) -> Tiny:
    """The tiny Llama in F32, for the tests of the engine's own behaviour."""
    return tiny_models("llama-f32")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return smollm2_file()


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path):
    from runtime.decoder import Decoder

    return Decoder.load(smollm2_path)
