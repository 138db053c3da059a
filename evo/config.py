"""The job config: YAML validated into typed models (unknown keys are errors; every default documented)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from archive import Run
from archive.memory import MemorySettings
from evo.errors import UserError
from evo.llm import LLM_OPERATORS, LLMSettings
from genome import ParamSpace, SpaceError, SpaceSpec
from runtime import EvalSettings, Task, TaskLoadError, TaskSpec, load_task_class
from runtime.followed_runs import FollowsRuns

__all__ = [
    "ArchiveConfig",
    "BudgetConfig",
    "OperatorsConfig",
    "RunConfig",
    "SearchConfig",
    "SelectionConfig",
    "dump_config",
    "load_config",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BudgetConfig(_Model):
    """When the search stops: whichever limit is reached first (at least one must be set)."""

    max_evals: int | None = Field(200, ge=1, description="evaluations in total, including earlier sessions")
    max_time: float | None = Field(None, gt=0, description="wall seconds of this session")
    target_fitness: float | None = Field(None, description="stop once an ok candidate reaches this fitness")

    @model_validator(mode="after")
    def _some_limit(self) -> BudgetConfig:
        if self.max_evals is None and self.max_time is None and self.target_fitness is None:
            raise ValueError("set at least one of max_evals, max_time, target_fitness")
        return self


class SelectionConfig(_Model):
    """How parents are drawn from the archive's elites."""

    scheme: Literal["uniform", "tournament", "curiosity"] = Field(
        "tournament",
        description="uniform over elites; tournament (fitness-biased); curiosity (elites whose children "
        "recently entered the archive are preferred)",
    )
    tournament_size: int = Field(3, ge=2, description="elites drawn per tournament")
    uniform_fraction: float = Field(
        0.3, ge=0, le=1, description="share of parents drawn uniformly whatever the scheme (keeps diversity)"
    )


class MutationConfig(_Model):
    indpb: float = Field(0.3, gt=0, le=1, description="probability that each gene mutates")
    index_sigma: float = Field(1.0, gt=0, description="std of the index step of int and pow2 genes")
    eta: float = Field(20.0, gt=0, description="crowding degree of the polynomial mutation of float genes")


class OperatorsConfig(_Model):
    """Variation operators and their weights (normalised; a zero weight disables one)."""

    weights: dict[
        Literal["mutate", "crossover", "random", "llm_diff", "llm_rewrite", "llm_params", "agentic"], float
    ] = Field(
        default_factory=lambda: {"mutate": 0.7, "crossover": 0.2, "random": 0.1},
        description="relative weight of each operator (llm_diff, llm_rewrite, llm_params, agentic need llm:)",
    )
    adaptive: bool = Field(
        False, description="choose operators by a bandit rewarded when their children enter the archive"
    )
    mutation: MutationConfig = Field(default_factory=MutationConfig)
    crossover_indpb: float = Field(0.5, gt=0, le=1, description="per-gene swap probability of uniform crossover")

    @model_validator(mode="after")
    def _positive(self) -> OperatorsConfig:
        if any(w < 0 for w in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise ValueError("weights must be >= 0 and not all zero")
        return self


class ConfirmConfig(_Model):
    """The best re-measured after the search: a figure picked for being the highest is biased high."""

    repeats: int = Field(3, ge=0, description="fresh evaluations of the best after the search (0: none)")
    top: int = Field(5, ge=1, description="candidates confirmed at most, while one not yet confirmed recorded a "
                     "higher vs_reference than the confirmed leader measured")


class SearchConfig(_Model):
    workers: int | None = Field(None, ge=1, description="evaluation workers (default: the cores this process may use)")
    seed: int = Field(0, description="run seed: proposals derive their randomness from (seed, proposal counter)")
    initial_random: int = Field(16, ge=0, description="random valid samples added to the task's seeds at start")
    selection: SelectionConfig = Field(default_factory=SelectionConfig)
    operators: OperatorsConfig = Field(default_factory=OperatorsConfig)
    max_dedup_tries: int = Field(50, ge=1, description="proposals tried before giving up a slot on duplicates")
    confirm: ConfirmConfig = Field(default_factory=ConfirmConfig)


class ArchiveConfig(_Model):
    """The MAP-Elites archive: which descriptors span it, and how it is cut into cells."""

    kind: Literal["grid", "cvt"] = Field("grid", description="grid: bins per descriptor; cvt: Voronoi cells")
    descriptors: list[str] = Field(min_length=1, description="descriptor names offered by the task")
    bins: list[int] | int = Field(8, description="grid: bins per descriptor (one number for all)")
    ranges: list[tuple[float, float]] | None = Field(
        None, description="[low, high] per descriptor, fixed for the run (default: the task's suggestion)"
    )
    cells: int = Field(64, ge=2, description="cvt: number of cells")
    qd_offset: float = Field(0.0, description="subtracted from each elite's fitness in the QD-score")

    @model_validator(mode="after")
    def _lengths(self) -> ArchiveConfig:
        n = len(self.descriptors)
        if isinstance(self.bins, list) and len(self.bins) != n:
            raise ValueError(f"bins has {len(self.bins)} entries for {n} descriptors")
        if self.ranges is not None:
            if len(self.ranges) != n:
                raise ValueError(f"ranges has {len(self.ranges)} entries for {n} descriptors")
            for lo, hi in self.ranges:
                if not hi > lo:
                    raise ValueError(f"range [{lo}, {hi}] must have high > low")
        return self

    def bin_list(self) -> list[int]:
        return self.bins if isinstance(self.bins, list) else [self.bins] * len(self.descriptors)


class ExecutionConfig(_Model):
    """Where candidates are evaluated: sandboxed workers on this machine, or on every node of a Ray cluster."""

    kind: Literal["local", "ray"] = Field("local", description="local: workers on this machine; ray: on a Ray cluster")
    address: str = Field("auto", description="the Ray cluster (auto: the one `ray start` made here; or host:port, "
                         "ray://host:port)")
    workers_per_node: int | None = Field(None, ge=1, description="evaluation slots per Ray node (default: its CPUs)")
    use_head: bool = Field(True, description="evaluate on the Ray head node too (false: keep it for the driver)")
    fingerprints: Literal["same", "ratio"] = Field(
        "same", description="same: refuse nodes that differ in CPU, compiler or BLAS; ratio: rank by vs_reference "
        "measured on each node")


class RunConfig(_Model):
    """A whole job: the task, how candidates are evaluated, how the search moves, when it stops."""

    name: str | None = Field(None, description="run name (default: the config file's stem); runs/<name> by default")
    task: TaskSpec
    evaluation: EvalSettings = Field(default_factory=EvalSettings)
    search: SearchConfig = Field(default_factory=SearchConfig)
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    archive: ArchiveConfig
    space: SpaceSpec | None = Field(
        None, description="replaces the task's parameter space (params and constraints the template understands)"
    )
    llm: LLMSettings | None = Field(None, description="language models as operators (none: classical operators only)")
    memory: MemorySettings = Field(
        default_factory=MemorySettings, description="the memory of discoveries shared by runs (seeds, hints, novelty)"
    )
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig)
    _built_task: tuple[TaskSpec, Task] | None = PrivateAttr(None)  # (the spec it was built from, the task)

    def make_space(self, task: Task) -> ParamSpace:
        """The space the search explores: the config's override (completed by the task), else the task's own."""
        if self.space is None:
            return task.space()
        space = ParamSpace(self.space.params, self.space.constraints)
        return task.complete_space(space) if isinstance(task, FollowsRuns) else space

    def make_task(self) -> Task:
        """The task this config names, built once per task spec (copies of the config that keep the spec share
        it: the task is built once per process, not by every part that asks)."""
        built = self._built_task
        if built is not None and built[0] is self.task:
            return built[1]
        try:
            cls = load_task_class(self.task.name)
        except TaskLoadError as exc:
            raise UserError(f"task.name: {exc}") from None
        try:
            task = cls(self.task.args)
        except ValidationError as exc:
            raise UserError(_first_error(exc, prefix="task.args")) from None
        self._built_task = (self.task, task)
        return task


def _first_error(exc: ValidationError, *, prefix: str = "") -> str:
    errors = exc.errors()
    e = errors[0]
    loc = ".".join(str(p) for p in ((prefix,) if prefix else ()) + tuple(e["loc"]))
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    got = f" (got {e['input']!r})" if e["type"] not in ("missing", "extra_forbidden") and "input" in e else ""
    msg = "unknown key: remove it or check its spelling" if e["type"] == "extra_forbidden" else e["msg"]
    return f"{loc}: {msg}{got}{more}"


OBSOLETE: dict[str, str] = {
    "search.duel_margin": "every would-be new best is now re-timed side by side against the best before it is "
    "crowned, whatever its margin",
}
"""Keys earlier versions accepted, and why they are gone: a config (or a run's stored config) naming one
still loads, with a note, and without the key."""


def _migrated(data: dict[str, Any], source: str) -> dict[str, Any]:
    """``data`` without the :data:`OBSOLETE` keys, each dropped with a note on stderr."""
    out = dict(data)
    for key, why in OBSOLETE.items():
        section, _, name = key.partition(".")
        if isinstance(out.get(section), dict) and name in out[section]:
            out[section] = {k: v for k, v in out[section].items() if k != name}
            print(f"note: {source}: {key} is obsolete and ignored: {why}; remove it", file=sys.stderr)
    return out


def parse_config(data: Any, *, source: str, base_dir: Path | None = None) -> RunConfig:
    """Validates a parsed YAML document; errors name ``source`` and the key path."""
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a mapping of keys at the top level")
    data = _migrated(data, source)
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise UserError(f"{source}: {_first_error(exc)}") from None
    try:  # relative paths in task args mean relative to where `evo run` runs, as --run-dir does
        cls = load_task_class(config.task.name)
        args = cls.resolve_args(config.task.args, os.getcwd())
        if issubclass(cls, FollowsRuns):
            args = cls.read_runs(args, Run.open)
        config = config.model_copy(update={"task": config.task.model_copy(update={"args": args})})
    except TaskLoadError:
        pass  # make_task says what is wrong with the name
    try:
        task = config.make_task()
    except UserError as exc:
        raise UserError(f"{source}: {exc}") from None
    try:
        config.make_space(task)
    except SpaceError as exc:
        raise UserError(f"{source}: space: {exc}") from None
    llm_weighted = [n for n in LLM_OPERATORS if config.search.operators.weights.get(n, 0) > 0]  # type: ignore[call-overload]
    if llm_weighted and config.llm is None:
        raise UserError(f"{source}: search.operators.weights: {', '.join(llm_weighted)} need an llm: section "
                        "(add one, see configs/matmul_cpu_llm.yaml, or set their weights to 0)")
    offered = task.descriptors()
    for name in config.archive.descriptors:
        if name not in offered:
            raise UserError(
                f"{source}: archive.descriptors: {name!r} is not offered by task {config.task.name!r} "
                f"(choose from {', '.join(sorted(offered))})"
            )
    return config


def load_config(path: str | os.PathLike[str]) -> RunConfig:
    """Reads and validates a YAML config; a user's mistake raises :class:`UserError` naming the file and key."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file not found: {p} (check the path; ready configs are in configs/)")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"{p}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    # A user's task module (``module:Class``) may sit beside its config.
    config_dir = str(p.parent.resolve())
    if config_dir not in sys.path:
        sys.path.insert(0, config_dir)
    config = parse_config(data, source=str(p))
    if config.name is None:
        config = config.model_copy(update={"name": p.stem})
    return config


def dump_config(config: RunConfig) -> str:
    """The resolved config (every default filled in) as YAML, as stored with a run."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
