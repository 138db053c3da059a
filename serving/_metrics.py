"""Prometheus metrics of one app (its own registry): requests by route and status, refusals, and the engine's
own: the encoder's queue, tokenisation, inference, batch size, tokens per batch and queue depth; or the
chat model's time to first token, inter-token latency, output tokens, KV cache use and requests running
and waiting."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from runtime.decoder import Scheduler

__all__ = ["ChatMetrics", "HTTPMetrics", "Metrics", "RequestCounter"]

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class HTTPMetrics:
    """Every app's collectors (requests, latency, refusals); ``render()`` is the text exposition format."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("evoforge_requests", "HTTP requests by route, method and status",
                                ["route", "method", "status"], registry=r)
        self.latency = Histogram("evoforge_request_seconds", "request latency by route", ["route"],
                                 buckets=_SECONDS, registry=r)
        self.rejected = Counter("evoforge_rejected", "requests refused or dropped, by reason", ["reason"],
                                registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Metrics(HTTPMetrics):
    """The encoder app's collectors."""

    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.queue = Histogram("evoforge_queue_seconds", "time a text waited for its batch", buckets=_SECONDS,
                               registry=r)
        self.tokenize = Histogram("evoforge_tokenize_seconds", "tokenisation time of a request", buckets=_SECONDS,
                                  registry=r)
        self.inference = Histogram("evoforge_inference_seconds", "run time of a batch", buckets=_SECONDS,
                                   registry=r)
        self.batch_size = Histogram("evoforge_batch_size", "texts per batch", buckets=[2**i for i in range(10)],
                                    registry=r)
        self.batch_tokens = Histogram("evoforge_batch_tokens", "tokens per batch", buckets=[2**i for i in range(3, 16)],
                                      registry=r)
        self.queue_depth = Gauge("evoforge_queue_depth", "texts queued in the engine's batcher", registry=r)
        self.in_flight = Gauge("evoforge_in_flight_requests", "embeddings requests being served", registry=r)

    def watch_queue(self, depth: Callable[[], float]) -> None:
        self.queue_depth.set_function(depth)


class ChatMetrics(HTTPMetrics):
    """The chat model app's collectors; the gauges read the engines' schedulers when scraped (``schedulers()``:
    the one serving, then any swapped out and finishing their requests)."""

    def __init__(self, schedulers: Callable[[], list[Scheduler]], kv_budget_bytes: int) -> None:
        super().__init__()
        r = self.registry
        self.ttft = Histogram("evoforge_chat_time_to_first_token_seconds", "from a request's arrival to its first "
                              "token", buckets=_SECONDS + (30.0, 60.0), registry=r)  # fmt: skip
        self.inter_token = Histogram("evoforge_chat_inter_token_seconds", "between one request's successive tokens",
                                     buckets=_SECONDS, registry=r)  # fmt: skip
        self.prompt_tokens = Counter("evoforge_chat_prompt_tokens", "prompt tokens of the requests accepted",
                                     registry=r)  # fmt: skip
        self.output_tokens = Counter("evoforge_chat_output_tokens", "tokens generated", registry=r)
        self.output_tokens.inc(0)

        def total(read: Callable[[Scheduler], float]) -> Callable[[], float]:
            return lambda: sum(read(s) for s in schedulers())

        used = total(lambda s: s.kv_used_bytes)
        gauges = {
            "evoforge_chat_output_tokens_per_second": ("tokens generated per second over the last 10 s",
                                                       total(lambda s: s.tokens_per_second())),
            "evoforge_chat_kv_cache_bytes": ("KV cache held by the running requests", used),
            "evoforge_chat_kv_cache_budget_bytes": ("the KV cache budget", lambda: kv_budget_bytes),
            "evoforge_chat_kv_cache_usage_ratio": ("KV cache held over its budget", lambda: used() / kv_budget_bytes),
            "evoforge_chat_running_requests": ("requests in the running batch", total(lambda s: s.running)),
            "evoforge_chat_waiting_requests": ("requests waiting for KV cache", total(lambda s: s.waiting)),
        }  # fmt: skip
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=r).set_function(read)
        self.step_size = Histogram("evoforge_chat_step_requests", "requests in one engine step (the running batch)",
                                   buckets=[2**i for i in range(8)], registry=r)  # fmt: skip
        self.step_tokens = Histogram("evoforge_chat_step_tokens", "tokens in one engine step",
                                     buckets=[2**i for i in range(12)], registry=r)  # fmt: skip
        self.step_seconds = Histogram("evoforge_chat_step_seconds", "run time of one engine step", buckets=_SECONDS,
                                      registry=r)  # fmt: skip

    def observe_step(self, requests: int, tokens: int, seconds: float) -> None:
        self.step_size.observe(requests)
        self.step_tokens.observe(tokens)
        self.step_seconds.observe(seconds)


class RequestCounter:
    """ASGI middleware counting every HTTP request by its route template (not its raw path) and status."""

    def __init__(self, app: ASGIApp, *, metrics: HTTPMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]
        t0 = time.perf_counter()

        async def send_status(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.requests.labels(route, scope["method"], str(status[0])).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - t0)
