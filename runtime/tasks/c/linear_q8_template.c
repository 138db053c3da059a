/* Parametric int8 linear layer with activations quantised in groups of 32, on AVX2 (runtime.tasks.linear_q8):
 *   per group g of 32 values of a row of x: s_g = max|x| / 127, q = clamp(rint(x / s_g), -127, 127) (0 where the
 *   group is all zero); dot_g = q_g . wq_g exactly in int32; y = sum_g (s_g * w_scale_g) * dot_g + bias.
 *
 * Each row of x is quantised once per call, a panel of rows at a time, into a heap buffer of int8 values and one
 * scale per group. W comes quantised to s8, a scale per group of 32 rows of each column (w_scale[g * n + j]), and
 * packed in quads, wq[((kk/4)*n + j)*4 + kk%4] = wq[kk, j] (runtime.tasks.linear_q8.pack_q8). A quad of q
 * broadcast to all 8 columns multiplies 32 bytes of W quads: vpsignb moves q's sign onto W, vpmaddubsw
 * multiplies |q| (u8) by it into int16 pairs (|q|, |w| <= 127: a pair sum stays below 2^15, no saturation),
 * vpmaddwd by ones gives each column's int32 sum of the quad.
 * After a group's 8 quads the int32 sums are converted and added into fp32 accumulators with the product of the
 * group's two scales (one FMA). Requires k % 32 == 0, n % 8 == 0, m >= 1, AVX2 and FMA.
 *
 * Parameters (arrive as #defines):
 *   MR, NR    register tile: MR rows by NR blocks of 8 columns (MR * NR int32 and MR * NR fp32 accumulators).
 *   KU        unroll of the loop over a group's 8 quads.
 *   PANEL     rows of x quantised at a time (rounded up to whole MR row blocks); each block of columns sweeps them.
 * Built with -fopenmp (threads > 1), threads share the rows to quantise, then the blocks of columns.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define PRAGMA(x) _Pragma(#x)
#define UNROLLED(n) PRAGMA(GCC unroll n)

typedef int32_t i32_alias __attribute__((may_alias));

static inline float max8(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

/* One row of x (k floats, k % 32 == 0) to s8 values in q, one scale per group of 32 in s. */
static inline void quantize_row(int k, const float *x, int8_t *q, float *s)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int g = 0; g < k / 32; g++) {
        const float *xg = x + 32 * g;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int c = 0; c < 4; c++) {
            v[c] = _mm256_loadu_ps(xg + 8 * c);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[c]));
        }
        const float a = max8(amax), scale = a / 127.0f;
        const __m256 inv = _mm256_set1_ps(a > 0.0f ? 1.0f / scale : 0.0f);
        const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
        __m256i w[4];
        for (int c = 0; c < 4; c++)
            w[c] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[c], inv)), lo), hi);
        /* 32 int32 -> 32 int8 in order: packs work within 128-bit lanes, the permute puts the lanes back */
        const __m256i w16 = _mm256_packs_epi32(w[0], w[1]), x16 = _mm256_packs_epi32(w[2], w[3]);
        const __m256i b8 = _mm256_packs_epi16(w16, x16);
        _mm256_storeu_si256((__m256i *)(q + 32 * g),
                            _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        s[g] = scale;
    }
}

/* EVOLVE-BLOCK-START */
/* y[0:R, 0:8V] of R quantised rows (q, row stride k; group scales qs, row stride k / 32); wq, ws (row stride n),
 * bias and y point at the block's first column. */
static inline __attribute__((always_inline)) void tile(const int R, const int V, int n, int k, const int8_t *q,
                                                       const float *qs, const int8_t *wq, const float *ws,
                                                       const float *bias, float *y)
{
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR][NR];
    UNROLLED(8) for (int r = 0; r < R; r++) UNROLLED(4) for (int v = 0; v < V; v++) acc[r][v] = _mm256_setzero_ps();
    for (int g = 0; g < k / 32; g++) {
        __m256i dot[MR][NR];
        UNROLLED(8) for (int r = 0; r < R; r++) UNROLLED(4) for (int v = 0; v < V; v++) dot[r][v] = _mm256_setzero_si256();
        UNROLLED(KU) for (int p = 8 * g; p < 8 * g + 8; p++) {
            __m256i b[NR];
            UNROLLED(4) for (int v = 0; v < V; v++) b[v] = _mm256_loadu_si256((const __m256i *)(wq + ((long)p * n + 8 * v) * 4));
            UNROLLED(8) for (int r = 0; r < R; r++) {
                const __m256i a = _mm256_set1_epi32(*(const i32_alias *)(q + (long)r * k + 4 * p));
                const __m256i magnitude = _mm256_sign_epi8(a, a);
                UNROLLED(4) for (int v = 0; v < V; v++) {
                    const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(b[v], a));
                    dot[r][v] = _mm256_add_epi32(dot[r][v], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        __m256 wscale[NR];
        UNROLLED(4) for (int v = 0; v < V; v++) wscale[v] = _mm256_loadu_ps(ws + (long)g * n + 8 * v);
        UNROLLED(8) for (int r = 0; r < R; r++) {
            const __m256 s = _mm256_set1_ps(qs[(long)r * (k / 32) + g]);
            UNROLLED(4) for (int v = 0; v < V; v++)
                acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][v]), _mm256_mul_ps(s, wscale[v]), acc[r][v]);
        }
    }
    UNROLLED(8) for (int r = 0; r < R; r++) UNROLLED(4) for (int v = 0; v < V; v++)
        _mm256_storeu_ps(y + (long)r * n + 8 * v, _mm256_add_ps(acc[r][v], _mm256_loadu_ps(bias + 8 * v)));
}

/* Columns [0, 8V) (pointers at the block's first column) of the panel's rows: MR at a time, then the rest
 * (< MR <= 8) in one pass per set bit. */
static inline __attribute__((always_inline)) void cols(const int V, int rows, int n, int k, const int8_t *q,
                                                       const float *qs, const int8_t *wq, const float *ws,
                                                       const float *bias, float *y)
{
    int r = 0;
    const long sk = k / 32;
    for (; r + MR <= rows; r += MR) tile(MR, V, n, k, q + (long)r * k, qs + r * sk, wq, ws, bias, y + (long)r * n);
    const int rest = rows - r;
#define TAIL(T)                                                                         \
    if (rest & T) {                                                                     \
        tile(T, V, n, k, q + (long)r * k, qs + r * sk, wq, ws, bias, y + (long)r * n); \
        r += T;                                                                         \
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

/* Panels of PANEL rows: each row quantised once into the buffer q (PANEL x k int8, then the group scales), then
 * each block of columns runs down the panel, so its W columns stay in cache across row blocks. Blocks are NR
 * vectors wide, then single vectors for the columns left. */
static void gemm(int m, int n, int k, const float *x, const int8_t *wq, const float *ws, const float *bias, float *y,
                 int8_t *q, int panel)
{
    float *qs = (float *)(q + (long)panel * k);
    const int wide_cols = 8 * NR;
    const int wide_blocks = n / wide_cols, blocks = wide_blocks + (n - wide_blocks * wide_cols) / 8;
    for (int i0 = 0; i0 < m; i0 += panel) {
        const int rows = m - i0 < panel ? m - i0 : panel;
        float *yp = y + (long)i0 * n;
#pragma omp parallel
        {
#pragma omp for schedule(static)
            for (int r = 0; r < rows; r++) quantize_row(k, x + (long)(i0 + r) * k, q + (long)r * k, qs + (long)r * (k / 32));
#pragma omp for schedule(static)
            for (int b = 0; b < blocks; b++) {
                const int wide = b < wide_blocks;
                const int j = wide ? b * wide_cols : wide_blocks * wide_cols + (b - wide_blocks) * 8;
                const int8_t *wj = wq + 4L * j;
                if (wide) cols(NR, rows, n, k, q, qs, wj, ws + j, bias + j, yp + j);
                else cols(1, rows, n, k, q, qs, wj, ws + j, bias + j, yp + j);
            }
        }
    }
}
/* EVOLVE-BLOCK-END */

void kernel(int m, int n, int k, const float *x, const int8_t *wq, const float *w_scale, const float *bias, float *y)
{
    int panel = (PANEL + MR - 1) / MR * MR;
    const size_t bytes = (size_t)panel * k + (size_t)panel * (k / 32) * 4;
    int8_t *q = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!q) { /* no heap: one row block at a time, from a stack buffer */
        panel = MR;
        q = __builtin_alloca((size_t)panel * k + (size_t)panel * (k / 32) * 4 + 64);
        q = (int8_t *)(((uintptr_t)q + 63) & ~(uintptr_t)63);
        gemm(m, n, k, x, wq, w_scale, bias, y, q, panel);
        return;
    }
    gemm(m, n, k, x, wq, w_scale, bias, y, q, panel);
    free(q);
}
