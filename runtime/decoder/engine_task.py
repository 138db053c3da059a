"""The ``chat_engine`` task: a chat engine's settings are the genome, fitness is output tokens/s under generative load.

A candidate (:class:`runtime.decoder.engine.ChatEngine`: what runs the GEMMs, the other slots, the KV cache's
type, the tokens per step, the running batch, the threads) serves a GGUF chat model over HTTP in a host process
of its own, and ``streams`` closed-loop clients stream greedy chat completions from it, fresh prompts every
load. Fitness is the output tokens/s the clients counted; an engine whose p99 inter-token latency or p99 time to
first token is over its budget is stored with its figures and no fitness, never an elite. Descriptors: the p99
inter-token latency and the host's memory. The evaluation is :mod:`runtime.backends.chat_engine`'s.
"""

from __future__ import annotations

import inspect
import os
import random
from collections.abc import Mapping
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, model_validator

from genome import ChoiceParam, Genome, IntParam, ParamSpace, Pow2Param
from runtime.decoder.engine import ChatEngine
from runtime.decoder.fidelity import Floor
from runtime.decoder.kernels import KERNEL_SLOTS, PRECISIONS, DecoderKernelError, linear_task, parse_mix, precision_of
from runtime.decoder.model import DecoderModel, load_decoder
from runtime.decoder.models import MODELS, model_file
from runtime.engine.kernel_runs import KernelSource
from runtime.hardware import cpu_flags
from runtime.kernel_offers import KernelOfferArgs, KernelOffers, absolute_runs
from runtime.task import Descriptor, Task, TaskArgs, load_task_class

__all__ = ["ChatEngineArgs", "ChatEngineTask", "runnable_precisions"]


# the tokens per step the space offers: a step's prompt chunk sets the inter-token latency of every stream decoding
# beside it, so the short end is fine-grained (24-token steps held SmolLM2's p99 under llama-server's at 8 streams)
STEP_TOKENS = (16, 24, 32, 48, 64, 96, 128, 192, 256)


def step_tokens_choices(most: int) -> tuple[int, ...]:
    """:data:`STEP_TOKENS` up to ``most``, then powers of two up to it."""
    longer = [1 << e for e in range(STEP_TOKENS[-1].bit_length(), most.bit_length())]
    return tuple(t for t in (*STEP_TOKENS, *longer) if t <= most)


class ChatEngineArgs(TaskArgs, KernelOfferArgs):
    """The model, the load an engine is measured under, its budgets and its fidelity floor."""

    model: str = Field("smollm2", description="a GGUF chat model: a path, or smollm2 / gemma3 (their packages' files)")
    threads: int = Field(2, ge=1, description="cores the engine and its load may use")
    streams: int = Field(8, ge=1, le=256, description="closed-loop chat clients")
    requests: int = Field(2, ge=1, description="requests each client sends per load (one after another)")
    prompt_tokens: tuple[int, int] = Field((32, 512), description="the prompts' lengths in tokens, drawn uniformly")
    max_tokens: int = Field(128, ge=1, description="tokens each answer runs to (greedy, end tokens ignored)")
    itl_p99_budget_ms: float = Field(1000.0, gt=0, description="p99 inter-token latency above this: no fitness")
    itl_p99_factor: float | None = Field(None, gt=0, description="p99 inter-token latency above this multiple of "
                                         "the engine's measured beside it (the default engine in a search, the "
                                         "rival in a duel): no fitness either; a bound that carries across "
                                         "CPUs")  # fmt: skip
    ttft_p99_budget_ms: float = Field(60000.0, gt=0, description="p99 time to first token above this: no fitness")
    top1_floor: float = Field(0.94, gt=0, le=1, description="top-1 agreement with the fp32 engine, at least")
    kl_floor: float = Field(0.01, ge=0, description="mean KL divergence from the fp32 engine (nats), at most")
    check_texts: int = Field(8, ge=1, description="held-out texts the fidelity check teacher-forces")
    check_skip: int = Field(0, ge=0, description="held-out texts start after this many (a factory's duels skip "
                            "those its searches check)")
    duel_rounds: int = Field(2, ge=1, description="load rounds of each engine in a duel, alternating")
    verified: int = Field(4, ge=0, description="answers of each load checked against the fp32 engine, chosen "
                          "once it is over")  # fmt: skip
    kv_cache_mb: float = Field(2048.0, gt=0, description="the KV cache budget of the running requests")
    reference_every_s: float = Field(300.0, ge=0, description="re-measure the default engine (vs_reference's base) "
                                     "once its figures are older than this; 0: before every candidate")  # fmt: skip
    max_step_tokens: int = Field(256, ge=64, description="largest step_tokens the space offers (64, the default "
                                 "engine's, at least)")  # fmt: skip
    precisions: list[str] | None = Field(None, description="what the linear gene may choose besides numpy "
                                         "(default: every precision with a kernel this CPU runs)")  # fmt: skip
    seed: int = Field(0, description="seed of the held-out texts")

    @model_validator(mode="after")
    def _ranges(self) -> ChatEngineArgs:
        lo, hi = self.prompt_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"prompt_tokens {list(self.prompt_tokens)}: give [low, high] with 1 <= low <= high")
        for p in self.precisions or ():
            if p not in PRECISIONS:
                raise ValueError(f"precisions: no precision {p!r} (choose from {', '.join(PRECISIONS)})")
        return self

    @property
    def floor(self) -> Floor:
        return Floor(top1=self.top1_floor, mean_kl=self.kl_floor)


def runnable_precisions() -> list[str]:
    """The linear slot's precisions with a kernel this CPU runs (as :mod:`runtime.isa` shows it)."""
    out = []
    for p in PRECISIONS:
        try:
            linear_task(p)
        except DecoderKernelError:
            continue
        out.append(p)
    return out


@lru_cache(maxsize=2)
def _loaded(path: Path) -> DecoderModel:
    return load_decoder(path)


def _precisions(linear: str) -> set[str]:
    if linear == "numpy":
        return set()
    precision, matrices = parse_mix(linear)
    return {precision, *matrices.values()}


def head_choices() -> tuple[str, ...]:
    """The LM heads this CPU runs: the full logits, and the top list where its kernel's instructions are here."""
    from runtime.tasks.lm_head_topk import head_task

    return ("full",) if head_task(cpu_flags()) is None else ("full", "topk")


@cache
def corpus() -> str:
    """English text that ships with evoforge (its decoder's module documentation): held-out texts and prompts."""
    from runtime.decoder import chat_load, engine, fidelity, generate, gguf_file, kernels, model, scheduler, tokenizer

    docs = [inspect.getdoc(m) or "" for m in (generate, scheduler, kernels, fidelity, model, tokenizer, gguf_file,
                                                engine, chat_load)]  # fmt: skip
    return "\n\n".join(d for d in docs if d)


class ChatEngineTask(Task, KernelOffers):
    """Evolves a :class:`ChatEngine` for a GGUF chat model (default SmolLM2-135M-Instruct) under generative load
    (the ``chat_engine`` backend)."""

    name = "chat_engine"
    unit = "tokens/s"
    description = "chat engine under closed-loop streaming load, p99 inter-token latency bounded"
    signature = "(a chat engine configuration)"
    backend = "chat_engine"
    Args = ChatEngineArgs
    args: ChatEngineArgs
    kernel_slots = KERNEL_SLOTS

    def __init__(self, args: Mapping[str, Any] | None = None) -> None:
        super().__init__(args)
        self._model: DecoderModel | None = None
        self._path: Path | None = None

    @classmethod
    def resolve_args(cls, args: Mapping[str, Any], cwd: str) -> dict[str, Any]:
        """A model given as a relative path, and the kernel runs' directories, made absolute against ``cwd``
        (workers run elsewhere)."""
        out = absolute_runs(args, cwd)
        model = str(out.get("model", "smollm2"))
        if model not in MODELS:
            out["model"] = os.path.join(cwd, model)
        return out

    @classmethod
    def check_fills(cls, slot: str, task: str) -> None:
        """A linear kernel of a precision the decoder runs, an attention or an RMSNorm kernel."""
        if slot not in KERNEL_SLOTS:
            raise ValueError(f"unknown slot {slot!r} (a chat engine's slots: {', '.join(KERNEL_SLOTS)})")
        if slot == "linear":
            precision_of(task)
            return
        declared = getattr(load_task_class(task), "slot", None)
        if declared is None or declared.name != slot:
            raise ValueError(f"{task!r} kernels cannot fill a chat engine's {slot!r} slot")

    @property
    def cores(self) -> int:
        return max(1, min(self.args.threads, len(os.sched_getaffinity(0))))

    # --- the genome -----------------------------------------------------------------------------

    def linear_choices(self) -> tuple[str, ...]:
        runnable = runnable_precisions()
        chosen = [p for p in (self.args.precisions or runnable) if p in runnable]
        return ("numpy", *chosen)

    def space(self) -> ParamSpace:
        a = self.args
        running = 1 << max(a.streams - 1, 1).bit_length()  # a power of two, at least the streams
        params: dict[str, Any] = {
            "linear": ChoiceParam(type="choice", values=self.linear_choices()),
            "slots": ChoiceParam(type="choice", values=("c", "numpy")),
            "kv_dtype": ChoiceParam(type="choice", values=("fp32", "f16")),
            "head": ChoiceParam(type="choice", values=head_choices()),
            "step_tokens": ChoiceParam(type="choice", values=step_tokens_choices(a.max_step_tokens)),
            "max_running": Pow2Param(type="pow2", low=1, high=running),
            "threads": IntParam(type="int", low=1, high=self.cores),
            **self.kernel_genes(),
        }
        return ParamSpace(params, self.kernel_constraints())

    def kernel_constraints(self) -> list[str]:
        """What each offered kernel needs of the rest of the genome, as the space's constraints (so a mutation or a
        crossover is repaired into an engine that runs its kernels, as :meth:`fit_kernels` fits an offer): a linear
        kernel the GEMMs of its precision; attention and RMSNorm kernels C slots, an attention kernel the KV cache
        type it was evolved for; a top-list kernel the top-list head."""
        out: list[str] = []
        for slot, ids in self.kernel_choices().items():
            gene = f"kernel_{slot}"
            if not ids:
                continue
            if slot == "linear":
                by: dict[str, list[str]] = {}
                for cid in ids:
                    by.setdefault(precision_of(self.kernel_source(slot, cid).task), []).append(cid)
                runnable = self.linear_choices()
                out += [f"{gene} not in {sorted(c)!r} or linear == {p!r}" if p in runnable else
                        f"{gene} not in {sorted(c)!r}" for p, c in sorted(by.items())]  # fmt: skip
            elif slot == "lm_head":
                out.append(f"{gene} == 'numpy' or head == 'topk'")
            else:
                out.append(f"{gene} == 'numpy' or slots == 'c'")
                if slot == "attention":
                    caches: dict[str, list[str]] = {}
                    for cid in ids:
                        caches.setdefault(self.kernel_source(slot, cid).args.get("cache", "fp32"), []).append(cid)
                    out += [f"{gene} not in {sorted(c)!r} or kv_dtype == {t!r}" for t, c in sorted(caches.items())]
        return out

    def seeds(self) -> list[Genome]:
        """The default engine (``evo serve --gguf``'s: fp32 C GEMMs where they run, C attention and RMSNorm); with
        q8 kernels, an f16 cache, 24-token steps and the LM head's top list where they run here (the fastest engine
        measured by hand on SmolLM2 that holds the floor); and that one on the first kernel offered in each slot
        that runs in it as it is (else the slot's first)."""
        base = self._default()
        fast = self._fast(base)
        choices = self.kernel_choices()
        seeds = [base] if fast is None else [base, fast]
        if any(choices.values()):
            start = fast or base
            offered = {f"kernel_{s}": next((c for c in ids if self._keeps(start, s, c)), ids[0])
                       for s, ids in choices.items() if ids}  # fmt: skip
            seeds.append(self.fit_kernels({**start, **offered}))
        return [Genome(params=p) for p in seeds]

    def _default(self) -> dict[str, Any]:
        running = self.space().params["max_running"].high  # type: ignore[attr-defined]
        base = ChatEngine(threads=self.cores, max_running=min(64, running)).model_dump()
        base.pop("kernels")
        if base["linear"] not in self.linear_choices():  # the task's precisions leave the default out
            base["linear"] = "numpy"
        return {**base, **{f"kernel_{slot}": "numpy" for slot in self.kernel_choices()}}

    def _fast(self, base: dict[str, Any]) -> dict[str, Any] | None:
        """``base`` as the hand-tuned engine runs: q8 GEMMs, an f16 cache, 24-token steps, the top-list head
        (``None`` where this CPU has no q8 kernel, or the task's precisions leave q8 out)."""
        if "q8" not in self.linear_choices():
            return None
        return {**base, "linear": "q8", "kv_dtype": "f16", "step_tokens": 24, "head": head_choices()[-1]}

    def offer_start(self) -> Genome:
        """The hand-tuned engine where it runs (offers made before anything is measured build on the fastest engine
        known), else the default one."""
        base = self._default()
        return Genome(params=self._fast(base) or base)

    def fit_kernels(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` with the rest of the engine set to what its chosen kernels run: C slots and the KV cache
        type an attention kernel was evolved for, and a linear kernel's precision for the GEMMs."""
        out = dict(params)
        for slot in KERNEL_SLOTS:
            cid = out.get(f"kernel_{slot}", "numpy")
            if cid == "numpy":
                continue
            ks = self.kernel_source(slot, cid)
            if slot == "linear":
                precision = precision_of(ks.task)
                if precision in self.linear_choices() and precision not in _precisions(out.get("linear", "numpy")):
                    out["linear"] = precision
            elif slot == "lm_head":
                out["head"] = "topk"
            else:
                out["slots"] = "c"
                if slot == "attention":
                    out["kv_dtype"] = ks.args.get("cache", "fp32")
        return out

    def engine(self, genome: Genome) -> ChatEngine:
        """The engine a genome describes (raises ValueError for one outside the engine's options)."""
        p = dict(genome.params)
        kernels = {k.removeprefix("kernel_"): p.pop(k) for k in list(p) if k.startswith("kernel_")}
        return ChatEngine(**p, kernels={slot: cid for slot, cid in kernels.items() if cid != "numpy"})

    def kernel_sources(self, engine: ChatEngine) -> dict[str, KernelSource]:
        """The evolved kernel of each slot ``engine`` names (raises :class:`runtime.followed_runs.RunNotFound`)."""
        return {slot: self.kernel_source(slot, cid) for slot, cid in engine.kernels.items()}

    def render(self, genome: Genome) -> str:
        """The engine as YAML (what ``evo archive show`` and ``export`` print; ``POST /admin/engine`` takes it as
        JSON)."""
        cfg = self.engine(genome).model_dump(mode="json")
        return f"# chat engine ({self.name} task)\n" + yaml.safe_dump(cfg, sort_keys=False)

    def descriptors(self) -> dict[str, Descriptor]:
        budget = self.args.itl_p99_budget_ms
        return {
            "itl_p99_ms": Descriptor("itl_p99_ms", "p99 inter-token latency under the load (ms)",
                                     lambda g, m: float(m.get("itl_p99_ms", budget)), 0.0, budget),
            "memory_mb": Descriptor("memory_mb", "peak resident memory of the engine's host under the load (MB)",
                                    lambda g, m: float(m.get("memory_mb", 0.0)), 0.0, 4096.0),
            "step_tokens": Descriptor("step_tokens", "the genome's tokens per engine step",
                                      lambda g, m: float(g.params.get("step_tokens", 64)), 0.0, 256.0),
        }  # fmt: skip

    # --- what a worker loads --------------------------------------------------------------------

    def prime(self) -> None:
        """Loads the model, the held-out texts and the offered kernels' sources (a worker calls this before it
        drops its privileges)."""
        self.model()
        self.corpus_ids()
        self.check_texts()
        self.kernel_choices()

    def model_path(self) -> Path:
        """The model's file (found once: a worker may not see it after it drops its privileges)."""
        if self._path is None:
            self._path = model_file(self.args.model)
        return self._path

    def model(self) -> DecoderModel:
        """The model in fp32 (loaded once per file in this process: a search following kernel runs makes a task
        of each offer, and a model per task would fill a worker's memory)."""
        if self._model is None:
            self._model = _loaded(self.model_path())
        return self._model

    def model_id(self) -> str:
        return self.model_path().stem

    def corpus_ids(self) -> list[int]:
        return self.model().tokenizer.encode(corpus(), add_bos=False)

    def check_texts(self) -> list[str]:
        """The held-out texts of the fidelity check: paragraphs of :func:`corpus`, the longest first that fit in
        half the model's context, from the ``check_skip``-th (fixed)."""
        fit = min(self.model().config.context // 2, 512)
        tokenizer = self.model().tokenizer
        paragraphs = sorted((p for p in corpus().split("\n\n") if len(p) > 80), key=len, reverse=True)
        fitting = [p for p in paragraphs if len(tokenizer.encode(p)) <= fit]
        return fitting[self.args.check_skip : self.args.check_skip + self.args.check_texts]

    def prompts(self, salt: int) -> list[str]:
        """One load's prompts, new text for each ``salt``: every client's requests, and one to warm up with first.
        Their lengths are the same in every load (drawn from the task's ``seed``), so two loads do the same work."""
        from runtime.decoder.chat_load import draw_prompts

        a = self.args
        return draw_prompts(self.model().tokenizer, self.corpus_ids(), a.streams * a.requests + 1, *a.prompt_tokens,
                            random.Random(salt), lengths=random.Random(a.seed))  # fmt: skip
