"""What the LLM operators of one run share: the models, the response cache, the token budget, notes.

``ask`` is the one way an operator talks to a model: it picks a model by weight among those not resting,
replays a cached answer when the run has one for this prompt (and slot), and otherwise calls, within
the token budget. It returns the answer (or ``None``) and a :class:`Draft` the operator completes with
the outcome; drafts become ``llm_calls`` rows through the proposal's ``on_commit``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from archive import LLMCall
from evo.llm.cache import ResponseCache, prompt_hash
from evo.llm.client import Answer, LLMClient, LLMUnavailable
from evo.llm.settings import LLMSettings

__all__ = ["Draft", "LLMSession"]


@dataclass
class Draft:
    """A call waiting for its outcome."""

    model: str
    prompt_hash: str = ""
    slot: int = 0
    cached: bool = False
    answer: Answer | None = None
    outcome: str = "error"
    reason: str | None = None
    transcript: Any = None
    latency_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def record(self, *, proposal: str, operator: str, candidate_id: str | None) -> LLMCall:
        a = self.answer
        return LLMCall(
            proposal=proposal, operator=operator, model=self.model, prompt_hash=self.prompt_hash, slot=self.slot,
            cached=self.cached, tokens_in=0 if a is None or self.cached else a.tokens_in,
            tokens_out=0 if a is None or self.cached else a.tokens_out, latency_s=self.latency_s,
            outcome=self.outcome, reason=self.reason, candidate_id=candidate_id, transcript=self.transcript,
            response=None if a is None else a.to_json(),
        )


class LLMSession:
    """The models, cache and budget of a run; thread-safe (operators call it from the proposer's threads)."""

    def __init__(self, settings: LLMSettings, *, cache: ResponseCache, tokens_used: int = 0,
                 note: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        self.cache = cache
        self._note = note or (lambda msg: None)
        self.closing = threading.Event()
        self.clients = [LLMClient(m, cooldown=settings.cooldown, failures_to_trip=settings.failures_to_trip,
                                  note=self._note, closing=self.closing) for m in settings.models]
        self._lock = threading.Lock()
        self.tokens_used = tokens_used
        self._told: set[str] = set()

    def note_once(self, key: str, message: str) -> None:
        with self._lock:
            if key in self._told:
                return
            self._told.add(key)
        self._note(message)

    def available(self) -> bool:
        """Whether an ask may succeed now: budget left and a model not resting."""
        if self.closing.is_set() or self._over_budget():
            return False
        return any(c.available() for c in self.clients)

    def _over_budget(self) -> bool:
        budget = self.settings.token_budget
        return budget is not None and self.tokens_used >= budget

    def sends_schema(self) -> bool:
        """Whether every model would be sent an answer's JSON schema now (``structured_output`` on, or auto and not
        refused yet): a prompt may then describe the JSON the endpoint enforces."""
        return all(c.response_format({"type": "object"}) is not None for c in self.clients)

    def ask(self, messages: list[dict[str, Any]], rng: np.random.Generator,
            tools: list[dict[str, Any]] | None = None, schema: dict[str, Any] | None = None) -> Draft:
        """One answer for ``messages`` (``draft.answer`` is ``None`` with ``draft.reason`` when there is none);
        ``schema``: the JSON schema a JSON answer follows, sent where the model's endpoint enforces one."""
        live = [c for c in self.clients if c.available()] or self.clients
        weights = np.array([c.settings.weight for c in live], dtype=float)
        client = live[int(rng.choice(len(live), p=weights / weights.sum()))]
        s = client.settings
        response_format = client.response_format(schema)
        key = prompt_hash(s.model, messages, temperature=s.temperature, max_tokens=s.max_tokens, tools=tools,
                          response_format=response_format)  # fmt: skip
        slot, cached = self.cache.claim(key)
        draft = Draft(model=s.model, prompt_hash=key, slot=slot)
        if cached is not None:
            draft.answer, draft.cached, draft.outcome = cached, True, "answered"
            return draft
        if self._over_budget():
            draft.reason = "token budget spent"
            self.note_once("budget", f"llm: token budget of {self.settings.token_budget} spent: LLM operators stop")
            return draft
        try:
            answer = client.chat(messages, tools=tools, response_format=response_format)
        except LLMUnavailable as exc:
            draft.reason = str(exc)
            return draft
        with self._lock:
            self.tokens_used += answer.tokens_in + answer.tokens_out
        self.cache.put(key, slot, answer)
        draft.answer, draft.latency_s, draft.outcome = answer, answer.latency_s, "answered"
        return draft

    def close(self) -> None:
        self.closing.set()
        for c in self.clients:
            c.close()
