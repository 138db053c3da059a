"""The engine's operators as slots: each is a numpy default, or an evolved C kernel of the matching task.

A slot's C kernel is an elite of a built-in task whose signature fits it (``SLOT_TASKS``): the
``layernorm`` slot takes ``layernorm`` elites, the attention ``softmax`` slot ``softmax`` elites, the
``gelu`` slot (bias + GELU, fused) ``gelu`` elites. The GEMMs stay numpy's BLAS. Every implementation
returns a new array and leaves its inputs alone, so slots can be swapped freely.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from runtime.backends.c import CKernel

__all__ = ["SLOT_TASKS", "SLOTS", "Ops", "c_slot", "numpy_ops"]

SLOT_TASKS: dict[str, str] = {"layernorm": "layernorm", "softmax": "softmax", "gelu": "gelu"}
"""Slot -> the built-in task whose elites fill it (the task's signature is the slot's C calling convention)."""
SLOTS = tuple(SLOT_TASKS)

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


def c_slot(slot: str, kernel: CKernel) -> Callable[..., np.ndarray]:
    """Wraps ``kernel`` (an elite of ``SLOT_TASKS[slot]``) as the slot's function."""
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
    raise ValueError(f"unknown slot {slot!r} (slots: {', '.join(SLOTS)})")
