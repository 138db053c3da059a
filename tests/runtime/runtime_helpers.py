"""Helpers of the runtime tests: vecadd candidates, fast settings, one-request evaluation."""

from __future__ import annotations

import os
from typing import Any

from genome import Genome
from runtime.executors import EvalRequest, LocalPool
from runtime.result import EvalResult
from runtime.settings import EvalSettings, TaskSpec

HERE = os.path.dirname(os.path.abspath(__file__))
VECADD = TaskSpec(name="vecadd_task:VecAdd")
SIGNATURE = "void kernel(int n, float a, float b, const float *x, float *y)"


def kernel(body: str, prelude: str = "") -> str:
    """A vecadd candidate whose function body is ``body``."""
    return f"{prelude}\n{SIGNATURE} {{\n{body}\n}}\n"


CORRECT = "for (int i = 0; i < n; i++) y[i] = a * x[i] + b;"

# An honest matmul candidate (naive triple loop), the base every cheating matmul kernel copies.
MATMUL_SIGNATURE = "void kernel(int M, int N, int K, const float *A, const float *B, float *C)"
MATMUL_COMPUTE = """
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float s = 0.0f;
            for (int k = 0; k < K; k++) s += A[i * K + k] * B[k * N + j];
            C[i * N + j] = s;
        }
"""
MATMUL_HONEST = f"{MATMUL_SIGNATURE} {{{MATMUL_COMPUTE}}}\n"


def make_settings(tmp: str, **sandbox: Any) -> EvalSettings:
    """Settings that keep the tests quick: short timing, a private timing lock, a short wall limit."""
    return EvalSettings.model_validate(
        {
            "timing": {"max_seconds": 0.05, "max_repeats": 30, "lock_file": os.path.join(tmp, "timing.lock")},
            "sandbox": {"timeout": 20.0, **sandbox},
        }
    )


def request(
    workdir: str,
    source: str | None = None,
    *,
    settings: EvalSettings | None = None,
    params: dict[str, Any] | None = None,
    task: TaskSpec = VECADD,
) -> EvalRequest:
    genome = Genome(params=params or {}, source=source)
    return EvalRequest(
        key=genome.id,
        genome=genome,
        task=task,
        settings=settings or make_settings(workdir),
        cache_dir=os.path.join(workdir, "cache"),
        sys_path=(HERE,),
    )


def run(pool: LocalPool, req: EvalRequest, timeout: float = 60.0) -> EvalResult:
    """Submits one request and waits for its result."""
    pool.submit(req)
    got = pool.next_result(timeout)
    assert got is not None, "no result"
    assert got[0].key == req.key
    return got[1]
