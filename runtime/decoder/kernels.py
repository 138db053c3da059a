"""The decoder's weight GEMMs and LM head on the C kernels of the engine's ``linear`` slot.

:func:`decoder_ops` returns a :class:`DecoderOps` whose ``linear`` and ``lm_head`` run a linear-slot task's kernel
(its seed register tile, or a genome given) over the model's weights, each quantised and packed once, here: int8
(``linear_int8`` where the CPU has AVX512_VNNI, else ``linear_int8_avx2``: the same arithmetic, bit for bit), fp32
(``linear_f32``, AVX2 and FMA), bf16 (``linear_bf16``, AVX512_BF16) or q8 (``linear_q8_vnni`` where the CPU
has AVX512_VNNI, else ``linear_q8`` on AVX2: int8 with both sides scaled per group of 32, as llama.cpp's Q8_0
blocks, which holds the fidelity floor on every matrix where per-token int8 does not). The CPU is the one
:mod:`runtime.isa` shows (``EVOFORGE_CPU_ISA=avx2`` hides the AVX-512 kernels). Each matrix may take its own
precision (e.g. the LM head in fp32, the rest int8). A reduced precision is checked against the fp32 engine with
:func:`runtime.decoder.fidelity.fidelity`.

Kernels built with more than one thread use OpenMP, whose team is ``OMP_NUM_THREADS`` (all cores when unset), as
BLAS follows its own variable.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import numpy as np

from genome import Genome
from runtime.decoder.model import DecoderModel, KVCache
from runtime.decoder.ops import DecoderOps, np_linear, np_lm_head
from runtime.decoder.sampling import TopLogits
from runtime.engine.kernel_runs import KernelSource
from runtime.hardware import cpu_flags
from runtime.settings import CompilerSettings
from runtime.slots import SlotTask
from runtime.task import load_task_class
from runtime.tasks._linear import LinearTask
from runtime.toolchain.cc import CKernel, CompileError, compile_source, load_kernel

__all__ = ["KERNEL_SLOTS", "MATRICES", "PRECISIONS", "TOP", "DecoderKernelError", "Precision", "c_attention",
           "c_lm_head_topk", "c_rmsnorm", "decoder_ops", "linear_task", "load_source", "parse_mix", "precision_of",
           "q8_lm_head", "seed_source"]  # fmt: skip

Precision = Literal["fp32", "int8", "bf16", "q8"]
PRECISIONS: tuple[str, ...] = get_args(Precision)

MATRICES = ("qkv", "o", "gate_up", "down", "lm_head")
"""The decoder's weight matrices, as :func:`decoder_ops` names them: the fused Q, K and V projection, the attention
output, the fused gate and up projection, the down projection, and the LM head."""

# The linear-slot tasks of each precision, the fastest first: the first whose instructions the CPU has is used.
_TASKS: dict[str, tuple[str, ...]] = {
    "int8": ("linear_int8", "linear_int8_avx2"),
    "fp32": ("linear_f32",),
    "bf16": ("linear_bf16",),
    "q8": ("linear_q8_vnni", "linear_q8"),
}

KERNEL_SLOTS = ("linear", "attention", "rmsnorm", "lm_head")
"""The decoder's slots a kernel run's elite may fill: the weight GEMMs (a linear-slot task of any precision: it runs
the matrices of its own), attention over the KV caches, RMSNorm, and the LM head's top list (``lm_head_topk``)."""

TOP = 64
"""Likeliest tokens per row an engine's top-list LM head keeps: the 20 log-probabilities a request may ask for, and
room for the end tokens a load's ``ignore_eos`` drops."""

DEFAULT_CACHE = Path.home() / ".cache" / "evoforge" / "kernels"


class DecoderKernelError(ValueError):
    """No kernel of the precision asked for runs on this CPU, or an unknown precision or matrix was named."""


def parse_mix(text: str) -> tuple[str, dict[str, str]]:
    """``PRECISION[:MATRIX=PRECISION,...]`` (e.g. ``int8:lm_head=fp32,down=fp32``: every matrix in int8 but those
    named) as :func:`decoder_ops` takes it: the precision and the matrices that differ. Checks the names only."""
    precision, _, rest = text.partition(":")
    matrices: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        matrix, eq, p = item.partition("=")
        if not eq or matrix not in MATRICES or p not in PRECISIONS:
            raise DecoderKernelError(f"{item!r} in {text!r}: write MATRIX=PRECISION, a matrix of {', '.join(MATRICES)} "
                                     f"and a precision of {', '.join(PRECISIONS)}")  # fmt: skip
        matrices[matrix] = p
    if precision not in PRECISIONS:
        raise DecoderKernelError(f"no precision {precision!r} in {text!r}: use one of {', '.join(PRECISIONS)}")
    return precision, matrices


def linear_task(precision: str, flags: Collection[str] | None = None) -> str:
    """The linear-slot task that runs ``precision``'s GEMMs on a CPU with ``flags`` (default this one, as
    :mod:`runtime.isa` shows it)."""
    if precision not in _TASKS:
        raise DecoderKernelError(f"no precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    flags, needs = cpu_flags() if flags is None else flags, []
    for name in _TASKS[precision]:
        spec = load_task_class(name).slot
        assert spec is not None
        if not spec.missing(flags):
            return name
        needs.append(f"{' and '.join(spec.cpu_flags)} ({name})")
    need = " or ".join(needs)
    raise DecoderKernelError(f"no {precision} kernel runs on this CPU: it needs {need}")


def precision_of(task: str) -> str:
    """The precision a linear-slot task's kernels run (ValueError for a task that runs none of the decoder's)."""
    for precision, names in _TASKS.items():
        if task in names:
            return precision
    raise DecoderKernelError(f"{task!r} kernels run none of the decoder's GEMMs (tasks: "
                             f"{', '.join(n for names in _TASKS.values() for n in names)})")  # fmt: skip


def seed_source(task: SlotTask, genome: Genome | None = None) -> KernelSource:
    """``genome`` of ``task`` (default its last seed, a modest template point) rendered, ready to compile."""
    return KernelSource(task.slot.name if task.slot else "", "", task.render(genome or task.seeds()[-1]),
                        tuple(task.compile_flags()), task.name, args=task.args.model_dump(mode="json"))  # fmt: skip


def load_source(source: KernelSource, compiler: CompilerSettings | None, cache_dir: str | Path | None) -> CKernel:
    """``source`` compiled (into ``cache_dir``, default ``~/.cache/evoforge/kernels``: a compiled library is only
    loaded, so a process that may not run the compiler loads what was compiled for it) and loaded. Raises the
    toolchain's CompileError, also where the library is not the build ``source.sha256`` names."""
    cache = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE
    with contextlib.suppress(OSError):
        cache.mkdir(parents=True, exist_ok=True)
    built = compile_source(source.source, compiler=compiler or CompilerSettings(), extra_flags=source.flags,
                           cache_dir=str(cache))  # fmt: skip
    if source.sha256 and built.sha256 != source.sha256:
        raise CompileError(f"the {source.task} kernel's library is not the build that was checked (sha256 "
                           f"{built.sha256[:16]}, checked {source.sha256[:16]}): refused")  # fmt: skip
    return load_kernel(built.path, load_task_class(source.task).kernel_name)


@dataclass(frozen=True)
class _Packed:
    """One weight made ready for its kernel: ``call(m, n, k, x, *packed, bias, y)``, addresses given as ints (the
    bias is zeros: a layer's own is added after)."""

    call: Callable[..., None]
    k: int
    n: int
    tail: tuple[int, ...]  # the packed arrays' and the bias's addresses
    keep: tuple[np.ndarray, ...]  # what the addresses point into, alive as long as this entry


class _Kernels:
    """The compiled kernel of each precision in use, and its task (how it packs weights)."""

    def __init__(self, sources: Mapping[str, KernelSource], threads: int, compiler: CompilerSettings | None,
                 cache: str | Path | None) -> None:  # fmt: skip
        self.tasks: dict[str, LinearTask] = {}
        self.kernels: dict[str, CKernel] = {}
        self._sources, self._threads, self._compiler, self._cache = sources, threads, compiler, cache

    def get(self, precision: str) -> tuple[LinearTask, CKernel]:
        if precision not in self.kernels:
            source = self._sources.get(precision)
            task = load_task_class(source.task if source else linear_task(precision))({"threads": self._threads})
            assert isinstance(task, LinearTask)
            kernel = load_source(source or seed_source(task), self._compiler, self._cache)
            self.tasks[precision], self.kernels[precision] = task, kernel
        return self.tasks[precision], self.kernels[precision]

    def pack(self, precision: str, w: np.ndarray) -> _Packed | None:
        """``w`` ``[k, n]`` packed for ``precision``'s kernel (``None`` where its shape is outside the kernel's)."""
        task, kernel = self.get(precision)
        spec = task.slot
        assert spec is not None
        k, n = w.shape
        if k % spec.k_multiple or n % spec.n_multiple:
            return None
        packed = task.slot_pack(np.ascontiguousarray(w, np.float32))
        bias = np.zeros(n, np.float32)
        x0, y0 = np.zeros((1, k), np.float32), np.zeros((1, n), np.float32)
        # the linear slot's kernels all take (m, n, k, x, *packed, bias, y): the task's C types fixed once
        call = kernel.caller(task.slot_args({"x": x0, "packed": packed, "bias": bias}, y0))
        keep = (*packed, bias)
        return _Packed(call, k, n, tuple(a.ctypes.data for a in keep), keep)


def _run(p: _Packed, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    y = np.empty((x.shape[0], p.n), np.float32)
    p.call(x.shape[0], p.n, p.k, x.ctypes.data, *p.tail, y.ctypes.data)
    return y


def decoder_ops(
    model: DecoderModel,
    precision: Precision = "int8",
    *,
    matrices: Mapping[str, Precision] | None = None,
    sources: Mapping[str, KernelSource] | None = None,
    threads: int = 1,
    compiler: CompilerSettings | None = None,
    cache_dir: str | Path | None = None,
    base: DecoderOps | None = None,
) -> DecoderOps:
    """``base`` (numpy's operators by default) with ``linear`` and ``lm_head`` on C kernels over ``model``'s weights.

    Every matrix runs in ``precision`` unless ``matrices`` names another for it (keys from :data:`MATRICES`);
    ``sources`` gives a precision's kernel (e.g. a kernel run's elite; default its task's seed register tile).
    Kernels compile (``compiler``, cached in ``cache_dir``, default ``~/.cache/evoforge/kernels``) for ``threads``
    threads. A weight the kernels do not hold (another model's), or a shape outside a kernel's
    multiples, runs in numpy. Raises :class:`DecoderKernelError`, and the toolchain's CompileError.
    """
    chosen = dict(matrices or {})
    if unknown := sorted(set(chosen) - set(MATRICES)):
        raise DecoderKernelError(f"no matrix {', '.join(map(repr, unknown))}: name some of {', '.join(MATRICES)}")
    for p in (precision, *chosen.values()):
        linear_task(p)  # an unknown precision, or one this CPU cannot run, fails before anything compiles
    kernels = _Kernels(sources or {}, threads, compiler, cache_dir)

    def of(matrix: str) -> str:
        return chosen.get(matrix, precision)

    table: dict[int, tuple[np.ndarray, _Packed]] = {}  # id(weight) -> (the weight, kept alive; its packed form)
    for layer in model.layers:
        for name, w in (("qkv", layer.w_qkv), ("o", layer.w_o), ("gate_up", layer.w_gate_up), ("down", layer.w_down)):
            if (p := kernels.pack(of(name), w)) is not None:
                table[id(w)] = (w, p)
    head = kernels.pack(of("lm_head"), model.lm_head.T)
    base = base or DecoderOps()
    np_head = base.lm_head

    def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        entry = table.get(id(w))
        if entry is None:
            return np_linear(x, w, b)
        y = _run(entry[1], x)
        if b is not None:  # Qwen2's Q, K and V biases
            y += b
        return y

    def lm_head(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        if head is None or w is not model.lm_head:
            return np_head(x, w)
        return _run(head, x)

    return dataclasses.replace(base, linear=linear, lm_head=lm_head)


def q8_lm_head(model: DecoderModel, *, threads: int = 1, compiler: CompilerSettings | None = None,
               cache_dir: str | Path | None = None) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:  # fmt: skip
    """The ``lm_head`` slot in q8 on the linear slot's kernel: the full logits of the arithmetic the LM head's top list
    (``lm_head_topk``) keeps the likeliest of, for a check that reads every logit."""
    packed = _Kernels({}, threads, compiler, cache_dir).pack("q8", model.lm_head.T)
    if packed is None:
        raise DecoderKernelError(f"the q8 LM head runs on a hidden size that is a multiple of 32, not "
                                 f"{model.lm_head.shape[1]}")  # fmt: skip

    def lm_head(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return _run(packed, x) if w is model.lm_head else np_lm_head(x, w)

    return lm_head


def _build(task: SlotTask, genome: Genome | None, source: KernelSource | None, compiler: CompilerSettings | None,
           cache_dir: str | Path | None) -> CKernel:  # fmt: skip
    """``source`` (else ``genome`` of ``task``, default its last seed) compiled and loaded."""
    if source is not None and source.task != task.name:
        raise DecoderKernelError(f"a {source.task} kernel cannot fill the {task.name} task's slot")
    return load_source(source or seed_source(task, genome), compiler, cache_dir)


def c_rmsnorm(
    genome: Genome | None = None,
    *,
    source: KernelSource | None = None,
    threads: int = 1,
    compiler: CompilerSettings | None = None,
    cache_dir: str | Path | None = None,
) -> Callable[[np.ndarray, np.ndarray, float], np.ndarray]:
    """The ``rmsnorm`` slot on the ``rmsnorm`` task's kernel (``source``, e.g. a kernel run's elite, else ``genome``,
    default its template seed)."""
    from runtime.tasks.rmsnorm import RMSNorm

    task = RMSNorm({"threads": threads})
    kernel = _build(task, genome, source, compiler, cache_dir)
    one = np.zeros((1, 1), np.float32)
    call = kernel.caller(task.slot_args({"x": one, "w": one[0], "eps": 1.0}, one))

    def rmsnorm(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        g = np.ascontiguousarray(g, np.float32)
        out = np.empty_like(x)
        call(x.shape[0], x.shape[1], eps, x.ctypes.data, g.ctypes.data, out.ctypes.data)
        return out

    rmsnorm.kernel = kernel  # type: ignore[attr-defined]  # alive as long as the function
    return rmsnorm


def c_lm_head_topk(
    head: np.ndarray,
    genome: Genome | None = None,
    *,
    source: KernelSource | None = None,
    threads: int = 1,
    compiler: CompilerSettings | None = None,
    cache_dir: str | Path | None = None,
) -> Callable[[np.ndarray, np.ndarray, int], TopLogits]:
    """The ``lm_head_topk`` slot on a top-list task's kernel (``source``, e.g. a kernel run's elite, else ``genome``
    of the engine's default such task on this CPU, default its template seed) over ``head`` ``[vocab, H]`` (quantised to
    q8 once, here); another weight runs in numpy. Raises :class:`DecoderKernelError` for a hidden size that is not
    a multiple of 32, or a CPU without AVX2 and FMA."""
    from runtime.decoder.ops import np_lm_head_topk
    from runtime.tasks.lm_head_topk import LmHeadTopk, head_task

    if head.shape[1] % 32:
        raise DecoderKernelError(f"the LM head's top list runs on a hidden size that is a multiple of 32, not "
                                 f"{head.shape[1]}")  # fmt: skip
    name = source.task if source is not None else head_task(cpu_flags())
    if name is None:
        raise DecoderKernelError("no kernel of the LM head's top list runs on this CPU: it needs AVX2 and FMA")
    task = load_task_class(name)({"threads": threads})
    assert isinstance(task, LmHeadTopk)
    kernel = _build(task, genome, source, compiler, cache_dir)
    packed = task.slot_pack(head)
    x0, ids0, out0, lse0 = (np.zeros((1, head.shape[1]), np.float32), np.zeros((1, 1), np.int32),
                            np.zeros((1, 1), np.float32), np.zeros(1, np.float32))  # fmt: skip
    call = kernel.caller(task.slot_args({"x": x0, "packed": packed, "top": 1, "ids": ids0, "lse": lse0}, out0))
    vocab, hidden = head.shape
    where = tuple(a.ctypes.data for a in packed)

    def lm_head_topk(x: np.ndarray, w: np.ndarray, top: int) -> TopLogits:
        if w is not head:
            return np_lm_head_topk(x, w, top)
        x = np.ascontiguousarray(x, np.float32)
        ids = np.empty((len(x), top), np.int32)
        values = np.empty((len(x), top), np.float32)
        lse = np.empty(len(x), np.float32)
        call(len(x), vocab, hidden, top, x.ctypes.data, *where, ids.ctypes.data, values.ctypes.data, lse.ctypes.data)
        return TopLogits(ids, values, lse)

    lm_head_topk.kernel, lm_head_topk.packed = kernel, packed  # type: ignore[attr-defined]  # alive with it
    return lm_head_topk


def c_attention(
    genome: Genome | None = None,
    *,
    source: KernelSource | None = None,
    threads: int = 1,
    cache: str = "fp32",
    compiler: CompilerSettings | None = None,
    cache_dir: str | Path | None = None,
) -> Callable[[np.ndarray, Sequence[KVCache], int, Sequence[int], Sequence[int], int], np.ndarray]:
    """The ``attention`` slot on the ``attention_decode`` task's kernel (``source``, e.g. a kernel run's elite,
    rendered for ``cache``'s type; else ``genome``, default its template seed), compiled for ``threads`` threads:
    every sequence of a forward pass in one call (decode steps and prompts' chunks alike, each query's output
    independent of the others), over the caches where they are (each passed as its offset from the first, from
    the addresses a cache keeps), of ``cache``'s type (``fp32`` or ``f16``; a cache of another is a ValueError)."""
    from runtime.tasks.attention_decode import AttentionDecode

    cls = load_task_class(source.task) if source is not None and source.task else AttentionDecode
    if not issubclass(cls, AttentionDecode):
        raise DecoderKernelError(f"a {source.task} kernel cannot fill the attention slot")  # type: ignore[union-attr]
    task = cls({"threads": threads, "cache": cache})  # the task of each cache type renders the kernel for either
    kernel = _build(task, genome, source, compiler, cache_dir)
    dtype = np.dtype(np.float16 if cache == "f16" else np.float32)
    one, index, ints = np.zeros((1, 1, 1), np.float32), np.zeros(1, np.int64), np.zeros(1, np.int32)
    call = kernel.caller(task.slot_args({"q": one, "kv_heads": 1, "window": 0, "k": one, "v": one, "k_off": index,
                                         "v_off": index, "length": ints, "count": ints, "capacity": ints}, one))

    def attention(q: np.ndarray, caches: Sequence[KVCache], layer: int, lengths: Sequence[int],
                  counts: Sequence[int], window: int = 0) -> np.ndarray:  # fmt: skip
        if caches[0].dtype != dtype:
            raise ValueError(f"a KV cache of {caches[0].dtype} for a kernel built for {dtype}: build it with "
                             f"cache={'f16' if caches[0].dtype == np.float16 else 'fp32'}")  # fmt: skip
        where = np.array([c.addresses[layer] for c in caches])  # [B, 2]: keys, values
        offsets = (where - where[0]) // dtype.itemsize  # elements from the first cache's (all 16-byte aligned)
        q = np.ascontiguousarray(q, np.float32)
        _, heads, d = q.shape
        length, count = np.asarray(lengths, np.int32), np.asarray(counts, np.int32)
        if int(count.sum()) != len(q) or (count < 1).any() or (count > length).any():
            raise ValueError(f"{len(q)} query rows for new queries {count.tolist()} over lengths {length.tolist()}")
        capacity = np.array([c.capacity for c in caches], np.int32)
        k_off, v_off = np.ascontiguousarray(offsets[:, 0]), np.ascontiguousarray(offsets[:, 1])
        out = np.empty_like(q)
        call(len(caches), heads, caches[0].config.kv_heads, d, window, q.ctypes.data, int(where[0, 0]),
             int(where[0, 1]), k_off.ctypes.data, v_off.ctypes.data, length.ctypes.data, count.ctypes.data,
             capacity.ctypes.data, out.ctypes.data)  # fmt: skip
        return out

    attention.kernel = kernel  # type: ignore[attr-defined]  # alive as long as the function
    return attention
