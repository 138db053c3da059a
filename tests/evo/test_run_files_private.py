"""A run's files are its owner's alone: a candidate, running as the sandbox user, cannot read the store (every
candidate's source and figures), the frozen config or the logs of the run that evaluates it."""

from __future__ import annotations

import os

import pytest

from evo.config import parse_config
from evo.rundir import create_run
from genome import Genome
from runtime.executors import EvalRequest, LocalPool
from runtime.result import Status
from runtime.sandbox.limits import sandbox_ids
from runtime.settings import TaskSpec

# Opens each of the run's files for reading on its first call; any that opens spoils its output.
READS_THE_RUN = r"""
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
static int opened, tried;
static void try_open(const char *path) {
    int fd = open(path, O_RDONLY);
    if (fd >= 0) { opened++; printf("EVOFORGE-READ %%s\n", path); fflush(stdout); close(fd); }
}
void kernel(int M, int N, int K, const float *A, const float *B, float *C) {
    if (!tried) { tried = 1; try_open("%(run)s/archive.db"); try_open("%(run)s/config.yaml");
                  try_open("%(run)s/logs/worker-0.log"); try_open("%(run)s"); }
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float s = 0.0f;
            for (int k = 0; k < K; k++) s += A[i * K + k] * B[k * N + j];
            C[i * N + j] = opened ? 0.0f / 0.0f : s;
        }
}
"""


@pytest.mark.skipif(sandbox_ids() is None, reason="not root: workers keep this user, the sandbox user is the owner")
def test_a_candidate_cannot_read_the_files_of_the_run_it_is_evaluated_in(tmp_path):
    run_path = tmp_path / "run"
    config = parse_config({"task": {"name": "matmul", "args": {"m": 32, "n": 32, "k": 32}},
                           "archive": {"descriptors": ["source_lines"], "bins": 4}, "memory": {"enabled": False}},
                          source="test")  # fmt: skip
    run = create_run(run_path, config)
    assert (os.stat(run_path).st_mode & 0o777) == 0o700
    genome = Genome(source=READS_THE_RUN % {"run": run_path})
    settings = config.evaluation.model_copy(update={"check_trials": 1})
    request = EvalRequest(key=genome.id, genome=genome, task=TaskSpec(name="matmul", args={"m": 32, "n": 32, "k": 32}),
                          settings=settings, cache_dir=str(run.cache_dir), stages="check")  # fmt: skip
    with LocalPool(workers=1, log_dir=str(run.log_dir)) as pool:
        pool.submit(request)
        got = pool.next_result(120)
    assert got is not None
    result = got[1]
    assert result.status is Status.OK, result.error
    run.store.close()
