"""The factory: rounds of profile -> plan -> kernel searches with the engine search alongside -> duel ->
promotion.

Everything lives in the factory directory (:class:`archive.FactoryDir` lays it out), and every step leaves
its evidence there before the next starts, so ``--resume`` (after a crash or ``kill -9``) redoes only the step
that was cut short, and that step's search resumes as any run does: a round's profile, its plan, a kernel run
per planned task, the round's engine run following the kernel runs (offered each elite as it lands), its best
engine's duel against the incumbent, and the promotion when it wins; every decision and why in the events.

Each search is an ``evo run`` in a process of its own that dies with the factory. Here the kernel searches
run one after another and the engine search beside them (on a Ray cluster, a round's kernel searches at
once): the machine-wide timing lock keeps every timing and load test alone on the machine, so searches
that share it cost each other time, never accuracy.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from archive import FactoryDir, is_run
from evo.errors import UserError
from evo.factory.config import ChatPromoteConfig, FactoryConfig, PromoteConfig
from evo.factory.kinds import ModelKind, kind_of
from evo.factory.measure import Measurer
from evo.factory.plan import Plan, make_plan
from runtime.result import EvalResult, Status
from runtime.sandbox.limits import private_dir

__all__ = ["Factory"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In a search's process before it runs: a factory killed (even with -9) takes its searches with it."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class _SearchProcess:
    """One ``evo run`` in its own process, its output appended to its log."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.cmd, self.log = cmd, log
        with log.open("a") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)

    def wait(self) -> None:
        code = self.proc.wait()
        if code != 0:
            raise RuntimeError(f"evo run {self.cmd[4]} ended {code}{self._why()}: see {self.log}")

    def _why(self) -> str:
        """The last error its log shows (an internal error's exception, a user error's line), briefly."""
        try:
            with self.log.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 20000))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        for line in reversed(lines):
            line = line.strip()
            if re.match(r"(error: |[\w.]+(Error|Exception|Exit)\b)", line):
                return f" ({line[:300]})"
        return ""

    def wait_until(self, ready: Callable[[], bool]) -> None:
        """Returns once ``ready()`` holds or the process has ended (:meth:`wait` then says how)."""
        while not ready() and self.proc.poll() is None:
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def why_not_promoted(kind: ModelKind, promote: ChatPromoteConfig | PromoteConfig, result: EvalResult) -> str:
    """Why a duel's ``result`` does not promote its candidate (``""``: it does). It must hold every rule, keep its
    p99 within the budget, and beat the incumbent by more than ``promote.min_gain`` in the median and, with
    ``promote.every_round``, in each round beside it; an incumbent that broke a rule is replaced."""
    if result.status != Status.OK:
        floor = kind.under_floor(result) if result.status == Status.WRONG else None
        return floor or f"the candidate lost its duel: {_failure(result)}"
    m, unit = result.metrics, kind.unit
    c, i = kind.figures(m), kind.figures(m, "rival_")
    gain = c["throughput"] / i["throughput"] - 1 if i.get("throughput") else float("inf")
    limit = c.get("p99_limit_ms", kind.p99_budget_ms)  # a chat duel's: the budget, or a multiple of the rival's
    if c["p99_ms"] > limit:
        return f"p99 {c['p99_ms']:.1f} ms is over the budget {limit:g} ms"
    if m.get("rival_failed"):
        return ""  # the incumbent broke a rule: the candidate, which held every one, replaces it
    if gain <= promote.min_gain:
        return f"{c['throughput']:.1f} {unit} against the incumbent's {i['throughput']:.1f} ({gain:+.1%})"
    lost = [(k, a, b) for k, (a, b) in enumerate(zip(kind.round_throughputs(c), kind.round_throughputs(i),
                                                    strict=False), 1) if a <= b * (1 + promote.min_gain)]  # fmt: skip
    if promote.every_round and lost:
        k, a, b = lost[0]
        return (f"{gain:+.1%} in the median, but round {k} of the duel gave {a:.1f} {unit} against the "
                f"incumbent's {b:.1f}: not ahead in every round")
    return ""


def _gain(candidate: dict[str, Any], incumbent: dict[str, Any]) -> float | None:
    """The candidate's throughput over the incumbent's, less one (``None``: either has no figure)."""
    if not incumbent.get("throughput") or not candidate.get("throughput"):
        return None
    return candidate["throughput"] / incumbent["throughput"] - 1


def _fidelity(figures: dict[str, Any]) -> dict[str, Any]:
    """An engine's duel figures less its speed: what it was checked to keep of the fp32 engine."""
    return {k: v for k, v in figures.items() if k not in ("throughput", "p99_ms", "ttft_p99_ms", "rounds")}


def _failure(result: Any) -> str:
    """A failed measurement's status and error, in a line or a few (a candidate's own output included)."""
    return f"{result.status}: {(result.error or '').strip()[-1500:]}"


class Factory:
    """One factory directory; :meth:`run` does (or, resumed, finishes) its rounds."""

    def __init__(self, config: FactoryConfig, path: Path, *, note: Callable[[str], None] = print) -> None:
        # absolute: promotions name their runs by path, for a server started anywhere
        self.config, self.path, self.note = config, path.resolve(), note
        self.dir = FactoryDir(self.path)
        self.kind = kind_of(config)
        self.measurer = Measurer(self.path, config, self.kind)

    @classmethod
    def create(cls, config: FactoryConfig, path: Path, **kw: Any) -> Factory:
        if FactoryDir(path).exists():
            raise UserError(f"{path} already holds a factory: continue it with --resume, or choose another --dir")
        factory = cls(config, path, **kw)
        factory.kind.check()  # a model the engine cannot run is one line, before anything is written
        private_dir(path)
        factory.dir.write_config(config.model_dump(mode="json"))
        return factory

    @classmethod
    def open(cls, path: Path, *, rounds: int | None = None, **kw: Any) -> Factory:
        """The factory in ``path`` with its frozen config (``rounds``: more rounds than it was started with)."""
        stored = FactoryDir(path)
        if not stored.exists():
            raise UserError(f"no factory in {path} (expected {stored.config_file}): start one with evo factory CONFIG")
        config = FactoryConfig.model_validate(stored.read_config())
        if rounds is not None:
            config = config.model_copy(update={"budget": config.budget.model_copy(update={"rounds": rounds})})
        private_dir(path)  # one started by an older version too
        return cls(config, path, **kw)

    # --- the rounds -------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            for n in range(1, self.config.budget.rounds + 1):
                self.note(f"round {n} of {self.config.budget.rounds}")
                profile = self._profile(n)
                plan = self._plan(n, profile)
                engine_run = self._searches(n, plan)
                self._duel(n, engine_run)
        finally:
            self.measurer.close()

    def _profile(self, n: int) -> dict[str, Any]:
        if self.dir.profiles.has(n):
            return self.dir.profiles.read(n)
        incumbent = self.incumbent()
        result = self.measurer.profile(incumbent)
        if result.status != Status.OK and incumbent is not None:  # the default engine's, to plan by
            self._event("not profiled", round=n, engine=incumbent, why=_failure(result))
            incumbent, result = None, self.measurer.profile(None)
        if result.status != Status.OK:
            raise RuntimeError(f"the default engine could not be profiled: {_failure(result)}")
        got = result.metrics["profile"]
        self.dir.profiles.write(n, got)
        top = ", ".join(f"{k} {v:.0%}" for k, v in sorted(got["shares"].items(), key=lambda kv: -kv[1])[:5])
        self._event("profiled", round=n, engine=incumbent, why=f"where the time goes: {top}")
        return got

    def _plan(self, n: int, profile: dict[str, Any]) -> Plan:
        if self.dir.plans.has(n):
            return Plan.from_dict(self.dir.plans.read(n))
        from runtime.hardware import cpu_flags

        flags = cpu_flags()
        plan = make_plan(n, self.kind.shares(profile), self.config,
                         slot_tasks=lambda slot: self.kind.slot_tasks(slot, flags), gains=self._gains(n))  # fmt: skip
        self.dir.plans.write(n, plan.to_dict())
        for s in plan.searches:
            self._event("planned", round=n, slot=s.slot, task=s.task, evals=s.evals, why=s.why)
        for slot, why in plan.skipped.items():
            self._event("not planned", round=n, slot=slot, why=why)
        return plan

    def _gains(self, n: int) -> dict[str, float | None]:
        """Each slot's relative gain in its search of the last round (its run's best after over before)."""
        if n == 1:
            return {}
        last = self.dir.plans.read(n - 1)
        by_slot: dict[str, list[float | None]] = {}
        for s in last["searches"]:
            entry = self.dir.history(s["task"]).get(n - 1) or {}
            before, after = entry.get("before"), entry.get("after")
            by_slot.setdefault(s["slot"], []).append((after / before - 1) if before and after else None)
        # a slot several tasks searched (bf16, int8): the best of their gains, unmeasured while one is
        return {slot: None if None in g else max(x for x in g if x is not None) for slot, g in by_slot.items()}

    def _searches(self, n: int, plan: Plan) -> Path:
        """Round ``n``'s kernel searches, with its engine search alongside following their runs (it offers each
        new kernel elite as it lands); the engine search's last ``engine_after_kernels`` evaluations wait for
        the kernel searches to end, so they try every kernel the round found."""
        run_dir = self.dir.engine_run(n)
        self._say_searched(n, plan)
        if self.dir.engine_done(n):
            return run_dir
        config = self._engine_config(n, plan)
        b = self.config.budget
        pending = [s for s in plan.searches if n not in self.dir.history(s.task)]
        started: list[_SearchProcess] = []
        try:
            if pending and b.engine_evals > b.engine_after_kernels:
                self.note(f"engine search round {n}: alongside the kernel searches, following their runs")
                started.append(self._start(config, run_dir, max_evals=b.engine_evals - b.engine_after_kernels,
                                           confirm=False))  # its last session confirms
                # it reads what the kernel runs hold once, as it starts: a kernel found before then would be part
                # of its task from the outset rather than an offer it tries first
                started[-1].wait_until(lambda: is_run(run_dir))
            at_once = self.config.execution.kind == "ray"  # a cluster has room for every search at once
            for group in ([pending] if at_once else [[s] for s in pending]):
                kernels = [(s.task, self._start_kernel(n, s.task, s.evals)) for s in group]
                started += [k for _, (k, _) in kernels]
                for task, (search, before) in kernels:
                    search.wait()
                    self._end_kernel(n, task, before)
            for search in started:
                search.wait()
            self.note(f"engine search round {n}: its last evaluations, offered every kernel the round found")
            started.append(self._start(config, run_dir, max_evals=b.engine_evals))
            started[-1].wait()
        finally:
            for search in started:
                search.kill()  # a failed search (or an interrupt) leaves none running
        self.dir.mark_engine_done(n)
        self._event("searched", round=n, task=FactoryDir.ENGINE, evaluations=self._evaluations(run_dir),
                    best=self._best(run_dir), offered=self._offers(run_dir))  # fmt: skip
        return run_dir

    def _say_searched(self, n: int, plan: Plan) -> None:
        """The ``searched`` events of round ``n``'s searches that ended in an earlier session which died before
        it said so (between a search's record and its event)."""
        said = {(e.get("round"), e.get("task")) for e in self.dir.events() if e.get("event") == "searched"}
        for s in plan.searches:
            entry = self.dir.history(s.task).get(n)
            if entry is not None and (n, s.task) not in said:
                self._event("searched", round=n, task=s.task, evaluations=self._evaluations(self.dir.run_dir(s.task)),
                            **entry)  # fmt: skip
                said.add((n, s.task))
        run_dir = self.dir.engine_run(n)
        if self.dir.engine_done(n) and (n, FactoryDir.ENGINE) not in said:
            self._event("searched", round=n, task=FactoryDir.ENGINE, evaluations=self._evaluations(run_dir),
                        best=self._best(run_dir), offered=self._offers(run_dir))  # fmt: skip

    def _start_kernel(self, n: int, task: str, evals: int) -> tuple[_SearchProcess, float | None]:
        run_dir = self.dir.run_dir(task)
        exists = is_run(run_dir)
        before = self._best(run_dir) if exists else None
        target = self._target(task, n)  # from the plans: a search resumed after a crash gets no more
        config = self.dir.run_config(task)
        if not exists:  # a resumed run keeps the config it started with; only its budget grows
            self.dir.write_run_config(task, self.kind.kernel_run_config(task, target))
        self.note(f"kernel search {task}: {evals} evaluations (to {target} in all)")
        return self._start(config, run_dir, max_evals=target), before

    def _end_kernel(self, n: int, task: str, before: float | None) -> None:
        run_dir = self.dir.run_dir(task)
        history = self.dir.history(task)
        history[n] = {"before": before, "after": self._best(run_dir)}
        self.dir.write_history(task, history)
        self._event("searched", round=n, task=task, evaluations=self._evaluations(run_dir), **history[n])

    def _target(self, task: str, n: int) -> int:
        """The evaluations ``task``'s run has in all once round ``n``'s search is done: its plans' sum."""
        total = 0
        for k in range(1, n + 1):
            plan = self.dir.plans.read(k)
            total += sum(s["evals"] for s in plan["searches"] if s["task"] == task)
        return total

    def _engine_config(self, n: int, plan: Plan) -> Path:
        """Round ``n``'s engine run config (written once): following every kernel run the factory has and the
        round plans."""
        name = self.dir.engine_run(n).name
        config = self.dir.run_config(name)
        if not config.exists():
            tasks = set(self.dir.kernel_tasks()) | {s.task for s in plan.searches}
            kernel_runs = {t: self.dir.run_dir(t) for t in sorted(tasks)}
            self.dir.write_run_config(name, self.kind.engine_run_config(kernel_runs))
        return config

    def _offers(self, run_dir: Path) -> list[dict[str, Any]]:
        """What the engine run was offered while it ran: slot, kernel id, after how many evaluations."""
        from archive import Run

        with Run.open(run_dir) as run:
            offers = run.offers()
        return [{"slot": o["slot"], "id": o["id"], "evaluations": o["evaluations"]} for o in offers]

    def _duel(self, n: int, engine_run: Path) -> None:
        """The engine run's ``promote.finalists`` best, each in a duel against the incumbent (the machine quiet
        now: a search's single loads rank engines closer than their noise); the one ahead of it by the most, of
        those that hold every rule, is promoted."""
        if self.dir.duels.has(n):
            return
        from archive import Run

        p = self.config.promote
        incumbent = self.incumbent()
        with Run.open(engine_run) as run:  # the incumbent itself, found again by this round's search, is no rival
            ids = [i for i in run.elite_ids(p.finalists + 1) if not incumbent or i != incumbent["elite"]]
        ids = ids[: p.finalists]
        if not ids:
            self.dir.duels.write(n, {"promoted": False, "why": f"{engine_run} has no ok engine"})
            self._event("not promoted", round=n, why=f"{engine_run} has no ok engine")
            return
        verdicts = []
        for k, elite in enumerate(ids, 1):
            candidate = {"run_dir": str(engine_run), "elite": elite}
            of = f" (finalist {k} of {len(ids)})" if len(ids) > 1 else ""
            self.note(f"duel round {n}{of}: {elite[:12]} against the {'incumbent' if incumbent else 'default engine'}")
            verdicts.append(self._verdict(n, candidate, incumbent, self.measurer.duel(candidate, incumbent)))
        winners = [v for v in verdicts if v["promoted"]]
        record = max(winners, key=lambda v: v["gain"] if v["gain"] is not None else float("inf")) if winners \
            else verdicts[0]  # fmt: skip
        if len(verdicts) > 1:
            record = {**record, "finalists": [{"elite": v["engines"]["candidate"]["elite"], "promoted": v["promoted"],
                                               "gain": v["gain"], "figures": v["figures"], "why": v["why"]}
                                              for v in verdicts]}  # fmt: skip
            if record["promoted"]:
                record["why"] += f"; ahead by the most of the {len(winners)} of {len(verdicts)} finalists that won"
            else:
                record["why"] = f"none of {len(verdicts)} finalists won: " + "; ".join(
                    f"{v['engines']['candidate']['elite'][:12]}: {v['why']}" for v in verdicts)
        self.dir.duels.write(n, record)
        if record["promoted"]:
            c = record["figures"]["candidate"]
            entry = {"round": n, "run_dir": str(engine_run), "elite": record["engines"]["candidate"]["elite"],
                     "throughput": c["throughput"], "unit": record["unit"], "p99_ms": c["p99_ms"], **_fidelity(c),
                     "gain": record["gain"], "at": time.time()}  # fmt: skip
            self.dir.add_promotion(entry)
        self._event("promoted" if record["promoted"] else "not promoted", round=n,
                    engine=record["engines"]["candidate"], why=record["why"])  # fmt: skip

    def _verdict(self, n: int, candidate: dict[str, Any], incumbent: dict[str, Any] | None,
                 result: EvalResult) -> dict[str, Any]:  # fmt: skip
        """A duel's record: both engines' figures, the gain, and whether (and why) the candidate is promoted."""
        p, m = self.config.promote, result.metrics
        c, i = self.kind.figures(m), self.kind.figures(m, "rival_")
        why = why_not_promoted(self.kind, p, result)
        promoted, gain = not why, _gain(c, i)
        if promoted and m.get("rival_failed"):
            why = f"the incumbent failed its duel ({m['rival_failed'][:300]}); p99 {c['p99_ms']:.1f} ms"
        elif promoted:
            why = (f"{gain:+.1%} against the incumbent side by side, p99 {c['p99_ms']:.1f} ms, "
                   f"{self.kind.fidelity_text(_fidelity(c))} on {p.held_out_texts} held-out texts")  # fmt: skip
        return {"round": n, "promoted": promoted, "engines": {"candidate": candidate, "incumbent": incumbent},
                "figures": {"candidate": c, "incumbent": i}, "unit": self.kind.unit, "gain": gain,
                "status": str(result.status), "why": why}  # fmt: skip

    # --- helpers ------------------------------------------------------------------------------------

    def incumbent(self) -> dict[str, Any] | None:
        """The last promoted engine (``None``: none yet, the default configuration)."""
        last = self.dir.latest_promotion()
        return {"run_dir": last["run_dir"], "elite": last["elite"]} if last else None

    def _start(self, config: Path, run_dir: Path, *, max_evals: int, confirm: bool = True) -> _SearchProcess:
        """``evo run`` of ``config`` in ``run_dir`` (resumed if it exists) up to ``max_evals``, started."""
        cmd = [sys.executable, "-m", "evo", "run", str(config), "--run-dir", str(run_dir), "--max-evals",
               str(max_evals)]  # fmt: skip
        if is_run(run_dir):
            cmd.append("--resume")
        if not confirm:
            cmd.append("--no-confirm")
        return _SearchProcess(cmd, self.dir.search_log(run_dir.name))

    @staticmethod
    def _evaluations(run_dir: Path) -> int:
        if not is_run(run_dir):
            return 0
        from archive import Run, StoreError

        try:
            with Run.open(run_dir) as run:
                return run.store.count() - run.store.count("pending")
        except StoreError:  # created, its config not yet stored
            return 0

    @staticmethod
    def _best(run_dir: Path) -> float | None:
        from archive import Run

        with Run.open(run_dir) as run:
            best = run.best(1)
        return best[0].fitness if best else None

    def _event(self, what: str, **fields: Any) -> None:
        self.dir.add_event(what, **fields)
        self.note(f"{what}: " + ", ".join(f"{k}={v}" for k, v in fields.items() if k != "why")
                  + (f": {fields['why']}" if fields.get("why") else ""))  # fmt: skip
