"""The store's records of model calls (``llm_calls``) and its cache of their answers (``llm_responses``).

A mixin of :class:`archive.Store`, kept apart so the candidate store reads on its own. Outcomes of a
proposal's calls progress as its child is judged: ``applied`` -> ``compiled`` -> ``correct`` ->
``improved``; ``rejected``, ``error``, ``duplicate`` and ``step`` (an agent's intermediate turn) stay.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

__all__ = ["OUTCOME_RANK", "LLMCall", "LLMRecords"]

OUTCOME_RANK = {"applied": 1, "compiled": 2, "correct": 3, "improved": 4}
"""Outcomes a child moves through; a higher one implies the lower ones."""


@dataclass(frozen=True, kw_only=True)
class LLMCall:
    """One model call as recorded (``cached``: replayed from the store, nothing paid)."""

    proposal: str
    operator: str
    model: str
    prompt_hash: str
    slot: int
    cached: bool
    tokens_in: int
    tokens_out: int
    latency_s: float
    outcome: str
    reason: str | None = None
    candidate_id: str | None = None
    transcript: Any = None
    response: dict[str, Any] | None = None  # stored in llm_responses when not cached (None: no answer)


class LLMRecords:
    """``llm_calls`` and ``llm_responses`` methods of the store (see :class:`archive.Store`)."""

    _conn: sqlite3.Connection

    def _write(self) -> AbstractContextManager[sqlite3.Connection]:  # provided by Store
        raise NotImplementedError

    def record_llm_calls(self, calls: Sequence[LLMCall]) -> None:
        """Stores calls, and the answers paid for, in one transaction."""
        now = time.time()
        with self._write() as c:
            for k in calls:
                c.execute(
                    "INSERT INTO llm_calls (at, proposal, operator, model, prompt_hash, slot, cached, tokens_in,"
                    " tokens_out, latency_s, outcome, reason, candidate_id, transcript)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (now, k.proposal, k.operator, k.model, k.prompt_hash, k.slot, int(k.cached), k.tokens_in,
                     k.tokens_out, k.latency_s, k.outcome, k.reason, k.candidate_id,
                     None if k.transcript is None else json.dumps(k.transcript)),
                )
                if k.response is not None and not k.cached:
                    c.execute(
                        "INSERT INTO llm_responses (prompt_hash, slot, model, response, created_at)"
                        " VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                        (k.prompt_hash, k.slot, k.model, json.dumps(k.response), now),
                    )

    def llm_responses(self) -> Iterator[tuple[str, int, dict[str, Any]]]:
        """Every cached answer as ``(prompt_hash, slot, response)``."""
        for h, slot, text in self._conn.execute("SELECT prompt_hash, slot, response FROM llm_responses"):
            yield h, slot, json.loads(text)

    def llm_tokens_used(self) -> int:
        """Tokens paid for so far in this run (cached replays cost nothing)."""
        row = self._conn.execute("SELECT COALESCE(SUM(tokens_in + tokens_out), 0) FROM llm_calls WHERE cached = 0")
        return int(row.fetchone()[0])

    def advance_llm_outcome(self, candidate_id: str, outcome: str) -> None:
        """Moves the calls that produced ``candidate_id`` forward to ``outcome`` (never backwards)."""
        rank = OUTCOME_RANK[outcome]
        lower = [o for o, r in OUTCOME_RANK.items() if r < rank]
        with self._write() as c:
            marks = ",".join("?" * len(lower))
            c.execute(f"UPDATE llm_calls SET outcome = ? WHERE candidate_id = ? AND outcome IN ({marks})",
                      (outcome, candidate_id, *lower))

    def llm_calls(self, *, operator: str | None = None) -> list[dict[str, Any]]:
        """Recorded calls in order, as dicts (for tests and inspection)."""
        cur = self._conn.execute(
            "SELECT * FROM llm_calls" + (" WHERE operator = ?" if operator else "") + " ORDER BY seq",
            (operator,) if operator else (),
        )
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]

    def llm_stats(self, by: str = "model") -> dict[str, dict[str, int]]:
        """Per ``model`` or ``operator``: proposals, applied, compiled, correct, improved, calls, cached, tokens."""
        if by not in ("model", "operator"):
            raise ValueError("by must be 'model' or 'operator'")
        if getattr(self, "schema_version", 2) < 2:  # stored before model calls were kept
            return {}
        stages = {s: [o for o, r in OUTCOME_RANK.items() if r >= rank] for s, rank in OUTCOME_RANK.items()}
        cols = ", ".join(
            f"COUNT(DISTINCT CASE WHEN outcome IN ({','.join(repr(o) for o in outs)}) THEN proposal END)"
            for outs in stages.values()
        )
        rows = self._conn.execute(
            f"SELECT {by}, COUNT(DISTINCT proposal), {cols}, COUNT(*), SUM(cached), SUM(tokens_in), SUM(tokens_out)"
            f" FROM llm_calls GROUP BY {by} ORDER BY {by}"
        )
        keys = ["proposals", *stages, "calls", "cached", "tokens_in", "tokens_out"]
        return {r[0]: dict(zip(keys, (int(v or 0) for v in r[1:]), strict=True)) for r in rows}
