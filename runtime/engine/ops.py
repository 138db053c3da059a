"""The engine's operators as slots: each is a numpy default, or an evolved C kernel of the matching task.

A slot's C kernel is an elite of a built-in task whose signature fits it (``SLOT_TASKS``): the
``layernorm`` slot takes ``layernorm`` elites, the attention ``softmax`` slot ``softmax`` elites, the
``gelu`` slot (bias + GELU, fused) ``gelu`` elites, the ``linear`` slot (every weight GEMM: QKV, attention
output, feed-forward up and down) ``linear_bf16`` elites (bf16 GEMMs, fp32 accumulation) or
``linear_int8`` elites (u8 activations quantised per token, s8 weights per channel, int32
accumulation); an engine using either is checked against the similarity floor like any reduced
precision. The attention's batched matmuls stay numpy's BLAS. Every implementation returns a new
array and leaves its inputs alone, so slots can be swapped freely.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from runtime.toolchain.cc import CKernel

__all__ = ["SLOT_TASKS", "SLOTS", "Ops", "c_slot", "numpy_ops"]

SLOT_TASKS: dict[str, tuple[str, ...]] = {
    "layernorm": ("layernorm",), "softmax": ("softmax",), "gelu": ("gelu",), "linear": ("linear_bf16", "linear_int8"),
}
"""Slot -> the built-in tasks whose elites fill it (each task's signature is a calling convention of the slot)."""
SLOTS = tuple(SLOT_TASKS)

log = logging.getLogger(__name__)

_SQRT_HALF = np.float32(np.sqrt(0.5))


def np_layernorm(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """Layer norm over the last axis: ``(x - mean) / sqrt(var + eps) * g + b``."""
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    var = np.einsum("ij,ij->i", xc, xc)[:, None] / np.float32(x.shape[-1])
    xc *= 1.0 / np.sqrt(var + np.float32(eps))
    xc *= g
    xc += b
    return xc


def np_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise softmax over the last axis, max-subtracted."""
    e = x - x.max(axis=-1, keepdims=True)
    np.exp(e, out=e)
    e /= e.sum(axis=-1, keepdims=True)
    return e


def np_bias_gelu(x: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The erf GELU of ``x + b``, as BERT computes it: ``h * (1 + erf(h / sqrt 2)) / 2``.

    erf is Abramowitz & Stegun 7.1.26 (absolute error under 1.5e-7, below fp32's resolution of
    1 + erf): in numpy it is 4x faster than scipy's float32 erf.
    """
    h = x + b
    z = np.abs(h)
    z *= _SQRT_HALF  # |h| / sqrt 2
    t = z * np.float32(0.3275911)
    t += 1.0
    np.reciprocal(t, out=t)
    p = t * np.float32(1.061405429)
    for c in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
        p += np.float32(c)
        p *= t
    np.square(z, out=z)
    np.negative(z, out=z)
    np.exp(z, out=z)
    p *= z  # 1 - erf(|h| / sqrt 2)
    # (1 + erf(h / sqrt 2)) / 2 = 1 - p / 2 for h >= 0, p / 2 for h < 0
    p *= np.float32(0.5)
    np.subtract(1.0, p, out=p, where=h >= 0)
    p *= h
    return p


def np_linear(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = x @ w
    out += b
    return out


def np_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x @ w


@dataclass
class Ops:
    """The operator table a forward pass calls; ``kernels`` are the C kernels it holds (closed by :meth:`close`)."""

    layernorm: Callable[[np.ndarray, np.ndarray, np.ndarray, float], np.ndarray] = np_layernorm
    softmax: Callable[[np.ndarray], np.ndarray] = np_softmax
    gelu: Callable[[np.ndarray, np.ndarray], np.ndarray] = np_bias_gelu
    linear: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray] = np_linear
    matmul: Callable[[np.ndarray, np.ndarray], np.ndarray] = np_matmul
    kernels: dict[str, CKernel] = field(default_factory=dict)

    def close(self) -> None:
        for k in self.kernels.values():
            k.close()
        self.kernels.clear()


def numpy_ops() -> Ops:
    return Ops()


def _f32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


def c_slot(slot: str, kernel: CKernel, task: str | None = None) -> Callable[..., np.ndarray]:
    """Wraps ``kernel``, an elite of ``task`` (one of ``SLOT_TASKS[slot]``; default the first), as the slot's
    function."""
    task = task or SLOT_TASKS.get(slot, ("",))[0]
    if slot == "layernorm":

        def layernorm(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
            x = _f32(x)
            y = np.empty_like(x)
            kernel.bind([x.shape[0], x.shape[1], float(eps), x, _f32(g), _f32(b), y])()
            return y

        return layernorm
    if slot == "softmax":

        def softmax(x: np.ndarray) -> np.ndarray:
            x = _f32(x)
            y = np.empty_like(x)
            kernel.bind([x.shape[0], x.shape[1], x, y])()
            return y

        return softmax
    if slot == "gelu":

        def bias_gelu(x: np.ndarray, b: np.ndarray) -> np.ndarray:
            x = _f32(x)
            y = np.empty_like(x)
            kernel.bind([x.shape[0], x.shape[1], x, _f32(b), y])()
            return y

        return bias_gelu
    if slot == "linear" and task in _LINEAR:
        return _packed_linear(kernel, _LINEAR[task])
    takes = ", ".join(f"{s} ({' or '.join(t)})" for s, t in SLOT_TASKS.items())
    raise ValueError(f"no slot {slot!r} for {task!r} kernels (slots: {takes})")


@dataclass(frozen=True)
class _LinearKind:
    """How a linear kernel takes its weights: the CPU flag it needs, the (k, n) multiples it accepts, and
    the packing that turns a fp32 ``[k, n]`` weight into its leading arguments."""

    flag: str
    k_multiple: int
    pack: str  # "module:function" returning a tuple of arrays


_LINEAR = {
    "linear_bf16": _LinearKind("avx512_bf16", 32, "runtime.tasks.linear_bf16:pack_bf16"),
    "linear_int8": _LinearKind("avx512_vnni", 64, "runtime.tasks.linear_int8:pack_int8"),
}


def _packed_linear(kernel: CKernel, kind: _LinearKind) -> Callable[..., np.ndarray]:
    """``x @ w + b`` through a linear kernel (bf16 or int8); each weight is packed once, on first use.

    The packed copies are keyed by the weight array's identity and keep the array alive (so an id is
    never reused while its entry exists); the model's weights live as long as the engine. Shapes outside
    the kernel's contract (not this model's) run in fp32 BLAS.
    """
    import importlib

    from runtime.hardware import cpu_flags

    if kind.flag not in cpu_flags():
        # an elite evolved on another machine: its instructions would kill the process (SIGILL) here
        log.warning("linear slot: this CPU has no %s: the kernel %s is not used, the GEMMs run in fp32 BLAS",
                    kind.flag, os.path.basename(kernel.path))
        return lambda x, w, b=None: np_linear(x, w, b) if b is not None else x @ w
    module, _, name = kind.pack.partition(":")
    pack_fn = getattr(importlib.import_module(module), name)
    packed: dict[int, tuple[np.ndarray, tuple[np.ndarray, ...]]] = {}
    zeros: dict[int, np.ndarray] = {}
    lock = threading.Lock()

    def pack(w: np.ndarray) -> tuple[np.ndarray, ...]:
        entry = packed.get(id(w))
        if entry is None:
            with lock:
                if (entry := packed.get(id(w))) is None:
                    out = pack_fn(w)
                    entry = packed[id(w)] = (w, out if isinstance(out, tuple) else (out,))
        return entry[1]

    def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        x = _f32(x)
        (m, k), n = x.shape, w.shape[1]
        if k % kind.k_multiple or n % 16:
            return np_linear(x, w, b) if b is not None else x @ w
        if b is None:
            b = zeros.get(n)
            if b is None:
                b = zeros.setdefault(n, np.zeros(n, np.float32))
        y = np.empty((m, n), np.float32)
        kernel.bind([m, n, k, x, *pack(w), _f32(b), y])()
        return y

    return linear
