"""Model answers cached by prompt hash, so a resumed (or copied) run replays instead of paying twice.

The key is ``(prompt hash, slot)``: the n-th time a session asks the same prompt it gets slot n. A
resumed session asking a prompt the run already answered replays the stored answers in order and pays
only for asks beyond them, so sampling still yields fresh answers for repeated prompts. The answers are
loaded from the store when the run starts (operator threads never touch the store); new ones reach
the store with their call records, through the controller thread.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from typing import Any

from archive import Store
from evo.llm.client import Answer

__all__ = ["ResponseCache", "prompt_hash"]


def prompt_hash(model: str, messages: list[dict[str, Any]], *, temperature: float, max_tokens: int,
                tools: list[dict[str, Any]] | None = None, response_format: dict[str, Any] | None = None) -> str:
    """sha256 of what determines an answer (the endpoint's URL is not part of it: a moved server still hits)."""
    doc = {"model": model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens,
           "tools": tools or []}
    if response_format is not None:  # absent otherwise: answers stored before it existed keep their keys
        doc["response_format"] = response_format
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class ResponseCache:
    """In-memory view of ``llm_responses``; thread-safe."""

    def __init__(self, answers: dict[tuple[str, int], Answer] | None = None) -> None:
        self._answers = dict(answers or {})
        self._asked: Counter[str] = Counter()
        self._lock = threading.Lock()

    @classmethod
    def load(cls, store: Store) -> ResponseCache:
        return cls({(h, slot): Answer.from_json(r) for h, slot, r in store.llm_responses()})

    def claim(self, key: str) -> tuple[int, Answer | None]:
        """The slot of this ask of ``key`` and its stored answer, if any."""
        with self._lock:
            slot = self._asked[key]
            self._asked[key] += 1
            return slot, self._answers.get((key, slot))

    def put(self, key: str, slot: int, answer: Answer) -> None:
        with self._lock:
            self._answers[(key, slot)] = answer

    def __len__(self) -> int:
        return len(self._answers)
