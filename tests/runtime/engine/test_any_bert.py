"""Any BERT-family sentence encoder loads from its directory: shapes from its config, pooling and
normalisation from its own modules; the engine matches sentence-transformers on it, and says where an
evolved kernel cannot serve its shapes."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from bert_models import encode, make_bert

from runtime.engine import Engine, EngineConfig, numpy_ops
from runtime.engine.model import ModelLoadError, load_model

pytest.importorskip("sentence_transformers")

FP32_FLOOR = 0.9999
SHAPES = {  # name -> (hidden, heads, layers, intermediate, activation, pooling, normalised)
    "mean-gelu": (64, 4, 2, 128, "gelu", "mean", True),
    "cls-tanh-raw": (96, 3, 2, 200, "gelu_new", "cls", False),  # head_dim 32, k=200 fits no linear kernel
    "relu-deep": (48, 2, 3, 96, "relu", "mean", True),
}


@pytest.fixture(scope="module")
def berts(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("berts")
    return {name: make_bert(root / name, hidden=h, heads=nh, layers=nl, intermediate=i, act=act, pooling=pool,
                            normalize=norm, seed=n)  # fmt: skip
            for n, (name, (h, nh, nl, i, act, pool, norm)) in enumerate(SHAPES.items())}


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("pack", [True, False])
def test_the_engine_matches_sentence_transformers_on_other_shapes(berts, sentences, name, pack):
    hidden, heads, layers, intermediate, act, pooling, normalised = SHAPES[name]
    model = load_model(berts[name])
    cfg = model.config
    assert (cfg.hidden, cfg.heads, cfg.layers, cfg.intermediate) == (hidden, heads, layers, intermediate)
    assert (cfg.pooling, cfg.normalize, cfg.max_tokens, cfg.vocab) == (pooling, normalised, 128, 30522)
    assert cfg.activation == {"gelu_new": "gelu_tanh"}.get(act, act)
    texts = sentences[:40]
    got = Engine(model, numpy_ops(), EngineConfig(max_batch=8, pack=pack)).embed(texts)
    want = encode(berts[name], texts)
    assert got.shape == want.shape == (len(texts), hidden)
    c = _cos(got, want)
    assert c.min() >= FP32_FLOOR, (name, c.min())
    # the same vectors, not only the same directions: unit-norm exactly where the model normalises
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1), rtol=1e-3)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5) is normalised


def test_a_slot_says_where_its_kernels_cannot_serve_a_model(berts, model):
    odd = load_model(berts["cls-tanh-raw"])
    reason = odd.misfit("linear", "linear_bf16")
    # the feed-forward: up's n and down's k are 200, no multiple of 16 or 32; QKV (n=288) and out (n=96) fit
    assert reason and "k=96 n=200, k=200 n=96" in reason and "fp32 BLAS" in reason
    assert "n=288" not in reason and "k=96 n=96" not in reason
    assert "multiple of 64" in (odd.misfit("linear", "linear_int8") or "")  # int8 takes k in 64s: 96 does not
    assert "activation is gelu_tanh" in (odd.misfit("gelu", "gelu") or "")
    fits = load_model(berts["mean-gelu"])
    assert fits.misfit("linear", "linear_bf16") is None and fits.misfit("gelu", "gelu") is None
    assert model.misfit("linear", "linear_int8") is None  # MiniLM: 384 and 1536 are multiples of 64
    assert odd.misfit("layernorm", "layernorm") is None and odd.misfit("softmax", "softmax") is None


def _broken(src, tmp_path, name, edit):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    edit(dst)
    return dst


def _set(path, **changes):
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps({**cfg, **changes}))


@pytest.mark.parametrize(("what", "edit", "says"), [
    ("no modules", lambda d: (d / "modules.json").unlink(), "modules.json is missing"),
    ("no tokenizer", lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    ("not bert", lambda d: _set(d / "config.json", model_type="roberta"), "model_type 'roberta'"),
    ("relative positions", lambda d: _set(d / "config.json", position_embedding_type="relative_key"),
     "absolute position embeddings only"),
    ("odd activation", lambda d: _set(d / "config.json", hidden_act="silu"), "hidden_act 'silu'"),
    ("max pooling", lambda d: _set(d / "1_Pooling" / "config.json", pooling_mode="max"), "pooling ['max']"),
    ("old-style max pooling", lambda d: (d / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True})),
     "pooling ['max_tokens']"),
    ("bad json", lambda d: (d / "config.json").write_text("{"), "is not valid JSON"),
    ("weights gone", lambda d: (d / "model.safetensors").unlink(), "model.safetensors is missing"),
])  # fmt: skip
def test_a_model_the_engine_cannot_run_is_one_clear_error(berts, tmp_path, what, edit, says):
    with pytest.raises(ModelLoadError) as err:
        load_model(_broken(berts["mean-gelu"], tmp_path, what.replace(" ", "-"), edit))
    assert says in str(err.value) and "\n" not in str(err.value)


def _legacy_names(d):
    """The checkpoint with its layer norms under TensorFlow-era names, as older BERTs and some transformers
    versions save them."""
    from safetensors.numpy import load_file, save_file

    path = d / "model.safetensors"
    weights = load_file(path)
    save_file({k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in weights.items()}, path)  # fmt: skip


def test_layer_norms_under_their_legacy_names_load_the_same(berts, sentences, tmp_path):
    legacy = _broken(berts["mean-gelu"], tmp_path, "legacy", _legacy_names)
    from safetensors import safe_open

    with safe_open(legacy / "model.safetensors", "np") as f:
        assert any(k.endswith("LayerNorm.gamma") for k in f.keys())
    want = Engine(load_model(berts["mean-gelu"]), numpy_ops(), EngineConfig()).embed(sentences)
    got = Engine(load_model(legacy), numpy_ops(), EngineConfig()).embed(sentences)
    np.testing.assert_array_equal(got, want)
