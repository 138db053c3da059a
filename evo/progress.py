"""Progress while a run goes on, and the summary at its end."""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from archive import run_db
from evo.confirm import provenance
from runtime import EvalResult, Status

if TYPE_CHECKING:
    from evo.search import RunSummary

__all__ = ["Reporter", "RichReporter", "SilentReporter"]


class Reporter(Protocol):
    def start(self, *, total: int | None, done: int, workers: int) -> None: ...
    def update(self, *, result: EvalResult, add_status: Any, best: float | None, qd: dict[str, float]) -> None: ...
    def note(self, message: str) -> None: ...
    def finish(self, summary: RunSummary) -> None: ...


class SilentReporter:
    def start(self, *, total: int | None, done: int, workers: int) -> None:
        pass

    def update(self, *, result: EvalResult, add_status: Any, best: float | None, qd: dict[str, float]) -> None:
        pass

    def note(self, message: str) -> None:
        pass

    def finish(self, summary: RunSummary) -> None:
        pass


class RichReporter:
    """A live bar: evaluations, best fitness, coverage, evals/s and failures by status. Where the output is not a
    terminal (a log, CI), a bar is not drawn until the end: a line with the same figures is printed every
    ``log_every_s`` seconds instead."""

    def __init__(self, *, unit: str, console: Console | None = None, log_every_s: float = 30.0) -> None:
        self.unit = unit
        self.console = console or Console(stderr=True)
        self.log_every_s = log_every_s
        self._logged = -math.inf  # the first update prints, however long the machine has been up
        self.progress = Progress(
            TextColumn("[bold]evaluating"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[stats]}"),
            console=self.console,
            transient=False,
        )
        self.failures: Counter[str] = Counter()
        self._task_id: Any = None
        self._t0 = 0.0
        self._session = 0

    def start(self, *, total: int | None, done: int, workers: int) -> None:
        self._t0 = time.monotonic()
        self.progress.start()
        self._task_id = self.progress.add_task("run", total=total, completed=done, stats="")
        if done:
            self.note(f"resuming: {done} evaluations already committed")

    def update(self, *, result: EvalResult, add_status: Any, best: float | None, qd: dict[str, float]) -> None:
        self._session += 1
        if result.status != Status.OK:
            self.failures[str(result.status)] += 1
        rate = self._session / max(time.monotonic() - self._t0, 1e-9)
        fails = " ".join(f"{k}:{v}" for k, v in sorted(self.failures.items())) or "none"
        best_s = f"{best:.2f} {self.unit}" if best is not None else "-"
        stats = f"best {best_s} | coverage {qd['coverage']:.0%} | {rate:.2f} eval/s | failed {fails}"
        self.progress.update(self._task_id, advance=1, stats=stats)
        now = time.monotonic()
        if not self.console.is_terminal and now - self._logged >= self.log_every_s:
            self._logged = now
            task = self.progress.tasks[0]
            of = f"/{task.total:.0f}" if task.total else ""
            self.console.print(f"{now - self._t0:6.0f} s  {task.completed:.0f}{of} evaluated | {stats}")

    def note(self, message: str) -> None:
        self.progress.console.print(message)

    def finish(self, summary: RunSummary) -> None:
        self.progress.stop()
        out = Console()
        table = Table(title=f"evoforge run: {summary.run_dir}", show_header=False)
        table.add_column(style="bold")
        table.add_column()
        table.add_row("stopped", summary.stopped)
        table.add_row("evaluations", f"{summary.evaluations} ({summary.this_session} this session, "
                                      f"{summary.elapsed:.0f} s)")
        table.add_row("statuses", ", ".join(f"{k} {v}" for k, v in sorted(summary.counts.items())))
        table.add_row("archive", f"{summary.qd['filled']:.0f} cells filled, coverage {summary.qd['coverage']:.0%}, "
                                 f"QD-score {summary.qd['qd_score']:.1f}")
        best = summary.best
        if best is not None:
            vs = best.metrics.get("vs_reference")
            table.add_row("best kernel", best.id[:12])
            table.add_row("fitness", f"{best.fitness:.2f} {best.unit}, {provenance(best.metrics)}")
            table.add_row("vs_reference", f"{vs:.3f}x (normalised: the ratio to the reference timed beside it)"
                          if vs is not None else "-")  # fmt: skip
            table.add_row("params", ", ".join(f"{k}={v}" for k, v in best.params.items()) or "(code genome)")
        else:
            table.add_row("best kernel", "none: no candidate passed its checks")
        if summary.extra:
            x = summary.extra
            table.add_row("memory", f"{x['memory_seeds']} seeds from {len(x['seeded_from'])} earlier runs, "
                                    f"{x['memory_recorded']} discoveries recorded, "
                                    f"{x['novelty_rejected']} near-duplicates rejected")
        table.add_row("stored in", str(run_db(summary.run_dir)))
        table.add_row("next", f"evo archive best {summary.run_dir} --top 5")
        out.print(table)
