"""``evo check`` end to end, and ``evo run`` on a CUDA config without a GPU (one line, exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "runtime", "cuda"))
from cuda_helpers import gpu_missing, needs_nvcc  # noqa: E402


def evo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "evo", *args], capture_output=True, text=True, cwd=ROOT, timeout=240)


@needs_nvcc
def test_check_compile_only_reports_ptxas_figures_per_point():
    proc = evo("check", "configs/softmax_cuda.yaml", "--compile-only", "--points", "1", "--arch", "sm_90", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["point"] for r in rows] == ["seed 0", "seed 1", "seed 2", "sample 0"]
    for r in rows:
        assert r["status"] == "ok" and r["arch"] == "sm_90" and r["registers"] > 0
        assert 0 < r["occupancy"] <= 1 and r["spill_bytes"] == 0 and r["threads_per_block"] >= 32
    table = evo("check", "configs/softmax_cuda.yaml", "--compile-only", "--points", "0")
    assert table.returncode == 0 and "occupancy" in table.stdout and "seed 2" in table.stdout


def test_check_compile_only_on_a_c_config():
    proc = evo("check", "configs/softmax_cpu.yaml", "--compile-only", "--points", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    assert [r["status"] for r in json.loads(proc.stdout)] == ["ok", "ok", "ok"]


def test_check_on_an_engine_config_builds_and_checks_its_similarity():
    proc = evo("check", "configs/engine_minilm.yaml", "--points", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert len(rows) >= 1 and all(r["status"] == "ok" and r["similarity"] > 0.999 for r in rows), rows
    table = evo("check", "configs/engine_minilm.yaml", "--compile-only", "--points", "0")
    assert table.returncode == 0 and "min cosine" in table.stdout and "seed 0" in table.stdout


@pytest.mark.skipif(gpu_missing() is None, reason="this machine has a GPU: evo run would start")
def test_run_on_a_cuda_config_without_a_gpu_stops_with_one_line():
    proc = evo("run", "configs/matmul_cuda.yaml", "--run-dir", os.devnull + "-never-created")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: task 'matmul_cuda' runs on an NVIDIA GPU")
    assert "evo check configs/matmul_cuda.yaml --compile-only" in lines[0]
