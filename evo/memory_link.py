"""How a search uses the memory of discoveries: seeds at start, hints for prompts, novelty, and recording.

Recording is batched on a background thread (embedding stays off the evaluation path); everything else
is called from the controller. Without the ``memory`` extra installed the search goes on without it and
says so once.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from archive import Candidate
from archive.memory import MemorySettings
from genome import Genome, ParamSpace
from runtime import EvalResult, Status, Task

__all__ = ["MemoryLink"]

log = logging.getLogger("evo.memory")

_FLUSH_SECONDS = 5.0


class MemoryLink:
    def __init__(self, memory: Any, settings: MemorySettings, task: Task, run: str) -> None:
        from archive.memory import NoveltyFilter

        self.memory = memory
        self.settings = settings
        self.task = task
        self.run = run
        self.novelty = NoveltyFilter(memory.embedder, settings.novelty_threshold)
        self.seeded_from: dict[str, int] = {}  # run -> seeds it gave this run
        self.recorded = 0
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._record_loop, name="evo-memory", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, settings: MemorySettings, task: Task, run: str, note: Callable[[str], None]) -> MemoryLink | None:
        """The memory named by ``settings``, or ``None`` (disabled, or its packages are missing: said once)."""
        if not settings.enabled:
            return None
        memory = None
        try:
            from archive.memory import Memory

            memory = Memory(settings.resolved_path(), settings=settings)
            return cls(memory, settings, task, run)  # its novelty filter needs faiss as well
        except ImportError as exc:
            if memory is not None:
                memory.close()
            note(f"memory disabled: {exc.name or exc} is not installed (pip install 'evoforge[memory]')")
            return None

    # --- at the start ---------------------------------------------------------------------------

    def seeds(self, space: ParamSpace, hardware: dict[str, Any], seed: int, *,
              max_evals: int | None = None) -> list[Genome]:
        """The nearest past discoveries for this task and machine, mapped into ``space``: ``seed_k`` of them, and
        at most a quarter of a run's ``max_evals`` (one at least), so that the run's own seeds and what it finds
        keep most of a small budget."""
        from archive.memory import seed_genomes

        args = self.task.args.model_dump(mode="json")
        k = self.settings.seed_k if max_evals is None else min(self.settings.seed_k, max(1, max_evals // 4))
        hits = self.memory.nearest_for_task(self.task.name, args, hardware, k=k)
        out = seed_genomes(hits, self.task, space, np.random.default_rng([seed, 2]))
        for _, run in out:
            self.seeded_from[run] = self.seeded_from.get(run, 0) + 1
        return [g for g, _ in out]

    # --- during the run -------------------------------------------------------------------------

    def hints(self, parents: Sequence[Candidate]) -> list[Any]:
        """Memory hits for the parents of a model-backed proposal (what to show in its prompt)."""
        if not parents or self.settings.prompt_hits <= 0:
            return []
        p = parents[0]
        text = f"{self.task.name} {self.task.description} " + " ".join(f"{k}={v}" for k, v in p.params.items())
        return self.memory.search(text, k=self.settings.prompt_hits, task=self.task.name)

    def search(self, text: str, k: int = 5) -> list[Any]:
        return self.memory.search(text, k=k)

    def is_novel(self, genome: Genome, parent_sources: Sequence[str | None]) -> bool:
        """False for new code within ``novelty_threshold`` of code already evaluated in this run.

        Only new source is judged: a child that keeps its parent's source differs in params alone.
        """
        from archive.memory import code_text

        if genome.source is None or genome.source in parent_sources or self.settings.novelty_threshold is None:
            return True
        return self.novelty.is_novel(code_text(genome.source))

    def record(self, cand: Candidate, result: EvalResult, improved: bool) -> None:
        """Remembers an improvement (or a failed code change); the memory writes them in batches."""
        from archive.memory import MemoryEntry, code_text, summary_text

        if cand.genome.source is not None:
            self.novelty.add(code_text(cand.genome.source))  # evaluated code: later near-copies are rejected
        if cand.genome.source is not None and result.status != Status.OK:
            kind, note = "failure", f"{result.status}: {(result.error or '')[:200]}"
        elif improved and result.status == Status.OK:
            kind, note = "improvement", ""
        else:
            return
        args = self.task.args.model_dump(mode="json")
        vs = result.metrics.get("vs_reference")
        summary = summary_text(task=self.task.name, task_args=args, genome=cand.genome, hardware=result.hardware,
                               fitness=result.fitness, unit=result.unit, vs_reference=vs, kind=kind, note=note,
                               description=self.task.description)
        self._queue.put(MemoryEntry(
            task=self.task.name, task_args=args, genome=cand.genome, kind=kind, backend=self.task.backend,
            signature=self.task.signature, hardware=result.hardware or {}, fitness=result.fitness, unit=result.unit,
            vs_reference=vs, note=note, summary=summary, run=self.run,
        ))  # fmt: skip

    def close(self) -> None:
        """Writes what is queued and stops the recorder."""
        self._queue.put(None)
        self._thread.join(timeout=120)
        self.memory.close()

    def _record_loop(self) -> None:
        batch: list[Any] = []
        done = False
        while not done:
            try:
                item = self._queue.get(timeout=_FLUSH_SECONDS)
            except queue.Empty:
                item = "flush"
            if item is None:
                done = True
            elif item != "flush":
                batch.append(item)
            if batch and (item in ("flush", None) or len(batch) >= 64):
                try:
                    self.recorded += self.memory.add(batch)
                except Exception:  # noqa: BLE001 - the memory is an aid: never the reason a run stops
                    log.exception("could not record %d memory entries", len(batch))
                batch = []
