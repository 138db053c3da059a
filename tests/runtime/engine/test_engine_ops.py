"""Every slot implementation agrees with numpy: the numpy defaults with float64 math, the C kernels
(the layernorm, softmax and gelu tasks' seeds and template points) with the numpy defaults."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from engine_helpers import embed_sorted
from scipy.special import erf

from genome import Genome
from runtime.engine import EngineConfig, KernelSource, build_ops, numpy_ops, tasks_of_slot
from runtime.engine.ops import np_bias_gelu, np_layernorm, np_softmax
from runtime.hardware import cpu_flags
from runtime.settings import CompilerSettings
from runtime.task import load_task_class
from runtime.toolchain.cc import compile_source

RNG = np.random.default_rng(7)


def test_numpy_layernorm_matches_float64():
    x = (RNG.standard_normal((37, 384)) * 3 + 1).astype(np.float32)
    g, b = RNG.standard_normal(384).astype(np.float32), RNG.standard_normal(384).astype(np.float32)
    x64 = x.astype(np.float64)
    want = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-12) * g + b
    before = x.copy()
    np.testing.assert_allclose(np_layernorm(x, g, b, 1e-12), want, rtol=1e-4, atol=1e-4)
    assert np.array_equal(x, before)  # inputs untouched


def test_numpy_softmax_matches_float64_with_masked_keys():
    x = RNG.standard_normal((12 * 9, 9)).astype(np.float32) * 4
    x[:, 6:] += np.float32(-1e9)  # padding keys, as the attention adds them
    x64 = x.astype(np.float64)
    want = np.exp(x64 - x64.max(1, keepdims=True))
    want /= want.sum(1, keepdims=True)
    got = np_softmax(x.copy())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert (got[:, 6:] == 0).all()


def test_numpy_bias_gelu_matches_erf_gelu():
    x = (RNG.standard_normal((64, 1536)) * 4).astype(np.float32)
    b = RNG.standard_normal(1536).astype(np.float32)
    h = x.astype(np.float64) + b
    want = 0.5 * h * (1 + erf(h / np.sqrt(2)))
    np.testing.assert_allclose(np_bias_gelu(x, b), want, rtol=1e-4, atol=1e-6)


def _points(task_name: str) -> list[Genome]:
    """The task's seeds and a few template points covering its choices."""
    task = load_task_class(task_name)()
    points = list(task.seeds())
    if task_name == "layernorm":
        points += [Genome(params={"VEC": v, "UNROLL": u, "PASSES": p})
                   for v, u, p in itertools.product((8, 16), (1, 4), ("TWO", "ONE"))]
    elif task_name == "gelu":
        points += [Genome(params={"VEC": v, "UNROLL": u, "ERF": e})
                   for v, u, e in itertools.product((8, 16), (1, 2), ("POLY", "LIBM"))]
    else:
        points += [Genome(params={"VEC": 16, "UNROLL": 2, "ROWS_PER_BLOCK": r, "PASSES": p, "EXP": "POLY"})
                   for r, p in itertools.product((1, 2), ("THREE", "ONLINE"))]
    return points


def _kernel_ops(slot: str, genome: Genome, cache: str, task_name: str | None = None):
    task = load_task_class(task_name or tasks_of_slot(slot)[0])()
    ks = KernelSource(slot, genome.id, task.render(genome), tuple(task.compile_flags()), task_name or task.name)
    return build_ops({slot: ks}, compiler=CompilerSettings(), cache_dir=cache)


@pytest.mark.parametrize("genome", _points("layernorm"), ids=lambda g: str(g.params or "naive"))
def test_c_layernorm_slot_agrees_with_numpy(genome, tmp_path):
    ops = _kernel_ops("layernorm", genome, str(tmp_path))
    try:
        for rows, cols in ((1, 384), (77, 384), (5, 33)):
            x = (RNG.standard_normal((rows, cols)) * 2 + 0.5).astype(np.float32)
            g, b = RNG.standard_normal(cols).astype(np.float32), RNG.standard_normal(cols).astype(np.float32)
            np.testing.assert_allclose(ops.layernorm(x, g, b, 1e-12), np_layernorm(x, g, b, 1e-12),
                                       rtol=1e-4, atol=1e-4)
    finally:
        ops.close()


@pytest.mark.parametrize("genome", _points("softmax"), ids=lambda g: str(g.params or "naive"))
def test_c_softmax_slot_agrees_with_numpy(genome, tmp_path):
    ops = _kernel_ops("softmax", genome, str(tmp_path))
    try:
        for rows, cols in ((12, 3), (12 * 4 * 23, 23), (12 * 2 * 64, 64)):
            x = RNG.standard_normal((rows, cols)).astype(np.float32) * 4
            x[:, cols - cols // 3 :] += np.float32(-1e9)
            np.testing.assert_allclose(ops.softmax(x), np_softmax(x.copy()), rtol=1e-5, atol=1e-7)
    finally:
        ops.close()


@pytest.mark.parametrize("genome", _points("gelu"), ids=lambda g: str(g.params or "naive"))
def test_c_gelu_slot_agrees_with_numpy(genome, tmp_path):
    ops = _kernel_ops("gelu", genome, str(tmp_path))
    try:
        for rows, cols in ((1, 1536), (33, 1536), (3, 37)):
            x = (RNG.standard_normal((rows, cols)) * 4).astype(np.float32)
            b = RNG.standard_normal(cols).astype(np.float32)
            np.testing.assert_allclose(ops.gelu(x, b), np_bias_gelu(x, b), rtol=1e-4, atol=2e-6)
    finally:
        ops.close()


needs_bf16 = pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="this CPU has no AVX512-BF16: "
                                "linear_bf16's kernels cannot run here")  # fmt: skip
needs_vnni = pytest.mark.skipif("avx512_vnni" not in cpu_flags(), reason="this CPU has no AVX512-VNNI: "
                                "linear_int8's kernels cannot run here")  # fmt: skip


def _has_amx() -> bool:
    with open("/proc/cpuinfo") as f:
        return "amx_bf16" in f.read()


def _linear_points() -> list[Genome]:
    """The linear_bf16 seeds (the scalar loop, an AVX512 tile) and, where the CPU has it, an AMX point."""
    points = list(load_task_class("linear_bf16")().seeds())
    if _has_amx():
        points.append(Genome(params={**points[-1].params, "ISA": "AMX"}))
    return points


@needs_bf16
@pytest.mark.parametrize("genome", _linear_points(), ids=lambda g: str(g.params.get("ISA", "naive")))
def test_c_linear_slot_is_a_bf16_gemm_on_every_weight_shape(genome, tmp_path):
    from runtime.tasks.linear_bf16 import bf16_round

    ops = _kernel_ops("linear", genome, str(tmp_path))
    try:
        assert ops.matmul is ops.linear  # the bias-free GEMM of the feed-forward runs on it too
        for m, k, n in ((1, 384, 1152), (37, 384, 384), (70, 1536, 384), (9, 40, 24)):
            x = RNG.standard_normal((m, k)).astype(np.float32)
            w = (RNG.standard_normal((k, n)) * 0.05).astype(np.float32)
            b = RNG.standard_normal(n).astype(np.float32)
            exact = x.astype(np.float64) @ w + b
            got = ops.linear(x, w, b)
            if k % 32:  # outside the kernel's contract: fp32 BLAS
                np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-4)
                continue
            want = bf16_round(x).astype(np.float64) @ bf16_round(w) + b
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
            assert np.abs(got - exact).max() > 1e-5  # it really is bf16, not a fp32 GEMM
            np.testing.assert_allclose(ops.matmul(x, w), want - b, rtol=1e-4, atol=1e-4)
            np.testing.assert_array_equal(ops.linear(x, w, b), got)  # the packed weight is reused
    finally:
        ops.close()


@needs_bf16
def test_engine_with_a_bf16_linear_slot_stays_close_to_fp32(model, sentences, reference_embeddings, tmp_path):
    """Every weight GEMM in bf16: the embeddings move (it is a reduced precision) but stay far above the
    default similarity floor (0.99)."""
    ops = _kernel_ops("linear", _linear_points()[-1], str(tmp_path))
    try:
        got = embed_sorted(model, sentences, ops)
    finally:
        ops.close()
    cos = np.sum(got * reference_embeddings, axis=1)
    assert 0.995 <= cos.min() and cos.min() < 0.99999


def test_engine_with_c_slots_matches_numpy_engine(model, sentences, tmp_path):
    """A forward pass with both slots filled by C kernels gives the numpy engine's embeddings."""
    ln = load_task_class("layernorm")()
    sm = load_task_class("softmax")()
    kernels = {
        "layernorm": KernelSource("layernorm", "t", ln.render(Genome(params={"VEC": 16, "UNROLL": 2,
                                                                          "PASSES": "TWO"})), ()),
        "softmax": KernelSource("softmax", "t", sm.render(_points("softmax")[-1]), ()),
        "gelu": KernelSource("gelu", "t", load_task_class("gelu")().render(_points("gelu")[2]), ()),
    }
    ops = build_ops(kernels, compiler=CompilerSettings(), cache_dir=str(tmp_path))
    try:
        assert set(ops.kernels) == {"layernorm", "softmax", "gelu"}
        got = embed_sorted(model, sentences[:12], ops)
        want = embed_sorted(model, sentences[:12], numpy_ops())
        assert np.sum(got * want, axis=1).min() >= 0.99999
    finally:
        ops.close()
    assert EngineConfig(kernels={"layernorm": "abc"}).kernels == {"layernorm": "abc"}
    with pytest.raises(ValueError, match="unknown slot"):
        EngineConfig(kernels={"matmul": "abc"})


def test_compile_is_cached(tmp_path):
    ln = load_task_class("layernorm")()
    src = ln.render(ln.seeds()[0])
    first = compile_source(src, compiler=CompilerSettings(), cache_dir=str(tmp_path))
    again = compile_source(src, compiler=CompilerSettings(), cache_dir=str(tmp_path))
    assert not first.cached and again.cached and first.path == again.path


def _int8_points() -> list[Genome]:
    """The linear_int8 seeds (the scalar loops, a VNNI tile) and, where the CPU has it, an AMX point."""
    points = list(load_task_class("linear_int8")().seeds())
    with open("/proc/cpuinfo") as f:
        if "amx_int8" in f.read():
            points.append(Genome(params={**points[-1].params, "ISA": "AMX"}))
    return points


def _int8_cases() -> list:
    """(task, point) of both int8 tasks: linear_int8's where the CPU has VNNI, linear_int8_avx2's everywhere
    (the same arithmetic: it answers what linear_int8 answers)."""
    vnni = [pytest.param("linear_int8", g, marks=needs_vnni, id=f"vnni-{g.params.get('ISA', 'naive')}")
            for g in _int8_points()]  # fmt: skip
    avx2 = [pytest.param("linear_int8_avx2", g, id=f"avx2-{'tile' if g.params else 'naive'}")
            for g in load_task_class("linear_int8_avx2")().seeds()]  # fmt: skip
    return vnni + avx2


@pytest.mark.parametrize(("task", "genome"), _int8_cases())
def test_c_linear_slot_runs_int8_kernels_on_every_weight_shape(task, genome, tmp_path):
    from runtime.tasks.linear_int8 import int8_linear_reference, pack_int8

    multiple = load_task_class(task).slot.k_multiple
    ops = _kernel_ops("linear", genome, str(tmp_path), task)
    try:
        assert ops.matmul is ops.linear
        for m, k, n in ((1, 384, 1152), (37, 384, 384), (70, 1536, 384), (9, 40, 48)):
            x = RNG.standard_normal((m, k)).astype(np.float32)
            w = (RNG.standard_normal((k, n)) * 0.05).astype(np.float32)
            b = RNG.standard_normal(n).astype(np.float32)
            exact = x.astype(np.float64) @ w + b
            got = ops.linear(x, w, b)
            if k % multiple:  # outside the kernel's contract: fp32 BLAS
                np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-4)
                continue
            np.testing.assert_allclose(got, int8_linear_reference(x, *pack_int8(w), b), rtol=1e-5, atol=1e-5)
            assert 1e-3 < np.abs(got - exact).max() < 0.1 * np.abs(exact).max()  # int8: close, not exact
            no_bias = int8_linear_reference(x, *pack_int8(w), np.zeros(n, np.float32))
            np.testing.assert_allclose(ops.matmul(x, w), no_bias, rtol=1e-5, atol=1e-5)
    finally:
        ops.close()


@needs_vnni
def test_engine_with_an_int8_linear_slot_is_measured_against_the_floor(model, sentences, reference_embeddings,
                                                                     tmp_path):
    """Every weight GEMM in int8 (per-token u8 activations, per-channel s8 weights): the embeddings stay
    above the default similarity floor (0.99) on the test corpus, well below bf16's closeness."""
    ops = _kernel_ops("linear", _int8_points()[1], str(tmp_path), "linear_int8")
    try:
        got = embed_sorted(model, sentences, ops)
    finally:
        ops.close()
    cos = np.sum(got * reference_embeddings, axis=1)
    assert 0.99 <= cos.min() < 0.9999


def _avx2_points(task: str) -> list[Genome]:
    return list(load_task_class(task)().seeds())


@pytest.mark.parametrize("genome", _avx2_points("linear_f32"), ids=lambda g: str(g.params or "naive"))
def test_c_linear_slot_runs_fp32_kernels_on_every_weight_shape(genome, tmp_path):
    ops = _kernel_ops("linear", genome, str(tmp_path), "linear_f32")
    try:
        for m, k, n in ((1, 384, 1152), (37, 384, 384), (70, 1536, 384), (9, 36, 48)):
            x = RNG.standard_normal((m, k)).astype(np.float32)
            w = (RNG.standard_normal((k, n)) * 0.05).astype(np.float32)
            b = RNG.standard_normal(n).astype(np.float32)
            np.testing.assert_allclose(ops.linear(x, w, b), x.astype(np.float64) @ w + b, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(ops.matmul(x, w), x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)
    finally:
        ops.close()


@pytest.mark.parametrize(("task", "low", "high"), [("linear_int8_avx2", 0.99, 0.9999), ("linear_f32", 0.99999, 1.01)])
def test_engine_with_an_avx2_linear_slot_holds_the_floor(task, low, high, model, sentences, reference_embeddings,
                                                          tmp_path):
    """Every weight GEMM through an AVX2 kernel: int8 stays above the default similarity floor (0.99), fp32
    matches the reference."""
    ops = _kernel_ops("linear", _avx2_points(task)[1], str(tmp_path), task)
    try:
        got = embed_sorted(model, sentences, ops)
    finally:
        ops.close()
    cos = np.sum(got * reference_embeddings, axis=1)
    assert low <= cos.min() < high, cos.min()


def test_a_bf16_elite_on_a_cpu_without_bf16_falls_back_to_fp32(tmp_path, monkeypatch, caplog):
    """An elite evolved elsewhere must not kill the process with SIGILL: its GEMMs run in fp32 BLAS."""
    import runtime.hardware

    monkeypatch.setattr(runtime.hardware, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    with caplog.at_level("WARNING"):
        ops = _kernel_ops("linear", _linear_points()[-1], str(tmp_path))
    try:
        x = RNG.standard_normal((5, 384)).astype(np.float32)
        w, b = RNG.standard_normal((384, 384)).astype(np.float32), RNG.standard_normal(384).astype(np.float32)
        np.testing.assert_array_equal(ops.linear(x, w, b), x @ w + b)
        np.testing.assert_array_equal(ops.matmul(x, w), x @ w)
    finally:
        ops.close()
    assert "no avx512_bf16" in caplog.text


_USER_TASK = '''
import numpy as np
from runtime.slots import Slot
from runtime.tasks.softmax import Softmax

KERNEL = """
#include <math.h>
void kernel(float *y, const float *x, int cols, int rows) {  /* its own argument order */
    for (int i = 0; i < rows; i++) {
        const float *r = x + (long)i * cols; float *o = y + (long)i * cols; float m = r[0], s = 0.f;
        for (int j = 1; j < cols; j++) m = r[j] > m ? r[j] : m;
        for (int j = 0; j < cols; j++) { o[j] = expf(r[j] - m); s += o[j]; }
        for (int j = 0; j < cols; j++) o[j] /= s;
    }
}
"""


class ReorderedSoftmax(Softmax):
    name = "reordered_softmax"
    signature = "void kernel(float *y, const float *x, int cols, int rows)"
    slot = Slot("softmax")

    def template(self):
        return KERNEL

    def kernel_args(self, case, arrays):
        return [arrays["y"], arrays["x"], case["cols"], case["rows"]]

    def slot_args(self, operands, out):
        x = operands["x"]
        return [out, x, x.shape[1], x.shape[0]]


class NotASlot(Softmax):
    name = "not_a_slot"
    slot = None
'''


def test_a_users_task_declares_its_slot_and_how_it_is_called(tmp_path, monkeypatch):
    """One task class is all a new slot kernel needs: the slot calls it in the task's own argument order."""
    (tmp_path / "my_slot_task.py").write_text(_USER_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert tasks_of_slot("linear") == ("linear_bf16", "linear_int8", "linear_int8_avx2", "linear_f32")  # built-ins
    assert tasks_of_slot("softmax") == ("softmax",)
    ops = _kernel_ops("softmax", Genome(params={}), str(tmp_path), "my_slot_task:ReorderedSoftmax")
    try:
        x = RNG.standard_normal((40, 23)).astype(np.float32) * 4
        np.testing.assert_allclose(ops.softmax(x), np_softmax(x.copy()), rtol=1e-5, atol=1e-7)
    finally:
        ops.close()
    from runtime.engine.ops import c_slot

    with pytest.raises(ValueError, match="fills the 'softmax' slot"):
        c_slot("gelu", None, "my_slot_task:ReorderedSoftmax")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fills no engine slot"):
        c_slot("softmax", None, "my_slot_task:NotASlot")  # type: ignore[arg-type]
