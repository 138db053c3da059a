"""The plan of a round: which slots get a kernel search, with how many evaluations, and why.

A slot's budget follows its share of the engine's time, which is what a faster kernel there could
save; a slot under ``plan.min_share`` gets none, nor one whose kernels this CPU cannot run, nor one
whose last search stagnated. Every decision carries its reason, stored with the plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

from evo.factory.config import FactoryConfig

__all__ = ["Plan", "PlannedSearch", "make_plan", "slot_tasks_for"]


@dataclass(frozen=True)
class PlannedSearch:
    slot: str
    task: str
    evals: int  # evaluations this round adds to the slot's run
    share: float  # the slot's share of the engine's time
    why: str


@dataclass(frozen=True)
class Plan:
    round: int
    searches: tuple[PlannedSearch, ...]
    skipped: dict[str, str]  # slot -> why it gets no search this round

    def to_dict(self) -> dict:
        return {"round": self.round, "searches": [asdict(s) for s in self.searches], "skipped": dict(self.skipped)}

    @classmethod
    def from_dict(cls, d: Mapping) -> Plan:
        searches = tuple(PlannedSearch(**s) for s in d["searches"])
        return cls(round=d["round"], searches=searches, skipped=dict(d["skipped"]))


def slot_tasks_for(slot: str, cpu_flags: Sequence[str], hidden: int, intermediate: int) -> tuple[list[str], str]:
    """The built-in tasks to search for ``slot`` on this CPU and model (every one that can serve it: the linear
    slot's bf16 and int8 kernels trade accuracy for speed differently, and the engine search picks), or none and
    why not."""
    from runtime.engine.ops import slot_task, tasks_of_slot

    tasks, reasons = [], []
    specs = {name: slot_task(slot, name).slot for name in tasks_of_slot(slot)}
    for name, spec in specs.items():
        assert spec is not None
        original = specs.get(spec.stands_in_for or "")
        if missing := spec.missing(cpu_flags):
            reasons.append(f"{name} needs {' and '.join(missing)}, which this CPU lacks")
        elif original is not None and not original.missing(cpu_flags):
            reasons.append(f"{name} stands in for {spec.stands_in_for}, which this CPU runs")
        elif slot == "linear" and (hidden % spec.k_multiple or intermediate % spec.k_multiple
                                   or hidden % spec.n_multiple or intermediate % spec.n_multiple):  # fmt: skip
            reasons.append(f"{name} takes sizes in multiples of {spec.k_multiple} (k) and {spec.n_multiple} (n); "
                           f"the model's are {hidden} and {intermediate}")  # fmt: skip
        else:
            tasks.append(name)
    return tasks, "" if tasks else "; ".join(reasons) or f"no built-in task fills the {slot} slot"


def make_plan(round_: int, shares: Mapping[str, float], config: FactoryConfig, *,
              slot_tasks: Callable[[str], tuple[list[str], str]],
              gains: Mapping[str, float | None] | None = None) -> Plan:  # fmt: skip
    """The round's searches: ``budget.kernel_evals`` shared by the eligible slots in proportion to their share of
    the engine's time (``shares``, by slot), each at least ``budget.min_evals``; ``slot_tasks(slot)``: the tasks
    that can fill a slot on this CPU (or none and why). A slot several tasks can fill (the linear slot's bf16 and
    int8 kernels) splits its share between them. ``gains``: each slot's relative gain in its last search (the
    best of its tasks'; ``None``: not measured); one under ``plan.stagnation`` is stopped."""
    eligible: dict[str, tuple[list[str], float]] = {}
    skipped: dict[str, str] = {}
    for slot in config.slots:
        share = shares.get(slot, 0.0)
        tasks, why = slot_tasks(slot)
        gain = (gains or {}).get(slot)
        if not tasks:
            skipped[slot] = why
        elif share < config.plan.min_share:
            skipped[slot] = f"{share:.1%} of the time, under plan.min_share ({config.plan.min_share:.0%})"
        elif gain is not None and gain < config.plan.stagnation:
            skipped[slot] = f"its last search gained {gain:+.1%}, under plan.stagnation ({config.plan.stagnation:.0%})"
        else:
            eligible[slot] = (tasks, share)
    total = sum(share for _, share in eligible.values())
    searches = []
    for slot, (tasks, share) in sorted(eligible.items(), key=lambda kv: -kv[1][1]):
        evals = max(config.budget.min_evals, round(config.budget.kernel_evals * share / total))
        shared = -(-evals // len(tasks))
        each = max(config.budget.min_evals, shared)
        split = f", {each} each for {' and '.join(tasks)}" if len(tasks) > 1 else ""
        floor = " (budget.min_evals each)" if each > shared else ""
        why = f"{share:.1%} of the engine's time: {each * len(tasks)} of the round's kernel evaluations{split}{floor}"
        searches += [PlannedSearch(slot, task, each, share, why) for task in tasks]
    return Plan(round_, tuple(searches), skipped)
