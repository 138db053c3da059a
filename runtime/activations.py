"""Activation functions both engines compute in numpy, in fp32, in the order transformers computes them."""

from __future__ import annotations

import numpy as np

__all__ = ["gelu_tanh"]


def gelu_tanh(h: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation (transformers' ``gelu_new`` and ``gelu_pytorch_tanh``):
    ``h * (1 + tanh(sqrt(2/pi) * (h + 0.044715 h^3))) / 2``, as a new array."""
    t = h * h
    t *= np.float32(0.044715)
    t += 1.0
    t *= h
    t *= np.float32(np.sqrt(2.0 / np.pi))
    np.tanh(t, out=t)
    t += 1.0
    t *= h
    t *= np.float32(0.5)
    return t
