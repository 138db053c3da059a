"""The engine's operators as slots: each is a numpy default, or an evolved C kernel of a task that fills it.

A kernel task declares the slot its elites fill (:attr:`runtime.slots.SlotTask.slot`) and how the slot
calls them (``slot_args``, ``slot_pack``); the slots and their calling conventions are the engine's:
``layernorm`` (x, gamma, beta, eps), the attention ``softmax`` (x), ``gelu`` (bias + GELU, fused: x, bias),
and ``linear`` (every weight GEMM: QKV, attention output, feed-forward up and down: x, W, bias), whose
built-in tasks are ``linear_bf16`` (bf16 GEMMs, fp32 accumulation) and ``linear_int8`` (u8 activations
quantised per token, s8 weights per channel, int32 accumulation); an engine using either is checked
against the similarity floor like any reduced precision. The attention's batched matmuls stay numpy's
BLAS. Every implementation returns a new array and leaves its inputs alone, so slots can be swapped freely.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import numpy as np

from runtime.slots import SlotTask, slot_tasks
from runtime.task import load_task_class
from runtime.toolchain.cc import CKernel

__all__ = ["SLOTS", "Ops", "c_slot", "numpy_ops", "slot_task", "tasks_of_slot"]

SLOTS = ("layernorm", "softmax", "gelu", "linear")
"""The engine's operator slots."""


@cache
def tasks_of_slot(slot: str) -> tuple[str, ...]:
    """The built-in tasks whose elites fill ``slot``, the slot's default first."""
    return slot_tasks(slot)


def slot_task(slot: str, task: str) -> SlotTask:
    """``task`` (a built-in name or ``module:Class``) at its default arguments, checked to fill ``slot``."""
    cls = load_task_class(task)
    declared = cls.slot if issubclass(cls, SlotTask) else None
    if not issubclass(cls, SlotTask) or declared is None or declared.name != slot:
        fills = f"fills the {declared.name!r} slot" if declared is not None else "fills no engine slot"
        raise ValueError(f"{task!r} kernels cannot fill the {slot!r} slot: that task {fills}")
    return cls()

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
    attention: Callable[[np.ndarray, np.ndarray], np.ndarray] = np.matmul  # the attention's batched matmuls
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
    """Wraps ``kernel``, an elite of ``task`` (a task that fills ``slot``; default the slot's first built-in
    one), as the slot's function; the task says how its kernels are called."""
    if slot not in SLOTS:
        raise ValueError(f"no slot {slot!r} (slots: {', '.join(SLOTS)})")
    filled = slot_task(slot, task or tasks_of_slot(slot)[0])
    if slot == "linear":
        return _packed_linear(kernel, filled)
    if slot == "layernorm":

        def layernorm(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
            x = _f32(x)
            y = np.empty_like(x)
            kernel.bind(filled.slot_args({"x": x, "gamma": _f32(g), "beta": _f32(b), "eps": eps}, y))()
            return y

        return layernorm
    if slot == "softmax":

        def softmax(x: np.ndarray) -> np.ndarray:
            x = _f32(x)
            y = np.empty_like(x)
            kernel.bind(filled.slot_args({"x": x}, y))()
            return y

        return softmax

    def bias_gelu(x: np.ndarray, b: np.ndarray) -> np.ndarray:
        x = _f32(x)
        y = np.empty_like(x)
        kernel.bind(filled.slot_args({"x": x, "bias": _f32(b)}, y))()
        return y

    return bias_gelu


def _packed_linear(kernel: CKernel, task: SlotTask) -> Callable[..., np.ndarray]:
    """``x @ w + b`` through a linear kernel (bf16 or int8); each weight is packed once, on first use.

    The packed copies are keyed by the weight array's identity and keep the array alive (so an id is
    never reused while its entry exists); the model's weights live as long as the engine. Shapes outside
    the kernel's contract (``task.slot``'s multiples; not this model's) run in fp32 BLAS.
    """
    from runtime.hardware import cpu_flags

    spec = task.slot
    assert spec is not None
    if missing := spec.missing(cpu_flags()):
        # an elite evolved on another machine: its instructions would kill the process (SIGILL) here
        log.warning("linear slot: this CPU has no %s: the kernel %s is not used, the GEMMs run in fp32 BLAS",
                    " or ".join(missing), os.path.basename(kernel.path))
        return lambda x, w, b=None: np_linear(x, w, b) if b is not None else x @ w
    packed: dict[int, tuple[np.ndarray, tuple[np.ndarray, ...]]] = {}
    zeros: dict[int, np.ndarray] = {}
    lock = threading.Lock()

    def pack(w: np.ndarray) -> tuple[np.ndarray, ...]:
        entry = packed.get(id(w))
        if entry is None:
            with lock:
                if (entry := packed.get(id(w))) is None:
                    entry = packed[id(w)] = (w, task.slot_pack(w))
        return entry[1]

    def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        x = _f32(x)
        (m, k), n = x.shape, w.shape[1]
        if k % spec.k_multiple or n % spec.n_multiple:
            return np_linear(x, w, b) if b is not None else x @ w
        if b is None:
            b = zeros.get(n)
            if b is None:
                b = zeros.setdefault(n, np.zeros(n, np.float32))
        y = np.empty((m, n), np.float32)
        kernel.bind(task.slot_args({"x": x, "packed": pack(w), "bias": _f32(b)}, y))()
        return y

    return linear
