"""The agent's tools: compile, test and benchmark in the sandboxed runtime; read the archive and memory.

Evaluations go to a dedicated one-worker :class:`runtime.executors.LocalPool` (the search's workers stay
with the search) with partial cascades: ``compile`` stops after compiling, ``test`` after the checks,
``benchmark`` times too (under the machine-wide timing lock, like every candidate).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from archive import Run, StoreError
from evo.llm.prompt import candidate_section, result_line, shorten
from genome import Genome
from runtime import EvalRequest, EvalResult, Status, Task

__all__ = ["TOOL_SPECS", "SandboxTools", "tool_specs"]

MakeRequest = Callable[[Genome, str, str], EvalRequest]
"""``(genome, key, stages) -> EvalRequest`` for the run's task and evaluation settings."""


_SHORT = 200
"""The longest summary, id or query (a server that enforces the schema closes the string there: a small model that
repeats itself still ends its call)."""


def _spec(name: str, doc: str, *, optional: tuple[str, ...] = (), lines: list[str] | None = None,
          **props: str) -> dict[str, Any]:
    def prop(key: str, doc: str) -> dict[str, Any]:
        if key in ("from", "to") and lines is not None:  # the draft's own lines: a server that enforces it names one
            return {"description": doc, "enum": lines}
        return {"type": "string", "description": doc, **({} if key in ("source", "replace") else {"maxLength": _SHORT})}

    return {"type": "function", "function": {
        "name": name, "description": doc,
        "parameters": {"type": "object", "properties": {k: prop(k, v) for k, v in props.items()},
                       "required": [k for k in props if k not in optional]}}}


_SOURCE = "the whole kernel source (only evolve blocks may differ from the parent's); default: your draft"
_LINE = "a line of your draft, copied exactly, inside an evolve block, found once"


def tool_specs(with_memory: bool, lines: list[str] | None = None) -> list[dict[str, Any]]:
    """The tools offered (``search_memory`` only when a memory exists); ``lines``: the draft's lines an edit may
    name (see :func:`evo.llm.diff.anchor_lines`), ``None`` to leave them free."""
    code = {"source": _SOURCE}
    return [
        _spec("edit", "Replace lines from..to (both included) of your draft (the parent's source at first) by "
              "replace; returns the lines as they now read.", lines=lines, **{"from": _LINE, "to": _LINE,
              "replace": "the new lines, \\n between them"}),  # fmt: skip
        _spec("compile", "Compile a kernel source; returns the compiler's errors, if any.", optional=("source",),
              **code),
        _spec("test", "Compile a kernel and check it against the reference (no timing).", optional=("source",),
              **code),
        _spec("benchmark", "Compile, check and time a kernel: fitness and vs_reference.", optional=("source",),
              **code),
        _spec("show_candidate", "Show a stored candidate: source, results, lineage.", id="candidate id or prefix"),
        *([_spec("search_memory", "Search past discoveries of earlier runs.", query="what to look for")]
          if with_memory else []),
        _spec("commit", "Submit the final kernel; ends the session.", optional=("source",), **code,
              summary="one line: what changed and why it is faster"),
    ]  # fmt: skip


TOOL_SPECS = tool_specs(False)
"""The tools without a memory, an edit's lines left free."""


class SandboxTools:
    """Runs the agent's tools; thread-safe (evaluations are serialised on the one tool worker)."""

    def __init__(self, *, task: Task, make_request: MakeRequest, run_dir: Path, log_dir: Path,
                 memory: Callable[[str], Sequence[Any]] | None = None) -> None:
        self.task, self.make_request, self.run_dir, self.log_dir = task, make_request, run_dir, log_dir
        self.memory = memory
        self._pool: Any = None
        self._lock = threading.Lock()
        self._keys = itertools.count()
        self._closed = False

    def evaluate(self, genome: Genome, stages: str) -> EvalResult:
        from runtime.executors import LocalPool

        with self._lock:
            if self._closed:
                return EvalResult(status=Status.INVALID, error="the run is ending")
            if self._pool is None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                self._pool = LocalPool(workers=1, log_dir=str(self.log_dir))
            request = self.make_request(genome, f"tool-{next(self._keys)}", stages)
            self._pool.submit(request)
            limit = time.monotonic() + request.settings.sandbox.timeout + 60
            while time.monotonic() < limit:
                item = self._pool.next_result(timeout=0.5)
                if item is not None:
                    return item[1]
                if self._closed:
                    return EvalResult(status=Status.INVALID, error="the run is ending")
            return EvalResult(status=Status.TIMEOUT, error="the tool worker gave no result in time")

    def compile(self, genome: Genome) -> str:
        r = self.evaluate(genome, "compile")
        return "compiled without errors" if r.status == Status.OK else _failure(r)

    def test(self, genome: Genome) -> str:
        r = self.evaluate(genome, "check")
        return "correct: passed every check against the reference" if r.status == Status.OK else _failure(r)

    def benchmark(self, genome: Genome) -> str:
        r = self.evaluate(genome, "full")
        if r.status != Status.OK or r.fitness is None:
            return _failure(r)
        vs = r.metrics.get("vs_reference")
        return f"ok: fitness {r.fitness:.3f} {r.unit}" + (f", vs_reference {vs:.3f}x" if vs is not None else "")

    def show_candidate(self, cid: str) -> str:
        try:
            with Run.open(self.run_dir) as run:  # a reader of its own, in this thread
                store = run.store
                cand = store.get(cid)
                if cand is None:
                    return f"no candidate {cid!r}"
                lineage = store.lineage(cand.id)[1:6]
        except (StoreError, KeyError) as exc:
            return f"error: {exc}"
        text = candidate_section(cand, self.task, title="Candidate")
        if lineage:
            text += "\nLineage: " + " <- ".join(f"{a.id[:12]} ({a.operator}, {result_line(a)})" for a in lineage)
        return text

    def search_memory(self, query: str) -> str:
        if self.memory is None:
            return "error: no memory in this run"
        hits = list(self.memory(query))
        if not hits:
            return "no past discovery matches"
        lines = []
        for h in hits[:5]:
            entry = getattr(h, "entry", h)
            lines.append(f"- {getattr(entry, 'summary', entry)} (score {getattr(h, 'score', 0.0):.2f})")
        return "\n".join(lines)

    def close(self) -> None:
        self._closed = True  # an evaluation in progress gives up within half a second
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None


def _failure(r: EvalResult) -> str:
    return f"{r.status}: {shorten(r.error or 'no details')}"


def parse_arguments(raw: str) -> dict[str, Any]:
    """A tool call's arguments; ``ValueError`` when they are not one JSON object."""
    value = json.loads(raw or "{}")
    if not isinstance(value, dict):
        raise ValueError("arguments must be a JSON object")
    return value
