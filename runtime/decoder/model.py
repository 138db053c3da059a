"""A Llama-family or Gemma 3 decoder: weights from a GGUF file and the forward pass in numpy over per-sequence KV
caches.

Each layer is ``x += attn(rmsnorm(x))`` then ``x += mlp(rmsnorm(x))``: Q, K and V projections (one fused
GEMM), RoPE on Q and K, causal grouped-query attention over the sequence's cache, the output projection;
a SwiGLU MLP (gate and up fused). A final RMSNorm and the LM head give the logits. Gemma 3 adds an RMSNorm on
each query and key head (before RoPE) and on the attention's and the MLP's outputs (before the residual sum),
scales the embedding, has a GeGLU MLP and slides a window over the keys in most layers (with a RoPE base of
their own). Every operator goes through :class:`runtime.decoder.ops.DecoderOps`. The weights are dequantised
to fp32 once, at load.

RoPE rotates adjacent pairs: llama.cpp's converter permutes the rows of each Llama Q and K head so that
its pairs ``(i, i + d/2)`` become ``(2i, 2i + 1)``, and the decoder reads the file as it is. Qwen2 and Gemma 3
files keep the half-split layout; their Q and K rows (and biases, and Gemma's Q and K norms) are permuted the
same way at load, so one RoPE serves all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.decoder.gguf_file import DecoderConfig, GGUFFile, read_config
from runtime.decoder.ops import DecoderOps
from runtime.decoder.sampling import TopLogits
from runtime.decoder.tokenizer import Tokenizer

__all__ = ["ContextFull", "DecoderModel", "KVCache", "Layer", "load_decoder"]


class ContextFull(ValueError):
    """A sequence would grow past the model's context length."""


@dataclass
class Layer:
    """One decoder layer; projection weights are stored ``[in, out]`` (``x @ w``)."""

    attn_norm: np.ndarray  # [H]
    w_qkv: np.ndarray  # [H, q_width + 2 kv_width]: Q, K and V in one GEMM
    b_qkv: np.ndarray | None  # Qwen2's biases; None for Llama
    w_o: np.ndarray  # [q_width, H]
    ffn_norm: np.ndarray  # [H]
    w_gate_up: np.ndarray  # [H, 2 I]: gate, then up
    w_down: np.ndarray  # [I, H]
    q_norm: np.ndarray | None = None  # [head_dim]: Gemma 3's norms of each query and key head
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None  # [H]: Gemma 3's norms of the attention's and the MLP's outputs
    post_ffn_norm: np.ndarray | None = None


class KVCache:
    """One sequence's keys and values: per layer ``[kv_heads, capacity, head_dim]`` of ``dtype`` (fp32, or f16 at
    half the bytes), the first ``length`` positions filled. It grows by doubling (up to the context length) as the
    sequence does."""

    def __init__(self, config: DecoderConfig, capacity: int = 64, dtype: np.dtype | type = np.float32) -> None:
        self.config = config
        self.length = 0
        self.dtype = np.dtype(dtype)
        cap = max(1, min(capacity, config.context))
        shape = (config.kv_heads, cap, config.head_dim)
        self.k = [np.zeros(shape, self.dtype) for _ in range(config.layers)]
        self.v = [np.zeros(shape, self.dtype) for _ in range(config.layers)]
        self.addresses = np.zeros((config.layers, 2), np.int64)  # of each layer's keys and values, for C kernels
        self._locate()

    def _locate(self) -> None:
        for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            self.addresses[i] = k.__array_interface__["data"][0], v.__array_interface__["data"][0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    def reserve(self, n: int) -> None:
        """Room for ``n`` more positions; :class:`ContextFull` past the context length."""
        need = self.length + n
        if need > self.config.context:
            raise ContextFull(f"{need} tokens exceed the model's context length of {self.config.context}")
        if need <= self.capacity:
            return
        cap = min(max(need, 2 * self.capacity), self.config.context)
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                grown = np.zeros((old.shape[0], cap, old.shape[2]), self.dtype)
                grown[:, : self.length] = old[:, : self.length]
                store[i] = grown
        self._locate()

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stores ``k`` and ``v`` (``[t, kv_heads, d]``) at positions ``length..length+t-1`` of ``layer``; returns
        the layer's keys and values through them (``[kv_heads, length + t, d]``, views)."""
        end = self.length + k.shape[0]
        self.k[layer][:, self.length : end] = k.transpose(1, 0, 2)
        self.v[layer][:, self.length : end] = v.transpose(1, 0, 2)
        return self.k[layer][:, :end], self.v[layer][:, :end]


@dataclass
class DecoderModel:
    """Weights in fp32 and the tokenizer; :meth:`forward` runs a batch of sequences over their caches (of
    ``kv_dtype``: fp32, or f16)."""

    config: DecoderConfig
    tokenizer: Tokenizer
    embed: np.ndarray  # [vocab, H]
    layers: list[Layer]
    norm: np.ndarray  # [H]
    lm_head: np.ndarray  # [vocab, H]; the embedding matrix itself where the model ties them
    inv_freq: np.ndarray  # [rope_dim / 2]: RoPE's angle per position of each rotated pair
    path: Path = field(default_factory=Path)
    local_inv_freq: np.ndarray | None = None  # the sliding-window layers' (Gemma 3), where they have their own
    kv_dtype: np.dtype = field(default_factory=lambda: np.dtype(np.float32))

    def new_cache(self, capacity: int = 64) -> KVCache:
        return KVCache(self.config, capacity, self.kv_dtype)

    def rope_tables(self, positions: np.ndarray, *, local: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``cos`` and ``sin`` ``[T, rope_dim / 2]`` of the angles at ``positions`` (fp32, as transformers computes);
        ``local``: of the sliding-window layers (unscaled, at their own base)."""
        pos = positions.astype(np.float32)
        if local and self.local_inv_freq is not None:
            inv_freq = self.local_inv_freq
        else:
            inv_freq = self.inv_freq
            if self.config.rope_scale != 1.0:
                pos /= np.float32(self.config.rope_scale)
        angles = pos[:, None] * inv_freq[None, :]
        return np.cos(angles), np.sin(angles)

    def forward(
        self,
        chunks: Sequence[Sequence[int] | np.ndarray],
        caches: Sequence[KVCache],
        ops: DecoderOps,
        *,
        all_logits: bool = False,
        top: int = 0,
    ) -> np.ndarray | TopLogits:
        """Runs the new tokens ``chunks[i]`` of each sequence after what ``caches[i]`` holds, and appends them to
        it. Returns the logits of each chunk's last token ``[len(chunks), vocab]`` (``all_logits``: of every new
        token, ``[total tokens, vocab]``, the chunks one after another). A prompt is one chunk (prefill), a
        decode step a chunk of one token; the sequences of a batch may be at different positions. With ``top``,
        each chunk's last token gives only its ``top`` likeliest tokens and its log-sum-exp (``ops.lm_head_topk``;
        not with ``all_logits``, nor for a model whose logits are soft-capped)."""
        cfg = self.config
        if len(chunks) != len(caches) or not chunks:
            raise ValueError(f"{len(chunks)} chunks for {len(caches)} caches: give one non-empty chunk per cache")
        ids = [np.asarray(c, np.int64).reshape(-1) for c in chunks]
        counts = [len(c) for c in ids]
        if min(counts) == 0:
            raise ValueError("an empty chunk: every sequence in a forward pass needs at least one new token")
        if top and (all_logits or cfg.logit_softcap):
            raise ValueError("top logits are of each chunk's last token, for a model without soft-capped logits")
        flat = np.concatenate(ids)
        if flat.min() < 0 or flat.max() >= cfg.vocab:
            raise ValueError(f"token ids must lie in [0, {cfg.vocab}): got {int(flat.min())}..{int(flat.max())}")
        for cache, n in zip(caches, counts, strict=True):
            cache.reserve(n)
        starts = [c.length for c in caches]
        offsets = np.concatenate(([0], np.cumsum(counts)))
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
        tables = {False: self.rope_tables(positions)}
        if cfg.local_layers:
            tables[True] = self.rope_tables(positions, local=True)
        lengths = [s + n for s, n in zip(starts, counts, strict=True)]
        q_w, kv_w, d = cfg.q_width, cfg.kv_width, cfg.head_dim
        q_scale = np.float32(cfg.attn_scale * np.sqrt(d)) if cfg.attn_scale else None  # the slots scale by d^-1/2
        x = self.embed[flat]  # a copy: the residual stream, updated in place
        if cfg.embed_scale != 1.0:
            x *= np.float32(cfg.embed_scale)
        mlp = ops.geglu if cfg.activation == "gelu_tanh" else ops.swiglu
        for li, layer in enumerate(self.layers):
            window = cfg.window(li)
            cos, sin = tables[bool(window)]  # a sliding-window layer's own RoPE (the global one where none)
            qkv = ops.linear(ops.rmsnorm(x, layer.attn_norm, cfg.eps), layer.w_qkv, layer.b_qkv)
            q, k = qkv[:, :q_w], qkv[:, q_w : q_w + kv_w]
            if layer.q_norm is not None:
                q = ops.rmsnorm(np.ascontiguousarray(q).reshape(-1, d), layer.q_norm, cfg.eps)
                k = ops.rmsnorm(np.ascontiguousarray(k).reshape(-1, d), layer.k_norm, cfg.eps)
            q = ops.rope(q.reshape(-1, cfg.heads, d), cos, sin)
            k = ops.rope(k.reshape(-1, cfg.kv_heads, d), cos, sin)
            if q_scale is not None:
                q *= q_scale
            v = qkv[:, q_w + kv_w :].reshape(-1, cfg.kv_heads, d)
            for i, cache in enumerate(caches):
                cache.write(li, k[offsets[i] : offsets[i + 1]], v[offsets[i] : offsets[i + 1]])
            ctx = ops.attention(q, caches, li, lengths, counts, window).reshape(len(flat), q_w)
            attn = ops.linear(ctx, layer.w_o, None)
            x += attn if layer.post_attn_norm is None else ops.rmsnorm(attn, layer.post_attn_norm, cfg.eps)
            up = ops.linear(ops.rmsnorm(x, layer.ffn_norm, cfg.eps), layer.w_gate_up, None)
            down = ops.linear(mlp(up), layer.w_down, None)
            x += down if layer.post_ffn_norm is None else ops.rmsnorm(down, layer.post_ffn_norm, cfg.eps)
        for cache, n in zip(caches, counts, strict=True):
            cache.length += n
        rows = x if all_logits else x[offsets[1:] - 1]
        if top:
            return ops.lm_head_topk(ops.rmsnorm(rows, self.norm, cfg.eps), self.lm_head, top)
        logits = ops.lm_head(ops.rmsnorm(rows, self.norm, cfg.eps), self.lm_head)
        if cfg.logit_softcap:
            cap = np.float32(cfg.logit_softcap)
            logits = np.tanh(logits / cap) * cap
        return logits


def _interleave_heads(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head reordered from the half-split RoPE layout to adjacent pairs (llama.cpp's permutation)."""
    return np.ascontiguousarray(w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)
                                .reshape(w.shape))  # fmt: skip


def load_decoder(path: str | Path) -> DecoderModel:
    """Reads a Llama-family decoder and its tokenizer from the GGUF file ``path``, weights dequantised to fp32;
    raises :class:`runtime.decoder.GGUFLoadError` for a file it cannot run."""
    f = GGUFFile(path)
    cfg = read_config(f)
    tokenizer = Tokenizer.from_gguf(f)
    f.check_types()
    h, q_w, kv_w, inter = cfg.hidden, cfg.q_width, cfg.kv_width, cfg.intermediate
    half_split = cfg.architecture in ("qwen2", "gemma3")

    def qk(name: str, shape: tuple[int, ...], heads: int) -> np.ndarray:
        w = f.tensor(name, shape)
        return _interleave_heads(w, heads) if half_split else w

    def t(name: str, *shape: int) -> np.ndarray:  # a projection's weight, transposed to [in, out]
        return np.ascontiguousarray(f.tensor(name, shape).T)

    layers = []
    for i in range(cfg.layers):
        p = f"blk.{i}."
        q, k = qk(p + "attn_q.weight", (q_w, h), cfg.heads), qk(p + "attn_k.weight", (kv_w, h), cfg.kv_heads)
        extra = {}
        if cfg.architecture == "gemma3":  # a head's norm is permuted as its rows are
            d = cfg.head_dim
            extra = {"q_norm": qk(p + "attn_q_norm.weight", (d,), 1), "k_norm": qk(p + "attn_k_norm.weight", (d,), 1),
                     "post_attn_norm": f.tensor(p + "post_attention_norm.weight", (h,)),
                     "post_ffn_norm": f.tensor(p + "post_ffw_norm.weight", (h,))}  # fmt: skip
        b_qkv = None
        if f.has_tensor(p + "attn_q.bias"):
            b_qkv = np.concatenate([qk(p + "attn_q.bias", (q_w,), cfg.heads),
                                    qk(p + "attn_k.bias", (kv_w,), cfg.kv_heads),
                                    f.tensor(p + "attn_v.bias", (kv_w,))])  # fmt: skip
        layers.append(Layer(
            attn_norm=f.tensor(p + "attn_norm.weight", (h,)),
            w_qkv=np.ascontiguousarray(np.concatenate([q, k, f.tensor(p + "attn_v.weight", (kv_w, h))]).T),
            b_qkv=b_qkv,
            w_o=t(p + "attn_output.weight", h, q_w),
            ffn_norm=f.tensor(p + "ffn_norm.weight", (h,)),
            w_gate_up=np.ascontiguousarray(np.concatenate([f.tensor(p + "ffn_gate.weight", (inter, h)),
                                                           f.tensor(p + "ffn_up.weight", (inter, h))]).T),
            w_down=t(p + "ffn_down.weight", h, inter), **extra,
        ))  # fmt: skip
    embed = f.tensor("token_embd.weight", (cfg.vocab, h))
    lm_head = f.tensor("output.weight", (cfg.vocab, h)) if f.has_tensor("output.weight") else embed
    r = cfg.rope_dim
    inv_freq = 1.0 / np.float32(cfg.rope_base) ** (np.arange(0, r, 2, dtype=np.float32) / np.float32(r))
    if f.has_tensor("rope_freqs.weight"):  # Llama 3.1's per-pair frequency factors: angles divided by them
        inv_freq = inv_freq / f.tensor("rope_freqs.weight", (r // 2,))
    local = None
    if cfg.local_layers and cfg.local_rope_base:
        local = (1.0 / np.float32(cfg.local_rope_base) ** (np.arange(0, r, 2, dtype=np.float32) / np.float32(r)))
    return DecoderModel(config=cfg, tokenizer=tokenizer, embed=embed, layers=layers,
                        norm=f.tensor("output_norm.weight", (h,)), lm_head=lm_head,
                        inv_freq=inv_freq.astype(np.float32), path=Path(path),
                        local_inv_freq=None if local is None else local.astype(np.float32))  # fmt: skip
