"""The genome: parameter values plus optional source, with a canonical content id."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

__all__ = ["Genome", "canonical_json"]


def canonical_json(obj: Any) -> str:
    """Key-sorted, whitespace-free JSON: the same value always gives the same bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


@dataclass(frozen=True)
class Genome:
    """A candidate: ``params`` (name -> scalar) and, for code genomes, its ``source``.

    ``source`` is ``None`` when the candidate is the task's template filled with ``params``.
    """

    params: Mapping[str, Any] = field(default_factory=dict)
    source: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", dict(sorted(self.params.items())))

    @cached_property
    def id(self) -> str:
        """sha256 of the canonical JSON of (params, source)."""
        return hashlib.sha256(canonical_json(self.to_dict()).encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {"params": dict(self.params), "source": self.source}

    def to_json(self) -> str:
        return canonical_json(self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Genome:
        return cls(params=dict(data.get("params") or {}), source=data.get("source"))

    @classmethod
    def from_json(cls, text: str) -> Genome:
        return cls.from_dict(json.loads(text))

    def with_params(self, params: Mapping[str, Any]) -> Genome:
        return Genome(params=params, source=self.source)

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Genome) and other.id == self.id
