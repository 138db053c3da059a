"""Continuous batching: one engine thread steps every running generation together; new ones join at the next step.

A step is one forward pass over the running generations: each one that is decoding brings its last token,
then those still reading their prompts bring chunks of them, oldest first, until the step holds
``step_tokens`` tokens (chunked prefill: a long prompt takes several steps while the others keep decoding).
Each generation samples with its own parameters and generator, and a :class:`TextStream` settles its text,
so it gets the same tokens in any batch as alone (up to the rounding of batched matrix products, which
does not move a greedy choice that is not a near tie).

Memory: a generation's KV cache is allocated once, for the most it can hold (its prompt plus
``max_tokens``, at most the context), and the caches of the running generations stay within
``kv_budget_bytes`` together, so the cache never grows past the budget mid-generation. A generation
that does not fit waits, in order, in a queue of at most ``max_waiting``; beyond it, :class:`QueueFull`.
One that could never fit is refused at once (:class:`DoesNotFit`). A cancelled generation (its client
went away) leaves the queue at once, or its cache is freed at the end of the step under way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from runtime.decoder.channel import Channel
from runtime.decoder.generate import Completion, Decoder, check_prompt
from runtime.decoder.gguf_file import DecoderConfig
from runtime.decoder.grammar import GrammarState
from runtime.decoder.model import KVCache
from runtime.decoder.sampling import (
    SamplingParams,
    TopLogits,
    sample,
    sample_top,
    token_logprobs,
    top_logprobs,
    top_suffices,
)
from runtime.decoder.stream import FinishReason, TextStream

__all__ = ["Chunk", "DoesNotFit", "Generation", "QueueFull", "Scheduler", "SchedulerClosed", "SchedulerConfig",
           "kv_bytes_per_token"]  # fmt: skip

log = logging.getLogger(__name__)

_RECHECK_S = 0.02


class QueueFull(RuntimeError):
    """The KV cache budget is taken and the waiting queue is at its bound: retry later."""


class DoesNotFit(ValueError):
    """A generation whose KV cache alone exceeds the whole budget."""


class SchedulerClosed(RuntimeError):
    """The scheduler is closing or closed: it takes no new generations."""


def kv_bytes_per_token(config: DecoderConfig, itemsize: int = 4) -> int:
    """Bytes of KV cache one position of one sequence takes: keys and values of every layer, ``itemsize`` bytes
    each (4: fp32, 2: f16)."""
    return 2 * config.layers * config.kv_heads * config.head_dim * itemsize


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The engine's budgets: KV cache bytes, waiting generations, tokens per step, generations per step."""

    kv_budget_bytes: int = 2 << 30
    max_waiting: int = 64
    step_tokens: int = 64
    max_running: int = 64

    def __post_init__(self) -> None:
        for name in ("kv_budget_bytes", "step_tokens", "max_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} is {getattr(self, name)}: it must be at least 1")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting is {self.max_waiting}: use 0 (refuse what does not fit) or more")


@dataclass(frozen=True)
class Chunk:
    """One sampled token of a generation, as its consumer sees it."""

    token: int
    text: str  # the text it settled ("" while a character or a possible stop string is unfinished)
    tokens: int  # tokens sampled so far, this one and an end token included
    finish_reason: FinishReason | None  # set on the last chunk
    t: float  # time.perf_counter() when it was sampled
    logprob: tuple[float, tuple[tuple[int, float], ...]] | None = None  # where asked: see sampling.token_logprobs


class Generation:
    """A submitted request: its chunks in order (iterate, sync or async), :meth:`cancel` to end it early."""

    def __init__(self, scheduler: Scheduler, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.submitted = time.perf_counter()
        self._scheduler = scheduler
        self._channel: Channel[Chunk] = Channel()

    def cancel(self) -> None:
        """Ends the generation: it leaves the queue, or its cache is freed after the step under way."""
        self._scheduler._cancel(self)

    def __iter__(self) -> Iterator[Chunk]:
        while True:
            chunk = self._channel.get()
            yield chunk
            if chunk.finish_reason is not None:
                return

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        while True:
            chunk = await self._channel.aget()
            yield chunk
            if chunk.finish_reason is not None:
                return

    def result(self) -> Completion:
        """Waits for the whole generation (as :meth:`Decoder.generate` returns it)."""
        chunks = list(self)
        ids = [c.token for c in chunks]
        if ids and ids[-1] in self._scheduler.decoder.tokenizer.end_ids:
            ids.pop()
        return Completion(text="".join(c.text for c in chunks), token_ids=ids, prompt_tokens=self.prompt_tokens,
                          finish_reason=chunks[-1].finish_reason or "length")  # fmt: skip


@dataclass(eq=False)
class _Seq:
    gen: Generation
    prompt: list[int]
    params: SamplingParams
    rng: np.random.Generator
    stream: TextStream
    kv_bytes: int  # what its cache takes of the budget
    positions: int  # the cache's capacity
    cache: KVCache | None = None
    done: int = 0  # prompt tokens in the cache
    cancelled: bool = False
    grammar: GrammarState | None = None  # where its structured answer stands


class Scheduler:
    """The engine thread of one :class:`Decoder`: :meth:`submit` a prompt's ids, read its :class:`Generation`.
    ``on_step(generations, tokens, seconds)`` is called after each step (e.g. to observe batch sizes).
    ``held_elsewhere()`` is KV cache held outside this scheduler within the same budget (another engine's
    during a swap, while it finishes its requests); a generation that waits for it is looked at again every
    ``_RECHECK_S``."""

    def __init__(self, decoder: Decoder, config: SchedulerConfig | None = None, *,
                 on_step: Callable[[int, int, float], None] | None = None,
                 held_elsewhere: Callable[[], int] | None = None) -> None:  # fmt: skip
        self.decoder, self.config, self.on_step = decoder, config or SchedulerConfig(), on_step
        self.held_elsewhere = held_elsewhere
        self.bytes_per_token = kv_bytes_per_token(decoder.model.config, decoder.model.kv_dtype.itemsize)
        self._cond = threading.Condition()
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._seqs: dict[Generation, _Seq] = {}
        self._used = 0
        self._closed = False
        self._out = 0
        self._recent: deque[tuple[float, int]] = deque()  # (step end, tokens sampled) of the last seconds
        self._thread = threading.Thread(target=self._loop, name="evoforge-decoder", daemon=True)
        self._thread.start()

    # what the metrics read
    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_used_bytes(self) -> int:
        return self._used

    @property
    def output_tokens(self) -> int:
        return self._out

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Tokens sampled per second over the last ``window`` seconds."""
        since = time.perf_counter() - window
        with self._cond:
            return sum(n for t, n in self._recent if t >= since) / window

    def submit(self, prompt: Sequence[int], params: SamplingParams) -> Generation:
        """Queues a generation from the token ids ``prompt``. Raises ``ValueError`` for an empty prompt,
        :class:`runtime.decoder.ContextFull` for one that fills the context, :class:`DoesNotFit`,
        :class:`QueueFull` or :class:`SchedulerClosed`."""
        ids = [int(i) for i in prompt]
        context = self.decoder.model.config.context
        check_prompt(ids, context)
        positions = min(len(ids) + params.max_tokens, context)
        need, budget = positions * self.bytes_per_token, self.config.kv_budget_bytes
        if need > budget:
            raise DoesNotFit(f"{positions} tokens of KV cache take {need / 2**20:.1f} MiB, over the whole budget of "
                             f"{budget / 2**20:.1f} MiB: ask for fewer tokens, or raise the budget")  # fmt: skip
        gen = Generation(self, len(ids))
        stream = TextStream(self.decoder.tokenizer, params, prompt_tokens=len(ids), context=context)
        seq = _Seq(gen, ids, params, params.rng(), stream, need, positions,
                   grammar=params.grammar.start() if params.grammar is not None else None)
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the engine is shutting down: it takes no new requests")
            self._admit()
            if not self._waiting and self._fits(seq):
                self._start(seq)
            elif len(self._waiting) >= self.config.max_waiting:
                raise QueueFull(f"the KV cache budget is taken ({self._used / 2**20:.1f} of {budget / 2**20:.1f} "
                                f"MiB) and {len(self._waiting)} requests wait (the bound): retry later")  # fmt: skip
            else:
                self._waiting.append(seq)
            self._seqs[gen] = seq
            self._cond.notify_all()
        return gen

    def close(self, timeout: float | None = None) -> None:
        """Takes no new generations, finishes those running and waiting, then stops the engine thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # under the lock
    def _fits(self, seq: _Seq) -> bool:
        used = self._used + (self.held_elsewhere() if self.held_elsewhere is not None else 0)
        return len(self._running) < self.config.max_running and used + seq.kv_bytes <= self.config.kv_budget_bytes

    def _start(self, seq: _Seq) -> None:
        seq.cache = self.decoder.model.new_cache(seq.positions)
        self._used += seq.kv_bytes
        self._running.append(seq)

    def _admit(self) -> None:
        while self._waiting and self._fits(self._waiting[0]):
            self._start(self._waiting.popleft())

    def _free(self, seq: _Seq) -> None:
        if seq.cache is not None:
            seq.cache = None
            self._used -= seq.kv_bytes
            self._running.remove(seq)
        self._seqs.pop(seq.gen, None)

    def _cancel(self, gen: Generation) -> None:
        with self._cond:
            seq = self._seqs.get(gen)
            if seq is None:  # finished already
                return
            seq.cancelled = True
            if seq.cache is None:
                self._waiting.remove(seq)
                self._seqs.pop(gen, None)
            self._cond.notify_all()

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._running if s.cancelled]:
            self._free(seq)

    def _plan(self) -> list[tuple[_Seq, list[int]]]:
        """This step's chunks: one token of every decoding generation, then prompt chunks up to the budget."""
        budget = self.config.step_tokens
        batch = [(s, [s.stream.generated[-1]]) for s in self._running if s.done == len(s.prompt)]
        budget -= len(batch)
        for s in self._running:
            if s.done < len(s.prompt) and budget > 0:
                n = min(budget, len(s.prompt) - s.done)
                batch.append((s, s.prompt[s.done : s.done + n]))
                budget -= n
        return batch

    # the engine thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    self._drop_cancelled()
                    self._admit()
                    if self._running:
                        break
                    if self._closed and not self._waiting:
                        return
                    # cache freed elsewhere wakes nobody here: look again soon while something waits for it
                    self._cond.wait(_RECHECK_S if self._waiting and self.held_elsewhere is not None else None)
                batch = self._plan()
            try:
                self._step(batch)
            except Exception as exc:  # noqa: BLE001 - the step's generations fail; the engine goes on
                log.exception("a decoder step failed")
                error = RuntimeError(f"the generation failed: {type(exc).__name__}: {exc}")
                with self._cond:
                    for seq, _ in batch:
                        if seq.stream.finish is None:
                            seq.gen._channel.put(error)
                            self._free(seq)

    def _step(self, batch: list[tuple[_Seq, list[int]]]) -> None:
        t0 = time.perf_counter()
        caches = [s.cache for s, _ in batch]
        end_ids = self.decoder.tokenizer.end_ids
        top = self.decoder.top  # the head's top lists where every sequence's sampling needs no more
        if top and not all(top_suffices(s.params, top, end_ids) for s, _ in batch):
            top = 0
        logits = self.decoder.model.forward([c for _, c in batch], caches, self.decoder.ops, top=top)
        now = time.perf_counter()
        finished, sampled = [], 0
        for i, (seq, chunk) in enumerate(batch):
            if seq.done < len(seq.prompt):
                seq.done += len(chunk)
                if seq.done < len(seq.prompt):  # more of the prompt to read: no token yet
                    continue
            k = seq.params.logprobs
            logprob = None
            if isinstance(logits, TopLogits):
                ids, values, lse = logits.row(i)
                token = sample_top(ids, values, seq.params, seq.rng, end_ids)
                if k is not None:
                    logprob = top_logprobs(ids, values, lse, token, k)
            else:
                row = logits[i]
                raw = row.copy() if k is not None else None  # sampling may mask the end tokens in place
                token = sample(row, seq.params, seq.rng, end_ids, seq.grammar)
                if raw is not None and k is not None:
                    logprob = token_logprobs(raw, token, k)
            text = seq.stream.push(token)
            sampled += 1
            seq.gen._channel.put(Chunk(token, text, seq.stream.sampled, seq.stream.finish, now, logprob))
            if seq.stream.finish is not None:
                finished.append(seq)
        with self._cond:
            for seq in finished:
                self._free(seq)
            self._out += sampled
            self._recent.append((now, sampled))
            while self._recent and self._recent[0][0] < now - 60.0:
                self._recent.popleft()
        if self.on_step is not None:
            self.on_step(len(batch), sum(len(c) for _, c in batch), now - t0)
