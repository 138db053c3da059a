"""The chat engine backend: a candidate is a chat engine (:class:`runtime.decoder.engine.ChatEngine`), served in a
host process of its own (:mod:`runtime.sandbox.chat_host`), checked against the fp32 engine and measured under
closed-loop streaming load.

Stages and statuses are the C backend's: a genome outside the engine's options, or one this machine cannot
run, is ``invalid``; a host that does not come up ``crash``; an engine under the fidelity floor ``wrong``.

- **Kernels.** Every library an engine loads (its slots' built-in kernels, and the kernel runs' elites its genome
  names) is compiled in the worker, and loaded only in the host, under its system-call filter, each as the
  build the worker compiled (:mod:`runtime.sandbox.chat_host`).
- **Fidelity.** An engine on built-in kernels only: its numerics (what runs the GEMMs, the other slots, the KV
  cache's type) teacher-forced on the task's held-out texts against the fp32 numpy engine, computed in the
  worker: top-1 agreement and mean KL must hold the task's floor (:class:`runtime.decoder.fidelity.Floor`).
  Engines that differ only in batching or threads share the figure. A top-list LM head (``head: topk``, the
  ``lm_head_topk`` task's built-in kernel) is teacher-forced as the q8 LM head of the linear slot, its arithmetic.
  An engine with an evolved kernel never runs in the worker: the host answers the held-out texts as prompts, and
  its answers are checked as the load's are.
- **The load.** ``streams`` clients in the worker stream greedy chat completions from the host (fresh prompts
  each load, one warm-up request first), the host's processes pinned to the task's cores under the timing lock.
  Every figure is the clients' (:mod:`runtime.decoder.chat_load`); every request asks for its tokens' ids and
  their ``_TOP`` likeliest rivals (``logprobs``). Then ``verified`` answers, chosen once the load is over, are
  teacher-forced through the fp32 engine here (:func:`runtime.decoder.fidelity.served_divergence`): each
  answer's ids must spell its streamed text and number the usage the host reported, each served token must be
  the likeliest the host reported, the share of them that are the fp32 engine's top-1 must be within
  ``_VERIFY_MARGIN`` of the floor, and the mean KL over the reported tokens (a lower bound of the full KL) must
  hold the floor, or the engine is ``wrong`` (it served something other than what was checked, or misreported
  its tokens). The host cannot tell which answers are checked, so it must serve every one as checked.
- **The reference** is the default engine (``evo serve --gguf``'s) under the same load, cores and path, again
  whenever its figures are older than ``reference_every_s``; ``vs_reference`` is the candidate's tokens/s over it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import ValidationError

from genome import Genome, canonical_json
from runtime.backends.base import (
    Backend,
    BackendUnavailable,
    Build,
    Column,
    Duels,
    Failure,
    Measurement,
    Profiles,
    Program,
    RivalFailure,
    WorkerContext,
)
from runtime.decoder.chat_load import Answer, ChatLoad, LoadFailed, chat, run_load
from runtime.decoder.engine import ChatEngine, EngineUnfit, build, compile_engine
from runtime.decoder.engine_task import ChatEngineArgs, ChatEngineTask
from runtime.decoder.fidelity import Fidelity, fidelity, forced_logits, served_divergence
from runtime.decoder.kernels import q8_lm_head
from runtime.decoder.models import ModelNotFound, model_file
from runtime.decoder.ops import DecoderOps
from runtime.engine.kernel_runs import KernelSource
from runtime.followed_runs import RunNotFound
from runtime.result import Status
from runtime.sandbox.chat_host import ChatHost, ChatHostFailed, ChatHostTemplate, prime_chat_host
from runtime.sandbox.hosted_engine import beside, frozen, pin, process_tree
from runtime.settings import EvalSettings
from runtime.timing import TimingLock, pinned
from runtime.toolchain.cc import CompileError, CompilerNotFound, compiler_version

__all__ = ["ChatEngineBackend", "ChatEngineProgram", "Measured"]

_VERIFY_MARGIN = 0.10  # a greedy answer's own tokens agree with the fp32 engine a little less than teacher-forced text
_TOP = 20  # rivals reported per served token (OpenAI's top_logprobs at most): the verified KL's resolution
_CHECK_TOKENS = 32  # each held-out text's answer, where the check reads an evolved engine's answers


@dataclass
class Measured:
    """One load on one host: the clients' figures and the host's peak resident memory (MB)."""

    load: ChatLoad
    memory_mb: float


def _rss_bytes(pids: list[int]) -> int:
    page, total = os.sysconf("SC_PAGE_SIZE"), 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{pid}/statm") as f:
            total += int(f.read().split()[1]) * page
    return total


def measure(host: ChatHost, task: ChatEngineTask, cores: set[int], salt: int | None = None,
            others: Callable[[], list[int]] | None = None) -> Measured:  # fmt: skip
    """The task's load on ``host`` (its processes on ``cores``), on prompts drawn from ``salt`` (default a fresh
    one), after one warm-up request, with the processes ``others`` names stopped meanwhile (another engine's host
    cannot slow this one: the rival in a duel, the default engine beside a candidate). Raises :class:`Failure`
    (``crash``) where a request fails."""
    with frozen(others) if others is not None else contextlib.nullcontext():
        return _measure(host, task, cores, salt)


def _measure(host: ChatHost, task: ChatEngineTask, cores: set[int], salt: int | None) -> Measured:
    a = task.args
    pin(process_tree(host.pid), cores)
    prompts = task.prompts(secrets.randbits(63) if salt is None else salt)
    peak = [0]

    def sample() -> None:
        peak[0] = max(peak[0], _rss_bytes(process_tree(host.pid)))

    try:
        chat(host.port, prompts[0], 4)
        load = run_load(host.port, prompts[1:], a.streams, a.max_tokens, ids=True, top=_TOP, tick=sample)
    except LoadFailed as exc:
        deadline = time.monotonic() + 2.0  # a killed host's streams break before its process is gone
        while host.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        why = "the engine's host died" if not host.alive() else "a request failed"
        raise Failure(Status.CRASH, f"{why} under load: {exc}; its log: {host.tail(600)}") from None
    sample()
    return Measured(load, peak[0] / 2**20)


def served_fidelity(task: ChatEngineTask, answers: list[Answer], name: str) -> dict[str, Any]:
    """``answers`` (greedy, each with its ids and the rivals the host reported) teacher-forced through the fp32
    engine here: the share of served tokens that are its top-1 (``<name>_top1``) and the mean KL over the reported
    tokens (``<name>_kl``). Raises :class:`Failure` (``wrong``) where an answer's ids do not spell its text or
    number its usage, where a served token is not the likeliest the host reported, or under the task's floor."""
    floor, model = task.args.floor, task.model()
    kls, agree, contradictions = [], [], 0
    for answer in answers:
        got = answer.token_ids
        # a character cut by the last token is held back by the stream: only its replacement may differ
        spelled = model.tokenizer.decode(got).rstrip("\ufffd") == answer.text.rstrip("\ufffd")
        if len(got) != answer.completion_tokens or not spelled or len(answer.reported) != len(got):
            raise Failure(Status.WRONG, f"an answer's text and tokens disagree: {len(got)} tokens listed, "
                          f"{answer.completion_tokens} reported, {len(answer.reported)} with their rivals, and its "
                          f"text {'is' if spelled else 'is not'} theirs",
                          metrics={f"{name}_answers": len(answers)})  # fmt: skip
        prompt = model.tokenizer.encode_chat([{"role": "user", "content": answer.prompt}])
        ids = prompt + got
        logits = model.forward([ids], [model.new_cache(len(ids))], DecoderOps(), all_logits=True)
        kl, same, wrong = served_divergence(logits[len(prompt) - 1 : len(ids) - 1], got, answer.reported,
                                            never=model.tokenizer.end_ids)  # fmt: skip
        kls.append(kl)
        agree.append(same)
        contradictions += wrong
    kl_all, agree_all = np.concatenate(kls or [np.zeros(0)]), np.concatenate(agree or [np.zeros(0, bool)])
    share = float(agree_all.mean()) if agree_all.size else 1.0
    mean_kl = float(kl_all.mean()) if kl_all.size else 0.0
    metrics = {f"{name}_top1": share, f"{name}_kl": mean_kl, f"{name}_answers": len(answers)}
    if contradictions:
        raise Failure(Status.WRONG, f"{contradictions} served tokens are not the likeliest the engine reported for "
                      "their place: it served something other than what it reports", metrics=metrics)  # fmt: skip
    least = floor.top1 - _VERIFY_MARGIN
    if share < least or mean_kl > floor.mean_kl:
        raise Failure(Status.WRONG, f"{name} answers: {share:.3f} of their tokens are the fp32 engine's top-1 (at "
                      f"least {least:.2f} expected) and the mean KL over the reported tokens is {mean_kl:.5f} nats "
                      f"(at most {floor.mean_kl:g}): it served something other than what holds the floor",
                      metrics=metrics)  # fmt: skip
    return metrics


def itl_p99_limit_ms(args: ChatEngineArgs, beside_ms: float) -> float:
    """The p99 inter-token latency over which an engine gets no fitness: the task's budget, or, with
    ``itl_p99_factor``, that multiple of ``beside_ms`` (the engine measured beside it) where that is lower."""
    if args.itl_p99_factor is None:
        return args.itl_p99_budget_ms
    return min(args.itl_p99_budget_ms, args.itl_p99_factor * beside_ms)


def _duel_figures(rounds: list[Measured]) -> dict[str, Any]:
    """A duel's figures of one engine: the median of its rounds' tokens/s, p99 inter-token latency, p99 time to
    first token and memory, and each round's."""
    loads = [m.load for m in rounds]
    return {"tokens_per_s": float(np.median([x.tokens_per_s for x in loads])),
            "itl_p99_ms": float(np.median([x.itl_s[1] for x in loads])) * 1000,
            "ttft_p99_ms": float(np.median([x.ttft_s[1] for x in loads])) * 1000,
            "memory_mb": float(np.median([m.memory_mb for m in rounds])),
            "rounds": [{"tokens_per_s": x.tokens_per_s, "itl_p99_ms": x.itl_s[1] * 1000} for x in loads]}  # fmt: skip


@dataclass
class _Reference:
    """The default engine's load figures, and when (``time.monotonic()``) they were taken."""

    measured: Measured | None = None
    at: float = 0.0


@dataclass
class ChatEngineProgram(Program, Profiles, Duels):
    """A chat engine serving in its host (its kernels loaded), not yet under load."""

    task: ChatEngineTask
    host: ChatHost
    engine: ChatEngine
    settings: EvalSettings
    ctx: WorkerContext
    backend: ChatEngineBackend
    built: dict[str, KernelSource] = field(default_factory=dict)  # its libraries, compiled (compile_engine)
    calls_s: float = 0.0
    _closed: bool = field(default=False, repr=False)

    def check(self, trials: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        if self.engine.kernels:  # evolved kernels run only in the host: its answers to the held-out texts
            try:
                texts = self.task.check_texts()
                load = run_load(self.host.port, texts, len(texts), _CHECK_TOKENS, ids=True, top=_TOP)
            except LoadFailed as exc:
                raise Failure(Status.CRASH, f"the engine's host failed the check's requests: {exc}; its log: "
                              f"{self.host.tail(600)}") from None  # fmt: skip
            found = served_fidelity(self.task, load.answers, "check")
            self.calls_s += time.perf_counter() - t0
            return found
        found = self.backend.fidelity(self.task, self.engine, self.ctx)
        spent = time.perf_counter() - t0
        self.calls_s += spent
        metrics = {"top1": found.top1, "mean_kl": found.mean_kl, "max_kl": found.max_kl}
        if not found.holds(self.task.args.floor):
            f = self.task.args.floor
            raise Failure(Status.WRONG, f"under the fidelity floor (top-1 >= {f.top1:g}, mean KL <= {f.mean_kl:g}) "
                          f"against the fp32 engine: {found} (linear {self.engine.linear})", metrics=metrics,
                          timings={"check_s": spent})  # fmt: skip
        return metrics

    def _verify(self, measured: Measured) -> dict[str, Any]:
        """``verified`` answers of the load, chosen now, against the fp32 engine; raises :class:`Failure`."""
        answers = measured.load.answers
        rng = np.random.default_rng(secrets.randbits(63))
        picked = [answers[i] for i in rng.choice(len(answers), size=min(self.task.args.verified, len(answers)),
                                                 replace=False)]  # fmt: skip
        return served_fidelity(self.task, picked, "verified")

    def time(self) -> Measurement:
        task, settings, ref = self.task, self.settings, self.backend.reference_of(self.task)
        a = task.args
        t0 = time.perf_counter()
        with self.ctx.lock.held() as waited, pinned(settings.timing.core, task.cores) as cores:  # type: ignore[union-attr]
            age = time.monotonic() - ref.at
            if ref.measured is None or age > a.reference_every_s:
                default = self.backend.serve_default(task, settings, self.ctx)
                try:
                    ref.measured = measure(default, task, cores, others=lambda: self.backend.others(default))
                    ref.at, age = time.monotonic(), 0.0
                finally:
                    self.backend.release(default)
            run = measure(self.host, task, cores, others=lambda: self.backend.others(self.host))
        spent = time.perf_counter() - t0 - waited
        t1 = time.perf_counter()
        verified = self._verify(run)
        verify_s = time.perf_counter() - t1
        self.calls_s += spent
        base, r = ref.measured.load, run.load
        itl_ms, ttft_ms = r.itl_s[1] * 1000, r.ttft_s[1] * 1000
        itl_limit = itl_p99_limit_ms(a, base.itl_s[1] * 1000)
        over = itl_ms > itl_limit or ttft_ms > a.ttft_p99_budget_ms
        metrics = dict(
            tokens_per_s=r.tokens_per_s, ttft_p50_ms=r.ttft_s[0] * 1000, ttft_p99_ms=ttft_ms,
            itl_p50_ms=r.itl_s[0] * 1000, itl_p99_ms=itl_ms, requests=len(r.answers), tokens=r.tokens,
            prompt_tokens=r.prompt_tokens, memory_mb=run.memory_mb,
            vs_reference=r.tokens_per_s / base.tokens_per_s if base.tokens_per_s else None,
            ref_tokens_per_s=base.tokens_per_s, ref_itl_p99_ms=base.itl_s[1] * 1000, ref_age_s=age,
            over_budget=over, itl_p99_budget_ms=a.itl_p99_budget_ms, itl_p99_limit_ms=itl_limit,
            ttft_p99_budget_ms=a.ttft_p99_budget_ms, streams=a.streams, cores=sorted(cores), **verified,
        )  # fmt: skip
        return Measurement(None if over else r.tokens_per_s, metrics,
                           {"lock_wait_s": waited, "time_s": spent, "verify_s": verify_s})  # fmt: skip

    def confirm(self) -> None:
        """The fidelity again (the engine's numerics, as checked before its load)."""
        self.check(1)

    def profile(self) -> Measurement:
        """Where the engine's time goes serving the task's load (its fixed prompts, every answer to
        ``max_tokens``): a host of its own, confined as every host is, serves them through the engine's scheduler
        with each operator timed (:func:`runtime.decoder.profile.profile_decoder`), pinned to the task's cores
        under the lock, and prints its profile. A profile that cannot be true (more time than the worker's clock
        saw, other requests or tokens than asked) is ``invalid``; how the engine splits its time stays its own
        account, and steers only where a factory's next searches spend (never a promotion)."""
        a, model = self.task.args, self.task.model()
        prompts = [model.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in self.task.prompts(a.seed)[1:]]
        asked = {"prompts": prompts, "max_tokens": a.max_tokens}
        with self.ctx.lock.held() as waited, pinned(self.settings.timing.core, self.task.cores) as cores:  # type: ignore[union-attr]
            t0 = time.perf_counter()
            host = self.backend.template(self.task, self.ctx).spawn(
                self.engine, self.built, compiler=self.settings.compiler, profile=asked,
                kv_budget_bytes=int(a.kv_cache_mb * 2**20))  # fmt: skip
            try:
                pin(process_tree(host.pid), cores)
                found = host.wait_profile(timeout=self.settings.sandbox.timeout)
            except ChatHostFailed as exc:
                raise Failure(Status.CRASH, str(exc)) from None
            finally:
                host.close()
            wall_s = time.perf_counter() - t0
        self.calls_s += wall_s
        total, tokens = found.get("total_s", 0.0), found.get("output_tokens", -1)
        if not 0 < total <= wall_s or found.get("requests") != len(prompts) or tokens != len(prompts) * a.max_tokens:
            raise Failure(Status.INVALID, f"the engine's host misreported its profile: {total:.3f} s of "
                          f"{wall_s:.3f} s, {found.get('requests')} requests and {tokens} tokens for "
                          f"{len(prompts)} and {len(prompts) * a.max_tokens}")  # fmt: skip
        return Measurement(None, {"profile": found}, {"lock_wait_s": waited, "time_s": wall_s})

    def duel(self, open_rival: Callable[[], Program]) -> Measurement:
        """Both engines checked (:meth:`check`), then the load on each in turn, ``duel_rounds`` rounds each under
        the lock, both on the same new prompts each round, then both engines' answers verified against the fp32
        engine. ``duel_ratio`` is the median tokens/s over the rival's. The fitness is ``None`` when the median
        p99 inter-token latency or time to first token is over its budget. A rival that breaks a rule raises
        :class:`RivalFailure`: both are held to the fp32 engine, never one to the other."""
        a = self.task.args
        t0 = time.perf_counter()
        checked = self.check(1)
        failed: RivalFailure | None = None  # the challenger's figures are measured still: the verdict needs them
        rival_checked: dict[str, Any] = {}
        rival: ChatEngineProgram | None = None
        try:  # a rival that cannot be built (a kernel no run offers now) loses; the challenger is measured alone
            rival = open_rival()
            assert isinstance(rival, ChatEngineProgram)
            with RivalFailure.blame():
                rival_checked = rival.check(1)
        except RivalFailure as exc:
            failed = exc
        check_s = time.perf_counter() - t0
        mine: list[Measured] = []
        theirs: list[Measured] = []
        t1 = time.perf_counter()

        def all_but(one: ChatEngineProgram, other: ChatEngineProgram | None) -> Callable[[], list[int]]:
            # every host but ``one`` stopped, the other side's above all (it may not share ``one``'s backend)
            return lambda: sorted({*one.backend.others(one.host),
                                   *(process_tree(other.host.pid) if other is not None else ())})

        with self.ctx.lock.held() as waited, pinned(self.settings.timing.core, self.task.cores) as cores:  # type: ignore[union-attr]
            for _ in range(a.duel_rounds):
                salt = secrets.randbits(63)
                mine.append(measure(self.host, self.task, cores, salt, all_but(self, rival)))
                if failed is None and rival is not None:
                    try:
                        with RivalFailure.blame():
                            theirs.append(measure(rival.host, self.task, cores, salt, all_but(rival, self)))
                    except RivalFailure as exc:
                        failed = exc
        spent = time.perf_counter() - t1 - waited
        t2 = time.perf_counter()
        verified = [self._verify(m) for m in mine]
        if failed is None and rival is not None:
            try:
                with RivalFailure.blame():
                    for m in theirs:
                        rival._verify(m)
            except RivalFailure as exc:
                failed = exc
        verify_s = time.perf_counter() - t2
        self.calls_s += spent
        figures = _duel_figures(mine)
        metrics: dict[str, Any] = {**checked, **figures, **verified[-1], "duel_rounds": len(mine)}
        timings = {"check_s": check_s, "lock_wait_s": waited, "time_s": spent, "verify_s": verify_s}
        if failed is not None:
            raise RivalFailure(failed.status, str(failed), metrics=metrics, timings=timings)
        rival_figures = _duel_figures(theirs)
        metrics.update({f"rival_{k}": v for k, v in {**rival_checked, **rival_figures}.items()},
                       duel_ratio=figures["tokens_per_s"] / rival_figures["tokens_per_s"]
                       if rival_figures["tokens_per_s"] else float("inf"))  # fmt: skip
        itl_limit = itl_p99_limit_ms(a, rival_figures["itl_p99_ms"])
        over = figures["itl_p99_ms"] > itl_limit or figures["ttft_p99_ms"] > a.ttft_p99_budget_ms
        metrics["itl_p99_limit_ms"] = itl_limit
        return Measurement(None if over else figures["tokens_per_s"], metrics, timings)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.backend.release(self.host)


class ChatEngineBackend(Backend[ChatEngineTask]):
    """Chat engines of a GGUF model, measured under streaming load over HTTP."""

    name = "chat_engine"
    whole_node = True
    program = ChatEngineProgram
    check_columns = (Column("top1", "top-1"), Column("mean_kl", "mean KL"))

    def __init__(self) -> None:
        self._templates: dict[str, ChatHostTemplate] = {}
        self._references: dict[str, _Reference] = {}
        self._fidelity: dict[tuple[str, ...], Fidelity] = {}
        self._live: set[int] = set()

    def reference_of(self, task: ChatEngineTask) -> _Reference:
        key = canonical_json(task.args.model_dump(mode="json"))
        return self._references.setdefault(key, _Reference())

    def fidelity(self, task: ChatEngineTask, engine: ChatEngine, ctx: WorkerContext) -> Fidelity:
        """The numerics of ``engine`` against the fp32 engine on the task's held-out texts (computed once per
        model, texts and numerics in this worker)."""
        key = (task.args.model, canonical_json(task.check_texts()), engine.linear, engine.slots, engine.kv_dtype,
               engine.head)  # fmt: skip
        found = self._fidelity.get(key)
        if found is None:
            model = task.model()
            candidate = build(model, engine.model_copy(update={"threads": 1}), cache_dir=ctx.cache_dir)
            if engine.head == "topk":  # teacher-forcing reads every logit: the top list's arithmetic gives them
                candidate.ops = dataclasses.replace(candidate.ops, lm_head=q8_lm_head(model, cache_dir=ctx.cache_dir))
            # the candidate's model keeps its own KV cache type: an f16 cache is part of its numerics
            found = self._fidelity[key] = fidelity(model, DecoderOps(), forced_logits(candidate.model, candidate.ops),
                                                   task.check_texts())  # fmt: skip
        return found

    # --- hosts -------------------------------------------------------------------------------------

    def template(self, task: ChatEngineTask, ctx: WorkerContext) -> ChatHostTemplate:
        key = task.args.model
        found = self._templates.get(key)
        if found is None or not found.alive:
            found = self._templates[key] = ChatHostTemplate(task.model(), task.model_id(), cache_dir=ctx.cache_dir,
                                                        log_dir=ctx.work_dir)  # fmt: skip
        return found

    def serve(self, task: ChatEngineTask, engine: ChatEngine, built: dict[str, KernelSource], settings: EvalSettings,
              ctx: WorkerContext) -> ChatHost:  # fmt: skip
        """A host serving ``engine`` on ``built`` (:func:`compile_engine`'s answer), ready. Raises :class:`Failure`
        (``crash``) where it does not come up."""
        host = self.template(task, ctx).spawn(engine, built, compiler=settings.compiler,
                                              kv_budget_bytes=int(task.args.kv_cache_mb * 2**20))  # fmt: skip
        self._live.add(host.pid)
        try:
            host.wait_ready()
        except ChatHostFailed as exc:
            self.release(host)
            raise Failure(Status.CRASH, str(exc)) from None
        return host

    def serve_default(self, task: ChatEngineTask, settings: EvalSettings, ctx: WorkerContext) -> ChatHost:
        """A host serving the default engine (``evo serve --gguf``'s, on the task's cores)."""
        engine = ChatEngine(threads=task.cores)
        built = compile_engine(engine, compiler=settings.compiler, cache_dir=ctx.cache_dir, work_dir=ctx.work_dir)
        return self.serve(task, engine, built, settings, ctx)

    def release(self, host: ChatHost) -> None:
        self._live.discard(host.pid)
        host.close()

    def others(self, host: ChatHost) -> list[int]:
        """The processes to stop while ``host`` is measured: every other host's, and, in a worker (which leads
        its process group, which no host may leave), every process a host orphaned; never a template."""
        return beside(host.pid, self._live, [t.pid for t in self._templates.values()])

    # --- the backend -------------------------------------------------------------------------------

    def preflight(self, task: ChatEngineTask, settings: EvalSettings, *, compile_only: bool = False) -> None:
        try:
            compiler_version(settings.compiler.cc)  # the slots' kernels are C
            model_file(task.args.model)
        except (CompilerNotFound, ModelNotFound) as exc:
            raise BackendUnavailable(str(exc)) from None
        try:
            import uvicorn  # noqa: F401 - a host serves the chat app

            import serving  # noqa: F401
        except ImportError as exc:
            raise BackendUnavailable(f"the chat_engine task serves its engines: it needs the serve extra "
                                     f"({exc.name} is missing): pip install -c constraints.txt -e "
                                     "'.[serve,decoder]'") from None  # fmt: skip

    def prepare_worker(self, task: ChatEngineTask, lock: TimingLock) -> None:
        """Loads the model and the held-out texts, and whatever a host serves with (see
        :func:`runtime.sandbox.chat_host.prime_chat_host`)."""
        task.prime()
        prime_chat_host(task.model(), task.model_id())

    def sandboxed(self, task: ChatEngineTask, ctx: WorkerContext) -> None:
        """Forks the hosts' template now, before any evaluation puts reference logits or answers in memory."""
        self.template(task, ctx)

    def compile(self, task: ChatEngineTask, genome: Genome, settings: EvalSettings, ctx: WorkerContext) -> Build:
        """``genome``'s engine, validated, and every library it loads compiled into the cache (none loaded)."""
        try:
            engine = task.engine(genome)
            engine.check()
            built = compile_engine(engine, task.kernel_sources(engine), compiler=settings.compiler,
                                   cache_dir=ctx.cache_dir, work_dir=ctx.work_dir)  # fmt: skip
        except (ValueError, ValidationError, TypeError, RunNotFound) as exc:  # EngineUnfit is a ValueError
            why = str(exc) if isinstance(exc, EngineUnfit | RunNotFound) else f"not a chat engine: {exc}"
            raise Failure(Status.INVALID, why) from None
        except CompileError as exc:
            raise Failure(Status.COMPILE_ERROR, exc.stderr) from None
        return Build(genome, (engine, built), 0.0, {"kernel_sha256": {part: ks.sha256 for part, ks in built.items()}})

    def load(self, task: ChatEngineTask, build: Build, settings: EvalSettings, ctx: WorkerContext) -> ChatEngineProgram:
        engine, built = build.artifact
        return ChatEngineProgram(task, self.serve(task, engine, built, settings, ctx), engine, settings, ctx, self,
                                 built)  # fmt: skip
