"""An engine: the model in one precision, an operator table, and a batching scheduler, set by an EngineConfig."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from runtime.engine.model import Model, Precision
from runtime.engine.ops import SLOTS, Ops
from runtime.engine.scheduler import Batcher, length_class, longest_first
from runtime.engine.workers import ProcessWorkers

__all__ = ["Engine", "EngineConfig", "fit_threads"]

log = logging.getLogger(__name__)


def fit_threads(workers: int, blas_threads: int, cores: int) -> tuple[int, int]:
    """``(workers, blas_threads)`` cut down until ``workers * blas_threads <= cores``: BLAS threads go first,
    then workers. More threads than cores was measured to cut throughput tenfold on a small machine."""
    blas_threads = max(1, min(blas_threads, cores // max(workers, 1)))
    return max(1, min(workers, cores // blas_threads)), blas_threads


class EngineConfig(BaseModel):
    """Everything that may vary about an engine (the genome of the ``engine`` task maps onto this)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch: int = Field(32, ge=1, description="requests per batch at most")
    max_wait_ms: float = Field(0.0, ge=0, description="how long a batch waits for more requests once it has one")
    token_budget: int = Field(8192, ge=1, description="tokens per batch at most (sum over its requests)")
    bucketing: Literal["none", "split", "queue"] = Field(
        "split", description="none: one padded batch; split: a batch runs as sub-batches of one length class each, "
        "longest first, each answered when done; "
        "queue: requests queue by length class and a batch comes from one class")
    pack: bool = Field(True, description="token-wise operators run on the real tokens only (no padding)")
    workers: int = Field(1, ge=1, description="scheduler workers (batches run concurrently)")
    worker_kind: Literal["thread", "process"] = Field(
        "thread", description="thread: workers share the interpreter; process: each runs in a forked child")
    blas_threads: int = Field(1, ge=1, description="BLAS threads per worker; workers * blas_threads <= cores")
    precision: Precision = Field("fp32", description="GEMM weights: fp32, or rounded to bf16 / int8 per channel")
    kernels: dict[str, str] = Field(default_factory=dict, description="slot -> 'numpy' or an elite id")
    queue_size: int = Field(1024, ge=1, description="queued requests at most; more are refused")

    @model_validator(mode="after")
    def _slots(self) -> EngineConfig:
        unknown = set(self.kernels) - set(SLOTS)
        if unknown:
            raise ValueError(f"unknown slot(s) {sorted(unknown)} (slots: {', '.join(SLOTS)})")
        return self


class Engine:
    """Embeds texts with ``model`` and ``ops`` under ``config``.

    :meth:`embed` runs synchronously in the caller's thread; :meth:`start` starts the batching
    scheduler, after which :meth:`submit` queues one text and returns a future of its embedding.
    """

    def __init__(self, model: Model, ops: Ops, config: EngineConfig) -> None:
        self.model, self.ops, self.config = model, ops, config
        self._batcher: Batcher[np.ndarray, np.ndarray] | None = None
        self._blas: object | None = None
        self._procs: ProcessWorkers | None = None
        self.threads: tuple[int, int] | None = None  # (workers, BLAS threads) running, once started
        self.worker_kind = config.worker_kind  # what runs, once started (OpenMP kernels force threads)

    @property
    def dim(self) -> int:
        return self.model.config.hidden

    def run_batch(self, seqs: Sequence[np.ndarray]) -> np.ndarray:
        """Embeddings of token id arrays, in order; ``split`` bucketing runs each length class on its own."""
        if self.config.bucketing != "split" or len(seqs) < 2:
            return self.model.forward(seqs, self.ops, pack=self.config.pack)
        out = np.empty((len(seqs), self.dim), np.float32)
        classes: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            classes.setdefault(length_class(len(s)), []).append(i)
        for idx in classes.values():
            out[idx] = self.model.forward([seqs[i] for i in idx], self.ops, pack=self.config.pack)
        return out

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """``[len(texts), dim]`` unit-norm embeddings, computed in the caller's thread.

        Texts run sorted by length in batches of ``max_batch`` (all of them are here already, so
        there is nothing to schedule); results come back in the order of ``texts``.
        """
        seqs = self.model.tokenizer.encode_batch(texts)
        out = np.empty((len(seqs), self.dim), np.float32)
        order = np.argsort([len(s) for s in seqs], kind="stable")
        step = self.config.max_batch
        for i in range(0, len(order), step):
            chunk = order[i : i + step]
            out[chunk] = self.run_batch([seqs[j] for j in chunk])
        return out

    # --- serving --------------------------------------------------------------------------------

    def start_workers(self, *, restore_blas: bool = True) -> Callable[[Sequence[np.ndarray]], np.ndarray]:
        """Sets the BLAS threads and forks the worker processes (``worker_kind="process"``); returns the batch
        function a scheduler's worker threads call (:meth:`run_batch`, or a hand-off to a free child).

        ``self.threads`` is then ``(workers, BLAS threads)`` as they run: the config's, cut down to the
        cores this process may use (:func:`fit_threads`). :meth:`close` stops them and, with
        ``restore_blas``, restores the process-wide BLAS threads (a server swapping engines, whose old
        engine closes after the new one started, passes False).
        """
        from threadpoolctl import threadpool_limits

        c = self.config
        cores = len(os.sched_getaffinity(0))
        workers, blas = fit_threads(c.workers, c.blas_threads, cores)
        if (workers, blas) != (c.workers, c.blas_threads):
            log.warning("engine: %d worker(s) x %d BLAS thread(s) exceed the %d core(s) this process may use; "
                        "running %d x %d", c.workers, c.blas_threads, cores, workers, blas)
        self.threads = (workers, blas)
        kind = c.worker_kind
        if kind == "process" and any(k.openmp for k in self.ops.kernels.values()):
            # GNU OpenMP does not survive a fork once it has run: a child's first parallel region would hang
            log.warning("engine: OpenMP kernels cannot run in forked workers: running thread workers instead")
            kind = "thread"
        self.worker_kind = kind
        if kind == "process":
            # one tiny batch first: kernels are loaded and weights packed here, then shared with the children
            self.run_batch([np.array([0, 0], np.int32)])
            self._procs = ProcessWorkers(self.run_batch, workers, blas_threads=blas)
            return self._procs
        # threads share the process-wide BLAS pool: one BLAS call per worker at a time
        limits = threadpool_limits(limits=blas, user_api="blas")
        self._blas = limits if restore_blas else None
        return self.run_batch

    def start(self) -> Engine:
        """Starts the workers (:meth:`start_workers`) and the batching scheduler."""
        if self._batcher is not None:
            return self
        run = self.start_workers()
        c = self.config
        self._batcher = Batcher(
            lambda seqs: list(run(seqs)), max_batch=c.max_batch, token_budget=c.token_budget,
            max_wait_ms=c.max_wait_ms, queue_size=c.queue_size, workers=self.threads[0] if self.threads else 1,
            bucketing=c.bucketing == "queue", split=c.bucketing == "split",
        )
        return self

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' ids (none with thread workers)."""
        return self._procs.pids if self._procs else []

    def submit(self, text: str) -> Future[np.ndarray]:
        """Queues ``text``; raises :class:`runtime.engine.QueueFull` when the queue is full."""
        if self._batcher is None:
            raise RuntimeError("start() the engine before submitting")
        seq = self.model.tokenizer.encode(text)
        return self._batcher.submit(seq, len(seq))

    def submit_all(self, texts: Sequence[str]) -> list[Future[np.ndarray]]:
        """Queues all of ``texts`` at once, longest first (:func:`~runtime.engine.scheduler.longest_first`), and
        returns their futures in the order of ``texts``: the engine's bulk path, over every worker. Raises
        :class:`runtime.engine.QueueFull` when they do not fit in the queue."""
        if self._batcher is None:
            raise RuntimeError("start() the engine before submitting")
        seqs = self.model.tokenizer.encode_batch(list(texts))
        futures: list[Future[np.ndarray]] = [Future()] * len(seqs)
        for i in longest_first([len(s) for s in seqs]):
            futures[i] = self._batcher.submit(seqs[i], len(seqs[i]))
        return futures

    @property
    def batches(self) -> int:
        return self._batcher.batches if self._batcher else 0

    def close(self) -> None:
        """:meth:`stop`, then frees the kernels: the engine cannot run again."""
        self.stop()
        self.ops.close()

    def stop(self) -> None:
        """Stops the scheduler (queued requests are served first), then the worker processes; restores BLAS
        threads. The kernels stay loaded: :meth:`start` may run it again."""
        if self._batcher is not None:
            self._batcher.close()
            self._batcher = None
        if self._procs is not None:
            self._procs.close()
            self._procs = None
        if self._blas is not None:
            self._blas.restore_original_limits()  # type: ignore[attr-defined]
            self._blas = None

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
