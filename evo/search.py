"""The search controller: asynchronous steady-state MAP-Elites.

The loop, in one screen (see :meth:`Search.run`): keep every worker busy with a candidate, and as
each result arrives commit it, place it in the archive, and report. Policies live elsewhere:
proposals (:mod:`evo.proposer`: selection, operators, dedup), budgets (:mod:`evo.budget`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from archive import OFFERS_KEY, AddStatus, Candidate, Store, StoreError, read_run, rebuild_archive
from evo.budget import Budget
from evo.config import RunConfig
from evo.confirm import confirmed_result, outranks, ranked
from evo.duel import settle, wants_duel
from evo.memory_link import MemoryLink
from evo.operators import Operator, build_operators
from evo.proposer import Proposer
from evo.reporting import Reporter, SilentReporter
from evo.rundir import RunDir, build_archive
from evo.selection import Curiosity
from genome import Genome
from runtime import EvalRequest, EvalResult, Executor, Status, Task, backend_for

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
        operators: dict[str, Operator] | None = None,
        weights: dict[str, float] | None = None,
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
        self.curiosity = Curiosity()
        self.memory = MemoryLink.open(config.memory, self.task, str(run_dir.path.resolve()), self.reporter.note)
        self.proposer = Proposer(
            config=config, task=self.task, space=self.space, store=self.store, archive=self.archive,
            operators=operators or {**build_operators(config.search.operators), **self._llm_operators()},
            weights=weights or dict(config.search.operators.weights), curiosity=self.curiosity,
            max_blocking=sum(m.max_concurrency for m in config.llm.models) if config.llm else 2,
            hints=self.memory.hints if self.memory else None,
        )
        if self.memory:
            self.proposer.novelty = self.memory.is_novel
            self.proposer.novelty_limit = config.memory.novelty_max_resamples
        self._best: Candidate | None = None
        self._pool: Executor | None = None
        # challenger id -> ((its request, its result), the best it duels): held back until the duel ends
        self._duels: dict[str, tuple[tuple[EvalRequest, EvalResult], Candidate]] = {}
        self._evaluated = 0
        self._session = 0
        self._offers_due = 0.0  # monotonic time of the next look for new offers (now: a resumed run looks first)

    def _llm_operators(self) -> dict[str, Operator]:
        """Model-backed operators, when the config has an ``llm:`` section (see evo.llm)."""
        if self.config.llm is None:
            return {}
        from evo.llm.factory import build_llm_operators

        def note(message: str) -> None:
            log.warning("%s", message)
            self.reporter.note(message)

        return dict(build_llm_operators(self.config, store=self.store, task=self.task,
                                        cache_dir=self.run_dir.cache_dir, log_dir=self.run_dir.log_dir, note=note,
                                        memory=self.memory.search if self.memory else None,
                                        current=lambda: self.config))

    # --- the loop -------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        budget = Budget(self.config.budget)
        self._replay()
        queue = self._requeue_pending()
        resumed = len(queue)
        queue += self._initial_population()
        executor = self._pool = self._executor or self.run_dir.make_pool(
            self.workers, self.config.execution, self.config.evaluation.compiler.cc, self.task.backend)
        self.workers = getattr(executor, "slots", self.workers)  # a cluster's slots are its nodes'
        self.reporter.start(total=self.config.budget.max_evals, done=self._evaluated, workers=self.workers)
        self.reporter.note(
            f"run dir {self.run_dir.path}: task {self.task.name} {_brief(self.config.task.args)}, "
            f"{self.workers} workers, {len(queue)} queued ({resumed} resumed), fitness in {self.task.unit}"
        )
        if self.config.llm is None:
            self.reporter.note("no llm: section in the config: the search runs on classical operators only")
        last_snapshot, stopped = 0.0, ""
        try:
            while True:
                queue[:0] = self._new_offers()  # what a new offer makes possible goes first
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
                    self._commit(*item)
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
            self._pool = None
            self._settle_held()
            self.proposer.close()
            if self.memory:
                self.memory.close()
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
            duplicates=self.proposer.duplicates,
            resumed_pending=resumed,
            extra=self._memory_summary(),
        )
        self.reporter.finish(summary)
        return summary

    # --- what the task offers -------------------------------------------------------------------

    def _new_offers(self) -> list[Candidate]:
        """What the runs the task reads offer since the last look (an engine task's followed kernel runs):
        from now on every request carries the grown args, the stored config offers it to a resumed run, and
        the store's ``offers`` says what was offered after how many evaluations. Returns the candidates the
        task makes of the additions and the best genome (:meth:`Task.offer_seeds`)."""
        every = self.task.offers_every_s()
        if not every or time.monotonic() < self._offers_due:
            return []
        self._offers_due = time.monotonic() + every
        got = type(self.task).new_offers(self.config.task.args, read_run)
        if got is None:
            return []
        args, added = got
        config = self.config.model_copy(update={"task": self.config.task.model_copy(update={"args": args})})
        task = config.make_task()
        self.config, self.task, self.space = config, task, config.make_space(task)
        self.proposer.task, self.proposer.space = self.task, self.space
        offers = json.loads(self.store.get_meta(OFFERS_KEY) or "[]")
        offers += [{**a, "at": time.time(), "evaluations": self._evaluated} for a in added]
        stored = yaml.safe_load(self.store.get_meta("config") or "{}")  # as frozen, this session's budget aside
        stored["task"]["args"] = args
        text = yaml.safe_dump(stored, sort_keys=False)
        self.store.set_metas({"config": text, OFFERS_KEY: json.dumps(offers)})
        (self.run_dir.path / "config.yaml").write_text(text)
        for a in added:
            self.reporter.note(f"offered {a['slot']} kernel {a['id'][:12]} of {a['run_dir']} "
                               f"after {self._evaluated} evaluations")  # fmt: skip
        base = self._best.genome if self._best is not None else None
        return [c for g in task.offer_seeds(base, added) if (c := self.proposer.add(g, [], "offer")) is not None]

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

        seeds = self.memory.seeds(self.space, fingerprint(self.config.evaluation.compiler.cc), self.config.search.seed)
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
            self.proposer.parents_of[cand.id] = list(cand.parents)
            self.proposer.op_of[cand.id] = cand.operator
        if pending:
            log.info("re-queued %d pending candidates", len(pending))
        return pending

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
        """A finished evaluation: a would-be new best is held back for a duel against the best first."""
        if request.stages == "duel":
            held, best = self._duels.pop(request.key)
            settled = settle(held[1], result, best.id, best.fitness or 0.0, best.metrics.get("vs_reference"))
            log.info("duel of %s against the best %s: %s", request.key[:12], best.id[:12], settled.metrics["duel"])
            if result.status == Status.OK and result.metrics.get("rival_failed"):
                self._demote(best, Status(result.metrics["rival_status"]),
                             f"as the rival of {request.key[:12]} in a duel: {result.metrics['rival_failed']}")
            self._finish(held[0], settled)
            return
        best = self._best
        if (self._pool is not None and best is not None and best.id != request.key
                and backend_for(self.task).supports("duel")
                and wants_duel(result, best.fitness)):
            self._duels[request.key] = ((request, result), best)
            self._pool.submit(dataclasses.replace(request, stages="duel", rival=best.genome))
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

    def _settle_held(self) -> None:
        """Results whose duel did not come back (a time limit or Ctrl-C stopped the run): recorded, not crowned."""
        for (request, result), best in self._duels.values():
            self._finish(request, settle(result, None, best.id, best.fitness or 0.0))
        self._duels.clear()

    def _finish(self, request: EvalRequest, result: EvalResult) -> None:
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
        """Adds an ok result to the archive and updates curiosity and the best candidate."""
        if result.status != Status.OK or result.fitness is None:
            status = AddStatus.NOT_ADDED
        else:
            status = self.archive.add(cid, result.fitness, descriptors)
            if self._best is None or result.fitness > (self._best.fitness or 0.0):
                self._best = self.store.get(cid)
        parents = self.proposer.parents_of.pop(cid, None)
        if parents is None:
            cand = self.store.get(cid)
            parents = list(cand.parents) if cand else []
        self.curiosity.update(parents, status != AddStatus.NOT_ADDED)
        self.proposer.feedback(cid, result.status, status, parents=parents)
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
            self.proposer.parents_of[cand.id] = list(cand.parents)
            self.proposer.op_of[cand.id] = cand.operator
            self._place(cand.id, EvalResult(status=Status(cand.status), fitness=cand.fitness), cand.descriptors)
        if self._evaluated:
            found = self.store.best(1)
            self._best = found[0] if found else None

    # --- confirmation -------------------------------------------------------------------------

    def _confirm(self, executor: Executor) -> None:
        """Evaluates the best again after the search (:mod:`evo.confirm`): the best not yet confirmed, while
        it outranks the confirmed leader, up to ``top`` of them."""
        repeats, top = self.config.search.confirm.repeats, self.config.search.confirm.top
        if repeats == 0:
            return
        self._pool = None  # no more duels: results still in flight are recorded as they come back
        confirmed = set(self.store.confirmed())
        leaders = [c for c in self.store.best(len(confirmed)) if c.id in confirmed]  # those still ok, best first
        changed = False
        for _ in range(top):
            cand = self._unconfirmed(leaders)
            if cand is None or (leaders and not outranks(cand, leaders[0])):
                break
            self.reporter.note(f"confirming the best {cand.id[:12]} ({cand.fitness:.4g} {self.task.unit}): "
                               f"{repeats} fresh evaluations")  # fmt: skip
            again = self._evaluate_again(executor, cand, repeats)
            recorded = EvalResult(status=Status(cand.status), fitness=cand.fitness, unit=cand.unit,
                                  metrics=cand.metrics)  # fmt: skip
            result = confirmed_result(recorded, again)
            ok = result.status == Status.OK
            now = ranked([*leaders, dataclasses.replace(cand, fitness=result.fitness, metrics=result.metrics)]
                         if ok else leaders)  # fmt: skip
            self.store.revise_result(cand.id, result, descriptors=cand.descriptors if ok else {},
                                     confirmed=[c.id for c in now])  # fmt: skip
            leaders, changed = self.store.get_many([c.id for c in now]), True
            figures = ", ".join(f"{r.fitness:.4g}" if r.fitness is not None else str(r.status) for r in again)
            vs = result.metrics.get("vs_reference")
            self.reporter.note(f"confirmed {cand.id[:12]}: recorded {cand.fitness:.4g}, again {figures}: "
                               + (f"keeps {result.fitness:.4g} {self.task.unit}, the median measured"
                                  + (f" ({vs:.3f}x the reference)" if vs is not None else "") if ok
                                  else f"{result.status}: {result.error}"))  # fmt: skip
        else:
            cand = self._unconfirmed(leaders)
            if cand is not None and not leaders:
                self.reporter.note(f"the best is not confirmed: {top} candidates were (search.confirm.top)")
            elif cand is not None and outranks(cand, leaders[0]):
                self.reporter.note(f"{cand.id[:12]} recorded a figure above the confirmed best's but is not confirmed: "
                                   f"{top} candidates were (search.confirm.top); the best is the confirmed "
                                   f"{leaders[0].id[:12]}")  # fmt: skip
        if changed:  # the archive follows the revised figures
            self.archive = rebuild_archive(self.store)
        found = self.store.best(1)  # the best is the confirmed leader where there is one
        self._best = found[0] if found else None

    def _unconfirmed(self, leaders: list[Candidate]) -> Candidate | None:
        """The best candidate not confirmed yet, by the search's own ranking (fitness)."""
        found = self.store.best(len(leaders) + 1)
        return found[-1] if len(found) > len(leaders) else None

    def _evaluate_again(self, executor: Executor, cand: Candidate, repeats: int) -> list[EvalResult]:
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
                self._commit(request, result)
        return [got[k] for k in keys]

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
