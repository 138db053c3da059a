"""Reading a GGUF file: its metadata, the model's shapes and hyperparameters, and weights dequantised to fp32.

A GGUF file is llama.cpp's format: a header of typed key-value metadata (the model's hyperparameters
under ``{architecture}.*``, the tokenizer under ``tokenizer.*``) and tensors, each in its own type (F32,
F16, BF16 or a block quantisation such as Q4_0, Q8_0, Q4_K, Q6_K). The header is parsed here; every type
the ``gguf`` package's ``gguf.quants`` dequantises loads. Tensor shapes in the file list the fastest axis
first (ggml's ``ne``), the reverse of numpy's: a linear layer's weight is ``[in, out]`` there and
``[out, in]`` here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ARCHITECTURES", "DecoderConfig", "GGUFFile", "GGUFLoadError", "read_config"]

ARCHITECTURES = ("llama", "qwen2", "gemma3")
"""The ``general.architecture`` values the decoder runs: RMSNorm, RoPE and GQA decoders. Llama and Qwen2 have a
SwiGLU MLP (Qwen2 adds biases to the Q, K and V projections and stores Q and K unpermuted for the half-split
RoPE). Gemma 3 adds an RMSNorm on each query and key head and after the attention and the MLP, a GeGLU MLP,
an embedding scaled by the square root of its width, and sliding-window attention in five layers of six, whose
RoPE has a base of its own."""

GEMMA3_WINDOW_PATTERN = 6
"""Of each six Gemma 3 layers the last is global, the others sliding-window (llama.cpp and transformers both fix
it, where the file does not say)."""

GEMMA3_LOCAL_ROPE_BASE = 10000.0
"""The RoPE base of Gemma 3's sliding-window layers, where the file does not state one."""


class GGUFLoadError(ValueError):
    """A GGUF file the decoder cannot run; the message says why and what to do."""


@dataclass(frozen=True)
class DecoderConfig:
    """A decoder's shapes and hyperparameters, as the file's metadata states them."""

    architecture: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    context: int  # the longest sequence (prompt and generated tokens) the model was trained for
    eps: float  # RMSNorm's epsilon
    rope_base: float
    rope_dim: int  # the leading dimensions of each head that RoPE rotates (the whole head, as a rule)
    rope_scale: float = 1.0  # linear RoPE scaling: positions are divided by it (Gemma 3: in its global layers)
    activation: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0  # the embedding's rows are multiplied by it (Gemma: sqrt(hidden))
    attn_scale: float = 0.0  # attention scores' scale; 0: 1 / sqrt(head_dim)
    sliding_window: int = 0  # positions a sliding-window layer sees (its own included); 0: none
    local_layers: tuple[bool, ...] = ()  # per layer: whether it is a sliding-window one (none where empty)
    local_rope_base: float = 0.0  # the RoPE base of the sliding-window layers
    logit_softcap: float = 0.0  # logits become cap * tanh(logits / cap); 0: none

    def window(self, layer: int) -> int:
        """The positions ``layer`` attends to (its own included): the sliding window, or 0 for all of them."""
        return self.sliding_window if self.local_layers and self.local_layers[layer] else 0

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy's axis order: the file's dimensions reversed
    qtype: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # uint8 [rows, bytes of a row], a view of the mapped file


class GGUFFile:
    """An open GGUF file: :meth:`get` reads metadata, :meth:`tensor` a weight dequantised to fp32 ``[out, in]``.

    Raises :class:`GGUFLoadError` for a path that is missing or not a GGUF file. The header is parsed here
    (:func:`_parse_header`): the ``gguf`` package's reader builds numpy views of every element of every array,
    which for Gemma 3's 262k-token vocabulary took 36 s; this takes well under one. Tensors stay in the mapped
    file until :meth:`tensor` dequantises one (with ``gguf.quants``).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFLoadError(f"{self.path}: no such file")
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
            self._fields, self._tensors = _parse_header(self._map)
        except (ValueError, KeyError, IndexError, UnicodeDecodeError) as exc:
            raise GGUFLoadError(f"{self.path} is not a GGUF file the decoder can read ({exc})") from None

    def get(self, key: str, default: Any = None) -> Any:
        """The metadata value of ``key`` (a Python scalar, string or list), ``default`` where it is absent."""
        return self._fields.get(key, default)

    def require(self, key: str) -> Any:
        """The metadata value of ``key``; a :class:`GGUFLoadError` naming the key where it is absent."""
        value = self.get(key)
        if value is None:
            raise GGUFLoadError(f"{self.path}: the metadata has no {key!r}; the decoder needs it to run this model")
        return value

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The shape of tensor ``name`` in numpy's axis order (``None`` where the file has no such tensor)."""
        t = self._tensors.get(name)
        return None if t is None else t.shape

    def check_types(self) -> None:
        """Raises :class:`GGUFLoadError` naming the first tensor whose type cannot be dequantised (probing one row
        of each, so that a file fails before any weight is read in full)."""
        from gguf.quants import dequantize

        for t in self._tensors.values():
            try:
                dequantize(t.data[:1], t.qtype)
            except NotImplementedError:
                raise self._unreadable(t.name, t.qtype.name) from None

    def _unreadable(self, name: str, type_name: str) -> GGUFLoadError:
        return GGUFLoadError(f"{self.path}: tensor {name} is of type {type_name}, which the gguf package cannot "
                             "dequantise; convert the model to a type it reads (F16, Q8_0, Q4_K...)")  # fmt: skip

    def tensor(self, name: str, expect: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor ``name`` dequantised to a C-contiguous fp32 array in numpy's axis order (checked to have the
        shape ``expect`` where given)."""
        from gguf.quants import dequantize

        t = self._tensors.get(name)
        if t is None:
            raise GGUFLoadError(f"{self.path} has no tensor {name!r}: not a complete "
                                f"{self.get('general.architecture')} model")  # fmt: skip
        try:
            w = dequantize(t.data, t.qtype)
        except NotImplementedError:
            raise self._unreadable(name, t.qtype.name) from None
        shape = t.shape
        if expect is not None and shape != expect:
            raise GGUFLoadError(f"{self.path}: tensor {name} is {list(shape)}, where the metadata implies "
                                f"{list(expect)}")  # fmt: skip
        return np.ascontiguousarray(w.reshape(shape), dtype=np.float32)


_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
            12: "<f8"}  # fmt: skip
_STRING, _ARRAY = 8, 9  # GGUF's value types beside the scalars


def _parse_header(buf: np.ndarray) -> tuple[dict[str, Any], dict[str, _Tensor]]:
    """The metadata and the tensors of a GGUF file (version 2 or 3) mapped as ``buf``; a ValueError where it is
    not one. Numeric arrays are read whole (``np.frombuffer``); strings one by one."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    raw = memoryview(buf)
    if bytes(raw[:4]) != b"GGUF":
        raise ValueError("no GGUF magic number")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", raw, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}; the decoder reads versions 2 and 3")
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", raw, pos)
        pos += 8 + n
        return bytes(raw[pos - n : pos]).decode("utf-8")

    def value(kind: int) -> Any:
        nonlocal pos
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", raw, pos)
            pos += 12
            if item == _STRING:
                return [string() for _ in range(count)]
            if item == _ARRAY:
                return [value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_SCALARS[item])
            pos += count * dtype.itemsize
            return np.frombuffer(raw, dtype, count, pos - count * dtype.itemsize).tolist()
        dtype = np.dtype(_SCALARS[kind])
        pos += dtype.itemsize
        return np.frombuffer(raw, dtype, 1, pos - dtype.itemsize)[0].item()

    fields: dict[str, Any] = {}
    for _ in range(kv_count):
        key = string()
        (kind,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        fields[key] = value(kind)
    infos = []
    for _ in range(tensor_count):
        name = string()
        (dims,) = struct.unpack_from("<I", raw, pos)
        ne = struct.unpack_from(f"<{dims}Q", raw, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", raw, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        infos.append((name, ne, GGMLQuantizationType(qtype), offset))
    align = int(fields.get("general.alignment", 32))
    start = (pos + align - 1) // align * align
    tensors = {}
    for name, ne, qtype, offset in infos:
        block, size = GGML_QUANT_SIZES[qtype]
        row = ne[0] // block * size
        rows = int(np.prod(ne[1:], dtype=np.int64)) if len(ne) > 1 else 1
        begin = start + offset
        if begin + rows * row > len(buf):
            raise ValueError(f"tensor {name} runs past the end of the file")
        data = buf[begin : begin + rows * row].reshape(rows, row)
        tensors[name] = _Tensor(name, tuple(int(n) for n in reversed(ne)), qtype, data)
    return fields, tensors


def read_config(f: GGUFFile) -> DecoderConfig:
    """The decoder's shapes from the metadata of ``f``; a :class:`GGUFLoadError` for a model it cannot run."""
    arch = f.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFLoadError(f"{f.path}: architecture {arch!r}; the decoder runs {', '.join(ARCHITECTURES)} models")
    if f.get(f"{arch}.expert_count", 0):
        raise GGUFLoadError(f"{f.path}: a mixture-of-experts {arch} model; the decoder runs dense models only")

    def key(name: str) -> int:
        value = f.require(f"{arch}.{name}")
        if not isinstance(value, int) or value <= 0:
            raise GGUFLoadError(f"{f.path}: {arch}.{name} is {value!r}, not a positive integer")
        return value

    hidden, heads = key("embedding_length"), key("attention.head_count")
    kv_heads = f.get(f"{arch}.attention.head_count_kv", heads)
    head_dim = f.get(f"{arch}.attention.key_length", hidden // heads)
    if heads % kv_heads:
        raise GGUFLoadError(f"{f.path}: {heads} attention heads do not share {kv_heads} key-value heads evenly")
    if f.get(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise GGUFLoadError(f"{f.path}: keys and values of different widths; the decoder needs them equal")
    rope_dim = f.get(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim % 2 or rope_dim > head_dim or (arch != "llama" and rope_dim != head_dim):
        raise GGUFLoadError(f"{f.path}: RoPE over {rope_dim} of {head_dim} head dimensions is not supported")
    scaling = f.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise GGUFLoadError(f"{f.path}: RoPE scaling {scaling!r}; the decoder runs none or linear scaling")
    scale = float(f.get(f"{arch}.rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
    embed = f.shape("token_embd.weight")
    if embed is None or len(embed) != 2 or embed[1] != hidden:
        raise GGUFLoadError(
            f"{f.path}: token_embd.weight is {embed}, not [vocab, {hidden}]: not a complete {arch} model"
        )
    layers = key("block_count")
    config = DecoderConfig(
        architecture=arch, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, intermediate=key("feed_forward_length"), vocab=embed[0], context=key("context_length"),
        eps=float(f.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_base=float(f.get(f"{arch}.rope.freq_base", 10000.0)), rope_dim=rope_dim, rope_scale=scale,
    )  # fmt: skip
    return _gemma3(f, config) if arch == "gemma3" else config


def _gemma3(f: GGUFFile, config: DecoderConfig) -> DecoderConfig:
    """Gemma 3's additions, from the metadata where it states them and llama.cpp's fixed values where not."""
    from dataclasses import replace

    arch, layers = config.architecture, config.layers
    window = int(f.get(f"{arch}.attention.sliding_window", 0) or 0)
    pattern = f.get(f"{arch}.attention.sliding_window_pattern", GEMMA3_WINDOW_PATTERN)
    if isinstance(pattern, list):  # newer converters: one flag per layer
        local = tuple(bool(p) for p in pattern)
        if len(local) != layers:
            raise GGUFLoadError(f"{f.path}: {arch}.attention.sliding_window_pattern has {len(local)} entries "
                                f"for {layers} layers")  # fmt: skip
    elif isinstance(pattern, int) and pattern > 0:
        local = tuple((i + 1) % pattern != 0 for i in range(layers))
    else:
        raise GGUFLoadError(f"{f.path}: {arch}.attention.sliding_window_pattern is {pattern!r}")
    # llama.cpp's query scale: the slots' 1 / sqrt(head_dim), but 1 / sqrt(hidden / heads) for the 62-layer 27B model
    scale = (config.hidden / config.heads) ** -0.5 if layers == 62 else 0.0
    return replace(
        config, activation="gelu_tanh", embed_scale=config.hidden**0.5, attn_scale=scale,
        sliding_window=window, local_layers=local if window else (),
        local_rope_base=float(f.get(f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
        logit_softcap=float(f.get(f"{arch}.final_logit_softcapping", 0.0) or 0.0),
    )  # fmt: skip
