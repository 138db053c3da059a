"""Helpers shared by the memory tests: entries of two tasks on two machines, and a tiny real run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from archive.memory import MemoryEntry, summary_text
from genome import Genome

HERE = {"id": "hw-here", "cpu_model": "Intel(R) Xeon(R) Processor"}
ELSEWHERE = {"id": "hw-else", "cpu_model": "AMD EPYC 7763"}
MATMUL_SIG = "void kernel(int M, int N, int K, const float *A, const float *B, float *C)"
MATMUL_DESC = "fp32 row-major matrix multiply C[M,N] = A[M,K] x B[K,N]"
SOFTMAX_DESC = "fp32 softmax over the last axis of a [rows, cols] matrix, max-subtracted"


def matmul(mr: int = 8, nr: int = 48, *, mc: int = 96, n: int = 1024, hardware: dict[str, Any] = HERE, vs: float = 1.0,
           source: str | None = None, **kw: Any) -> MemoryEntry:
    args = {"m": n, "n": n, "k": n, "threads": 1}
    genome = Genome(params={"MR": mr, "NR": nr, "MC": mc, "KC": 256}, source=source)
    fitness = 140.0 * vs
    summary = summary_text(task="matmul", task_args=args, genome=genome, hardware=hardware, fitness=fitness,
                           unit="GFLOP/s", vs_reference=vs, description=MATMUL_DESC)
    return MemoryEntry(task="matmul", task_args=args, genome=genome, hardware=hardware, fitness=fitness,
                       unit="GFLOP/s", vs_reference=vs, signature=kw.pop("signature", MATMUL_SIG), summary=summary,
                       run=kw.pop("run", "runs/mm"), **kw)


def softmax(vec: int = 16, *, hardware: dict[str, Any] = HERE, vs: float = 2.0) -> MemoryEntry:
    args = {"rows": 4096, "cols": 1024, "threads": 1}
    genome = Genome(params={"VEC": vec, "UNROLL": 4})
    summary = summary_text(task="softmax", task_args=args, genome=genome, hardware=hardware, fitness=30 * vs,
                           unit="GB/s", vs_reference=vs, description=SOFTMAX_DESC)
    return MemoryEntry(task="softmax", task_args=args, genome=genome, hardware=hardware, fitness=30 * vs,
                       unit="GB/s", vs_reference=vs, summary=summary, run="runs/sm")


def tiny_run(where: Path) -> Path:
    """A real, finished 6-evaluation matmul run (n=64) made by ``python -m evo run``; returns its directory."""
    cfg = {
        "name": "mm",
        "task": {"name": "matmul", "args": {"m": 64, "n": 64, "k": 64}},
        "evaluation": {"timing": {"max_seconds": 0.1, "max_repeats": 5}, "check_trials": 1},
        "search": {"workers": 1, "seed": 0, "initial_random": 3},
        "budget": {"max_evals": 6},
        "archive": {"descriptors": ["register_tile_area", "cache_block_kib"], "bins": [4, 4]},
    }
    where.mkdir(parents=True, exist_ok=True)
    (where / "mm.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "evo", "run", "mm.yaml", "--run-dir", "run"], cwd=where,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return where / "run"
