"""Closed-loop load: ``concurrency`` clients, each submitting its next text as soon as the last one returned."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from runtime.engine.scheduler import QueueFull

__all__ = ["LoadResult", "ServingLoad", "closed_loop"]


class ServingLoad(BaseModel):
    """The serving load an engine is measured under: closed-loop clients sending texts of these lengths.
    The engine task's arguments and the factory's ``load:`` section share it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    concurrency: int = Field(8, ge=1, description="closed-loop clients")
    lengths: dict[int, float] = Field(
        default_factory=lambda: {16: 0.6, 48: 0.3, 128: 0.1},
        description="token length -> weight of the requests' length distribution (lengths vary +-25%)")
    texts: int = Field(256, ge=8, description="distinct request texts (the first 32 are the similarity check)")
    warmup_s: float = Field(0.5, ge=0, description="load before the measured window")
    duration_s: float = Field(3.0, gt=0, description="the measured window")
    p99_budget_ms: float = Field(250.0, gt=0, description="p99 latency above this: recorded, never an elite")


@dataclass(frozen=True)
class LoadResult:
    completed: int  # requests that finished inside the measured window
    seconds: float  # the window's length
    throughput: float  # completed / seconds (sentences/s)
    p50_ms: float  # with nothing completed, the latencies are the window's length (a lower bound)
    p99_ms: float
    mean_ms: float
    refused: int  # QueueFull answers (a closed loop within queue_size never sees one)
    latencies_ms: tuple[float, ...] = ()  # every counted request's, to pool rounds for a steadier p99


def closed_loop(
    submit: Callable[[str], Future],
    texts: Sequence[str],
    *,
    concurrency: int,
    duration_s: float,
    warmup_s: float = 0.0,
) -> LoadResult:
    """Runs the load for ``warmup_s + duration_s``; requests finishing in the last ``duration_s`` count."""
    start = time.perf_counter()
    window = (start + warmup_s, start + warmup_s + duration_s)
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    refused = [0] * concurrency
    errors: list[BaseException] = []

    def client(i: int) -> None:
        k = i
        try:
            while time.perf_counter() < window[1]:
                text = texts[k % len(texts)]
                k += concurrency
                t0 = time.perf_counter()
                try:
                    submit(text).result()
                except QueueFull:
                    refused[i] += 1
                    time.sleep(0.001)
                    continue
                t1 = time.perf_counter()
                if window[0] <= t1 <= window[1]:
                    latencies[i].append(t1 - t0)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    lat = np.array([x for per in latencies for x in per]) * 1000.0
    n = len(lat)
    if n == 0:  # nothing finished inside the window: every request took longer than it
        lat = np.array([duration_s * 1000.0])
    return LoadResult(
        completed=n,
        seconds=duration_s,
        throughput=n / duration_s,
        p50_ms=float(np.percentile(lat, 50)),
        p99_ms=float(np.percentile(lat, 99)),
        mean_ms=float(lat.mean()),
        refused=sum(refused),
        latencies_ms=tuple(float(x) for x in lat) if n else (),
    )
