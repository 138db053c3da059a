"""Turns the archive into new candidates: parent selection, a weighted operator, dedup, storage.

The search asks (:meth:`Proposer.propose`, :meth:`Proposer.harvest`) and tells (:meth:`Proposer.tell`: what
became of a candidate); the proposer keeps its own books (each candidate's parents and operator, curiosity,
the bandit) and nothing else writes them.

Proposals are reproducible: each draws from ``numpy.random.default_rng([seed, 1, counter])`` with a
counter persisted in the store. Operators that block on something slow (a model endpoint) run on a
small thread pool, so the workers stay busy with other proposals meanwhile; their children join the
queue when ready. Every child is written to the store as ``pending`` before it is evaluated.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from archive import AddStatus, Archive, Candidate, Store
from evo.bandit import OperatorBandit
from evo.config import RunConfig
from evo.operators import Mutate, Operator, Proposal, ProposalContext, RandomSample
from evo.selection import Curiosity, select_parents
from genome import Genome, ParamSpace
from runtime import Task

__all__ = ["Proposer"]

log = logging.getLogger("evo.search")

_INSPIRATIONS = 3


class Proposer:
    def __init__(
        self,
        *,
        config: RunConfig,
        task: Task,
        space: ParamSpace,
        store: Store,
        archive: Archive,
        operators: dict[str, Operator],
        weights: dict[str, float],
        hints: Any = None,  # callable(parents) -> list of memory hits, when a memory is configured
        novelty: Any = None,  # callable(genome, parent sources) -> bool, when a memory is configured
        novelty_limit: int = 20,  # novelty rejections tolerated per slot before giving it up
        max_blocking: int = 2,
    ) -> None:
        self.config, self.task, self.space, self.store, self.archive = config, task, space, store, archive
        self.operators = operators
        self.curiosity = Curiosity()
        self._hints = hints
        self._names = [n for n in operators if weights.get(n, 0.0) > 0]
        p = np.array([weights[n] for n in self._names], dtype=float)
        self._p = p / p.sum()
        self._blocking: ThreadPoolExecutor | None = None
        self._max_blocking = max_blocking
        self._futures: dict[Future[Proposal | Genome | None], tuple[str, list[str]]] = {}
        self._parents: dict[str, list[str]] = {}  # candidate id -> its parents, until it is told of
        self._operator_of: dict[str, str] = {}  # candidate id -> its operator, until it is told of
        self.duplicates = 0
        self._novelty, self._novelty_limit = novelty, novelty_limit
        self.novelty_rejected = 0
        self.bandit = OperatorBandit(self._names) if config.search.operators.adaptive else None
        # carries the run when every weighted operator rests (e.g. all are model-backed and the endpoint is down)
        self._fallback = Mutate(config.search.operators)

    # --- the two ways candidates come out -------------------------------------------------------

    def propose(self) -> Candidate | None:
        """A new stored candidate now, from a non-blocking operator; blocking ones are started on the side.

        ``None`` after ``max_dedup_tries`` proposals that were all duplicates or invalid.
        """
        novelty_before = self.novelty_rejected
        for _ in range(self.config.search.max_dedup_tries):
            if self.novelty_rejected - novelty_before >= self._novelty_limit:
                break
            names = self._ready()
            if names is None:
                return None  # only busy model-backed operators: wait for their children
            rng = self._next_rng()
            op = self._draw(names, rng)
            elites = self.archive.elites()
            if not elites or op.arity == 0:
                op = self.operators.get("random") or RandomSample()
            if op.blocking:
                if len(self._futures) < self._max_blocking:
                    self._start_blocking(op, self._context(op, elites, rng))
                continue
            ctx = self._context(op, elites, rng)
            cand = self._store(op, ctx, op.propose(ctx))
            if cand is not None:
                return cand
        log.warning("no new candidate after %d tries (duplicates or invalid children)",
                    self.config.search.max_dedup_tries)
        return None

    def harvest(self) -> list[Candidate]:
        """Stored candidates from blocking proposals that have finished."""
        done = [f for f in self._futures if f.done()]
        out = []
        for f in done:
            op_name, parents = self._futures.pop(f)
            try:
                answer = f.result()
            except Exception:  # noqa: BLE001 - an operator's bug costs one proposal, not the run
                log.exception("operator %s failed", op_name)
                continue
            cand = self._store_answer(op_name, parents, answer)
            if cand is not None:
                out.append(cand)
        return out

    @property
    def waiting(self) -> int:
        """Blocking proposals still running."""
        return len(self._futures)

    def close(self) -> None:
        """Keeps what finished proposals paid for (children stored as pending, calls recorded), drops the rest."""
        self.harvest()
        if self._blocking is not None:
            self._blocking.shutdown(wait=False, cancel_futures=True)
        for op in self.operators.values():
            op.close()

    def tell(self, cid: str, status: Any, add_status: AddStatus) -> None:
        """What became of a candidate: curiosity learns from its parents, the bandit is rewarded, and its
        operator may record it (``on_result``)."""
        parents = self._parents.pop(cid, None)
        if parents is None:
            cand = self.store.get(cid)
            parents = list(cand.parents) if cand else []
        self.curiosity.update(parents, add_status != AddStatus.NOT_ADDED)
        name = self._operator_of.pop(cid, None)
        op = self.operators.get(name) if name else None
        if op is None:
            return
        if self.bandit is not None and parents:  # the initial population is no operator's doing
            self.bandit.update(op.name, add_status.added)
        op.on_result(self.store, cid, status, add_status)

    def remember(self, cand: Candidate) -> None:
        """A candidate stored by an earlier session (pending again, or evaluated and replayed): told of like
        one proposed in this one."""
        self._parents[cand.id] = list(cand.parents)
        self._operator_of[cand.id] = cand.operator

    def retarget(self, task: Task, space: ParamSpace) -> None:
        """Proposals from now on are for ``task`` in ``space`` (the task's arguments grew by an offer)."""
        self.task, self.space = task, space

    # --- storing --------------------------------------------------------------------------------

    def add(self, genome: Genome, parents: list[str], operator: str) -> Candidate | None:
        """Stores ``genome`` as pending; ``None`` if its id is already stored (dedup)."""
        if not self.store.add_pending(genome=genome, parents=parents, operator=operator):
            self.duplicates += 1
            return None
        self._parents[genome.id] = parents
        self._operator_of[genome.id] = operator
        return self.store.get(genome.id)

    def _store(self, op: Operator, ctx: ProposalContext, answer: Proposal | Genome | None) -> Candidate | None:
        return self._store_answer(op.name, [p.id for p in ctx.parents], answer)

    def _store_answer(self, op_name: str, parents: list[str], answer: Proposal | Genome | None) -> Candidate | None:
        proposal = answer if isinstance(answer, Proposal) else Proposal(genome=answer)
        genome = proposal.genome
        if genome is not None and self._novelty is not None and genome.source is not None:
            sources = [p.source for p in self.store.get_many(parents)]
            if not self._novelty(genome, sources):
                self.novelty_rejected += 1
                genome = None
        cand = self.add(genome, parents, op_name) if genome is not None else None
        if proposal.on_commit is not None:
            proposal.on_commit(self.store, cand.id if cand else None)
        return cand

    # --- helpers --------------------------------------------------------------------------------

    def _next_rng(self) -> np.random.Generator:
        counter = int(self.store.get_meta("proposals") or 0)
        self.store.set_meta("proposals", str(counter + 1))
        return np.random.default_rng([self.config.search.seed, 1, counter])

    def _ready(self) -> list[str] | None:
        """Operators able to propose now: a model-backed one is skipped while its slots are full or it rests
        (endpoint down, budget spent). ``None`` when only busy ones remain; ``[]`` when all of them rest."""
        full = len(self._futures) >= self._max_blocking
        ready = {n: self.operators[n].available() for n in self._names}
        names = [n for n in self._names if ready[n] and not (full and self.operators[n].blocking)]
        return None if not names and any(ready.values()) else names

    def _draw(self, names: list[str], rng: np.random.Generator) -> Operator:
        """An operator by weight (or by the bandit) among ``names``; the fallback mutation when empty."""
        if not names:
            return self._fallback
        if self.bandit is not None:
            return self.operators[self.bandit.choose(names, rng)]
        if len(names) == len(self._names):
            return self.operators[self._names[int(rng.choice(len(self._names), p=self._p))]]
        p = np.array([self._p[self._names.index(n)] for n in names])
        return self.operators[names[int(rng.choice(len(names), p=p / p.sum()))]]

    def _context(self, op: Operator, elites: list[Any], rng: np.random.Generator) -> ProposalContext:
        chosen = select_parents(elites, op.arity, rng, self.config.search.selection, self.curiosity) if op.arity else []
        parents = self.store.get_many([e.id for e in chosen])
        by_id = {p.id: p for p in parents}
        parents = [by_id[e.id] for e in chosen]
        inspirations: list[Candidate] = []
        if op.blocking and elites:
            taken = {e.id for e in chosen}
            others = [e for e in elites if e.id not in taken]
            idx = rng.permutation(len(others))[:_INSPIRATIONS]
            inspirations = self.store.get_many([others[int(i)].id for i in idx])
        hints = self._hints(parents) if (op.blocking and self._hints is not None) else ()
        return ProposalContext(space=self.space, rng=rng, task=self.task, parents=parents,
                               inspirations=inspirations, hints=hints)

    def _start_blocking(self, op: Operator, ctx: ProposalContext) -> None:
        if self._blocking is None:
            self._blocking = ThreadPoolExecutor(max_workers=self._max_blocking, thread_name_prefix="evo-propose")
        self._futures[self._blocking.submit(op.propose, ctx)] = (op.name, [p.id for p in ctx.parents])
