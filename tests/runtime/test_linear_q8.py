"""The linear_q8 task: int8 with activations scaled per group of 32, its kernels against the reference, the ways a
kernel can get it wrong, and the decoder on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_tasks import assert_correct, compile_kernel, random_points

from genome import Genome
from runtime.tasks._common import load_c_source
from runtime.tasks.linear_q8 import LinearQ8, pack_q8, q8_linear_reference, quantize_groups
from runtime.tasks.linear_q8_vnni import LinearQ8Vnni


def test_the_reference_is_close_to_fp32_where_a_per_row_scale_is_not():
    """With an outlier channel, scales per group of 32 keep x @ W at under half the error of one scale per row and
    column."""
    from runtime.tasks.linear_int8 import int8_linear_reference, pack_int8

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 576)).astype(np.float32)
    x[:, 5] *= 40  # an outlier channel
    w = rng.uniform(-1.0, 1.0, (576, 64)).astype(np.float32)
    exact = x @ w
    zero = np.zeros(64, np.float32)
    grouped = np.abs(q8_linear_reference(x, *pack_q8(w), zero) - exact).mean()
    per_row = np.abs(int8_linear_reference(x, *pack_int8(w), zero) - exact).mean()
    assert grouped < 0.02 * np.abs(exact).mean() and 2 * grouped < per_row, (grouped, per_row)
    q, s = quantize_groups(x)
    assert q.dtype == np.int8 and s.shape == (8, 18) and np.abs(q).max() == 127


@pytest.mark.parametrize("cls", [LinearQ8, LinearQ8Vnni], ids=["avx2", "vnni"])
def test_seeds_and_template_points_are_correct(cls, tmp_path: Path) -> None:
    """The AVX2 task on every CPU; its VNNI sibling (the same arithmetic) where the CPU has AVX512-VNNI."""
    from runtime.hardware import cpu_flags

    if cls.slot.missing(cpu_flags()):
        pytest.skip(f"this CPU has no {', '.join(cls.slot.missing(cpu_flags()))}: the avx2 case covers the task")
    task = cls()
    for genome in [*task.seeds(), *random_points(task, 3, seed=4)]:
        assert_correct(task, compile_kernel(task, genome, tmp_path), np.random.default_rng(0))
    threaded = cls({"threads": 2})
    assert_correct(threaded, compile_kernel(threaded, threaded.seeds()[-1], tmp_path), np.random.default_rng(1))


WRONG = {
    "one scale per row": ("for (int c = 32 * g; c < 32 * g + 32; c++) amax", "for (int c = 0; c < k; c++) amax"),
    "truncation for rounding": ("(int)rintf(xr[c] * inv)", "(int)(xr[c] * inv)"),
    "no weight scale": ("(s[g] * w_scale[(long)g * n + j])", "s[g]"),
    "one weight scale per column": ("w_scale[(long)g * n + j]", "w_scale[j]"),
}


@pytest.mark.parametrize("wrong", list(WRONG))
def test_a_kernel_that_gets_the_arithmetic_wrong_fails(wrong: str, tmp_path: Path) -> None:
    source = load_c_source("linear_q8_naive.c")
    old, new = WRONG[wrong]
    assert old in source
    task = LinearQ8()
    fn = compile_kernel(task, Genome(params={}, source=source.replace(old, new)), tmp_path)
    with pytest.raises(AssertionError, match="elements off"):
        assert_correct(task, fn, np.random.default_rng(0))
