"""Dynamic batching: requests queue, worker threads take batches, results come back as futures.

A batch takes what is already queued, up to ``max_batch`` requests and ``token_budget`` tokens (the sum
of the requests' token counts; a single request over the budget still goes alone), then waits at most
``max_wait_ms`` for more (default 0: never wait). With ``bucketing="queue"`` requests queue by length
class (powers of two) and a batch comes from the class whose oldest request has waited longest, so a
batch holds similar lengths and pads little; otherwise one FIFO queue. The queue is bounded: a request
beyond ``queue_size`` is refused with :class:`QueueFull`, never buffered. With ``split``, a batch runs as one
``run`` per length class in it, longest first, and each class's requests are answered as soon as theirs is
done: a short request does not wait for the long ones batched with it, and the long ones, the tail of the
latency, wait for nothing.

Workers are threads calling ``run``; an engine with process workers passes a ``run`` that hands the
batch to a forked child (:mod:`runtime.engine.workers`), so the scheduling is the same for both.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["Batcher", "BatcherClosed", "QueueFull", "length_class", "longest_first"]

T = TypeVar("T")
R = TypeVar("R")


class QueueFull(RuntimeError):
    """The queue holds ``queue_size`` requests already: this one is refused (retry later, or shed load)."""


class BatcherClosed(RuntimeError):
    """The batcher was closed: it takes no more requests."""


def length_class(tokens: int) -> int:
    """The power of two at or above ``tokens`` (at least 8): the length bucket of a request."""
    return max(8, 1 << (max(tokens, 1) - 1).bit_length())


def longest_first(lengths: Sequence[int]) -> list[int]:
    """Indices of ``lengths`` from the longest to the shortest (ties in order). Submitted in this order, the
    requests of one list queue next to others of their length, so its batches pad little, and the cheapest
    batches come last, where the workers finish together."""
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


@dataclass
class _Request(Generic[T, R]):
    item: T
    tokens: int
    future: Future[R]
    seq: int
    enqueued: float = field(default_factory=time.perf_counter)


class Batcher(Generic[T, R]):
    """Batches submitted items for ``run(items) -> results`` (one result per item, in order)."""

    def __init__(
        self,
        run: Callable[[list[T]], Sequence[R]],
        *,
        max_batch: int = 32,
        token_budget: int = 8192,
        max_wait_ms: float = 0.0,
        queue_size: int = 1024,
        workers: int = 1,
        bucketing: bool = False,
        split: bool = False,
        name: str = "evoforge-batcher",
    ) -> None:
        if max_batch < 1 or token_budget < 1 or queue_size < 1 or workers < 1 or max_wait_ms < 0:
            raise ValueError("max_batch, token_budget, queue_size and workers must be >= 1, max_wait_ms >= 0")
        self._run = run
        self.max_batch, self.token_budget, self.max_wait = max_batch, token_budget, max_wait_ms / 1000.0
        self.queue_size, self.bucketing, self.split = queue_size, bucketing, split
        self._queues: dict[int, collections.deque[_Request[T, R]]] = {}
        self._queued = 0
        self._seq = 0
        self._cond = threading.Condition()
        self._closed = False
        self.batches = 0  # statistics: batches run and requests served
        self.served = 0
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    # --- clients --------------------------------------------------------------------------------

    def submit(self, item: T, tokens: int = 1) -> Future[R]:
        """Queues ``item`` (costing ``tokens``); raises :class:`QueueFull` when the queue is full."""
        fut: Future[R] = Future()
        with self._cond:
            if self._closed:
                raise BatcherClosed("the batcher is closed")
            if self._queued >= self.queue_size:
                raise QueueFull(f"{self._queued} requests queued (queue_size={self.queue_size})")
            key = length_class(tokens) if self.bucketing else 0
            self._queues.setdefault(key, collections.deque()).append(_Request(item, tokens, fut, self._seq))
            self._seq += 1
            self._queued += 1
            self._cond.notify()
        return fut

    @property
    def queued(self) -> int:
        with self._cond:
            return self._queued

    def close(self, *, cancel: bool = False) -> None:
        """Stops taking requests; the workers finish what is queued (or fail it with ``cancel``) and exit."""
        with self._cond:
            self._closed = True
            if cancel:
                for q in self._queues.values():
                    for r in q:
                        r.future.set_exception(BatcherClosed("the batcher was closed"))
                    q.clear()
                self._queued = 0
            self._cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()

    def __enter__(self) -> Batcher[T, R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- workers --------------------------------------------------------------------------------

    def _oldest(self) -> collections.deque[_Request[T, R]] | None:
        heads = [q for q in self._queues.values() if q]
        return min(heads, key=lambda q: q[0].seq) if heads else None

    def _take(self, batch: list[_Request[T, R]], tokens: int, key_queue: collections.deque) -> int:
        while key_queue and len(batch) < self.max_batch:
            nxt = key_queue[0]
            if batch and tokens + nxt.tokens > self.token_budget:
                break
            batch.append(key_queue.popleft())
            tokens += nxt.tokens
            self._queued -= 1
        return tokens

    def _next_batch(self) -> list[_Request[T, R]] | None:
        with self._cond:
            while True:
                q = self._oldest()
                if q is not None:
                    break
                if self._closed:
                    return None
                self._cond.wait()
            batch: list[_Request[T, R]] = []
            tokens = self._take(batch, 0, q)
            deadline = time.perf_counter() + self.max_wait
            while len(batch) < self.max_batch and tokens < self.token_budget and not self._closed:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._cond.wait(left)
                before = len(batch)
                tokens = self._take(batch, tokens, q)
                if len(batch) == before and q and tokens + q[0].tokens > self.token_budget:
                    break  # the next one does not fit: go now
            return batch

    def _work(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            for part in self._parts(batch):
                self._answer(part)
            with self._cond:
                self.batches += 1
                self.served += len(batch)

    def _parts(self, batch: list[_Request[T, R]]) -> list[list[_Request[T, R]]]:
        """``batch`` as it runs: whole, or with ``split`` one part per length class, longest first."""
        if not self.split or len(batch) < 2:
            return [batch]
        classes: dict[int, list[_Request[T, R]]] = {}
        for r in batch:
            classes.setdefault(length_class(r.tokens), []).append(r)
        return [classes[k] for k in sorted(classes, reverse=True)]

    def _answer(self, part: list[_Request[T, R]]) -> None:
        try:
            results = self._run([r.item for r in part])
            if len(results) != len(part):
                raise RuntimeError(f"the batch function returned {len(results)} results for {len(part)} items")
        except BaseException as exc:  # noqa: BLE001 - every waiting client gets the error
            for r in part:
                r.future.set_exception(exc)
            return
        for r, res in zip(part, results, strict=True):
            r.future.set_result(res)
