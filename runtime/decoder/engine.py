"""A chat engine: what runs a decoder model's operators and how its scheduler batches, as one value.

:class:`ChatEngine` is what ``evo serve --gguf`` takes from its flags and ``POST /admin/engine`` swaps to, and
the genes an engine search varies. :func:`build` makes a :class:`Decoder` of it over a loaded model: the
weights are shared between engines of one model (only the kernels' packed copies are the engine's own), so
two engines can serve side by side during a swap.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from runtime.decoder.generate import Decoder
from runtime.decoder.kernels import (
    DEFAULT_CACHE,
    KERNEL_SLOTS,
    TOP,
    DecoderKernelError,
    c_attention,
    c_lm_head_topk,
    c_rmsnorm,
    decoder_ops,
    linear_task,
    parse_mix,
    precision_of,
    seed_source,
)
from runtime.decoder.model import DecoderModel
from runtime.decoder.ops import DecoderOps
from runtime.decoder.scheduler import SchedulerConfig
from runtime.engine.kernel_runs import KernelSource
from runtime.hardware import cpu_flags
from runtime.settings import CompilerSettings
from runtime.task import load_task_class
from runtime.tasks.lm_head_topk import head_task
from runtime.toolchain.cc import compile_source

__all__ = ["ChatEngine", "EngineUnfit", "build", "compile_engine", "default_linear", "engine_threads", "libraries",
           "warm_up"]


def default_linear() -> str:
    """The GEMMs' default: fp32 on the linear slot's C kernel where this CPU runs one (measured faster than BLAS at
    the decoder's shapes, in decode steps and prefill, and batch-invariant: a row's result does not depend on the
    rows beside it), else numpy."""
    try:
        linear_task("fp32")
    except DecoderKernelError:
        return "numpy"
    return "fp32"


class EngineUnfit(ValueError):
    """An engine this machine cannot run; ``field`` names the setting at fault, and the message starts with it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class ChatEngine(BaseModel):
    """The engine's settings (every field has the default ``evo serve --gguf`` uses)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    linear: str = Field(default_factory=lambda: default_linear(), description="what runs the weight GEMMs and the LM "
                        "head: numpy (fp32, BLAS), or the "
                        "linear slot's C kernel in PRECISION[:MATRIX=PRECISION,...] (fp32, int8, bf16, q8; "
                        "e.g. int8:lm_head=fp32)")  # fmt: skip
    slots: Literal["c", "numpy"] = Field("c", description="c: attention (batch-invariant) and RMSNorm on their "
                                         "tasks' C kernels; numpy: in numpy")  # fmt: skip
    kv_dtype: Literal["fp32", "f16"] = Field("fp32", description="the KV cache's type")
    head: Literal["full", "topk"] = Field("full", description="full: the LM head's logits come from the linear "
                                          "slot; topk: steps whose sampling needs no more (greedy, top-k, up to 20 "
                                          "log-probabilities) run the lm_head_topk kernel (q8), which keeps each "
                                          "row's 64 likeliest tokens and never writes the logits")  # fmt: skip
    step_tokens: int = Field(64, ge=1, le=65536, description="tokens one engine step runs (a token of each "
                             "decoding request, then prompt chunks)")  # fmt: skip
    max_running: int = Field(64, ge=1, le=4096, description="requests in the running batch at most")
    threads: int | None = Field(None, ge=1, le=1024, description="threads of the GEMMs, at most this machine's cores "
                                "(default: every core)")
    kernels: dict[str, str] = Field(default_factory=dict, description="slot (linear, attention, rmsnorm) -> the id "
                                    "of a kernel run's elite that fills it (a linear kernel runs the matrices of its "
                                    "own precision); the sources come from the chat_engine task that offers them "
                                    "(default: each slot's built-in kernel)")  # fmt: skip

    @field_validator("linear")
    @classmethod
    def _linear(cls, v: str) -> str:
        if v != "numpy":
            parse_mix(v)  # DecoderKernelError is a ValueError: a validation error naming the field
        return v

    @field_validator("kernels")
    @classmethod
    def _kernels(cls, v: dict[str, str]) -> dict[str, str]:
        if unknown := sorted(set(v) - set(KERNEL_SLOTS)):
            raise ValueError(f"no slot {', '.join(map(repr, unknown))}: kernels fill {', '.join(KERNEL_SLOTS)}")
        return v

    def check(self) -> None:
        """Raises :class:`EngineUnfit` when a precision named has no kernel this CPU runs, or more threads are asked
        for than this process has cores (a thread pool past them only fights itself)."""
        cores = len(os.sched_getaffinity(0))
        if self.threads is not None and self.threads > cores:
            raise EngineUnfit("threads", f"threads {self.threads}: this process has {cores} cores (give at most that)")
        if self.head == "topk" and head_task(cpu_flags()) is None:
            raise EngineUnfit("head", "head topk: its kernels need AVX2 and FMA, which this CPU lacks")
        mix = self.mix()
        if mix is not None:
            try:
                for precision in {mix[0], *mix[1].values()}:
                    linear_task(precision)
            except DecoderKernelError as exc:
                raise EngineUnfit("linear", f"linear {self.linear}: {exc}") from None

    def mix(self) -> tuple[str, dict[str, str]] | None:
        """The GEMMs' precision and per-matrix exceptions; ``None`` under numpy."""
        return None if self.linear == "numpy" else parse_mix(self.linear)

    def team(self) -> int:
        """Threads of the GEMMs."""
        return self.threads or len(os.sched_getaffinity(0))

    def scheduler(self, budgets: SchedulerConfig) -> SchedulerConfig:
        """``budgets`` (the server's KV cache and queue) with this engine's batching."""
        return dataclasses.replace(budgets, step_tokens=self.step_tokens, max_running=self.max_running)

    def describe(self) -> str:
        kernels = "".join(f", {slot} kernel {cid[:12]}" for slot, cid in sorted(self.kernels.items()))
        head = ", LM head top list" if self.head == "topk" else ""
        return (f"linear {self.linear}{head}, slots {self.slots}, KV cache {self.kv_dtype}, {self.step_tokens}-token "
                f"steps, up to {self.max_running} running, {self.team()} threads{kernels}")  # fmt: skip


def libraries(engine: ChatEngine, kernels: Mapping[str, KernelSource] | None = None) -> dict[str, KernelSource]:
    """Every kernel library ``engine`` loads, by what it runs (``attention``, ``rmsnorm``, ``linear <precision>``):
    the kernel ``kernels`` gives for the slot ``engine.kernels`` names (a kernel run's elite), else the slot's
    built-in kernel. Raises :class:`EngineUnfit` where a named kernel is not given, or cannot fill its place (an
    attention kernel evolved for another KV cache type, a linear kernel of a precision no matrix runs)."""
    from runtime.tasks.attention_decode import AttentionDecode
    from runtime.tasks.rmsnorm import RMSNorm

    given = dict(kernels or {})
    chosen: dict[str, KernelSource] = {}
    for slot, cid in engine.kernels.items():
        ks = given.get(slot)
        if ks is None or not ks.id.startswith(cid):
            raise EngineUnfit("kernels", f"kernels.{slot}: no source was given for kernel {cid!r} (an engine with "
                              "evolved kernels is built from the chat_engine task that offers them)")  # fmt: skip
        chosen[slot] = ks
    mix, team = engine.mix(), engine.team()
    out: dict[str, KernelSource] = {}
    if engine.head == "topk":
        head = chosen.pop("lm_head", None)
        if head is not None and (missing := load_task_class(head.task).slot.missing(cpu_flags())):  # type: ignore[union-attr]
            raise EngineUnfit("kernels", f"kernels.lm_head: kernel {head.id[:12]} ({head.task}) needs "
                              f"{' and '.join(missing)}, which this CPU lacks")  # fmt: skip
        default = load_task_class(head_task(cpu_flags()) or "lm_head_topk")
        out["lm_head"] = head or seed_source(default({"threads": team if mix else 1}))
    elif "lm_head" in chosen:
        raise EngineUnfit("kernels", "kernels.lm_head: the engine's head is full (head: topk runs the LM head's top "
                          "list)")  # fmt: skip
    if engine.slots == "c":
        attention = chosen.pop("attention", None)
        if attention is not None and attention.args.get("cache", "fp32") != engine.kv_dtype:
            raise EngineUnfit("kernels", f"kernels.attention: kernel {attention.id[:12]} was evolved for an "
                              f"{attention.args.get('cache', 'fp32')} KV cache, the engine's is {engine.kv_dtype}")
        out["attention"] = attention or seed_source(AttentionDecode({"threads": team if mix else 1,
                                                                     "cache": engine.kv_dtype}))  # fmt: skip
        out["rmsnorm"] = chosen.pop("rmsnorm", None) or seed_source(RMSNorm({"threads": 1}))
    if mix:
        linear = chosen.pop("linear", None)
        spec = load_task_class(linear.task).slot if linear is not None else None
        if spec is not None and (missing := spec.missing(cpu_flags())):
            raise EngineUnfit("kernels", f"kernels.linear: kernel {linear.id[:12]} ({linear.task}) needs "  # type: ignore[union-attr]
                              f"{' and '.join(missing)}, which this CPU lacks")  # fmt: skip
        for precision in sorted({mix[0], *mix[1].values()}):
            if linear is not None and precision_of(linear.task) == precision:
                out[f"linear {precision}"], linear = linear, None
            else:
                out[f"linear {precision}"] = seed_source(load_task_class(linear_task(precision))({"threads": team}))
        if linear is not None:
            raise EngineUnfit("kernels", f"kernels.linear: kernel {linear.id[:12]} runs "
                              f"{precision_of(linear.task)} GEMMs; the engine's are {engine.linear}")  # fmt: skip
    if chosen:
        raise EngineUnfit("kernels", f"kernels.{next(iter(chosen))}: the engine runs that slot in numpy "
                          "(slots: c runs attention and RMSNorm on kernels)")  # fmt: skip
    return out


def compile_engine(engine: ChatEngine, kernels: Mapping[str, KernelSource] | None = None, *,
                   compiler: CompilerSettings | None = None, cache_dir: str | Path | None = None,
                   work_dir: str | None = None) -> dict[str, KernelSource]:  # fmt: skip
    """Compiles every library ``engine`` loads (:func:`libraries`) into the cache without loading any: the same
    sources, each with the hash of its build (what a process that may not compile then loads, checked). Raises
    :class:`EngineUnfit` and the toolchain's CompileError."""
    engine.check()
    cache = str(cache_dir if cache_dir is not None else DEFAULT_CACHE)
    Path(cache).mkdir(parents=True, exist_ok=True)
    out = {}
    for part, ks in libraries(engine, kernels).items():
        built = compile_source(ks.source, compiler=compiler or CompilerSettings(), extra_flags=ks.flags,
                               cache_dir=cache, work_dir=work_dir)  # fmt: skip
        out[part] = dataclasses.replace(ks, sha256=built.sha256)
    return out


def build(model: DecoderModel, engine: ChatEngine, *, kernels: Mapping[str, KernelSource] | None = None,
          built: Mapping[str, KernelSource] | None = None, cache_dir: str | Path | None = None,
          compiler: CompilerSettings | None = None) -> Decoder:  # fmt: skip
    """A decoder running ``model`` (its weights shared, not copied) as ``engine`` says, on the libraries
    :func:`libraries` lists (``kernels``: the evolved ones ``engine.kernels`` names), or on ``built``
    (:func:`compile_engine`'s answer: each library then loads only as the build it names); compiles what is not
    in the cache yet (``compiler``; ``cache_dir``, default ``~/.cache/evoforge/kernels``). Raises
    :class:`EngineUnfit` (see :meth:`ChatEngine.check`)."""
    engine.check()
    model = dataclasses.replace(model, kv_dtype=np.dtype(np.float16 if engine.kv_dtype == "f16" else np.float32))
    parts = dict(built) if built is not None else libraries(engine, kernels)
    mix, team = engine.mix(), engine.team()
    openmp = team if mix else 1
    where = {"cache_dir": cache_dir, "compiler": compiler}
    ops = DecoderOps()
    if engine.slots == "c":
        ops = DecoderOps(attention=c_attention(source=parts["attention"], threads=openmp, cache=engine.kv_dtype,
                                               **where),
                         rmsnorm=c_rmsnorm(source=parts["rmsnorm"], threads=1, **where))  # fmt: skip
    if mix:
        sources = {part.removeprefix("linear "): ks for part, ks in parts.items() if part.startswith("linear ")}
        ops = decoder_ops(model, mix[0], matrices=mix[1], sources=sources, threads=team, base=ops,
                          **where)  # type: ignore[arg-type]
    if engine.head == "full":
        return Decoder(model, ops=ops)
    if model.config.logit_softcap or model.config.hidden % 32:
        raise EngineUnfit("head", f"head topk: {model.path.name}'s LM head has no top list (its logits are "
                          "soft-capped, or its hidden size is not a multiple of 32): use head full")  # fmt: skip
    ops = dataclasses.replace(ops, lm_head_topk=c_lm_head_topk(model.lm_head, source=parts["lm_head"],
                                                                threads=openmp, **where))  # fmt: skip
    return Decoder(model, ops=ops, top=min(TOP, model.config.vocab))  # a list as long as a small vocabulary at most


def engine_threads(engine: ChatEngine) -> None:
    """Gives the thread pools to the engine's GEMMs: OpenMP's team (read when the first kernel loads) under C
    kernels, BLAS's under numpy; the other pool gets one thread. Two pools at work together fight for the cores
    (OpenMP's threads spin a while after each kernel; measured: a decode step 2x slower)."""
    from threadpoolctl import threadpool_limits

    team, c = engine.team(), engine.mix() is not None
    os.environ["OMP_NUM_THREADS"] = str(team if c else 1)
    threadpool_limits(limits=1 if c else team, user_api="blas")


def warm_up(decoder: Decoder) -> None:
    """Runs every kernel of ``decoder`` once (lazy binding, packed weights), in a thread of its own that ends before
    this returns. OpenMP gives each thread that starts a parallel region a team of its own; a team left to a thread
    that lives on beside the one that serves made every decode step about 25% slower (measured: 8 prompts of 64
    tokens, 4.3 s against 5.5)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="evoforge-warm-up") as once:
        once.submit(decoder.generate, "Hello", max_tokens=2, temperature=0.0).result()
