"""The search controller: asynchronous steady-state MAP-Elites.

The loop, in one screen (see :meth:`Search.run`): keep every worker busy with a proposal, and as
each result arrives commit it, place it in the archive, and report. Policies live elsewhere:
selection (:mod:`evo.selection`), operators (:mod:`evo.operators`), budgets (:mod:`evo.budget`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from archive import AddStatus, Candidate, Store
from evo.budget import Budget
from evo.config import RunConfig
from evo.operators import Operator, ProposalContext, RandomSample, build_operators
from evo.reporting import Reporter, SilentReporter
from evo.rundir import RunDir, build_archive
from evo.selection import Curiosity, select_parents
from genome import Genome
from runtime import EvalRequest, EvalResult, Executor, Status, Task

__all__ = ["RunSummary", "Search"]

log = logging.getLogger("evo.search")


@dataclass
class RunSummary:
    run_dir: Path
    evaluations: int  # in the whole run, earlier sessions included
    this_session: int
    elapsed: float
    stopped: str
    counts: dict[str, int]
    best: Candidate | None
    qd: dict[str, float]
    duplicates: int = 0
    resumed_pending: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Search:
    """One run of the search over a run directory (new, or resumed)."""

    def __init__(
        self,
        config: RunConfig,
        run_dir: RunDir,
        *,
        executor: Executor | None = None,
        reporter: Reporter | None = None,
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.task: Task = config.make_task()
        self.space = config.make_space(self.task)
        self.store: Store = run_dir.store
        self.archive = build_archive(config, self.task, self.store)
        self.reporter = reporter or SilentReporter()
        self.workers = config.search.workers or len(os.sched_getaffinity(0))
        self._executor = executor
        self.operators: dict[str, Operator] = build_operators(config.search.operators)
        weights = np.array([config.search.operators.weights[n] for n in self.operators], dtype=float)
        self._op_names = list(self.operators)
        self._op_p = weights / weights.sum()
        self.curiosity = Curiosity()
        self._genomes: dict[str, Genome] = {}
        self._best: Candidate | None = None
        self._parents: dict[str, list[str]] = {}
        self.duplicates = 0
        self._evaluated = 0
        self._session = 0

    # --- the loop -------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        budget = Budget(self.config.budget)
        self._replay()
        queue = self._requeue_pending()
        resumed = len(queue)
        queue += self._initial_population()
        executor = self._executor or self.run_dir.make_pool(self.workers)
        self.reporter.start(total=self.config.budget.max_evals, done=self._evaluated, workers=self.workers)
        last_snapshot = 0.0
        stopped = ""
        try:
            while True:
                while executor.in_flight < self.workers and budget.may_submit(self._evaluated, executor.in_flight):
                    cand = queue.pop(0) if queue else self._propose()
                    if cand is None:
                        break
                    executor.submit(self._request(cand))
                if executor.in_flight == 0:
                    stopped = budget.exhausted(self._evaluated, self._best_fitness()) or "no new candidate found in max_dedup_tries proposals (the space may be exhausted)"
                    break
                item = executor.next_result(timeout=0.5)
                if item is not None:
                    self._commit(*item)
                if time.monotonic() - last_snapshot > 5.0:
                    self._snapshot(budget.elapsed())
                    last_snapshot = time.monotonic()
                reason = budget.exhausted(self._evaluated, self._best_fitness())
                if reason and not budget.may_submit(self._evaluated, 0):
                    # let in-flight work finish only when the evaluation budget is what ran out
                    if reason.startswith("reached max_evals") and executor.in_flight:
                        continue
                    stopped = reason
                    break
        finally:
            if self._executor is None:
                executor.close()
        self._snapshot(budget.elapsed())
        summary = RunSummary(
            run_dir=self.run_dir.path,
            evaluations=self._evaluated,
            this_session=self._session,
            elapsed=budget.elapsed(),
            stopped=stopped,
            counts=self.store.counts_by_status(),
            best=self._best,
            qd=self._qd(),
            duplicates=self.duplicates,
            resumed_pending=resumed,
        )
        self.reporter.finish(summary)
        return summary

    # --- proposals ------------------------------------------------------------------------------

    def _initial_population(self) -> list[Candidate]:
        """The task's seeds and ``initial_random`` samples, each derived from (seed, index)."""
        out = []
        genomes = [(g, "seed") for g in self.task.seeds()]
        seed = self.config.search.seed
        for i in range(self.config.search.initial_random):
            rng = np.random.default_rng([seed, 0, i])
            genomes.append((Genome(params=self.space.sample(rng)), "random"))
        for genome, op in genomes:
            cand = self._add_pending(genome, [], op)
            if cand is not None:
                out.append(cand)
        return out

    def _propose(self) -> Candidate | None:
        """Selects parents, applies a weighted operator; retries on duplicates up to a limit."""
        for _ in range(self.config.search.max_dedup_tries):
            counter = int(self.store.get_meta("proposals") or 0)
            self.store.set_meta("proposals", str(counter + 1))
            rng = np.random.default_rng([self.config.search.seed, 1, counter])
            ctx = ProposalContext(space=self.space, rng=rng)
            elites = self.archive.elites()
            name = self._op_names[int(rng.choice(len(self._op_names), p=self._op_p))]
            op = self.operators[name]
            if not elites or op.arity == 0:
                op = self.operators.get("random") or RandomSample()
                parents: list[Any] = []
            else:
                parents = select_parents(elites, op.arity, rng, self.config.search.selection, self.curiosity)
            child = op.propose([self._genome(p.id) for p in parents], ctx)
            if child is None:
                continue
            cand = self._add_pending(child, [p.id for p in parents], op.name)
            if cand is not None:
                return cand
            self.duplicates += 1
        log.warning("no new candidate after %d tries (duplicates or invalid children)",
                    self.config.search.max_dedup_tries)
        return None

    def _add_pending(self, genome: Genome, parents: list[str], operator: str) -> Candidate | None:
        """Writes the candidate as pending before it is evaluated; ``None`` if its id is already stored."""
        if not self.store.add_pending(genome=genome, parents=parents, operator=operator):
            return None
        self._parents[genome.id] = parents
        self._genomes[genome.id] = genome
        return self.store.get(genome.id)

    def _genome(self, cid: str) -> Genome:
        if cid not in self._genomes:
            cand = self.store.get(cid)
            assert cand is not None, cid
            self._genomes[cid] = cand.genome
        return self._genomes[cid]

    def _request(self, cand: Candidate) -> EvalRequest:
        return EvalRequest(
            key=cand.id,
            genome=cand.genome,
            task=self.config.task,
            settings=self.config.evaluation,
            cache_dir=str(self.run_dir.cache_dir),
            sys_path=tuple(p for p in sys.path if p),
        )

    # --- results --------------------------------------------------------------------------------

    def _commit(self, request: EvalRequest, result: EvalResult) -> None:
        descriptors = self._describe(request.genome, result)
        self.store.record_result(request.key, result, descriptors=descriptors)
        status = self._place(request.key, result, descriptors)
        self._evaluated += 1
        self._session += 1
        self.reporter.update(result=result, add_status=status, best=self._best_fitness(), qd=self._qd())

    def _place(self, cid: str, result: EvalResult, descriptors: dict[str, float]) -> AddStatus:
        """Adds an ok result to the archive and updates curiosity and the best candidate."""
        if result.status != Status.OK or result.fitness is None:
            status = AddStatus.NOT_ADDED
        else:
            vec = [descriptors[n] for n in self.config.archive.descriptors]
            status = self.archive.add(cid, result.fitness, vec)
            if self._best is None or result.fitness > (self._best.fitness or 0.0):
                self._best = self.store.get(cid)
        parents = self._parents.pop(cid, None)
        if parents is None:
            cand = self.store.get(cid)
            parents = list(cand.parents) if cand else []
        self.curiosity.update(parents, status != AddStatus.NOT_ADDED)
        return status

    def _describe(self, genome: Genome, result: EvalResult) -> dict[str, float]:
        if result.status != Status.OK:
            return {}
        offered = self.task.descriptors()
        return {n: float(offered[n].fn(genome, result.metrics)) for n in self.config.archive.descriptors}

    def _replay(self) -> None:
        """Rebuilds archive, curiosity and best from the store (a resumed run continues where it was)."""
        for cand in self.store.evaluated():
            self._evaluated += 1
            result = EvalResult(status=Status(cand.status), fitness=cand.fitness)
            self._parents[cand.id] = list(cand.parents)
            self._place(cand.id, result, cand.descriptors)

    def _requeue_pending(self) -> list[Candidate]:
        pending = self.store.pending()
        for cand in pending:
            self._parents[cand.id] = list(cand.parents)
        if pending:
            log.info("re-queued %d pending candidates", len(pending))
        return pending

    # --- stats ----------------------------------------------------------------------------------

    def _best_fitness(self) -> float | None:
        return self._best.fitness if self._best else None

    def _qd(self) -> dict[str, float]:
        s = self.archive.stats(qd_offset=self.config.archive.qd_offset)
        return {"coverage": s.coverage, "qd_score": s.qd_score, "best": s.best or 0.0, "mean": s.mean or 0.0,
                "filled": s.filled}

    def _snapshot(self, elapsed: float) -> None:
        qd = self._qd()
        self.store.add_qd_snapshot(evals=self._evaluated, elapsed_s=elapsed, coverage=qd["coverage"],
                                   qd_score=qd["qd_score"], best=qd["best"], mean=qd["mean"])

