"""The rmsnorm task: its kernels against the decoder's numpy RMSNorm, and on the decoder's slot."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from test_tasks import assert_correct, compile_kernel, random_points

from genome import Genome
from runtime.decoder.kernels import c_rmsnorm
from runtime.decoder.ops import np_rmsnorm
from runtime.tasks._common import load_c_source
from runtime.tasks.rmsnorm import RMSNorm


def test_seeds_and_template_points_are_correct(tmp_path: Path) -> None:
    task = RMSNorm()
    for genome in [*task.seeds(), *random_points(task, 6, seed=5)]:
        assert_correct(task, compile_kernel(task, genome, tmp_path), np.random.default_rng(0))
    threaded = RMSNorm({"threads": 2})
    assert_correct(threaded, compile_kernel(threaded, threaded.seeds()[-1], tmp_path), np.random.default_rng(1))


def test_a_kernel_that_forgets_eps_or_a_column_fails(tmp_path: Path) -> None:
    import pytest

    source = load_c_source("rmsnorm_naive.c")
    task = RMSNorm()
    for wrong, right in (("sq / cols + eps", "sq / cols"), ("c < cols; c++) sq", "c < cols - 1; c++) sq")):
        assert wrong in source
        fn = compile_kernel(task, Genome(params={}, source=source.replace(wrong, right)), tmp_path)
        with pytest.raises(AssertionError, match="elements off"):
            assert_correct(task, fn, np.random.default_rng(0))


def test_the_decoder_slot_runs_the_kernel(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    x, g = rng.standard_normal((8, 576)).astype(np.float32), rng.standard_normal(576).astype(np.float32)
    norm = c_rmsnorm(cache_dir=tmp_path)
    np.testing.assert_allclose(norm(x, g, 1e-5), np_rmsnorm(x, g, 1e-5), rtol=1e-5, atol=1e-6)
    doubled = load_c_source("rmsnorm_naive.c").replace("* inv * w[c]", "* inv * w[c] * 2.0f")
    wrong = c_rmsnorm(Genome(params={}, source=doubled), cache_dir=tmp_path)
    np.testing.assert_allclose(wrong(x, g, 1e-5), 2 * np_rmsnorm(x, g, 1e-5), rtol=1e-5, atol=1e-6)
