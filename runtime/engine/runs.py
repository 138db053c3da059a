"""Reading a run directory from the runtime: its task, an elite's genome, a kernel elite's source.

``runtime`` may not import ``archive`` (archive imports runtime), so this is a small read-only view of
the store's documented tables (``meta``: the frozen config; ``candidates``: genomes and results).
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml

from genome import Genome
from runtime.engine.ops import SLOT_TASKS, Ops, c_slot
from runtime.settings import CompilerSettings, TaskSpec
from runtime.task import load_task_class
from runtime.toolchain.cc import compile_source, load_kernel

__all__ = ["KernelSource", "RunNotFound", "StoredCandidate", "StoredRun", "build_ops"]


class RunNotFound(LookupError):
    """No run, or no such candidate in it."""


@dataclass(frozen=True)
class StoredCandidate:
    id: str
    genome: Genome
    status: str
    fitness: float | None
    metrics: dict[str, Any]


@dataclass(frozen=True)
class KernelSource:
    """A kernel elite made ready to compile: its rendered source and the flags its task asks for."""

    slot: str
    id: str
    source: str
    flags: tuple[str, ...]
    task: str = ""  # the task that evolved it (empty: the slot's first, SLOT_TASKS[slot][0])


class StoredRun:
    """A run directory, read-only."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        db = self.path / "archive.db"
        if not db.is_file():
            raise RunNotFound(f"no run in {self.path} (expected {db})")
        self._db = db
        text = self._query("SELECT value FROM meta WHERE key = 'config'")
        if not text:
            raise RunNotFound(f"{db} has no stored config: it was not written by evo run")
        self.config: dict[str, Any] = yaml.safe_load(text[0][0])
        self.task = TaskSpec.model_validate(self.config["task"])
        self.compiler = CompilerSettings.model_validate(self.config.get("evaluation", {}).get("compiler", {}))
        self.cache_dir = self.path / "cache"

    def _query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        con = sqlite3.connect(f"file:{quote(str(self._db.resolve()))}?mode=ro", uri=True)
        try:
            return con.execute(sql, params).fetchall()
        finally:
            con.close()

    def elite_ids(self, top: int) -> list[str]:
        """Ids of the ``top`` fittest ok candidates, best first."""
        rows = self._query("SELECT id FROM candidates WHERE status = 'ok' AND fitness IS NOT NULL "
                           "ORDER BY fitness DESC, eval_seq LIMIT ?", (top,))
        return [r[0] for r in rows]

    def candidate(self, cid: str) -> StoredCandidate:
        """The candidate with this id or unique id prefix."""
        key = cid.strip().lower()
        rows = self._query("SELECT id, params, source, status, fitness, metrics FROM candidates "
                           "WHERE id >= ? AND id < ? ORDER BY id LIMIT 2", (key, key + "\x7f"))
        if not key or not rows:
            raise RunNotFound(f"no candidate {cid!r} in {self.path}")
        if len(rows) > 1 and rows[0][0] != key:
            raise RunNotFound(f"{cid!r} is ambiguous in {self.path}: give more of the id")
        id_, params, source, status, fitness, metrics = rows[0]
        return StoredCandidate(id_, Genome(params=json.loads(params), source=source), status, fitness,
                               json.loads(metrics))

    def kernel_source(self, slot: str, cid: str) -> KernelSource:
        """The rendered source of kernel elite ``cid`` for ``slot`` (its run's task must fit the slot)."""
        want = SLOT_TASKS.get(slot)
        if want is None:
            raise ValueError(f"unknown slot {slot!r} (slots: {', '.join(SLOT_TASKS)})")
        if self.task.name not in want:
            raise ValueError(f"{self.path} evolved {self.task.name!r} kernels; slot {slot!r} takes "
                             f"{' or '.join(repr(t) for t in want)} ones")
        cand = self.candidate(cid)
        if cand.status != "ok":
            raise ValueError(f"candidate {cand.id[:12]} in {self.path} is {cand.status}, not ok")
        task = load_task_class(self.task.name)(self.task.args)
        return KernelSource(slot, cand.id, task.render(cand.genome), tuple(task.compile_flags()), self.task.name)


def compile_kernels(
    kernels: dict[str, KernelSource], *, compiler: CompilerSettings, cache_dir: str, work_dir: str | None = None
) -> float:
    """Compiles the kernels into the cache without loading them (nothing of them runs); returns the seconds
    the compiler took (0 when every one was cached). Raises :class:`runtime.toolchain.CompileError`."""
    return sum(compile_source(ks.source, compiler=compiler, extra_flags=ks.flags, cache_dir=cache_dir,
                              work_dir=work_dir).seconds for ks in kernels.values())


def build_ops(
    kernels: dict[str, KernelSource], *, compiler: CompilerSettings, cache_dir: str, work_dir: str | None = None
) -> Ops:
    """An operator table with the given slots filled by compiled kernels (the rest numpy).

    Raises :class:`runtime.toolchain.CompileError` when a kernel does not compile.
    """
    ops = Ops()
    try:
        for slot, ks in kernels.items():
            built = compile_source(ks.source, compiler=compiler, extra_flags=ks.flags, cache_dir=cache_dir,
                                   work_dir=work_dir)
            kernel = load_kernel(built.path, "kernel")
            ops.kernels[slot] = kernel
            fn = c_slot(slot, kernel, ks.task or None)
            setattr(ops, slot, fn)
            if slot == "linear":  # the bias-free GEMM ahead of the fused bias + GELU runs on it too
                ops.matmul = fn
    except BaseException:
        ops.close()
        raise
    return ops
