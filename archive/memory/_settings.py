"""The memory's settings (the ``memory:`` section of a run config) and where the memory lives by default."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["MEMORY_DIR_ENV", "MemorySettings", "default_memory_dir"]

MEMORY_DIR_ENV = "EVOFORGE_MEMORY_DIR"
"""Environment variable that overrides the default memory directory (tests point it at a tmp dir)."""


def default_memory_dir() -> Path:
    """``$EVOFORGE_MEMORY_DIR``, else ``$XDG_CACHE_HOME/evoforge/memory``, else ``~/.cache/evoforge/memory``."""
    override = os.environ.get(MEMORY_DIR_ENV)
    if override:
        return Path(override).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "evoforge" / "memory"


class MemorySettings(BaseModel):
    """The memory of discoveries: where it lives, how it seeds runs and rejects near-duplicates."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="use the memory: seed from it, check novelty, record improvements")
    path: str | None = Field(
        None,
        description="memory directory shared by runs (default: $EVOFORGE_MEMORY_DIR, else "
        "$XDG_CACHE_HOME/evoforge/memory, else ~/.cache/evoforge/memory)",
    )
    seed_k: int = Field(8, ge=0, description="memory entries turned into seeds of the initial population (at most "
                        "a quarter of the run's budget.max_evals)")
    novelty_threshold: float | None = Field(
        0.98,
        gt=0,
        le=1,
        description="a proposed code genome whose cosine similarity to one already evaluated in this run is at "
        "least this is rejected before evaluation (null disables the check)",
    )
    novelty_max_resamples: int = Field(20, ge=0, description="proposals resampled after novelty rejections per slot")
    index: Literal["auto", "flat", "hnsw"] = Field(
        "auto", description="vector index: flat (exact), hnsw (approximate), auto (flat up to approximate_after)"
    )
    approximate_after: int = Field(20_000, ge=1, description="auto: entries beyond which the index becomes HNSW")
    embedder: str = Field(
        "minilm",
        description="text embedder: minilm (all-MiniLM-L6-v2, offline), hash (hashed bag of tokens, no model), "
        "or 'module:Class' implementing archive.memory.Embedder",
    )
    prompt_hits: int = Field(3, ge=0, description="memory hits offered to the LLM operators per prompt")

    def resolved_path(self) -> Path:
        """The memory directory: ``path`` if set, else :func:`default_memory_dir`."""
        return Path(self.path).expanduser() if self.path else default_memory_dir()
