"""Builds a run's LLM operators from its config: one shared session (models, cache, budget) for all."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from archive import Store
from evo.errors import UserError
from evo.llm import LLM_OPERATORS
from evo.llm.agentic import Agentic
from evo.llm.cache import ResponseCache
from evo.llm.operators import LLMDiff, LLMOperator, LLMParams, LLMRewrite
from evo.llm.prompt import PromptBook
from evo.llm.session import LLMSession
from evo.llm.tools import SandboxTools
from genome import Genome
from runtime import EvalRequest, Task
from runtime.hardware import fingerprint

if TYPE_CHECKING:
    from evo.config import RunConfig

__all__ = ["build_llm_operators"]


def build_llm_operators(
    config: RunConfig,
    *,
    store: Store,
    task: Task,
    cache_dir: Path,
    log_dir: Path,
    note: Callable[[str], None] | None = None,
    memory: Callable[[str], Sequence[Any]] | None = None,
    current: Callable[[], RunConfig] | None = None,
) -> dict[str, LLMOperator]:
    """The LLM operators weighted above zero (none without an ``llm:`` section).

    ``current`` returns the run's config as it is now (default: ``config``): the agent's tool requests are
    built from it, so they carry what the task was offered since the run started (an engine task's new kernels).
    """
    wanted = [n for n in LLM_OPERATORS if config.search.operators.weights.get(n, 0) > 0]  # type: ignore[call-overload]
    if config.llm is None or not wanted:
        return {}
    settings = config.llm
    if importlib.util.find_spec("openai") is None:
        raise UserError("llm: the openai package is not installed: pip install 'evoforge[llm]'")
    session = LLMSession(settings, cache=ResponseCache.load(store), tokens_used=store.llm_tokens_used(), note=note)
    book = PromptBook(settings.prompts)
    hardware = fingerprint(config.evaluation.compiler.cc)
    ops: dict[str, LLMOperator] = {}
    for name in wanted:
        if name == "agentic":
            tools = SandboxTools(task=task, make_request=_requests(current or (lambda: config), cache_dir),
                                 run_dir=store.path.parent, log_dir=log_dir / "agent", memory=memory)
            ops[name] = Agentic(session, book, hardware=hardware, tools=tools)
        else:
            cls = {"llm_diff": LLMDiff, "llm_rewrite": LLMRewrite, "llm_params": LLMParams}[name]
            ops[name] = cls(session, book, hardware=hardware)
    return ops


def _requests(current: Callable[[], RunConfig], cache_dir: Path) -> Callable[[Genome, str, str], EvalRequest]:
    def make(genome: Genome, key: str, stages: str) -> EvalRequest:
        config = current()
        return EvalRequest(key=key, genome=genome, task=config.task, settings=config.evaluation,
                           cache_dir=str(cache_dir), sys_path=tuple(p for p in sys.path if p),
                           stages=stages)  # type: ignore[arg-type]

    return make
