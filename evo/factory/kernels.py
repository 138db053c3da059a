"""The run configs of a factory's searches: a kernel search per slot task, at the model's own shapes, and the
engine search offered those kernel runs, under the factory's load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evo.factory.config import FactoryConfig
from runtime.engine.model import ModelConfig

__all__ = ["engine_run_config", "kernel_run_config"]


def _shapes(task: str, model: ModelConfig) -> tuple[dict[str, int], list[str], list[int]]:
    """The timed case at the model's shapes, the archive's descriptors and bins, per built-in slot task."""
    h, i = model.hidden, model.intermediate
    if task == "layernorm":
        return {"rows": 2048, "cols": h}, ["vector_width"], [4]
    if task == "gelu":
        return {"rows": 2048, "cols": i}, ["vector_width"], [4]
    if task == "softmax":  # rows of attention scores over a typical padded batch length
        return {"rows": 4096, "cols": min(128, model.max_tokens)}, ["vector_width", "rows_per_block"], [4, 4]
    from runtime.task import load_task_class
    from runtime.tasks._linear import LinearTask

    cls = load_task_class(task)
    if issubclass(cls, LinearTask):  # every linear task: a batch of 256 tokens through the feed-forward up GEMM
        return {"m": 256, "k": h, "n": i}, [cls.block[0]], [4]
    raise ValueError(f"the factory has no kernel search for task {task!r}")


def kernel_run_config(task: str, config: FactoryConfig, model: ModelConfig, max_evals: int) -> dict[str, Any]:
    args, descriptors, bins = _shapes(task, model)
    return {
        "task": {"name": task, "args": {**args, "threads": 1}},
        "search": {"seed": config.seed, "initial_random": 8, "confirm": {"repeats": config.budget.confirm_repeats}},
        "budget": {"max_evals": max_evals},
        "archive": {"kind": "grid", "descriptors": descriptors, "bins": bins if len(bins) > 1 else bins[0]},
        "execution": config.execution.model_dump(mode="json"),
    }


def engine_run_config(config: FactoryConfig, kernel_runs: dict[str, Path]) -> dict[str, Any]:
    """The engine search: the factory's load, following each kernel run by its slot (its top 2 elites
    offered, and each new one as it lands: the kernel searches run alongside, and a run may not exist yet)."""
    from runtime.task import load_task_class

    by_slot: dict[str, list[dict[str, Any]]] = {}
    for task, run_dir in sorted(kernel_runs.items()):
        slot = load_task_class(task).slot.name  # type: ignore[attr-defined]  # a slot task: it declares it
        by_slot.setdefault(slot, []).append({"run_dir": str(run_dir), "top": 2, "follow": True, "optional": True})
    load = config.load
    args: dict[str, Any] = {
        **load.model_dump(), "similarity_floor": config.promote.similarity_floor,
        "kernels": {slot: runs[0] if len(runs) == 1 else runs for slot, runs in by_slot.items()},
    }  # fmt: skip
    if config.model_dir:
        args["model_dir"] = config.model_dir
    return {
        "task": {"name": "engine", "args": args},
        "search": {"seed": config.seed, "initial_random": 4, "confirm": {"repeats": config.budget.confirm_repeats}},
        "budget": {"max_evals": config.budget.engine_evals},
        "archive": {"descriptors": ["p99_ms", "memory_mb"], "bins": [4, 4],
                    "ranges": [[0, load.p99_budget_ms], [0, 4096]]},
        "execution": config.execution.model_dump(mode="json"),
    }  # fmt: skip

