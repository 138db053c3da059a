"""Blocking operators (e.g. a model behind HTTP) run beside the workers, and their children are evaluated."""

import threading
import time

import pytest

from evo.config import OperatorsConfig, parse_config
from evo.operators import Mutate, Operator, Proposal, RandomSample
from evo.rundir import create_run
from evo.search import Search

pytestmark = pytest.mark.slow


class SlowMutate(Operator):
    """A stand-in for a model-backed operator: slow, off the controller's thread, records via on_commit."""

    name = "slow"
    arity = 1
    blocking = True

    def __init__(self) -> None:
        self.inner = Mutate(OperatorsConfig())
        self.threads: set[str] = set()
        self.committed: list[str | None] = []

    def propose(self, ctx):
        self.threads.add(threading.current_thread().name)
        time.sleep(0.3)
        child = self.inner.propose(ctx)
        return Proposal(genome=child, on_commit=lambda store, cid: self.committed.append(cid))


def test_blocking_operator_children_are_stored_and_evaluated(tmp_path):
    config = parse_config({
        "task": {"name": "matmul", "args": {"m": 48, "n": 48, "k": 48}},
        "evaluation": {"timing": {"max_seconds": 0.05}, "check_trials": 1},
        "search": {"workers": 1, "initial_random": 2},
        "budget": {"max_evals": 14},
        "archive": {"descriptors": ["register_tile_area"], "bins": 2},
        "memory": {"enabled": False},
    }, source="test")
    slow = SlowMutate()
    rd = create_run(tmp_path / "run", config)
    search = Search(config, rd, operators={"slow": slow, "random": RandomSample()},
                    weights={"slow": 0.8, "random": 0.2})
    summary = search.run()
    assert summary.evaluations == 14
    by_op = rd.store.counts_by_operator()
    assert by_op.get("slow", 0) >= 2, by_op
    assert slow.threads and threading.main_thread().name not in slow.threads
    assert [c for c in slow.committed if c] and all(rd.store.get(c) for c in slow.committed if c)
    evaluated_slow = [c for c in rd.store.by_operator("slow", limit=100) if c.status != "pending"]
    assert evaluated_slow and all(c.parents for c in evaluated_slow)
