"""A memory entry (one discovery, or one notable failure), the text that is embedded, and a search hit."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from genome import Genome, canonical_json

__all__ = ["EntryKind", "MemoryEntry", "MemoryHit", "hardware_id", "summary_text"]

EntryKind = Literal["improvement", "failure"]

_FEATURES = re.compile(r"_mm\d*_\w+|__builtin_\w+|#\s*pragma\s+\w+(?:\s+\w+)?|\brestrict\b|\baligned\b")


def hardware_id(hardware: Mapping[str, Any] | None) -> str:
    """The fingerprint's own ``id`` (see runtime.hardware), else a hash of it; ``""`` when unknown."""
    if not hardware:
        return ""
    hid = hardware.get("id")
    return str(hid) if hid else hashlib.sha256(canonical_json(dict(hardware)).encode()).hexdigest()[:16]


def _fmt_args(args: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(args.items()))


def source_digest(source: str) -> str:
    """A short description of a code genome: hash, size, and the intrinsics and pragmas it uses."""
    sha = hashlib.sha256(source.encode()).hexdigest()[:8]
    features = list(dict.fromkeys(" ".join(m.split()) for m in _FEATURES.findall(source)))[:8]
    uses = f", uses {' '.join(features)}" if features else ""
    return f"code {sha} ({source.count(chr(10)) + 1} lines{uses})"


def summary_text(
    *,
    task: str,
    task_args: Mapping[str, Any],
    genome: Genome,
    hardware: Mapping[str, Any] | None = None,
    fitness: float | None = None,
    unit: str = "",
    vs_reference: float | None = None,
    kind: EntryKind = "improvement",
    note: str = "",
    description: str = "",
) -> str:
    """The text embedded for an entry, e.g. ``matmul k=1024 m=1024 n=1024 threads=1 on <cpu>: MR=8 NR=48 ...``.

    ``description`` (the task's, e.g. "fp32 row-major matrix multiply") helps a search in other words find it.
    """
    head = f"{task} ({description}) {_fmt_args(task_args)}" if description else f"{task} {_fmt_args(task_args)}"
    head = head.strip()
    cpu = (hardware or {}).get("cpu_model")
    if cpu:
        head += f" on {cpu}"
    body = [_fmt_args(genome.params) or "no params"]
    if genome.source is not None:
        body.append(source_digest(genome.source))
    figures = []
    if fitness is not None:
        figures.append(f"{fitness:.4g} {unit}".strip())
    if vs_reference is not None:
        figures.append(f"{vs_reference:.2f}x reference")
    text = f"{head}: {'; '.join(body)}"
    if figures:
        text += ", " + ", ".join(figures)
    if kind == "failure":
        text = "failure: " + text
    return text + (f" ({note})" if note else "")


@dataclass(frozen=True, kw_only=True)
class MemoryEntry:
    """One remembered discovery (``kind="improvement"``) or notable failure (a change that broke or slowed a kernel).

    ``id`` and ``summary`` are filled in when left empty: the id hashes (task, task_args, genome id, hardware
    id), which is what makes two entries duplicates; the summary is :func:`summary_text`.
    """

    task: str
    task_args: dict[str, Any]
    genome: Genome
    kind: EntryKind = "improvement"
    backend: str = "c"
    signature: str | None = None  # the task's C prototype: code seeds are reused only where it matches
    hardware: dict[str, Any] = field(default_factory=dict)
    fitness: float | None = None
    unit: str = ""
    vs_reference: float | None = None
    note: str = ""  # e.g. the error of a failure
    summary: str = ""
    run: str = ""
    created_at: float = 0.0
    id: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("improvement", "failure"):
            raise ValueError(f"kind must be 'improvement' or 'failure', not {self.kind!r}")
        if not self.created_at:
            object.__setattr__(self, "created_at", time.time())
        if not self.summary:
            text = summary_text(task=self.task, task_args=self.task_args, genome=self.genome, hardware=self.hardware,
                                fitness=self.fitness, unit=self.unit, vs_reference=self.vs_reference, kind=self.kind,
                                note=self.note)
            object.__setattr__(self, "summary", text)
        if not self.id:
            key = canonical_json([self.task, self.task_args, self.genome.id, self.hardware_id])
            object.__setattr__(self, "id", hashlib.sha256(key.encode()).hexdigest()[:20])

    @property
    def hardware_id(self) -> str:
        return hardware_id(self.hardware)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (one line of ``evo memory export``)."""
        return {
            "id": self.id, "kind": self.kind, "task": self.task, "task_args": self.task_args,
            "backend": self.backend, "signature": self.signature, "hardware": self.hardware,
            "genome": self.genome.to_dict(), "fitness": self.fitness, "unit": self.unit,
            "vs_reference": self.vs_reference, "note": self.note, "summary": self.summary, "run": self.run,
            "created_at": self.created_at,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MemoryEntry:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k != "genome"}
        return cls(**known, genome=Genome.from_dict(d.get("genome") or {}))


@dataclass(frozen=True)
class MemoryHit:
    """A search result: the entry and its score (cosine similarity, or the seeding blend)."""

    entry: MemoryEntry
    score: float
    similarity: float

    def to_dict(self) -> dict[str, Any]:
        return {"score": self.score, "similarity": self.similarity, **self.entry.to_dict()}
