"""The lm_head_topk task: the q8 LM head's top list and log-sum-exp per row, its kernels against the reference, what
its judge refuses (a token named twice, outside the vocabulary, or beside another's logit) and what it accepts (two
equal logits in either order), and the kernels that get the arithmetic wrong."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_tasks import assert_correct, compile_kernel, random_points

from genome import Genome
from runtime.hardware import cpu_flags
from runtime.tasks._common import load_c_source
from runtime.tasks.linear_q8 import GROUP, quantize_groups
from runtime.tasks.lm_head_topk import LmHeadTopk, exact_logits
from runtime.tasks.lm_head_topk_vnni import LmHeadTopkVnni

pytestmark = pytest.mark.skipif(bool(LmHeadTopk.slot.missing(cpu_flags())), reason="this CPU has no AVX2 and FMA")


@pytest.mark.parametrize("cls", [LmHeadTopk, LmHeadTopkVnni], ids=["avx2", "vnni"])
def test_seeds_and_template_points_are_correct(cls, tmp_path: Path) -> None:
    """The AVX2 task on every CPU; its VNNI sibling (the same arithmetic) where the CPU has AVX512-VNNI."""
    if missing := cls.slot.missing(cpu_flags()):
        pytest.skip(f"this CPU has no {', '.join(missing)}: the avx2 case covers the task")
    task = cls()
    for genome in [*task.seeds(), *random_points(task, 3, seed=2)]:
        assert_correct(task, compile_kernel(task, genome, tmp_path), np.random.default_rng(0))
    threaded = cls({"threads": 2})
    assert_correct(threaded, compile_kernel(threaded, threaded.seeds()[-1], tmp_path), np.random.default_rng(1))


WRONG = {
    "an id off by one": ("ti[p] = v;", "ti[p] = v + 1 < vocab ? v + 1 : 0;"),
    "the list ascending": ("tv[p - 1] < l", "tv[p - 1] > l"),
    "the log-sum-exp without its peak": ("lse[i] = (float)(peak + log(sum));", "lse[i] = (float)log(sum);"),
    "one weight scale per row": ("w_scale[(long)v * groups + g]", "w_scale[(long)v * groups]"),
    "the last token never listed": ("for (int v = 0; v < vocab; v++) {\n            const float l",
                                    "for (int v = 0; v < vocab - 1; v++) {\n            const float l"),
}  # fmt: skip


@pytest.mark.parametrize("wrong", list(WRONG))
def test_a_kernel_that_gets_it_wrong_fails(wrong: str, tmp_path: Path) -> None:
    source = load_c_source("lm_head_topk_naive.c")
    old, new = WRONG[wrong]
    assert old in source
    task = LmHeadTopk()
    fn = compile_kernel(task, Genome(params={}, source=source.replace(old, new)), tmp_path)
    with pytest.raises(AssertionError, match="elements off|outside the vocabulary|has logit|twice"):
        assert_correct(task, fn, np.random.default_rng(0))


def test_the_judge_refuses_a_false_list_and_takes_equal_logits_in_either_order() -> None:
    task = LmHeadTopk()
    case = {"m": 2, "k": 64, "vocab": 300, "top": 8}
    inputs = task.inputs(case, np.random.default_rng(3))
    want = {name: np.empty(shape, dtype) for name, (shape, dtype) in task.outputs(case).items()}
    task.reference(case, inputs, want)
    assert task.judge(case, inputs, want, want) is None
    # token 150 repeats token 1's row: the two always tie; either may come first
    logits = exact_logits(inputs["x"], inputs["wq"], inputs["w_scale"])
    assert np.array_equal(logits[:, 1], logits[:, 150])
    case1 = {**case, "top": 300}
    full = {name: np.empty(shape, dtype) for name, (shape, dtype) in task.outputs(case1).items()}
    task.reference(case1, inputs, full)
    ids = full["ids"].copy()
    a, b = (np.flatnonzero(ids[0] == t)[0] for t in (1, 150))
    ids[0, [a, b]] = ids[0, [b, a]]
    assert task.judge(case1, inputs, full, {**full, "ids": ids}) is None

    def judged(ids: np.ndarray) -> str | None:
        return task.judge(case, inputs, want, {**want, "ids": ids})

    twice = want["ids"].copy()
    twice[1, 3] = twice[1, 2]
    assert "names a token twice" in judged(twice)
    outside = want["ids"].copy()
    outside[0, 0] = 300
    assert "outside the vocabulary" in judged(outside)
    swapped = want["ids"].copy()
    swapped[0, [0, 5]] = swapped[0, [5, 0]]
    assert "has logit" in judged(swapped)


def test_exact_logits_go_through_the_head_in_blocks_and_match_one_product() -> None:
    task = LmHeadTopk()
    case = {"m": 3, "k": 64, "vocab": 20_000, "top": 8}  # three blocks of head rows, the last one short
    inputs = task.inputs(case, np.random.default_rng(5))
    wq, w_scale = inputs["wq"], inputs["w_scale"]
    x = inputs["x"]
    got = exact_logits(x, wq, w_scale)
    q, s = quantize_groups(x)
    a = (q.astype(np.float64).reshape(3, -1, GROUP) * s[:, :, None]).reshape(3, -1)
    w = (wq.astype(np.float64).reshape(len(wq), -1, GROUP) * w_scale[:, :, None]).reshape(len(wq), -1)
    assert got.shape == (3, 20_000) and np.allclose(got, a @ w.T, rtol=1e-12, atol=1e-9)
    assert np.allclose(exact_logits(x, wq, w_scale, magnitude=True), np.abs(a) @ np.abs(w).T, rtol=1e-12, atol=1e-9)


def test_the_head_is_packed_in_blocks_as_one_quantisation_would() -> None:
    from runtime.tasks.lm_head_topk import pack_rows_q8

    w = np.random.default_rng(6).normal(0, 0.05, (20_000, 64)).astype(np.float32)  # three blocks, the last short
    w[9_000] = 0.0  # an all-zero row: scale 1
    wq, w_scale = pack_rows_q8(w)
    groups = w.reshape(len(w), -1, GROUP)
    scale = np.abs(groups).max(axis=2) / np.float32(127)
    scale[scale == 0] = 1
    want = np.clip(np.rint(groups / scale[:, :, None]), -127, 127).astype(np.int8).reshape(len(w), -1)
    assert np.array_equal(wq, want) and np.array_equal(w_scale, scale) and not wq[9_000].any()
