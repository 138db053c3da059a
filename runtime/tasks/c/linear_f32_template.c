/* Parametric fp32 linear layer on AVX2 + FMA (runtime.tasks.linear_f32): y = x @ W + bias.
 *
 * x is fp32 row-major [m,k]; W comes packed in panels of 8 columns, each panel's k rows contiguous:
 * W[kk, j] = wp[((j/8)*k + kk)*8 + j%8] (runtime.tasks.linear_f32.pack_f32). A register tile of MR rows by NR
 * panels keeps MR * NR accumulators, broadcasts one x element per row and loads one 8-wide row of each panel
 * per step of k. Requires k % 8 == 0, n % 8 == 0, m >= 1, AVX2 and FMA.
 *
 * Parameters (arrive as #defines):
 *   MR, NR    register tile: MR rows by NR vectors of 8 columns.
 *   KU        unroll of the loop over k.
 *   PANEL     rows of x a block of columns sweeps before the next block (its W panels stay in cache).
 * Built with -fopenmp (threads > 1), threads share the blocks of columns.
 */
#include <immintrin.h>

#define PRAGMA(x) _Pragma(#x)
#define UNROLLED(n) PRAGMA(GCC unroll n)

/* EVOLVE-BLOCK-START */
/* y[0:R, 0:8V] = x[0:R, :] @ panels[0:V] + bias; wp points at the block's first panel, bias and y at its first
 * column. */
static inline __attribute__((always_inline)) void tile(const int R, const int V, int n, int k, const float *x,
                                                       const float *wp, const float *bias, float *y)
{
    __m256 acc[MR][NR];
    UNROLLED(8) for (int r = 0; r < R; r++) UNROLLED(4) for (int v = 0; v < V; v++)
        acc[r][v] = _mm256_setzero_ps();
    UNROLLED(KU) for (int kk = 0; kk < k; kk++) {
        __m256 b[NR];
        UNROLLED(4) for (int v = 0; v < V; v++) b[v] = _mm256_loadu_ps(wp + ((long)v * k + kk) * 8);
        UNROLLED(8) for (int r = 0; r < R; r++) {
            const __m256 a = _mm256_broadcast_ss(x + (long)r * k + kk);
            UNROLLED(4) for (int v = 0; v < V; v++) acc[r][v] = _mm256_fmadd_ps(a, b[v], acc[r][v]);
        }
    }
    UNROLLED(8) for (int r = 0; r < R; r++) UNROLLED(4) for (int v = 0; v < V; v++)
        _mm256_storeu_ps(y + (long)r * n + 8 * v, _mm256_add_ps(acc[r][v], _mm256_loadu_ps(bias + 8 * v)));
}

/* Columns [0, 8V) of rows [0, rows): MR at a time, then the rest (< MR <= 8) in one pass per set bit. */
static inline __attribute__((always_inline)) void cols(const int V, int rows, int n, int k, const float *x,
                                                       const float *wp, const float *bias, float *y)
{
    int r = 0;
    for (; r + MR <= rows; r += MR) tile(MR, V, n, k, x + (long)r * k, wp, bias, y + (long)r * n);
    const int rest = rows - r;
#define TAIL(T)                                                         \
    if (rest & T) {                                                     \
        tile(T, V, n, k, x + (long)r * k, wp, bias, y + (long)r * n); \
        r += T;                                                         \
    }
#if MR > 4
    TAIL(4)
#endif
#if MR > 2
    TAIL(2)
#endif
    TAIL(1)
#undef TAIL
}

static void gemm(int m, int n, int k, const float *x, const float *wp, const float *bias, float *y)
{
    const int wide_cols = 8 * NR;
    const int wide_blocks = n / wide_cols, blocks = wide_blocks + (n - wide_blocks * wide_cols) / 8;
    for (int i0 = 0; i0 < m; i0 += PANEL) {
        const int rows = m - i0 < PANEL ? m - i0 : PANEL;
#pragma omp parallel for schedule(static)
        for (int b = 0; b < blocks; b++) {
            const int wide = b < wide_blocks;
            const int j = wide ? b * wide_cols : wide_blocks * wide_cols + (b - wide_blocks) * 8;
            const float *xp = x + (long)i0 * k, *wj = wp + (long)j * k;
            float *yp = y + (long)i0 * n + j;
            if (wide) cols(NR, rows, n, k, xp, wj, bias + j, yp);
            else cols(1, rows, n, k, xp, wj, bias + j, yp);
        }
    }
}
/* EVOLVE-BLOCK-END */

void kernel(int m, int n, int k, const float *x, const float *wp, const float *bias, float *y)
{
    gemm(m, n, k, x, wp, bias, y);
}
