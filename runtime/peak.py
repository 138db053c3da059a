"""The core's measured fp32 FMA peak: the most floating-point work one core can physically do per second.

A figure above it was not computed, it was forged (a clock, a calibration, a subtraction tampered with),
whatever the path that produced it. A task states its ceiling in terms of this peak
(:meth:`runtime.task.KernelTask.ceiling`); the cascade turns a fitness above the ceiling into ``invalid``.

The peak is measured, never assumed: independent chains of fused multiply-adds on the widest vectors the
compiler targets here (``-march=native``), enough of them to cover the FMA latency on every core we
know, timed in this process (the worker, which never runs candidate code) with the machine's timing lock
held. The best of several runs counts: a measurement can only come out low (another process on the core, or
on its other hardware thread, sharing the FMA units), never high, so the best is the one to trust. The runs
are spread over about a tenth of a second, so that one burst of a neighbour's work does not cover them all.
"""

from __future__ import annotations

import ctypes
import time

from runtime.settings import CompilerSettings

__all__ = ["PEAK_SOURCE", "fma_peak_gflops"]

PEAK_SOURCE = r"""
#if defined(__AVX512F__)
#define W 16
#define N 16
#elif defined(__AVX__)
#define W 8
#define N 12
#else
#define W 4
#define N 12
#endif
typedef float vec __attribute__((vector_size(4 * W)));

/* N independent chains of `iters` fused multiply-adds on W lanes: 2 * N * W * iters flops. */
float evoforge_fma_chains(long iters, float scale) {
    vec acc[N], x, y;
    for (int l = 0; l < W; l++) { x[l] = 1.0f - 1e-7f * scale; y[l] = 1e-7f * scale; }
    for (int c = 0; c < N; c++) for (int l = 0; l < W; l++) acc[c][l] = (float)(c + l);
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 16
        for (int c = 0; c < N; c++) acc[c] = acc[c] * x + y;
    }
    float s = 0.0f;
    for (int c = 0; c < N; c++) for (int l = 0; l < W; l++) s += acc[c][l];
    return s;
}
int evoforge_fma_flops_per_iter(void) { return 2 * N * W; }
"""

_RUN_S = 2e-3
_GAP_S = 8e-3  # between runs: a neighbour's burst on the sibling hardware thread rarely spans them all


def fma_peak_gflops(cache_dir: str, work_dir: str | None = None, *, cc: str = "cc", runs: int = 12) -> float:
    """GFLOP/s of fp32 fused multiply-adds on this core: the best of ``runs`` timings of about 2 ms each, 8 ms
    apart (call it pinned, with the timing lock held)."""
    from runtime.toolchain.cc import compile_source

    flags = ["-O2", "-march=native", "-ffp-contract=fast"]
    built = compile_source(PEAK_SOURCE, compiler=CompilerSettings(cc=cc, flags=flags), cache_dir=cache_dir,
                           work_dir=work_dir)  # fmt: skip
    lib = ctypes.CDLL(built.path)
    chains = lib.evoforge_fma_chains
    chains.argtypes, chains.restype = [ctypes.c_long, ctypes.c_float], ctypes.c_float
    per_iter = lib.evoforge_fma_flops_per_iter()
    iters = 1000
    while True:  # long enough to time well
        t0 = time.perf_counter()
        chains(iters, 1.0)
        spent = time.perf_counter() - t0
        if spent > _RUN_S / 4:
            break
        iters *= 4
    iters = max(1, int(iters * _RUN_S / spent))
    best = 0.0
    for run in range(runs):
        if run:
            time.sleep(_GAP_S)
        t0 = time.perf_counter()
        chains(iters, 1.0)
        best = max(best, per_iter * iters / (time.perf_counter() - t0) / 1e9)
    return best
