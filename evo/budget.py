"""When to stop: evaluations (over the whole run), wall time (this session), a target fitness."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from evo.config import BudgetConfig

__all__ = ["Budget"]


@dataclass
class Budget:
    config: BudgetConfig
    started: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def may_submit(self, evaluated: int, in_flight: int) -> bool:
        """Whether another candidate may start (in-flight ones count against max_evals)."""
        if self.config.max_evals is not None and evaluated + in_flight >= self.config.max_evals:
            return False
        return self.exhausted(evaluated, None) is None

    def exhausted(self, evaluated: int, best: float | None) -> str | None:
        """Why the run should stop now, or ``None``."""
        c = self.config
        if c.max_evals is not None and evaluated >= c.max_evals:
            return f"reached max_evals={c.max_evals}"
        if c.max_time is not None and self.elapsed() >= c.max_time:
            return f"reached max_time={c.max_time:g}s"
        if c.target_fitness is not None and best is not None and best >= c.target_fitness:
            return f"reached target_fitness={c.target_fitness:g}"
        return None
