"""The engine behind the API: which elite is served, its batcher with per-request timings, and hot swaps.

A thin adapter over :mod:`runtime.engine`: the engine's own :class:`runtime.engine.Batcher` runs
:meth:`Engine.run_batch`, wrapped to stamp each batch's start, end, size and tokens, so a response can
say how long its texts queued and ran. Swapping starts and warms the new engine first, then points new
requests at it; the old one finishes what it already holds before it closes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from serving._metrics import Metrics
from serving._served_run import EliteNotFound, ServedRun, ServeError, open_served

if TYPE_CHECKING:
    from runtime.engine import Engine, Model

__all__ = ["BatchInfo", "EliteNotFound", "ServedEngine", "EngineRunner", "ServeError", "Served"]

log = logging.getLogger("serving")


@dataclass(frozen=True)
class BatchInfo:
    start: float  # perf_counter when the batch began running
    end: float
    size: int
    tokens: int


@dataclass(frozen=True)
class Served:
    """What is served: the elite id (``None`` for the default configuration) and a description."""

    elite: str | None
    run_dir: str
    note: str


class EngineRunner:
    """One started engine: ``submit(token ids)`` -> future of ``(embedding, BatchInfo)``."""

    def __init__(self, engine: Engine, served: Served, metrics: Metrics) -> None:
        from runtime.engine import Batcher

        self.engine, self.served, self._metrics = engine, served, metrics
        c = engine.config
        try:
            # thread or process workers fitted to the cores; BLAS threads are process-wide, the server owns them
            self._forward = engine.start_workers(restore_blas=False)
            workers = engine.threads[0] if engine.threads else c.workers
            self.batcher: Batcher[np.ndarray, tuple[np.ndarray, BatchInfo]] = Batcher(
                self._run, max_batch=c.max_batch, token_budget=c.token_budget, max_wait_ms=c.max_wait_ms,
                queue_size=c.queue_size, workers=workers, bucketing=c.bucketing == "queue",
                split=c.bucketing == "split", name="evoforge-serve")
        except BaseException:
            engine.close()  # its children and kernels: the caller never gets a runner to close
            raise

    def _run(self, seqs: list[np.ndarray]) -> list[tuple[np.ndarray, BatchInfo]]:
        t0 = time.perf_counter()
        out = self._forward(seqs)
        info = BatchInfo(t0, time.perf_counter(), len(seqs), sum(len(s) for s in seqs))
        m = self._metrics
        m.inference.observe(info.end - info.start)
        m.batch_size.observe(info.size)
        m.batch_tokens.observe(info.tokens)
        return [(out[i], info) for i in range(len(seqs))]

    @property
    def free(self) -> int:
        return self.batcher.queue_size - self.batcher.queued

    def submit(self, seq: np.ndarray) -> Future[tuple[np.ndarray, BatchInfo]]:
        """Raises :class:`runtime.engine.QueueFull` when the queue is full."""
        return self.batcher.submit(seq, len(seq))

    def warm(self, texts: Sequence[str]) -> None:
        """Runs ``texts`` through the batcher once (first-call costs: allocation, kernel loading)."""
        seqs = self.engine.model.tokenizer.encode_batch(list(texts))
        for f in [self.submit(s) for s in seqs]:
            f.result()

    def close(self) -> None:
        """Finishes every queued text, then frees the engine's kernels."""
        self.batcher.close()
        self.engine.close()


_WARM_TEXTS = ["warm up", "a somewhat longer sentence to warm up the engine's larger shapes " * 4]


class ServedEngine:
    """Holds the current :class:`EngineRunner` of the served run and swaps it on request."""

    def __init__(self, run: ServedRun, metrics: Metrics, *, warmup: int = 8) -> None:
        self.run, self.metrics, self.warmup = run, metrics, warmup
        self.current: EngineRunner | None = None
        self.model: Model | None = None
        self._swap = threading.Lock()
        metrics.watch_queue(lambda: float(self.current.batcher.queued) if self.current else 0.0)

    @property
    def ready(self) -> bool:
        return self.current is not None

    def build(self, elite: str, run_dir: Path) -> tuple[EngineRunner, ServedRun]:
        """Loads (``best``, an id or prefix, or ``default``, of the run in ``run_dir``), starts and warms an
        engine; slow, call in a thread. The run is opened once, here.

        The engine's kernels run in a host process of their own (:func:`runtime.sandbox.hosted_engine.spawn_host`),
        started from a fresh interpreter whose environment holds no key: nothing of this process's memory
        is in it, and it drops to the sandbox user. Each kernel must load as the library its elite was
        measured with. Tokenising, batching and the timings stay here."""
        from archive import Run
        from runtime.engine import RunNotFound, load_model
        from runtime.sandbox.hosted_engine import spawn_elite

        with open_served(run_dir) as run:
            served = ServedRun.read(run, elite)
            if self.model is None:
                self.model = load_model(served.model_dir)
            try:
                engine = spawn_elite(run, served.elite_id, self.model, runs=Run.open)
            except RunNotFound as exc:
                raise ServeError(str(exc)) from None
        runner = EngineRunner(engine, Served(served.elite_id, str(run_dir), served.note), self.metrics)
        try:
            runner.warm((_WARM_TEXTS * self.warmup)[: max(1, self.warmup)])
        except BaseException:
            runner.close()
            raise
        return runner, served

    def switch(self, elite: str, run_dir: Path | None = None) -> Served:
        """Builds and warms ``elite`` (of ``run_dir``: another run of the same model, as a factory promotes
        them; default the one served), then serves it; the old engine drains in the background."""
        with self._swap:
            runner, served = self.build(elite, Path(run_dir) if run_dir is not None else self.run.path)
            old, self.current, self.run = self.current, runner, served
        log.info("serving %s", runner.served.note)
        if old is not None:
            threading.Thread(target=old.close, name="evoforge-drain", daemon=True).start()
        return runner.served

    def close(self) -> None:
        with self._swap:
            if self.current is not None:
                self.current.close()
                self.current = None
