"""What one app holds: its limits, the served engine, the kernel invoker, metrics, the API key."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from serving._kernels import KernelInvoker
from serving._metrics import Metrics
from serving._runner import ServedEngine

__all__ = ["Limits", "State"]


class Limits(BaseModel):
    """Request limits and back-pressure caps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(8 << 20, ge=1024, description="request bodies over this get 413")
    body_timeout_s: float = Field(30.0, gt=0, description="seconds a request's whole body may take to arrive; a "
                                  "client that sends less than its Content-Length gets 408 and the connection closed")
    max_items: int = Field(256, ge=1, description="texts per embeddings request")
    max_chars: int = Field(16384, ge=1, description="characters per text")
    max_in_flight: int = Field(256, ge=1, description="embeddings requests being served at once; more get 429")
    max_kernel_elements: int = Field(1 << 18, ge=1, description="elements of a kernel invoke's inputs + outputs")
    kernel_timeout_s: float = Field(30.0, gt=0, description="wall-clock limit of one kernel invoke")


@dataclass
class State:
    served: ServedEngine
    kernels: KernelInvoker
    metrics: Metrics
    limits: Limits
    api_key: str | None
    elite: str  # what to serve at start-up
    model_ids: tuple[str, ...] = ()  # the served model's id, then its aliases
    in_flight: int = 0
    started: float = field(default_factory=time.time)
    load_error: str | None = None
