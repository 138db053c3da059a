"""The numpy engine reproduces sentence-transformers' all-MiniLM-L6-v2 embeddings."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import embed_sorted

from runtime.engine import Engine, EngineConfig, numpy_ops

FP32_FLOOR = 0.9999


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_weights_load_from_the_package(model):
    cfg = model.config
    assert (cfg.hidden, cfg.heads, cfg.layers, cfg.intermediate, cfg.max_tokens) == (384, 12, 6, 1536, 256)
    assert model.word.shape == (30522, 384) and model.word.dtype == np.float32
    assert len(model.layers) == 6 and model.layers[0].w_qkv.shape == (384, 1152)
    assert model.layers[0].w_up.shape == (384, 1536) and model.layers[0].w_down.shape == (1536, 384)


def test_tokenizer_matches_and_truncates(model, sentences):
    ids = model.tokenizer.encode_batch(sentences)
    assert all(s[0] == 101 and s[-1] == 102 for s in ids)  # [CLS] ... [SEP]
    assert max(len(s) for s in ids) == 256  # the long sentence is truncated to max_seq_length
    assert len({len(s) for s in ids}) > 10  # varied lengths


@pytest.mark.parametrize("pack", [True, False])
def test_fp32_matches_sentence_transformers(model, sentences, reference_embeddings, pack):
    got = embed_sorted(model, sentences, numpy_ops(), pack=pack)
    assert got.shape == (len(sentences), 384) and got.dtype == np.float32
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    c = cosines(got, reference_embeddings)
    assert c.min() >= FP32_FLOOR, (c.min(), sentences[int(c.argmin())])


def test_engine_embed_keeps_order_whatever_the_batching(model, sentences, reference_embeddings):
    got = Engine(model, numpy_ops(), EngineConfig(max_batch=8, bucketing="split")).embed(sentences)
    assert cosines(got, reference_embeddings).min() >= FP32_FLOOR
    short = sentences[:6]  # unsorted, one padded batch
    got = Engine(model, numpy_ops(), EngineConfig(max_batch=4, bucketing="none", pack=False)).embed(short)
    assert cosines(got, reference_embeddings[:6]).min() >= FP32_FLOOR


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_reduced_precision_is_measured_against_the_floor(model, sentences, reference_embeddings, precision):
    """Reduced precision is allowed only with its measured minimum cosine at or above the floor (0.99)."""
    reduced = model.with_precision(precision)
    assert reduced.layers[0].w_qkv is not model.layers[0].w_qkv and model.precision == "fp32"
    got = embed_sorted(reduced, sentences, numpy_ops())
    c = cosines(got, reference_embeddings)
    print(f"{precision}: min cosine {c.min():.5f}")
    assert 0.99 <= c.min() < 1.0


def test_the_serving_path_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys\nfrom runtime.engine import Engine, EngineConfig, load_model, numpy_ops\n"
            "e = Engine(load_model(), numpy_ops(), EngineConfig())\n"
            "with e:\n    e.submit('hello there').result()\n"
            "print(sorted(m for m in ('torch', 'sentence_transformers', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_attention_blocks_cover_the_batch_in_order_within_the_budget():
    from runtime.engine.model import attention_blocks

    lengths = np.array([128, 16, 16, 48, 48, 48, 16, 130, 8])
    for pack in (True, False):
        blocks = attention_blocks(lengths, 12, pack=pack, budget=12 * 48 * 48 * 4 * 2)
        assert sum(b.sequences for b in blocks) == len(lengths)
        assert [b.sequences for b in blocks] == [1, 2, 2, 2, 1, 1]  # a 128 alone; (48, 16) is over the budget
        row, seq = 0, 0
        for b in blocks:
            group = lengths[seq : seq + b.sequences]
            assert b.width == group.max() and b.bias.shape == (b.sequences, 1, 1, b.width)
            assert b.rows.start == row and b.stride == (b.width if pack else lengths.max())
            assert (b.bias[:, 0, 0] == 0).sum() == group.sum()  # exactly the real keys are unmasked
            if b.sequences > 1:
                assert b.sequences * 12 * b.width**2 * 4 <= 12 * 48 * 48 * 4 * 2
            row, seq = b.rows.stop, seq + b.sequences
        assert row == (lengths.sum() if pack else len(lengths) * lengths.max())


@pytest.mark.parametrize("pack", [True, False])
def test_attention_in_blocks_gives_the_whole_batchs_embeddings(model, sentences, reference_embeddings, pack,
                                                               monkeypatch):  # fmt: skip
    """An unsorted batch of mixed lengths, its attention run a sequence at a time, a few at a time, and all at
    once: the same embeddings, and sentence-transformers'."""
    from runtime.engine import model as model_module

    seqs = model.tokenizer.encode_batch(sentences[:12])
    lengths = np.array([len(s) for s in seqs])
    assert len(set(lengths)) > 4
    blocks, got = [], []
    for budget in (1, 1 << 18, 1 << 40):  # the default budget is half the L2 cache's size
        monkeypatch.setattr(model_module, "l2_cache_bytes", lambda b=budget: 2 * b)
        blocks.append(len(model_module.attention_blocks(lengths, 12, pack=pack)))
        got.append(model.forward(seqs, numpy_ops(), pack=pack))
    assert blocks[0] == 12 and 1 < blocks[1] < 12 and blocks[2] == 1
    for emb in got:
        assert np.abs(emb - got[-1]).max() < 1e-5
        assert cosines(emb, reference_embeddings[:12]).min() >= FP32_FLOOR
