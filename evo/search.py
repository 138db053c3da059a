"""The search controller: asynchronous steady-state MAP-Elites.

The loop, in one screen (see :meth:`Search.run`): keep every worker busy with a candidate, and as
each result arrives commit it, place it in the archive, tell the proposer, and report. Policies live
elsewhere, each in a collaborator with a module of its own: proposals (:mod:`evo.proposer`: selection,
operators, dedup, asked and told), duels (:mod:`evo.duel`), offers of followed runs (:mod:`evo.offers`),
confirmation (:mod:`evo.confirm`), budgets (:mod:`evo.budget`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from archive import AddStatus, Candidate, Run, Store, StoreError, rebuild_archive
from evo.budget import Budget
from evo.config import RunConfig
from evo.confirm import Confirmation
from evo.duel import Challenges
from evo.memory_link import MemoryLink
from evo.offers import Offers
from evo.operators import Operator, build_operators
from evo.progress import Reporter, SilentReporter
from evo.proposer import Proposer
from evo.rundir import build_archive, make_pool
from genome import Genome
from runtime import EvalRequest, EvalResult, Executor, Status, Task, backend_for
from runtime.followed_runs import FollowsRuns

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
    """One run of the search over a run directory (new, or resumed): the loop, and its collaborators
    (:class:`Proposer` asked and told, :class:`Challenges`, :class:`Offers`, :class:`Confirmation`)."""

    def __init__(
        self,
        config: RunConfig,
        run: Run,
        *,
        executor: Executor | None = None,
        reporter: Reporter | None = None,
        operators: dict[str, Operator] | None = None,
        weights: dict[str, float] | None = None,
    ) -> None:
        self.config = config
        self.stored_run = run
        self.task: Task = config.make_task()
        self.space = config.make_space(self.task)
        self.store: Store = run.store
        self.archive = build_archive(config, self.task, self.store)
        self.reporter = reporter or SilentReporter()
        self.workers = config.search.workers or len(os.sched_getaffinity(0))
        self._executor = executor
        self.memory = MemoryLink.open(config.memory, self.task, str(run.path.resolve()), self.reporter.note)
        self.proposer = Proposer(
            config=config, task=self.task, space=self.space, store=self.store, archive=self.archive,
            operators=operators or {**build_operators(config.search.operators), **self._llm_operators()},
            weights=weights or dict(config.search.operators.weights),
            max_blocking=sum(m.max_concurrency for m in config.llm.models) if config.llm else 2,
            hints=self.memory.hints if self.memory else None,
            novelty=self.memory.is_novel if self.memory else None,
            novelty_limit=config.memory.novelty_max_resamples,
        )
        self.challenges = Challenges(enabled=backend_for(self.task).supports("duel"))
        self.offers = Offers(run, self.reporter.note)
        self.confirmation = Confirmation(config.search.confirm, self.store, self.task.unit, self.reporter.note)
        self._best: Candidate | None = None
        self._evaluated = 0
        self._unmeasured_seeds: set[str] = set()  # the task's seeds not yet measured: offers wait for them
        self._session = 0

    def _llm_operators(self) -> dict[str, Operator]:
        """Model-backed operators, when the config has an ``llm:`` section (see evo.llm)."""
        if self.config.llm is None:
            return {}
        from evo.llm.build import build_llm_operators

        def note(message: str) -> None:
            log.warning("%s", message)
            self.reporter.note(message)

        return dict(build_llm_operators(self.config, store=self.store, task=self.task,
                                        cache_dir=self.stored_run.cache_dir, log_dir=self.stored_run.log_dir, note=note,
                                        memory=self.memory.search if self.memory else None,
                                        current=lambda: self.config))

    # --- the loop -------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        budget = Budget(self.config.budget)
        self._replay()
        queue = self._requeue_pending()
        resumed = len(queue)
        queue += self._initial_population()
        # a fresh run's offers wait for its seeds; a resumed one has measured its best already, and a grown task's
        # new seeds must not hold back the offers of a session whose budget they could fill
        self._unmeasured_seeds = {c.id for c in queue if c.operator == "seed"} if not self._evaluated else set()
        executor = self._executor or make_pool(self.stored_run, self.workers, self.config.execution,
                                               self.config.evaluation.compiler.cc, backend_for(self.task))
        self.workers = executor.slots  # a cluster's slots are its nodes'
        self._start(budget, len(queue), resumed)
        last_snapshot, stopped = 0.0, ""
        try:
            while True:
                if not self._unmeasured_seeds:  # an offer builds on the best measured: the task's seeds come first
                    queue[:0] = self._new_offers()  # then what a new offer makes possible goes first
                queue += self.proposer.harvest()
                while executor.in_flight < self.workers and budget.may_submit(self._evaluated, executor.in_flight):
                    cand = queue.pop(0) if queue else self.proposer.propose()
                    if cand is None:
                        break
                    executor.submit(self._request(cand))
                if executor.in_flight == 0 and not self.proposer.waiting:
                    stopped = budget.exhausted(self._evaluated, self._best_fitness()) or (
                        "no new candidate found in max_dedup_tries proposals (the space may be exhausted)")
                    break
                item = executor.next_result(timeout=0.5 if executor.in_flight else 0.05)
                if item is not None:
                    self._commit(executor, *item)
                if time.monotonic() - last_snapshot > 5.0:
                    self._snapshot(budget.elapsed())
                    last_snapshot = time.monotonic()
                reason = budget.exhausted(self._evaluated, self._best_fitness())
                if reason and not budget.may_submit(self._evaluated, 0):
                    # in-flight work finishes when the evaluation budget ran out; not past a time limit
                    if reason.startswith("reached max_evals") and executor.in_flight:
                        continue
                    stopped = reason
                    break
            self._confirm(executor)
        finally:
            self.challenges.close()
            for request, result in self.challenges.abandon():
                self._finish(request, result)
            self.proposer.close()
            if self.memory:
                self.memory.close()
            if self._executor is None:
                executor.close()
        self._snapshot(budget.elapsed())
        return self._summary(budget, stopped, resumed)

    def _start(self, budget: Budget, queued: int, resumed: int) -> None:
        self.reporter.start(total=self.config.budget.max_evals, done=self._evaluated, workers=self.workers)
        self.reporter.note(
            f"run dir {self.stored_run.path}: task {self.task.name} {_brief(self.config.task.args)}, "
            f"{self.workers} workers, {queued} queued ({resumed} resumed), fitness in {self.task.unit}"
        )
        if self.config.llm is None:
            self.reporter.note("no llm: section in the config: the search runs on classical operators only")

    def _summary(self, budget: Budget, stopped: str, resumed: int) -> RunSummary:
        summary = RunSummary(
            run_dir=self.stored_run.path,
            evaluations=self._evaluated,
            this_session=self._session,
            elapsed=budget.elapsed(),
            stopped=stopped,
            counts=self.store.counts_by_status(),
            best=self._best,
            qd=self._qd(),
            duplicates=self.proposer.duplicates,
            resumed_pending=resumed,
            extra=self._memory_summary(),
        )
        self.reporter.finish(summary)
        return summary

    # --- what the task offers -------------------------------------------------------------------

    def _new_offers(self) -> list[Candidate]:
        """The candidates made of what the runs the task follows offer since the last look (:class:`Offers`):
        the task's seeds for the additions, from the best genome (:meth:`FollowsRuns.offer_seeds`)."""
        got = self.offers.look(self.config, self.task, self._evaluated)
        if got is None:
            return []
        self.config, added = got
        self.task = self.config.make_task()
        self.space = self.config.make_space(self.task)
        self.proposer.retarget(self.task, self.space)
        base = self._best.genome if self._best is not None else None
        seeds = self.task.offer_seeds(base, added) if isinstance(self.task, FollowsRuns) else []  # the same task
        return [c for g in seeds if (c := self.proposer.add(g, [], "offer")) is not None]

    # --- the initial population -----------------------------------------------------------------

    def _initial_population(self) -> list[Candidate]:
        """Seeds from the memory, the task's seeds and ``initial_random`` samples, each derived from (seed, index)."""
        seed = self.config.search.seed
        genomes = [(g, "memory") for g in self._memory_seeds()]
        genomes += [(g, "seed") for g in self.task.seeds()]
        for i in range(self.config.search.initial_random):
            rng = np.random.default_rng([seed, 0, i])
            genomes.append((Genome(params=self.space.sample(rng)), "random"))
        return [c for g, op in genomes if (c := self.proposer.add(g, [], op)) is not None]

    def _memory_seeds(self) -> list[Genome]:
        if self.memory is None:
            return []
        from runtime.hardware import fingerprint

        seeds = self.memory.seeds(self.space, fingerprint(self.config.evaluation.compiler.cc), self.config.search.seed,
                                  max_evals=self.config.budget.max_evals)
        if seeds:
            runs = ", ".join(f"{run} ({n})" for run, n in self.memory.seeded_from.items())
            self.reporter.note(f"memory: {len(seeds)} seeds from earlier runs: {runs}")
        return seeds

    def _memory_summary(self) -> dict[str, Any]:
        if self.memory is None:
            return {}
        return {"memory_seeds": sum(self.memory.seeded_from.values()), "seeded_from": self.memory.seeded_from,
                "memory_recorded": self.memory.recorded, "novelty_rejected": self.proposer.novelty_rejected}

    def _requeue_pending(self) -> list[Candidate]:
        """The pending candidates of an earlier session, offers first: what a new offer made possible goes
        first in every session (an offer left pending when a session's budget ran out is still the point)."""
        pending = sorted(self.store.pending(), key=lambda c: c.operator != "offer")  # stable: stored order kept
        for cand in pending:
            self.proposer.remember(cand)
        if pending:
            log.info("re-queued %d pending candidates", len(pending))
        return pending

    def _request(self, cand: Candidate) -> EvalRequest:
        return EvalRequest(
            key=cand.id,
            genome=cand.genome,
            task=self.config.task,
            settings=self.config.evaluation,
            cache_dir=str(self.stored_run.cache_dir),
            sys_path=tuple(p for p in sys.path if p),
        )

    # --- results --------------------------------------------------------------------------------

    def _commit(self, executor: Executor, request: EvalRequest, result: EvalResult) -> None:
        """A finished evaluation: a would-be new best is held back for a duel against the best first."""
        if request.stages == "duel":
            held, settled, best = self.challenges.verdict(request, result)
            log.info("duel of %s against the best %s: %s", request.key[:12], best.id[:12], settled.metrics["duel"])
            if result.status == Status.OK and result.metrics.get("rival_failed"):
                self._demote(best, Status(result.metrics["rival_status"]),
                             f"as the rival of {request.key[:12]} in a duel: {result.metrics['rival_failed']}")
            self._finish(held, settled)
            return
        duel = self.challenges.challenge(request, result, self._best)
        if duel is not None:
            executor.submit(duel)
            return
        self._finish(request, result)

    def _demote(self, cand: Candidate, status: Status, why: str) -> None:
        """``cand``, an elite that broke a rule when checked again, gets that status: out of the archive, and
        no longer the best."""
        self.reporter.note(f"{cand.id[:12]} is {status} {why}")
        try:
            self.store.revise_result(cand.id, EvalResult(status=status, unit=cand.unit, error=why))
        except StoreError:  # demoted already (two duels against it came back)
            return
        self.archive = rebuild_archive(self.store)
        found = self.store.best(1)
        self._best = found[0] if found else None

    def _finish(self, request: EvalRequest, result: EvalResult) -> None:
        self._unmeasured_seeds.discard(request.key)
        descriptors = self._describe(request.genome, result)
        self.store.record_result(request.key, result, descriptors=descriptors)
        status = self._place(request.key, result, descriptors)
        if self.memory is not None:
            cand = self.store.get(request.key)
            if cand is not None:
                self.memory.record(cand, result, improved=status != AddStatus.NOT_ADDED)
        self._evaluated += 1
        self._session += 1
        self.reporter.update(result=result, add_status=status, best=self._best_fitness(), qd=self._qd())

    def _place(self, cid: str, result: EvalResult, descriptors: dict[str, float]) -> AddStatus:
        """Adds an ok result to the archive, updates the best candidate, and tells the proposer."""
        if result.status != Status.OK or result.fitness is None:
            status = AddStatus.NOT_ADDED
        else:
            status = self.archive.add(cid, result.fitness, descriptors)
            if self._best is None or result.fitness > (self._best.fitness or 0.0):
                self._best = self.store.get(cid)
        self.proposer.tell(cid, result.status, status)
        return status

    def _describe(self, genome: Genome, result: EvalResult) -> dict[str, float]:
        if result.status != Status.OK:
            return {}
        offered = self.task.descriptors()
        return {n: float(offered[n].fn(genome, result.metrics)) for n in self.config.archive.descriptors}

    def _replay(self) -> None:
        """Rebuilds archive, curiosity and best from the store (a resumed run continues where it was; its best
        is the store's, the confirmed leader where an earlier session confirmed one)."""
        for cand in self.store.evaluated():
            self._evaluated += 1
            self.proposer.remember(cand)
            self._place(cand.id, EvalResult(status=Status(cand.status), fitness=cand.fitness), cand.descriptors)
        if self._evaluated:
            found = self.store.best(1)
            self._best = found[0] if found else None

    # --- confirmation -------------------------------------------------------------------------

    def _confirm(self, executor: Executor) -> None:
        """Evaluates the best again after the search (:class:`Confirmation`); no more duels meanwhile: results
        still in flight are recorded as they come back."""
        if self.config.search.confirm.repeats == 0:
            return
        self.challenges.close()

        def evaluate_again(cand: Candidate, repeats: int) -> list[EvalResult]:
            """``repeats`` fresh evaluations of ``cand``, each a request of its own (so a fresh host each)."""
            keys = [f"{cand.id}#confirm{i}" for i in range(repeats)]
            base = self._request(cand)
            for key in keys:
                executor.submit(dataclasses.replace(base, key=key))
            got: dict[str, EvalResult] = {}
            while len(got) < repeats:
                item = executor.next_result(timeout=0.5)
                if item is None:
                    continue
                request, result = item
                if request.key in keys:
                    got[request.key] = result
                else:
                    self._commit(executor, request, result)
            return [got[k] for k in keys]

        if self.confirmation.run(evaluate_again):  # the archive follows the revised figures
            self.archive = rebuild_archive(self.store)
        found = self.store.best(1)  # the best is the confirmed leader where there is one
        self._best = found[0] if found else None

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
        if self.proposer.bandit is not None:
            self.store.add_bandit_weights(evals=self._evaluated, elapsed_s=elapsed,
                                          weights=self.proposer.bandit.shares())


def _brief(args: Mapping[str, Any], width: int = 80) -> str:
    """A task's arguments for a log line: each value cut to ``width`` characters (an engine task's grow with the
    source of every kernel offered; the log is no place for candidate code)."""
    shown = {k: (r if len(r := repr(v)) <= width else r[: width - 3] + "...") for k, v in args.items()}
    return "{" + ", ".join(f"{k!r}: {v}" for k, v in shown.items()) + "}"
