"""One model endpoint behind the official ``openai`` client: a deadline, backoff, a circuit breaker.

A call has one deadline (``timeout``) covering every retry. 429, 5xx, timeouts and refused connections
are retried with exponential backoff (honouring ``Retry-After``) while time is left. A call that still
fails counts against the endpoint; ``failures_to_trip`` in a row open the breaker: the endpoint rests for
``cooldown`` seconds (doubling while it stays down), its operators step aside, and the run is told once.
The API key is read from the named environment variable at call time and kept nowhere else.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from evo.llm.settings import ModelSettings

__all__ = ["Answer", "LLMClient", "LLMUnavailable"]

_MAX_COOLDOWN = 600.0


class LLMUnavailable(Exception):
    """A call that produced no answer: endpoint down, deadline passed, breaker open, or a refused request."""


@dataclass
class Answer:
    """What a model said: text and/or tool calls (``[{"id", "name", "arguments"}]``), and its cost."""

    text: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tokens_in: int = 0
    tokens_out: int = 0
    latency_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "tool_calls": self.tool_calls, "tokens_in": self.tokens_in,
                "tokens_out": self.tokens_out}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Answer:
        return cls(text=d.get("text") or "", tool_calls=list(d.get("tool_calls") or []),
                   tokens_in=int(d.get("tokens_in", 0)), tokens_out=int(d.get("tokens_out", 0)))


class LLMClient:
    """Calls one model; thread-safe; at most ``max_concurrency`` calls in flight."""

    def __init__(self, settings: ModelSettings, *, cooldown: float = 30.0, failures_to_trip: int = 2,
                 note: Callable[[str], None] | None = None, closing: threading.Event | None = None) -> None:
        self.settings = settings
        self.name = settings.model
        self._cooldown, self._trip = cooldown, failures_to_trip
        self._note = note or (lambda msg: None)
        self._closing = closing or threading.Event()
        self._slots = threading.BoundedSemaphore(settings.max_concurrency)
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until = 0.0
        self._rest = cooldown
        self._down = False  # told the run it is down (told again only once it came back)
        self._client: Any = None
        self._client_key: str | None = None
        self._formats_refused = False  # the endpoint answered 400 to a response_format (structured_output: auto)
        self._choice_refused = False  # the endpoint answered 400 to tool_choice "required": tools are offered alone

    # --- the breaker ----------------------------------------------------------------------------

    def available(self) -> bool:
        """False while the endpoint rests after failures (a trial call is let through once it has rested)."""
        return time.monotonic() >= self._open_until

    def _succeeded(self) -> None:
        with self._lock:
            self._failures, self._rest = 0, self._cooldown
            was_down, self._down = self._down, False
        if was_down:
            self._note(f"llm: model {self.name} at {self.settings.base_url} answers again")

    def _failed(self, reason: str) -> None:
        with self._lock:
            self._failures += 1
            if self._failures < self._trip:
                return
            self._open_until = time.monotonic() + self._rest
            rest, self._rest = self._rest, min(self._rest * 2, _MAX_COOLDOWN)
            first, self._down = not self._down, True
        if first:
            self._note(f"llm: model {self.name} at {self.settings.base_url} is failing ({reason}); its operators "
                       f"rest {rest:.0f} s and retry later, the classical operators carry on")

    # --- a call ---------------------------------------------------------------------------------

    def response_format(self, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        """The ``response_format`` that asks this endpoint for JSON of ``schema``, or None where it is not asked
        (no schema, ``structured_output: off``, or an endpoint that refused one under ``auto``)."""
        mode = self.settings.structured_output
        if schema is None or mode == "off" or (mode == "auto" and self._formats_refused):
            return None
        return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}

    def chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
             response_format: dict[str, Any] | None = None) -> Answer:
        """One answer within ``settings.timeout`` seconds, retries included; :class:`LLMUnavailable` if none.
        Under ``structured_output: auto``, an endpoint that answers a ``response_format`` with 400 is asked again
        without it, and from then on never with one."""
        if not self.available():
            raise LLMUnavailable(f"{self.name} is resting after failures")
        try:
            answer = self._chat(messages, tools, response_format)
        except LLMUnavailable as exc:
            self._failed(str(exc))
            raise
        self._succeeded()
        return answer

    def _chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
              response_format: dict[str, Any] | None) -> Answer:  # fmt: skip
        import openai  # the optional extra "llm"

        s = self.settings
        t0 = time.monotonic()
        deadline = t0 + s.timeout
        if not self._slots.acquire(timeout=s.timeout):
            raise LLMUnavailable(f"no free slot for {self.name} within {s.timeout:g} s")
        try:
            attempt = 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0.05 or self._closing.is_set():
                    raise LLMUnavailable(f"no answer within the {s.timeout:g} s deadline")
                kw: dict[str, Any] = {"model": s.model, "messages": messages, "temperature": s.temperature,
                                      "max_tokens": s.max_tokens, "timeout": left}
                if tools:  # the agent's every turn is a call (a server that enforces it holds small models to one)
                    kw["tools"] = tools
                    if not self._choice_refused:
                        kw["tool_choice"] = "required"
                if response_format is not None:
                    kw["response_format"] = response_format
                try:
                    resp = self._openai().chat.completions.create(**kw)
                    return _answer(resp, time.monotonic() - t0)
                except (openai.RateLimitError, openai.InternalServerError, openai.APITimeoutError,
                        openai.APIConnectionError) as exc:
                    wait = _retry_after(exc) or min(8.0, 0.25 * 2**attempt) * (0.5 + random.random())
                    if time.monotonic() + wait >= deadline:
                        why = f"{_describe(exc)}; no answer within the {s.timeout:g} s deadline"
                        raise LLMUnavailable(why) from None
                    self._closing.wait(wait)
                    attempt += 1
                except openai.BadRequestError as exc:
                    if tools and not self._choice_refused and "tool_choice" in str(exc):
                        self._choice_refused = True  # asked again at once, and from now on, without it
                        self._note(f"llm: model {self.name} at {s.base_url} refused tool_choice required "
                                   f"({_describe(exc)}): tools are offered without it from now on")  # fmt: skip
                        continue
                    # only a 400 about the format itself turns it off (not one about the prompt's length, say)
                    if response_format is None or s.structured_output != "auto" or "response_format" not in str(exc):
                        raise LLMUnavailable(_describe(exc)) from None
                    self._formats_refused, response_format = True, None
                    self._note(f"llm: model {self.name} at {s.base_url} refused a response_format ({_describe(exc)}): "
                               "JSON is asked for in the prompt alone from now on")  # fmt: skip
                except openai.APIStatusError as exc:  # 4xx other than 429: retrying will not help
                    raise LLMUnavailable(_describe(exc)) from None
                except (openai.OpenAIError, ValueError, TypeError) as exc:  # an answer we cannot read
                    raise LLMUnavailable(f"unreadable answer: {exc}") from None
        finally:
            self._slots.release()

    def _openai(self) -> Any:
        import openai

        key = os.environ.get(self.settings.api_key_env, "") if self.settings.api_key_env else ""
        with self._lock:
            if self._client is None or key != self._client_key:
                # retries are ours (one deadline for all of them), not the library's
                self._client = openai.OpenAI(base_url=self.settings.base_url, api_key=key or "none", max_retries=0)
                self._client_key = key
            return self._client

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def _answer(resp: Any, latency: float) -> Answer:
    choice = resp.choices[0]
    msg = choice.message
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments or "{}"}
             for c in (msg.tool_calls or []) if getattr(c, "function", None) is not None]
    usage = resp.usage
    return Answer(text=msg.content or "", tool_calls=calls, latency_s=latency,
                  tokens_in=int(getattr(usage, "prompt_tokens", 0) or 0),
                  tokens_out=int(getattr(usage, "completion_tokens", 0) or 0))


def _retry_after(exc: Exception) -> float | None:
    response = getattr(exc, "response", None)
    value = response.headers.get("retry-after") if response is not None else None
    try:
        return min(float(value), 30.0) if value is not None else None
    except ValueError:
        return None


def _describe(exc: Exception) -> str:
    status = getattr(exc, "status_code", None)
    kind = type(exc).__name__
    return f"HTTP {status} ({kind})" if status else kind
