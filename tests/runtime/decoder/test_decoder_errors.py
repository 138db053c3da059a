"""A file the decoder cannot run fails with one line that names the cause."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_models import make_hf_model, write_gguf

from runtime.decoder import GGUFLoadError, load_decoder

# the tiny decoders are built once per worker: their tests share one
pytestmark = pytest.mark.xdist_group("decoder-tiny")


def _fails(path: Path, match: str) -> str:
    with pytest.raises(GGUFLoadError, match=match) as info:
        load_decoder(path)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.fixture(scope="module")
def hf_model(vocabulary):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return make_hf_model("llama", len(vocabulary.tokens), tied=True)


def test_missing_file(tmp_path):
    _fails(tmp_path / "absent.gguf", "no such file")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip archive, not a model")
    _fails(path, "is not a GGUF file")


def test_other_architecture(tmp_path, hf_model, vocabulary):
    path = write_gguf(tmp_path / "falcon.gguf", hf_model, vocabulary, arch="llama", architecture="falcon")
    _fails(path, "architecture 'falcon'; the decoder runs llama, qwen2")


def test_missing_tokenizer(tmp_path, hf_model, vocabulary):
    path = write_gguf(tmp_path / "bare.gguf", hf_model, vocabulary, arch="llama", tokenizer=False)
    _fails(path, "no tokenizer")


def test_tensor_type_without_a_dequantiser(tmp_path, hf_model, vocabulary):
    path = write_gguf(tmp_path / "q8_1.gguf", hf_model, vocabulary, arch="llama", qtype="Q8_1")
    _fails(path, "of type Q8_1, which the gguf package cannot dequantise")
